// One spdlog logger per subsystem ("daemon", "ops", "topology", ...), all writing to stderr, so that systemd and
// Kubernetes collect them and each line names where it came from.
#pragma once

#include <memory>
#include <string>

#include "spdlog/spdlog.h"

namespace epfabric::daemon {

// The logger of `subsystem`, created on first use at the current level.
std::shared_ptr<spdlog::logger> Logger(const std::string& subsystem);

// Sets the level of every logger, present and future. `level` is an spdlog level name.
void SetLogLevel(const std::string& level);

}  // namespace epfabric::daemon
