// Low-latency mode across hosts on the cuda backend: the calling thread relays between launches
// (low_latency_stage.h, docs/internode-dispatch.md "Low latency across hosts").
//
// The kernels are the intranode low-latency kernels over all ranks, with each rank on another host mapped to an
// outbox in this rank's RDMA region (writes: this rank's slots, compact) and the inbox (reads). A call runs as steps:
//   dispatch: send kernel -> send the staged messages, routing lists, then counts -> wait (host) for every source's
//             counts -> receive kernel;
//   combine:  weights kernel -> send the staged weights, then weights flags -> wait for every source's weights ->
//             send kernel (partial sums) -> send the staged rows, then combine flags -> wait for every rank's flag ->
//             receive kernel.
// Signals go on the same ring as their data, after it, so a destination never sees a signal before its bytes. The
// host waits cover same-host ranks too: once they end, no kernel of this rank spins, which matters on the socket
// wire, where the daemon lands bytes with GPU work of its own that a spinning client kernel would hold off.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "data_path/internode/low_latency_stage.h"
#include "data_path/internode/normal_stage.h"
#include "data_path/lost_ranks.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/kernels/common.h"

namespace epfabric::client::internal {
namespace {

using kernels::LowLatencyPhases;

// Which signal a step waits for, per source rank.
enum class Awaited { kDispatchCounts, kWeightsFlag, kCombineFlag };

const char* AwaitedName(Awaited what) {
  switch (what) {
    case Awaited::kDispatchCounts:
      return "dispatch counts";
    case Awaited::kWeightsFlag:
      return "combine weights";
    case Awaited::kCombineFlag:
      return "combine rows";
  }
  return "signal";
}

class LowLatencyRelayStage final : public LowLatencyRdmaStage {
 public:
  LowLatencyRelayStage(KernelPath* inner, std::unique_ptr<LowLatencyRemote> remote,
                       std::unique_ptr<RegionAccess> access, const kernels::LowLatencyLayout& layout, int rank,
                       void* own_region, const uint64_t* lost_ranks_host, bool masks_lost_ranks, absl::Duration timeout)
      : LowLatencyRdmaStage(inner),
        remote_(std::move(remote)),
        access_(std::move(access)),
        l_(layout),
        own_(kernels::LowLatencySourceSlots(layout, rank)),
        rank_(rank),
        own_region_(static_cast<uint8_t*>(own_region)),
        num_ranks_(layout.num_ranks),
        lost_ranks_(lost_ranks_host),
        masks_lost_ranks_(masks_lost_ranks),
        timeout_(timeout) {
    InitLostIgnore(lost_ranks_, lost_ignore_);
  }

  absl::Status LowLatencyDispatch(const kernels::LowLatencyDispatchArgs& args, cudaStream_t stream) override {
    EPF_RETURN_IF_ERROR(RefuseCaptureAcrossHosts(inner_->backend(), stream, /*low_latency=*/true));
    RefreshLostIgnore(lost_ranks_, lost_ignore_);
    absl::Status ran = RunDispatch(args, stream);
    return Finish(std::move(ran));
  }
  absl::Status LowLatencyCombine(const kernels::LowLatencyCombineArgs& args, cudaStream_t stream) override {
    EPF_RETURN_IF_ERROR(RefuseCaptureAcrossHosts(inner_->backend(), stream, /*low_latency=*/true));
    RefreshLostIgnore(lost_ranks_, lost_ignore_);
    absl::Status ran = RunCombine(args, stream);
    return Finish(std::move(ran));
  }
  absl::Status Reset(cudaStream_t stream) override {
    remote_->TakeError().IgnoreError();
    // The inner path zeroes this rank's own signals; the inbox's and the outboxes' are this path's.
    for (const LowLatencyRemote::SignalRange& range : remote_->SignalRanges()) {
      EPF_RETURN_IF_ERROR(access_->Zero(range.at, range.bytes, stream));
    }
    return inner_->Reset(stream);
  }

 private:
  bool Remote(int r) const { return remote_->remote(r); }
  using RankSet = kernels::LowLatencyRankSet;

