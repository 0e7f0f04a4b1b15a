// The transport side of low latency across hosts, and its stage on the host backend (low_latency_stage.h).
#include "data_path/internode/low_latency_stage.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "epfabric/common/status_macros.h"

namespace epfabric::client::internal {
namespace transport = kernels::transport;

uint64_t LowLatencyInternodeRdmaBytes(const kernels::LowLatencyLayout& layout) {
  return 2 * static_cast<uint64_t>(layout.half_bytes) +
         2 * static_cast<uint64_t>(layout.num_ranks) * layout.outbox_half_bytes;
}

absl::StatusOr<std::unique_ptr<LowLatencyRemote>> LowLatencyRemote::Create(Lease* lease,
                                                                           const kernels::LowLatencyLayout& layout,
                                                                           absl::Duration timeout,
                                                                           uint64_t rdma_offset) {
  auto remote = std::unique_ptr<LowLatencyRemote>(new LowLatencyRemote());
  remote->lease_ = lease;
  remote->timeout_ = timeout;
  remote->rdma_offset_ = rdma_offset;
  remote->layout_ = layout;
  const uint64_t need = LowLatencyInternodeRdmaBytes(layout);
  const uint64_t size = lease->rdma_region_bytes();
  const uint64_t available = size > rdma_offset ? size - rdma_offset : 0;
  if (lease->rdma_region() == nullptr || available < need) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "group '%s' spans hosts: its RDMA region has %d bytes%s, low latency needs %d (RequiredGroupBytes)",
        lease->group_name(), available,
        rdma_offset > 0 ? absl::StrCat(" after the normal-mode part's ", rdma_offset) : "", need));
  }
  remote->rdma_ = static_cast<uint8_t*>(lease->rdma_region()) + rdma_offset;
  for (int r = 0; r < lease->world_size(); ++r) {
    if (lease->region(r) == nullptr) remote->remote_ranks_.add(r);
  }
  void* commands = lease->commands_region();
  const int channels = static_cast<int>(lease->group().transport_channels());
  const uint32_t slots = lease->group().ring_slots();
  if (commands == nullptr || channels < 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", lease->group_name(), "' has no transport command rings mapped"));
  }
  for (int c = 0; c < channels; ++c) {
    EPF_ASSIGN_OR_RETURN(transport::RingIssuer ring,
                         transport::RingIssuer::Create(transport::RingAt(commands, c, slots), c, slots));
    remote->rings_.push_back(ring);
  }
  return remote;
}

void LowLatencyRemote::Reach(kernels::LowLatencyContext* context, bool put_as_written) const {
  for (int r = 0; r < context->num_ranks; ++r) {
    if (remote(r)) context->peer_regions[r] = outbox(r);
  }
  context->remote_ranks = remote_ranks_;
  context->remote_inbox = rdma_;
  context->remote_put = put_as_written ? &LowLatencyRemote::Put : nullptr;
  context->remote_put_arg = const_cast<LowLatencyRemote*>(this);
}

std::vector<LowLatencyRemote::SignalRange> LowLatencyRemote::SignalRanges() const {
  std::vector<SignalRange> ranges;
  for (int half = 0; half < 2; ++half) {
    ranges.push_back({inbox() + half * layout_.half_bytes, layout_.signal_bytes});
    for (int r = 0; r < layout_.num_ranks; ++r) {
      if (remote(r)) ranges.push_back({outbox(r) + half * layout_.outbox_half_bytes, layout_.outbox_signal_bytes});
    }
  }
  return ranges;
}

// One ring per destination (its rank modulo the rings), so that a destination sees this rank's sends in order.
absl::Status LowLatencyRemote::Send(int dst_rank, size_t outbox_offset, size_t inbox_offset, size_t bytes) {
  transport::RingIssuer& ring = rings_[dst_rank % rings_.size()];
  return ring.Put(dst_rank, rdma_offset_ + inbox_offset, rdma_offset_ + OutboxOffset(dst_rank) + outbox_offset, bytes,
                  timeout_);
}

bool LowLatencyRemote::Put(void* self, int dst_rank, size_t outbox_offset, size_t inbox_offset, size_t bytes) {
  auto* remote = static_cast<LowLatencyRemote*>(self);
  absl::Status sent = remote->Send(dst_rank, outbox_offset, inbox_offset, bytes);
  if (sent.ok()) return true;
  std::lock_guard<std::mutex> lock(remote->mu_);
  if (remote->error_.ok()) remote->error_ = sent;
  return false;
}

absl::Status LowLatencyRemote::Quiet() {
  for (transport::RingIssuer& ring : rings_) EPF_RETURN_IF_ERROR(ring.Quiet(timeout_));
  return absl::OkStatus();
}

absl::Status LowLatencyRemote::TakeError() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(error_, absl::OkStatus());
}

namespace {

class LowLatencyAsWrittenStage final : public LowLatencyRdmaStage {
 public:
  LowLatencyAsWrittenStage(KernelPath* inner, std::unique_ptr<LowLatencyRemote> remote)
      : LowLatencyRdmaStage(inner), remote_(std::move(remote)) {}

  absl::Status LowLatencyDispatch(const kernels::LowLatencyDispatchArgs& args, cudaStream_t stream) override {
    return Finish(inner_->LowLatencyDispatch(args, stream));
  }
  absl::Status LowLatencyCombine(const kernels::LowLatencyCombineArgs& args, cudaStream_t stream) override {
    return Finish(inner_->LowLatencyCombine(args, stream));
  }
  absl::Status Reset(cudaStream_t stream) override {
    remote_->TakeError().IgnoreError();
    return inner_->Reset(stream);
  }

 private:
  // A failed send explains the call better than the wait it caused; the quiet makes the sends complete.
  absl::Status Finish(absl::Status ran) {
    absl::Status quiet = remote_->Quiet();
    if (absl::Status sent = remote_->TakeError(); !sent.ok()) return sent;
    if (!ran.ok()) return ran;
    return quiet;
  }

  std::unique_ptr<LowLatencyRemote> remote_;
};

}  // namespace

std::unique_ptr<LowLatencyRdmaStage> NewLowLatencyAsWrittenStage(KernelPath* inner,
                                                                 std::unique_ptr<LowLatencyRemote> remote) {
  return std::make_unique<LowLatencyAsWrittenStage>(inner, std::move(remote));
}

}  // namespace epfabric::client::internal
