// The RDMA stage of internode normal mode driven from the host (normal_stage.h): the sends of rows and signals on
// the transport rings, the bounded waits on the region's words, the call counter, and what a failed call tells the
// ranks that wait for it. The host-driven calls use all of it; the worst-case calls (normal_worst.cc) use it on
// the host backend, where their transport steps are host code.
#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "data_path/internode/normal_stage.h"
#include "data_path/lost_ranks.h"
#include "epfabric/common/status_macros.h"

namespace epfabric::client::internal {
namespace {

namespace transport = kernels::transport;

constexpr uint64_t kWordBytes = sizeof(uint64_t);

}  // namespace

absl::Status NormalRdmaStage::QuietAll() {
  for (transport::RingIssuer& ring : rings_) EPF_RETURN_IF_ERROR(ring.Quiet(config_.timeout));
  return absl::OkStatus();
}

absl::Status NormalRdmaStage::WaitWords(size_t offset, uint64_t target, const char* what) {
  const int H = shape_.num_hosts;
  std::vector<uint64_t> words(H);
  const absl::Time deadline = absl::Now() + config_.timeout;
  absl::Time next_probe = absl::Now() + absl::Milliseconds(100);
  RefreshLostIgnore(lost_ranks_, lost_ignore_);
  for (int polls = 0;; ++polls) {
    EPF_RETURN_IF_ERROR(access_->ReadWords(region() + offset, words.data(), H));
    // A rank that left the call (LeaveCall) marks every word it owes: checked first, since the mark also reaches any
    // target.
    for (int h = 0; h < H; ++h) {
      if (h == shape_.host || words[h] < kLeftCallWord) continue;
      return absl::UnavailableError(absl::StrFormat(
          "rank %d stopped waiting for internode %s from rank %d (host %d): rank %d left the call (its own error says "
          "why)",
          lease_->rank(), what, PeerRank(h), h, PeerRank(h)));
    }
    int missing = -1;
    for (int h = 0; h < H && missing < 0; ++h) {
      if (h != shape_.host && words[h] < target) missing = h;
    }
    if (missing < 0) return absl::OkStatus();
    // Each host's words come from one rank there (the same local index as this one): once the daemon published
    // that rank as lost, its words never come. (A lost rank that wrote them first was found ready above.)
    for (int h = 0; h < H; ++h) {
      if (h == shape_.host || words[h] >= target || !RankLost(lost_ranks_, lost_ignore_, PeerRank(h))) continue;
      return absl::UnavailableError(absl::StrFormat(
          "rank %d stopped waiting for internode %s from rank %d (host %d): rank %d is lost (its client's lease ended "
          "or its daemon went down)",
          lease_->rank(), what, PeerRank(h), h, PeerRank(h)));
    }
    // A ring that failed (the peer's daemon is gone, a refused command) ends the wait at once.
    if (polls % 64 == 0) {
      for (transport::RingIssuer& ring : rings_) {
        const auto* control = static_cast<const transport::RingControl*>(
            transport::RingAt(lease_->commands_region(), ring.channel(), lease_->group().ring_slots()));
        EPF_RETURN_IF_ERROR(transport::RingErrorStatus(ring.channel(), *control));
      }
    }
    // A peer whose daemon died while nothing of ours was in flight to it would only show as this wait's timeout: a
    // signal_add of 0 to the awaited rank every 100 ms fails at once when its daemon is gone (the ring then reports
    // UNAVAILABLE naming it on the next poll), and changes nothing otherwise.
    if (absl::Now() > next_probe) {
      next_probe = absl::Now() + absl::Milliseconds(100);
      EPF_RETURN_IF_ERROR(
          RingFor(missing).SignalAdd(PeerRank(missing), offset + shape_.host * kWordBytes, 0, config_.timeout));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrFormat(
          "rank %d timed out after %s waiting for internode %s from rank %d (host %d): %d of %d arrived",
          lease_->rank(), absl::FormatDuration(config_.timeout), what, PeerRank(missing), missing, words[missing],
          target));
    }
    if (polls > 1000) std::this_thread::sleep_for(std::chrono::microseconds(polls > 20000 ? 200 : 10));
  }
}

