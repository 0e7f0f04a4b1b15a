// Internal: the RDMA stage of low latency across hosts (internode_path.h; docs/internode-dispatch.md). The
// low-latency kernel path runs over all ranks as usual; for a rank on another host this rank writes its own slots of
// that rank's half into an outbox in its RDMA region (compact: LowLatencyLayout::outbox), and every range written there
// is put over the transport into the same slots of that rank's inbox (the first part of its RDMA region, full halves),
// ordered per destination by the rings. What the other hosts send this rank is read from its own inbox.
//
// RDMA region of a rank (its low-latency part): [inbox: 2 halves][outbox for rank 0: 2 outbox halves]...[outbox for
// rank R-1] (an outbox for every rank, so that its place follows from the rank; those of same-host ranks go unused).
// Linear in the ranks: 2 * half_bytes + R * 2 * outbox_half_bytes.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "data_path/internode/internode_path.h"
#include "data_path/kernel_path.h"
#include "epfabric/client/client.h"
#include "epfabric/kernels/low_latency.h"
#include "epfabric/kernels/transport/issuer.h"

namespace epfabric::client::internal {

// The transport side: the staging copies, the inbox and the put function the host backend calls.
class LowLatencyRemote {
 public:
  // `rdma_offset`: where the low-latency part of the RDMA region starts (after a normal-mode part in a group that
  // serves both modes; GroupInfo.num_normal_rdma_bytes), the same on every rank.
  static absl::StatusOr<std::unique_ptr<LowLatencyRemote>> Create(Lease* lease, const kernels::LowLatencyLayout& layout,
                                                                  absl::Duration timeout, uint64_t rdma_offset = 0);
  // Fills the context of the low-latency kernel path over all ranks (ReachAcrossHosts): the ranks on other hosts,
  // their outboxes as peer regions, the inbox, and (`put_as_written`: the host backend sending each write as it is
  // made) the put function. Without it the stage sends what the steps staged (the relay, or the issue kernel).
  void Reach(kernels::LowLatencyContext* context, bool put_as_written) const;
  // Sends `bytes` at `outbox_offset` of this rank's outbox for `dst_rank` to `inbox_offset` of dst_rank's inbox, on
  // the ring of that destination (so that its sends arrive in order). Fails when the command cannot be queued.
  absl::Status Send(int dst_rank, size_t outbox_offset, size_t inbox_offset, size_t bytes);
  // The ranks on other hosts.
  const kernels::LowLatencyRankSet& remote_ranks() const { return remote_ranks_; }
  bool remote(int r) const { return remote_ranks_.has(r); }
  // Where the low-latency part starts in the RDMA region.
  uint64_t rdma_offset() const { return rdma_offset_; }
  // This rank's outbox for rank r (two outbox halves), and its inbox.
  uint8_t* outbox(int r) const { return rdma_ + OutboxOffset(r); }
  uint8_t* inbox() const { return rdma_; }
  // Where the signals that the paths across hosts read and send lie: both halves of the inbox (the layout's
  // signal_bytes) and of every outbox of a rank on another host (outbox_signal_bytes). Reset zeroes them.
  struct SignalRange {
    uint8_t* at;
    size_t bytes;
  };
  std::vector<SignalRange> SignalRanges() const;
  // Waits until every send so far is in place at its destination.
  absl::Status Quiet();
  // The first send that failed since the last call (then cleared).
  absl::Status TakeError();

 private:
  LowLatencyRemote() = default;
  static bool Put(void* self, int dst_rank, size_t outbox_offset, size_t inbox_offset, size_t bytes);
  uint64_t OutboxOffset(int r) const {
    return 2 * layout_.half_bytes + 2 * static_cast<uint64_t>(r) * layout_.outbox_half_bytes;
  }

  Lease* lease_ = nullptr;
  kernels::LowLatencyLayout layout_;
  uint8_t* rdma_ = nullptr;   // the low-latency part of this rank's RDMA region
  uint64_t rdma_offset_ = 0;  // ... at this offset of the region (the rings' offsets are the region's)
  kernels::LowLatencyRankSet remote_ranks_;
  absl::Duration timeout_;
  std::vector<kernels::transport::RingIssuer> rings_;
  std::mutex mu_;
  absl::Status error_;
};

// The RDMA stage of low latency across hosts: the calls of the low-latency kernel path over all ranks (`inner`, owned
// by the internode path with this stage) and the transport's sends for the ranks on other hosts.
class LowLatencyRdmaStage {
 public:
  virtual ~LowLatencyRdmaStage() = default;
  virtual absl::Status LowLatencyDispatch(const kernels::LowLatencyDispatchArgs& args, cudaStream_t stream) = 0;
  virtual absl::Status LowLatencyCombine(const kernels::LowLatencyCombineArgs& args, cudaStream_t stream) = 0;
  virtual absl::Status Check(cudaStream_t stream) { return inner_->Check(stream); }
  // The transport's signals (inbox, outboxes), then the kernel path's Reset.
  virtual absl::Status Reset(cudaStream_t stream) = 0;

 protected:
  explicit LowLatencyRdmaStage(KernelPath* inner) : inner_(inner) {}
  KernelPath* const inner_;
};

// Low latency across hosts on the cuda backend (low_latency_relay.cc): the calling thread relays. Each
// step's kernel writes a remote rank's part into its outbox; after the step the thread sends exactly what was
// written, waits on the host until what this rank's next step needs has arrived (so that no kernel spins while the
// daemon lands bytes on the same GPU), then launches the next step. `inner` is the kernel path over all ranks,
// reached through remote->Reach; `own_region` this rank's low-latency region; `lost_ranks_host` the daemon's
// lost-ranks words for the group's ranks; `masks_lost_ranks` the Buffer's enable_shrink.
absl::StatusOr<std::unique_ptr<LowLatencyRdmaStage>> NewLowLatencyRelayStage(
    KernelPath* inner, std::unique_ptr<LowLatencyRemote> remote, const kernels::LowLatencyLayout& layout, int rank,
    void* own_region, const uint64_t* lost_ranks_host, bool masks_lost_ranks, absl::Duration timeout);

// Low latency across hosts on the cuda backend with device-issued puts (low_latency_device.cc,
// kernels/low_latency_remote.h): every step a launch on the caller's stream, every wait a kernel's, so that calls can
// be captured into a CUDA graph. Takes the lease's low-latency channels (LowLatencyChannels); their next ring index
// lives in device memory while the path exists and goes back to the ring when it is destroyed.
absl::StatusOr<std::unique_ptr<LowLatencyRdmaStage>> NewLowLatencyDeviceStage(KernelPath* inner,
                                                                              std::unique_ptr<LowLatencyRemote> remote,
                                                                              Lease* lease, absl::Duration timeout);

// The host backend sending each write as it is made: runs the kernel path's calls and quiets the transport after each
// (so that a caller that detaches right after a call does not take its last sends with it), reporting failed sends.
std::unique_ptr<LowLatencyRdmaStage> NewLowLatencyAsWrittenStage(KernelPath* inner,
                                                                 std::unique_ptr<LowLatencyRemote> remote);

}  // namespace epfabric::client::internal
