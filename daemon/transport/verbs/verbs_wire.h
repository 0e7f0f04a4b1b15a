// The verbs wire: rdma-core RC queue pairs between daemons. One device context and protection domain per daemon; per
// group, the member's RDMA region registered (host memory: ibv_reg_mr; GPU memory: dma-buf, else nvidia-peermem), a
// completion queue with its polling thread, and one RC queue pair per (peer, channel), connected at Commit with the
// peers' endpoints (verbs_logic.h). Puts are RDMA WRITEs, signals fetch-and-adds on the same queue pair, which RC
// executes in order at the responder, so a signal lands after the puts before it (docs/internode-verbs.md).
//
// GPU-initiated work requests (IBGDA through mlx5dv) would replace the proxy behind the same command interface: the
// queue pairs created here would then be handed to the client's kernels instead of being driven by the proxy.
//
// Built and unit-tested (verbs_logic) everywhere; run only where a NIC exists (docs/internode-verbs.md).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "transport/wire.h"

namespace epfabric::daemon::transport::verbs {

struct VerbsOptions {
  // Device name (e.g. "mlx5_0"); empty picks the first device with an active port.
  std::string device;
  // Send queue depth per queue pair: at least the ring slots, which bound the commands in flight per channel.
  int queue_depth = 4096;
};

// Whether the memory of a daemon on `gpu` (-1: host memory) can be registered: FailedPrecondition saying what is
// missing (no dma-buf support and no nvidia-peermem) otherwise.
absl::Status CanRegister(int gpu);

// FailedPrecondition (one line) when no usable device exists.
absl::StatusOr<std::unique_ptr<Wire>> MakeVerbsWire(const VerbsOptions& options);

}  // namespace epfabric::daemon::transport::verbs