  // The sends were queued in order; the quiet makes them complete before the call returns (a caller that detaches
  // right after would otherwise take them with it). A failed send explains the call best, then the steps' error,
  // then a wait that timed out on the host.
  absl::Status Finish(absl::Status ran) {
    absl::Status quiet = remote_->Quiet();
    if (absl::Status sent = remote_->TakeError(); !sent.ok()) return sent;
    absl::Status timed_out = std::exchange(timed_out_, absl::OkStatus());
    if (!ran.ok()) return ran;
    if (!quiet.ok()) return quiet;
    return timed_out;
  }

  // Sends a field of this call's half of the outbox for r (at `outbox_field` in the outbox layout) to this rank's
  // slots of r's inbox (at `inbox_field` in the full layout).
  absl::Status Send(int r, int half, size_t outbox_field, size_t inbox_field, size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    return remote_->Send(r, half * l_.outbox_half_bytes + outbox_field, half * l_.half_bytes + inbox_field, bytes);
  }

  // The `bytes` of signals at the start of `half_base` (a half of this rank's region or of the inbox: signal_bytes;
  // of an outbox: outbox_signal_bytes), now.
  absl::Status ReadSignals(const uint8_t* half_base, size_t bytes, std::vector<int32_t>* out) {
    const int words = static_cast<int>(bytes / sizeof(uint64_t));
    std::vector<uint64_t> raw(words);
    EPF_RETURN_IF_ERROR(access_->ReadWords(half_base, raw.data(), words));
    out->resize(bytes / sizeof(int32_t));
    std::memcpy(out->data(), raw.data(), bytes);
    return absl::OkStatus();
  }
  // This call's half of the outbox for r: its signals.
  absl::Status ReadOutboxSignals(int r, int half, std::vector<int32_t>* out) {
    return ReadSignals(remote_->outbox(r) + half * l_.outbox_half_bytes, l_.outbox_signal_bytes, out);
  }

  int32_t SignalAt(const std::vector<int32_t>& signals, size_t offset, int index) const {
    return signals[offset / sizeof(int32_t) + index];
  }
  // A count signal (low_latency_layout.h: 64 bits, little-endian in two words).
  uint64_t CountAt(const std::vector<int32_t>& signals, size_t offset, int index) const {
    const size_t word = offset / sizeof(int32_t) + 2 * static_cast<size_t>(index);
    return static_cast<uint32_t>(signals[word]) |
           (static_cast<uint64_t>(static_cast<uint32_t>(signals[word + 1])) << 32);
  }

  bool Arrived(Awaited what, const std::vector<int32_t>& signals, int s) const {
    switch (what) {
      case Awaited::kDispatchCounts:
        for (int local = 0; local < l_.num_local_experts; ++local) {
          if (CountAt(signals, l_.dispatch_count_offset, local * num_ranks_ + s) == 0) return false;
        }
        return true;
      case Awaited::kWeightsFlag:
        return SignalAt(signals, l_.weights_flag_offset, s) != 0;
      case Awaited::kCombineFlag:
        return SignalAt(signals, l_.combine_flag_offset, s) != 0;
    }
    return false;
  }

