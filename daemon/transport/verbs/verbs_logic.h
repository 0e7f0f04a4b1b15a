// The verbs wire's decisions as pure functions, so that they are tested on machines without an RDMA NIC: connection
// data to and from the protobuf (checked: it comes from a peer), the choice of registration path, the queue-pair
// attributes of each state transition, work-completion errors as absl::Status, and the --transport choice.
#pragma once

#include <infiniband/verbs.h>

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epfabric/v1/common.pb.h"
#include "epfabric/v1/peer.pb.h"

namespace epfabric::daemon::transport::verbs {

// One member's side of a group on the verbs wire: its registered region and its queue pairs, one per
// (peer group rank, channel), index = peer * channels + channel (its own entries unused, 0).
struct VerbsEndpoint {
  uint64_t address = 0;  // the region's registered virtual address (iova)
  uint32_t rkey = 0;
  std::vector<uint32_t> qp_numbers;
  std::vector<uint32_t> psns;
  std::array<uint8_t, 16> gid{};
  uint16_t lid = 0;
  ibv_mtu mtu = IBV_MTU_4096;
  uint8_t gid_index = 0;
  uint8_t port = 1;
  bool roce = true;
};

v1::RdmaEndpoint ToProto(const VerbsEndpoint& endpoint, int rank);
// Checks a peer's endpoint: `queue_pairs` entries of QP numbers (24-bit) and PSNs (24-bit), a 16-byte GID, a valid
// MTU, a port >= 1, a LID for InfiniBand. InvalidArgument naming the field otherwise.
absl::StatusOr<VerbsEndpoint> FromProto(const v1::RdmaEndpoint& proto, size_t queue_pairs);

// How a region is registered with the NIC.
enum class RegistrationPath {
  kHostMemory,  // ibv_reg_mr on host memory
  kDmaBuf,      // device memory: cuMemGetHandleForAddressRange(DMA_BUF_FD) + ibv_reg_dmabuf_mr
  kPeerMemory,  // device memory: ibv_reg_mr on the device pointer (needs the nvidia-peermem kernel module)
};
const char* RegistrationPathName(RegistrationPath path);
// Host memory: kHostMemory. Device memory: dma-buf when both the GPU (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) and the
// kernel/NIC support it, else peer memory when nvidia-peermem is loaded, else FailedPrecondition saying what is
// missing.
absl::StatusOr<RegistrationPath> ChooseRegistrationPath(bool device_memory, bool dmabuf_supported, bool peermem_loaded);

// Access flags of every registered region and queue pair: local write (atomic results), remote write and atomics
// (puts and signals land here), remote read (none of ours; kept for GPU-initiated reads later).
inline constexpr int kAccessFlags =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_REMOTE_READ;

// The attributes (and the mask) of RESET -> INIT, INIT -> RTR (towards `remote`'s queue pair `remote_qp`, using the
// local GID index for RoCE) and RTR -> RTS (our own starting PSN).
struct QpTransition {
  ibv_qp_attr attr{};
  int mask = 0;
};
QpTransition InitTransition(uint8_t port);
QpTransition RtrTransition(const VerbsEndpoint& remote, size_t remote_qp, uint8_t local_gid_index, ibv_mtu mtu);
QpTransition RtsTransition(uint32_t psn);

// A failed work completion: UNAVAILABLE naming the peer and the verbs status (the peer, its NIC or the path is gone:
// retry exceeded, remote access error, flushed), INTERNAL for local errors (our bug or resources).
absl::Status CompletionError(ibv_wc_status status, ibv_wc_opcode opcode, int peer_rank);

// --transport: "verbs" needs a usable device (ProbeVerbs); "auto" takes verbs when usable, else the socket wire.
v1::Transport ChooseTransport(std::string_view flag, bool verbs_usable);

// Whether this machine has an RDMA device with an active port: FailedPrecondition with one line saying what is
// missing otherwise ("--transport=verbs: no RDMA device (ibv_get_device_list found none)").
absl::Status ProbeVerbs();

}  // namespace epfabric::daemon::transport::verbs
