// The deadline of an incoming call as an absl::Time, less a margin for the answer to travel back; the infinite
// future when the caller set none (gRPC reports that as a far-away time point).
#pragma once

#include <grpcpp/server_context.h>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace epfabric::daemon {

inline absl::Time CallDeadline(const grpc::ServerContext& context, absl::Duration margin = absl::Milliseconds(250)) {
  const auto deadline = context.deadline();
  if (deadline > std::chrono::system_clock::now() + std::chrono::hours(24 * 365)) return absl::InfiniteFuture();
  return absl::FromChrono(deadline) - margin;
}

}  // namespace epfabric::daemon
