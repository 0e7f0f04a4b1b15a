#include "logging.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <ctime>

#include "absl/strings/str_format.h"
#include "spdlog/sinks/stdout_color_sinks.h"

namespace epfabric::daemon {
namespace {

constexpr char kTextPattern[] = "%Y-%m-%dT%H:%M:%S.%e %^%l%$ [%n] %v";
std::atomic<bool> json_format{false};

void AppendJsonString(std::string_view text, spdlog::memory_buf_t& dest) {
  dest.push_back('"');
  for (unsigned char c : text) {
    switch (c) {
      case '"':
        dest.append(std::string_view("\\\""));
        break;
      case '\\':
        dest.append(std::string_view("\\\\"));
        break;
      case '\n':
        dest.append(std::string_view("\\n"));
        break;
      case '\r':
        dest.append(std::string_view("\\r"));
        break;
      case '\t':
        dest.append(std::string_view("\\t"));
        break;
      default:
        if (c < 0x20) {
          const std::string escaped = absl::StrFormat("\\u%04x", c);
          dest.append(std::string_view(escaped));
        } else {
          dest.push_back(static_cast<char>(c));
        }
    }
  }
  dest.push_back('"');
}

// {"time":"2024-05-01T12:00:00.123Z","level":"info","logger":"daemon","message":"...","pid":1,"thread":2}
class JsonFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const auto since_epoch = msg.time.time_since_epoch();
    const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(since_epoch);
    const auto millis = std::chrono::duration_cast<std::chrono::milliseconds>(since_epoch - seconds).count();
    const std::time_t t = seconds.count();
    std::tm tm{};
    gmtime_r(&t, &tm);
    char time_text[40];
    std::snprintf(time_text, sizeof(time_text), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1,
                  tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(millis));
    dest.append(std::string_view("{\"time\":\""));
    dest.append(std::string_view(time_text));
    dest.append(std::string_view("\",\"level\":"));
    const auto level = spdlog::level::to_string_view(msg.level);
    AppendJsonString(std::string_view(level.data(), level.size()), dest);
    dest.append(std::string_view(",\"logger\":"));
    AppendJsonString(std::string_view(msg.logger_name.data(), msg.logger_name.size()), dest);
    dest.append(std::string_view(",\"message\":"));
    AppendJsonString(std::string_view(msg.payload.data(), msg.payload.size()), dest);
    const std::string tail = absl::StrFormat(",\"pid\":%d,\"thread\":%d}\n", getpid(), msg.thread_id);
    dest.append(std::string_view(tail));
  }
  std::unique_ptr<spdlog::formatter> clone() const override { return std::make_unique<JsonFormatter>(); }
};

void ApplyFormat(spdlog::logger& logger) {
  if (json_format.load()) {
    logger.set_formatter(MakeJsonFormatter());
  } else {
    logger.set_pattern(kTextPattern);
  }
}

}  // namespace

std::unique_ptr<spdlog::formatter> MakeJsonFormatter() { return std::make_unique<JsonFormatter>(); }

std::shared_ptr<spdlog::logger> Logger(const std::string& subsystem) {
  if (auto existing = spdlog::get(subsystem)) return existing;
  try {
    auto logger = spdlog::stderr_color_mt(subsystem);
    logger->set_level(spdlog::get_level());
    ApplyFormat(*logger);
    return logger;
  } catch (const spdlog::spdlog_ex&) {
    return spdlog::get(subsystem);  // another thread registered it first
  }
}

void SetLogLevel(const std::string& level) { spdlog::set_level(spdlog::level::from_str(level)); }

void SetLogFormat(const std::string& format) {
  json_format.store(format == "json");
  spdlog::apply_all([](const std::shared_ptr<spdlog::logger>& logger) { ApplyFormat(*logger); });
}

}  // namespace epfabric::daemon
