#include "logging.h"

#include "spdlog/sinks/stdout_color_sinks.h"

namespace epfabric::daemon {

std::shared_ptr<spdlog::logger> Logger(const std::string& subsystem) {
  if (auto existing = spdlog::get(subsystem)) return existing;
  try {
    auto logger = spdlog::stderr_color_mt(subsystem);
    logger->set_level(spdlog::get_level());
    logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ [%n] %v");
    return logger;
  } catch (const spdlog::spdlog_ex&) {
    return spdlog::get(subsystem);  // another thread registered it first
  }
}

void SetLogLevel(const std::string& level) { spdlog::set_level(spdlog::level::from_str(level)); }

}  // namespace epfabric::daemon