  // Waits on the host until every rank in `sources` has raised `what` in this call's half (read from this rank's own
  // half, or from the inbox for a rank on another host). A rank the daemon publishes as lost stops being awaited (the
  // kernel then masks it without failing the call, as within one host). A rank still silent at the deadline is masked
  // for this and later calls and the call reports DEADLINE_EXCEEDED naming it, after the kernel ran without it.
  // A Buffer that masks no rank (enable_shrink off) cannot complete a call once any rank is lost, and the ranks that
  // come to the call after the loss refuse it (Buffer::State::CheckGeneration) and never send, live as they are: a
  // wait on them ends as soon as any rank is lost, UNAVAILABLE naming it.
  // The time waited for each remote rank is added to `wait_cost` (device int64 [num_ranks]) when given.
  absl::Status Await(Awaited what, const RankSet& sources, int half, int64_t* wait_cost, cudaStream_t stream) {
    const uint8_t* own = own_region_ + half * l_.half_bytes;
    const uint8_t* inbox = remote_->inbox() + half * l_.half_bytes;
    std::vector<int32_t> own_signals, inbox_signals;
    std::vector<int64_t> waited(num_ranks_, 0);
    const auto start = std::chrono::steady_clock::now();
    const absl::Time deadline = absl::Now() + timeout_;
    RankSet pending = sources;
    for (int polls = 0; !pending.empty(); ++polls) {
      bool need_own = false, need_inbox = false;
      for (int s = 0; s < num_ranks_; ++s) {
        if (pending.has(s)) (Remote(s) ? need_inbox : need_own) = true;
      }
      if (need_own) EPF_RETURN_IF_ERROR(ReadSignals(own, l_.signal_bytes, &own_signals));
      if (need_inbox) EPF_RETURN_IF_ERROR(ReadSignals(inbox, l_.signal_bytes, &inbox_signals));
      const int64_t now_ns =
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
      for (int s = 0; s < num_ranks_; ++s) {
        if (!pending.has(s)) continue;
        if (Arrived(what, Remote(s) ? inbox_signals : own_signals, s) || RankLost(lost_ranks_, lost_ignore_, s)) {
          pending.remove(s);
          waited[s] = now_ns;
        }
      }
      if (pending.empty()) break;
      if (!masks_lost_ranks_) {
        if (const int gone = FirstLostRank(lost_ranks_, lost_ignore_, num_ranks_, rank_); gone >= 0) {
          int awaited = 0;
          while (!pending.has(awaited)) ++awaited;
          return absl::UnavailableError(absl::StrFormat(
              "rank %d stopped waiting for low-latency %s from rank %d (across hosts, host-side wait): rank %d is "
              "lost, and a Buffer without enable_shrink completes no call without it",
              rank_, AwaitedName(what), awaited, gone));
        }
      }
      if (absl::Now() > deadline) break;
      // Polling costs a small device-to-host copy; after the first rounds, leave the CPU to others between reads.
      if (polls > 64) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    if (!pending.empty()) {
      int first = -1;
      for (int s = 0; s < num_ranks_; ++s) {
        if (!pending.has(s)) continue;
        if (first < 0) first = s;
        const int32_t one = 1;
        EPF_RETURN_IF_ERROR(access_->FromHost(inner_->LowLatencyRankMask() + s, &one, sizeof(one), stream));
      }
      if (timed_out_.ok()) {
        timed_out_ = absl::DeadlineExceededError(absl::StrFormat(
            "rank %d timed out after %s waiting for low-latency %s from rank %d (across hosts, host-side wait); "
            "rank %d is masked from now on",
            rank_, absl::FormatDuration(timeout_), AwaitedName(what), first, first));
      }
    }
    if (wait_cost != nullptr) {
      std::vector<int64_t> cost(num_ranks_);
      EPF_RETURN_IF_ERROR(access_->ToHost(cost.data(), wait_cost, sizeof(int64_t) * num_ranks_, stream));
      for (int s = 0; s < num_ranks_; ++s) {
        if (Remote(s) && sources.has(s)) cost[s] += std::max<int64_t>(waited[s], 1);
      }
      EPF_RETURN_IF_ERROR(access_->FromHost(wait_cost, cost.data(), sizeof(int64_t) * num_ranks_, stream));
    }
    return absl::OkStatus();
  }

  // Every rank the kernels' rank mask does not mask, this one included (its own signals come from its own send step).
  absl::StatusOr<RankSet> Sources(cudaStream_t stream) {
    std::vector<int32_t> mask(num_ranks_);
    EPF_RETURN_IF_ERROR(
        access_->ToHost(mask.data(), inner_->LowLatencyRankMask(), sizeof(int32_t) * num_ranks_, stream));
    RankSet sources;
    for (int r = 0; r < num_ranks_; ++r) {
      if (mask[r] == 0) sources.add(r);
    }
    return sources;
  }

  absl::Status RunDispatch(const kernels::LowLatencyDispatchArgs& args, cudaStream_t stream) {
    const int M = l_.max_tokens_per_rank, L = l_.num_local_experts, half = args.buffer_half;
    const kernels::LowLatencySlots& o = l_.outbox;
    kernels::LowLatencyDispatchArgs step = args;
    if (kernels::LowLatencySends(args.phases)) {
      step.phases = LowLatencyPhases::kSend;
      EPF_RETURN_IF_ERROR(inner_->LowLatencyDispatch(step, stream));
      EPF_RETURN_IF_ERROR(access_->Sync(stream));
      EPF_ASSIGN_OR_RETURN(const RankSet sources, Sources(stream));
      std::vector<int32_t> staged;
      for (int r = 0; r < num_ranks_; ++r) {
        if (!Remote(r) || !sources.has(r)) continue;
        EPF_RETURN_IF_ERROR(ReadOutboxSignals(r, half, &staged));
        // The messages of this rank's tokens; the receiver reads only the listed tokens' slots.
        EPF_RETURN_IF_ERROR(
            Send(r, half, o.msgs, own_.msgs, static_cast<size_t>(args.num_tokens) * l_.dispatch_msg_bytes));
        for (int local = 0; local < L; ++local) {
          const uint64_t value = CountAt(staged, o.count, local);
          const int64_t count = value == 0 ? 0 : static_cast<int64_t>(value & 0xffffffffu) - 1;
          if (count <= 0 || count > M) continue;  // the kernel's own count: 0 .. M
          EPF_RETURN_IF_ERROR(Send(r, half, o.table + local * o.table_stride, own_.table + local * own_.table_stride,
                                   static_cast<size_t>(count) * sizeof(int32_t)));
        }
        for (int local = 0; local < L; ++local) {
          if (CountAt(staged, o.count, local) == 0) continue;
          EPF_RETURN_IF_ERROR(Send(r, half, o.count + local * o.count_stride, own_.count + local * own_.count_stride,
                                   sizeof(uint64_t)));
        }
      }
    }
    if (kernels::LowLatencyReceives(args.phases)) {
      EPF_ASSIGN_OR_RETURN(const RankSet sources, Sources(stream));
      EPF_RETURN_IF_ERROR(Await(Awaited::kDispatchCounts, sources, half, args.wait_recv_cost_ns, stream));
      step.phases = LowLatencyPhases::kRecv;
      EPF_RETURN_IF_ERROR(inner_->LowLatencyDispatch(step, stream));
      EPF_RETURN_IF_ERROR(access_->Sync(stream));
    }
    return absl::OkStatus();
  }

  absl::Status RunCombine(const kernels::LowLatencyCombineArgs& args, cudaStream_t stream) {
    const int M = l_.max_tokens_per_rank, half = args.buffer_half;
    const kernels::LowLatencySlots& o = l_.outbox;
    const size_t row_bytes = static_cast<size_t>(l_.hidden) * 2;
    kernels::LowLatencyCombineArgs step = args;
    if (kernels::LowLatencySends(args.phases)) {
      // 1. This rank's weights to every rank, then the weights flags.
      step.phases = LowLatencyPhases::kCombineWeights;
      EPF_RETURN_IF_ERROR(inner_->LowLatencyCombine(step, stream));
      EPF_RETURN_IF_ERROR(access_->Sync(stream));
      EPF_ASSIGN_OR_RETURN(RankSet sources, Sources(stream));
      std::vector<int32_t> staged;
      for (int r = 0; r < num_ranks_; ++r) {
        if (!Remote(r) || !sources.has(r)) continue;
        EPF_RETURN_IF_ERROR(ReadOutboxSignals(r, half, &staged));
        EPF_RETURN_IF_ERROR(Send(r, half, o.weights, own_.weights,
                                 static_cast<size_t>(args.num_tokens) * kernels::kLowLatencyMaxTopk * sizeof(float)));
        if (SignalAt(staged, o.weights_flag, 0) != 0) {
          EPF_RETURN_IF_ERROR(Send(r, half, o.weights_flag, own_.weights_flag, sizeof(int32_t)));
        }
      }
      // 2. Every source's weights here, then the partial sums.
      sources.remove(rank_);  // this rank's own weights are its inputs
      EPF_RETURN_IF_ERROR(Await(Awaited::kWeightsFlag, sources, half, nullptr, stream));
      step.phases = LowLatencyPhases::kSendWeightsPublished;
      EPF_RETURN_IF_ERROR(inner_->LowLatencyCombine(step, stream));
      EPF_RETURN_IF_ERROR(access_->Sync(stream));
      // 3. The rows of the tokens of each remote rank that this rank holds experts of (the dispatch's token map),
      //    then the combine flags.
      EPF_ASSIGN_OR_RETURN(sources, Sources(stream));
      std::vector<int32_t> map(static_cast<size_t>(M) * kernels::kLowLatencyMaxTopk);
      for (int s = 0; s < num_ranks_; ++s) {
        if (!Remote(s) || !sources.has(s)) continue;
        EPF_RETURN_IF_ERROR(access_->ToHost(
            map.data(), args.handle.packed_recv_token_map + static_cast<size_t>(s) * M * kernels::kLowLatencyMaxTopk,
            map.size() * sizeof(int32_t), stream));
        for (int t = 0; t < M; ++t) {
          bool present = false;
          for (int k = 0; k < kernels::kLowLatencyMaxTopk && !present; ++k) {
            present = map[static_cast<size_t>(t) * kernels::kLowLatencyMaxTopk + k] >= 0;
          }
          if (!present) continue;
          EPF_RETURN_IF_ERROR(Send(s, half, o.recv + t * o.recv_stride, own_.recv + t * own_.recv_stride, row_bytes));
        }
        EPF_RETURN_IF_ERROR(ReadOutboxSignals(s, half, &staged));
        if (SignalAt(staged, o.combine_flag, 0) != 0) {
          EPF_RETURN_IF_ERROR(Send(s, half, o.combine_flag, own_.combine_flag, sizeof(int32_t)));
        }
      }
    }
    if (kernels::LowLatencyReceives(args.phases)) {
      EPF_ASSIGN_OR_RETURN(const RankSet sources, Sources(stream));
      EPF_RETURN_IF_ERROR(Await(Awaited::kCombineFlag, sources, half, args.wait_recv_cost_ns, stream));
      step.phases = LowLatencyPhases::kRecv;
      EPF_RETURN_IF_ERROR(inner_->LowLatencyCombine(step, stream));
      EPF_RETURN_IF_ERROR(access_->Sync(stream));
    }
    return absl::OkStatus();
  }

  std::unique_ptr<LowLatencyRemote> remote_;
  std::unique_ptr<RegionAccess> access_;
  const kernels::LowLatencyLayout l_;
  const kernels::LowLatencySlots own_;  // this rank's slots in a full half (where its puts land in an inbox)
  const int rank_;
  uint8_t* const own_region_;  // this rank's low-latency region (where same-host ranks write)
  const int num_ranks_;
  const uint64_t* lost_ranks_;
  uint64_t lost_ignore_[kernels::kLostRankWords] = {};
  const bool masks_lost_ranks_;  // BufferConfig::enable_shrink
  const absl::Duration timeout_;
  absl::Status timed_out_;  // a host-side wait that ended at its deadline in this call
};

}  // namespace

absl::StatusOr<std::unique_ptr<LowLatencyRdmaStage>> NewLowLatencyRelayStage(
    KernelPath* inner, std::unique_ptr<LowLatencyRemote> remote, const kernels::LowLatencyLayout& layout, int rank,
    void* own_region, const uint64_t* lost_ranks_host, bool masks_lost_ranks, absl::Duration timeout) {
  if (layout.signal_bytes / sizeof(uint64_t) > static_cast<size_t>(kRegionAccessMaxWords)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the low-latency signals of this shape (%d bytes) exceed what the relay reads at once (%d bytes): fewer "
        "experts or ranks",
        layout.signal_bytes, kRegionAccessMaxWords * sizeof(uint64_t)));
  }
  EPF_ASSIGN_OR_RETURN(std::unique_ptr<RegionAccess> access, NewRegionAccess(inner->backend()));
  return std::unique_ptr<LowLatencyRdmaStage>(
      std::make_unique<LowLatencyRelayStage>(inner, std::move(remote), std::move(access), layout, rank, own_region,
                                             lost_ranks_host, masks_lost_ranks, timeout));
}

}  // namespace epfabric::client::internal
