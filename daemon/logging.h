// One spdlog logger per subsystem ("daemon", "ops", "topology", ...), all writing to stderr, so that systemd and
// Kubernetes collect them and each line names where it came from. Text by default; --log_format=json writes one JSON
// object per line ({"time", "level", "logger", "message", "pid", "thread"}) for log collectors.
#pragma once

#include <memory>
#include <string>

#include "spdlog/formatter.h"
#include "spdlog/spdlog.h"

namespace epfabric::daemon {

// The logger of `subsystem`, created on first use at the current level and format.
std::shared_ptr<spdlog::logger> Logger(const std::string& subsystem);

// Sets the level of every logger, present and future. `level` is an spdlog level name.
void SetLogLevel(const std::string& level);

// "text" or "json", for every logger, present and future.
void SetLogFormat(const std::string& format);

// The JSON formatter (exposed for its unit test).
std::unique_ptr<spdlog::formatter> MakeJsonFormatter();

}  // namespace epfabric::daemon
