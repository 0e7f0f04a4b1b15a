// The verbs wire's options, the start-up probe and the choice between wires. Kept apart from verbs_wire.h so that
// the daemon's flag handling needs neither rdma-core nor the wire: `--transport=verbs` on a machine without a usable
// RDMA port must end the daemon at start (exit 2) with one line that says what is missing, not at the first group.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "epfabric/v1/common.pb.h"

namespace spdlog {
class logger;
}

namespace epfabric::daemon::transport::verbs {

struct VerbsOptions {
  // RDMA device (e.g. "mlx5_0"); empty: the first device, in ibv_get_device_list order, with an active port. The
  // daemon should pass the NIC nearest its GPU (topology/nics.h knows the PCIe distances).
  std::string device;
  // Port number on the device; 0: its first active port.
  int port = 0;
  // GID table index; -1: InfiniBand uses 0, RoCE the port's RoCE v2 GID (an IPv4-mapped one first).
  int gid_index = -1;
  // Send work requests per queue pair. The completion queue of a group holds one entry per posted work request,
  // so both are cut down together when the device allows fewer (SizeQueues).
  int send_queue_depth = 512;
  // RC transport: local ACK timeout exponent (4.096 us * 2^timeout; 20 ~ 4.3 s, NCCL's default) and retries
  // before a peer is declared lost. rnr_retry 7 means "forever"; it never matters since nothing uses receives.
  uint8_t timeout = 20;
  uint8_t retry_count = 7;
  uint8_t rnr_retry = 7;
  uint8_t min_rnr_timer = 12;
  // Outstanding RDMA READ / atomic operations per queue pair (initiator and responder); clamped to the device's.
  int max_rd_atomic = 16;
  // RoCE: traffic class and hop limit of the GRH; both: service level.
  uint8_t traffic_class = 0;
  uint8_t hop_limit = 64;
  uint8_t service_level = 0;
  // How long a command may wait for room in a full send queue before it fails with DeadlineExceeded.
  absl::Duration post_timeout = absl::Seconds(10);
  // Register device memory with ibv_reg_mr (nvidia-peermem) when DMA-BUF is not available or fails.
  bool allow_peermem = true;
  // Where the wire logs (nullptr: spdlog's default logger). The daemon passes its "transport" logger.
  std::shared_ptr<spdlog::logger> logger;
};

// OK when the options name a usable device and port: one with an active port and, on Ethernet, a RoCE v2 GID.
// Otherwise FailedPrecondition with one line that starts "--transport=verbs: " and says what is missing, e.g.
// "--transport=verbs: no RDMA device (ibv_get_device_list found none)" or "... device mlx5_0 has no active port".
absl::Status ProbeVerbs(const VerbsOptions& options = {});

// Whether memory of a daemon on CUDA device `gpu` (-1: host memory) can be registered with the NIC: host memory
// always; device memory when the GPU exports DMA-BUF or nvidia-peermem is loaded (/sys/module/nvidia_peermem).
// FailedPrecondition saying what is missing otherwise.
absl::Status CanRegister(int gpu);

// The wire for the --transport flag value: "socket", "verbs", or "auto" (verbs when `verbs_usable`, i.e. ProbeVerbs
// said OK, else socket). Anything else: TRANSPORT_UNSPECIFIED, which the flag parser rejects. "verbs" stays verbs
// even when it is not usable: the daemon must then exit with ProbeVerbs' message instead of falling back silently.
v1::Transport ChooseTransport(std::string_view flag, bool verbs_usable);

}  // namespace epfabric::daemon::transport::verbs