absl::Status NormalRdmaStage::IssueDispatchRows(const int32_t* counts, int row_bytes, int num_scales, int num_topk,
                                                bool has_weights) {
  const kernels::InternodeRdmaLayout& l = layout_;
  const int self = shape_.host;
  for (int h = 0; h < shape_.num_hosts; ++h) {
    if (h == self) continue;
    transport::RingIssuer& ring = RingFor(h);
    const int peer = PeerRank(h);
    const uint64_t n = counts[h];
    auto put = [&](size_t send, size_t recv, size_t slab_bytes, uint64_t bytes) -> absl::Status {
      if (bytes == 0) return absl::OkStatus();
      return ring.Put(peer, recv + self * slab_bytes, send + h * slab_bytes, bytes, config_.timeout);
    };
    EPF_RETURN_IF_ERROR(put(l.send_x, l.recv_x, l.x_slab_bytes, n * row_bytes));
    EPF_RETURN_IF_ERROR(put(l.send_scales, l.recv_scales, l.scales_slab_bytes, n * num_scales * sizeof(float)));
    EPF_RETURN_IF_ERROR(put(l.send_topk_idx, l.recv_topk_idx, l.topk_idx_slab_bytes, n * num_topk * sizeof(int64_t)));
    if (has_weights) {
      EPF_RETURN_IF_ERROR(
          put(l.send_topk_weights, l.recv_topk_weights, l.topk_weights_slab_bytes, n * num_topk * sizeof(float)));
    }
    EPF_RETURN_IF_ERROR(ring.Put(peer, l.dispatch_count + self * kWordBytes, l.send_count + h * kWordBytes, kWordBytes,
                                 config_.timeout));
    EPF_RETURN_IF_ERROR(ring.SignalAdd(peer, l.dispatch_arrived + self * kWordBytes, 1, config_.timeout));
  }
  return absl::OkStatus();
}

absl::Status NormalRdmaStage::IssueSlabFree() {
  for (int h = 0; h < shape_.num_hosts; ++h) {
    if (h == shape_.host) continue;
    EPF_RETURN_IF_ERROR(
        RingFor(h).SignalAdd(PeerRank(h), layout_.slab_free + shape_.host * kWordBytes, 1, config_.timeout));
  }
  return absl::OkStatus();
}

absl::Status NormalRdmaStage::IssueCombineRows(const int32_t* counts, int hidden, int num_topk) {
  const kernels::InternodeRdmaLayout& l = layout_;
  const int self = shape_.host;
  const size_t x_row = static_cast<size_t>(hidden) * 2, w_row = static_cast<size_t>(num_topk) * sizeof(float);
  for (int h = 0; h < shape_.num_hosts; ++h) {
    if (h == self) continue;
    transport::RingIssuer& ring = RingFor(h);
    const int peer = PeerRank(h);
    const uint64_t n = counts[h];
    if (n > 0) {
      EPF_RETURN_IF_ERROR(ring.Put(peer, l.combine_recv_x + self * l.combine_x_slab_bytes,
                                   l.combine_send_x + h * l.combine_x_slab_bytes, n * x_row, config_.timeout));
      if (num_topk > 0) {
        EPF_RETURN_IF_ERROR(ring.Put(peer, l.combine_recv_weights + self * l.combine_weights_slab_bytes,
                                     l.combine_send_weights + h * l.combine_weights_slab_bytes, n * w_row,
                                     config_.timeout));
      }
    }
    EPF_RETURN_IF_ERROR(ring.SignalAdd(peer, l.combine_arrived + self * kWordBytes, 1, config_.timeout));
  }
  return absl::OkStatus();
}

absl::Status NormalRdmaStage::IssueCombineFree() {
  for (int h = 0; h < shape_.num_hosts; ++h) {
    if (h == shape_.host) continue;
    EPF_RETURN_IF_ERROR(
        RingFor(h).SignalAdd(PeerRank(h), layout_.combine_free + shape_.host * kWordBytes, 1, config_.timeout));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> NormalRdmaStage::BeginCall(int call, cudaStream_t stream) {
  EPF_RETURN_IF_ERROR(access_->Sync(stream));  // a padded call before this one counts on the device
  uint8_t* word = region() + layout_.calls + call * kWordBytes;
  uint64_t count = 0;
  EPF_RETURN_IF_ERROR(access_->ReadWords(word, &count, 1));
  ++count;
  EPF_RETURN_IF_ERROR(access_->WriteWords(word, &count, 1));
  return count;
}

// Refusals come first and tell nobody: a call that every rank refuses must leave the group as it was.
void NormalRdmaStage::LeaveCall() {
  // This host's ranks wait for this one in their NVLink stage, in this call's barriers (it failed before it got there:
  // a rank on another host is lost, bad peer data, a broken transport) or the next call's (it failed after): they
  // learn it now instead of at their timeout. They do not see the cause themselves: it is on another host.
  nvlink_->AbandonCall();
  const kernels::InternodeRdmaLayout& l = layout_;
  // Best effort within one timeout in all: the transport may be what failed, and a peer the marks miss still ends at
  // its own timeout.
  const absl::Time deadline = absl::Now() + config_.timeout;
  auto left = [&] { return std::max(absl::ZeroDuration(), deadline - absl::Now()); };
  for (int h = 0; h < shape_.num_hosts; ++h) {
    if (h == shape_.host) continue;
    for (size_t words : {l.dispatch_arrived, l.slab_free, l.combine_arrived, l.combine_free}) {
      RingFor(h).SignalAdd(PeerRank(h), words + shape_.host * kWordBytes, kLeftCallWord, left()).IgnoreError();
    }
  }
  // The marks land before this call returns its error, so before any rank resets (which zeroes them).
  for (transport::RingIssuer& ring : rings_) ring.Quiet(left()).IgnoreError();
}

}  // namespace epfabric::client::internal
