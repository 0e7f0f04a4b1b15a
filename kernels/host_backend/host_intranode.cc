// Host backend of the intranode (normal) mode: notify, dispatch (also cached) and combine, run by the CPU
// over the same regions (ComputeIntranodeRegionLayout) and with the same signals as the CUDA kernels
// (kernels/cuda/intranode_*.cu, docs/intranode-kernels.md, docs/host-backend.md):
//  - barrier: monotonic arrival counters (lane 0; the host runs all channels on one thread, so one lane suffices),
//  - dispatch: per (sender, channel) a slot range and a tail, written by the sender with release stores into the
//    receiver's region after the rows; the receiver acquires them, copies, and zeroes them when done,
//  - combine: per (expert rank, channel) a tail holding the absolute slot end, zeroed by the reducing rank.
// The staging pools hold every row a peer can send, so a sender never waits: a rank sends everything, then
// receives; the only waits are the barrier and the tails, each bounded by group.timeout_ns.
#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>

#include "absl/strings/str_format.h"
#include "api/intranode_checks.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/kernels/host_backend.h"
#include "epfabric/kernels/host_backend_numeric.h"
#include "epfabric/kernels/reference/intranode_reference.h"
#include "host_backend/host_sync.h"

namespace epfabric::kernels::host_backend {
namespace {

using internal::FailureRecord;
using internal::LoadAcquire;
using internal::LossWords;
using internal::RankLost;
using internal::StoreRelaxed;
using internal::StoreRelease;
using internal::WaitForPeer;

using intranode_checks::kFp8ScaleBlock;
constexpr intranode_checks::Backend kHost = intranode_checks::Backend::kHost;
constexpr int kBarrierLane = 0;

// The group with its layout: what every step needs to address a section of any rank's region.
struct View {
  const IntranodeGroup& group;
  IntranodeRegionLayout layout;
  int rank;
  int num_ranks;
  int experts_per_rank;
  int max_channels;

  template <typename T>
  T* Section(int region_rank, size_t offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(group.peer_regions[region_rank]) + offset);
  }
  // Staging pool of `region_rank`'s region for the rank at the other end of the transfer.
  template <typename T>
  T* Pool(int region_rank, size_t section, size_t pool_bytes, int pool) const {
    return reinterpret_cast<T*>(static_cast<char*>(group.peer_regions[region_rank]) + section + pool * pool_bytes);
  }
  int32_t* ChannelTail(int region_rank, int writer, int channel) const {
    return Section<int32_t>(region_rank, layout.channel_tail) + writer * max_channels + channel;
  }
  int64_t* DispatchRange(int region_rank, int writer, int channel) const {
    return Section<int64_t>(region_rank, layout.dispatch_range) + writer * max_channels + channel;
  }
};

absl::StatusOr<View> MakeView(const IntranodeGroup& group) {
  EPF_ASSIGN_OR_RETURN(const IntranodeRegionLayout layout, intranode_checks::CheckGroup(group, kHost));
  const int num_ranks = group.config.num_ranks;
  return View{group, layout, group.rank, num_ranks, group.config.num_experts / num_ranks, group.config.max_channels};
}

// The barrier ends unfinished once the daemon has published any rank of the group as lost (one `lost_ignore` does not
// hide): the first such rank other than this one; -1 when none. Normal mode masks no rank, so no call of this Buffer's
// generation can succeed once a rank is lost: the ranks that come to the call after the loss is published refuse it
// (Buffer::State::CheckGeneration) and never arrive, live as they are, and waiting for them would end only at the
// timeout. So every rank counts, not only the one awaited, and a lost rank that arrived before it died counts too.
int FirstLostRank(const View& v) {
  for (int q = 0; q < v.num_ranks; ++q) {
    if (q != v.rank && RankLost(LossWords(v.group.lost_ranks, v.group.lost_ignore, q), q)) return q;
  }
  return -1;
}

// Cross-rank barrier on lane 0 (see block_barrier in kernels/cuda/intranode_common.cuh): arrive at every rank
// (release: this rank's earlier writes into peers' regions become visible to them), then wait until every rank has
// arrived here as often as this rank completed barriers + 1. A rank arrives only after its previous call returned,
// so after the barrier nothing a peer reads from an earlier call is still being read.
bool Barrier(const View& v, FailureRecord* failure) {
  int32_t* epoch = v.Section<int32_t>(v.rank, v.layout.barrier_epoch) + kBarrierLane;
  const int32_t target = static_cast<int32_t>(static_cast<uint32_t>(*epoch) + 1u);
  for (int peer = 0; peer < v.num_ranks; ++peer) {
    internal::FetchAddRelease(v.Section<int32_t>(peer, v.layout.barrier_arrive) + kBarrierLane * v.num_ranks + v.rank,
                              1);
  }
  for (int peer = 0; peer < v.num_ranks; ++peer) {
    const int32_t* arrived = v.Section<int32_t>(v.rank, v.layout.barrier_arrive) + kBarrierLane * v.num_ranks + peer;
    // Peer data: a peer has arrived at least as often as this rank completed barriers (each needed its arrival) and
    // at most twice more (its next arrival needs this rank's current one). Anything else is a stale or corrupt
    // counter, which would let this rank through without the peer: reported, never waited on.
    int32_t ahead = 0;
    int lost = -1;
    if (!internal::BoundedWait(
            [&] {
              ahead = static_cast<int32_t>(static_cast<uint32_t>(LoadAcquire(arrived)) - static_cast<uint32_t>(*epoch));
              return ahead != 0;
            },
            v.group.timeout_ns, [&] { return (lost = FirstLostRank(v)) >= 0; })) {
      failure->RecordWait(lost >= 0, WaitSite::kBarrier, v.rank, lost >= 0 ? lost : peer, kBarrierLane);
      return false;
    }
    // It left (IntranodeAbandonCall) and will not arrive. The marker plus at most the 2 arrivals a live rank can be
    // ahead (it may have arrived here before its call failed); any other large count is corrupt (checked below).
    if (ahead >= kAbandonArrivals && ahead <= kAbandonArrivals + 2) {
      failure->RecordPeerLeftCall(WaitSite::kBarrier, v.rank, peer, kBarrierLane);
      return false;
    }
    if (!failure->CheckPeerValue(PeerDataField::kBarrierArrivals, v.rank, peer, kBarrierLane, ahead, 1, 2)) {
      return false;
    }
  }
  *epoch = target;  // only the owner touches its epoch
  return true;
}

int RecvBase(const int32_t* rank_prefix_matrix, int num_ranks, int src, int dst) {
  return src == 0 ? 0 : rank_prefix_matrix[(src - 1) * num_ranks + dst];
}

// Received rows' metadata, as copied into the outputs: source token indices in [0, max_src_idx], local expert ids in
// [-1, max_local_expert]. Returns the DataLoss status naming `src` for the first value outside.
absl::Status CheckReceivedRows(const int32_t* src_idx, const int64_t* topk_idx, int count, int K, int max_src_idx,
                               int max_local_expert, int me, int src, int channel, FailureRecord* failure,
                               KernelStatus* status) {
  for (int i = 0; i < count; ++i) {
    if (!failure->CheckPeerValue(PeerDataField::kDispatchSrcIdx, me, src, channel, src_idx[i], 0, max_src_idx)) {
      return failure->Finish(status);
    }
  }
  for (int64_t i = 0; topk_idx != nullptr && i < static_cast<int64_t>(count) * K; ++i) {
    if (!failure->CheckPeerValue(PeerDataField::kDispatchTopkIdx, me, src, channel, topk_idx[i], -1,
                                 max_local_expert)) {
      return failure->Finish(status);
    }
  }
  return absl::OkStatus();
}

// This rank's column of a prefix matrix (inclusive over sources) must not decrease: every source's rows then lie in
// [0, column's last value).
absl::Status CheckPrefixColumn(const int32_t* rank_prefix_matrix, int num_ranks, int me) {
  for (int s = 0; s < num_ranks; ++s) {
    const int32_t at = rank_prefix_matrix[s * num_ranks + me];
    if (at < RecvBase(rank_prefix_matrix, num_ranks, s, me)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("handle.rank_prefix_matrix[%d][%d] = %d: this rank's column must not decrease", s, me, at));
    }
  }
  return absl::OkStatus();
}

// A failure found before any wait: recorded in the status word (when clear), as the kernel would, and returned.
absl::Status FinishWith(const KernelStatus& record, KernelStatus* status_word) {
  FailureRecord failure;
  failure.Adopt(record);
  return failure.Finish(status_word);
}

int64_t PackRange(int begin, int end) { return (static_cast<int64_t>(end + 1) << 32) | static_cast<uint32_t>(begin); }

}  // namespace

absl::Status IntranodeResetRegion(const IntranodeGroup& group) {
  EPF_ASSIGN_OR_RETURN(const View v, MakeView(group));
  std::memset(group.peer_regions[group.rank], 0, v.layout.signal_bytes);
  return absl::OkStatus();
}

absl::Status IntranodeAbandonCall(const IntranodeGroup& group) {
  EPF_ASSIGN_OR_RETURN(const View v, MakeView(group));
  // A rank that left reaches no barrier until the reset, and every call starts with one (notify, dispatch, combine), so
  // that is where its peers wait for it.
  for (int peer = 0; peer < v.num_ranks; ++peer) {
    if (peer == v.rank) continue;
    internal::FetchAddRelease(v.Section<int32_t>(peer, v.layout.barrier_arrive) + kBarrierLane * v.num_ranks + v.rank,
                              kAbandonArrivals);
  }
  return absl::OkStatus();
}

absl::Status IntranodeNotify(const IntranodeGroup& group, const IntranodeNotifyParams& p) {
  EPF_ASSIGN_OR_RETURN(const View v, MakeView(group));
  EPF_RETURN_IF_ERROR(intranode_checks::CheckNotify(group, p));
  const int R = v.num_ranks, epr = v.experts_per_rank;
  FailureRecord failure;
  if (!Barrier(v, &failure)) return failure.Finish(group.status);
  // Every region gets this rank's row of counts; published by the second barrier's release.
  for (int dst = 0; dst < R; ++dst) {
    std::memcpy(v.Section<int32_t>(dst, v.layout.notify_rank_counts) + v.rank * R, p.num_tokens_per_rank,
                R * sizeof(int32_t));
    std::memcpy(v.Section<int32_t>(dst, v.layout.notify_expert_counts) + v.rank * epr,
                p.num_tokens_per_expert + dst * epr, epr * sizeof(int32_t));
  }
  if (!Barrier(v, &failure)) return failure.Finish(group.status);
  // The counts are peer data: every one is checked before it is summed (a source sends at most
  // max_tokens_per_rank tokens to a rank, and has at most max_tokens_per_rank * max_topk top-k entries for one
  // expert), so the sums below fit int32 and num_recv never exceeds IntranodeWorstCaseRecvTokens.
  const int32_t* rank_counts = v.Section<int32_t>(v.rank, v.layout.notify_rank_counts);
  const int32_t* expert_counts = v.Section<int32_t>(v.rank, v.layout.notify_expert_counts);
  const int64_t max_rank_count = group.config.max_tokens_per_rank;
  const int64_t max_expert_count = max_rank_count * std::max(group.config.max_topk, 1);
  // Each count is read once into a local copy: a peer that keeps writing cannot change a value after its check.
  std::vector<int32_t> counts(static_cast<size_t>(R) * R);
  for (int src = 0; src < R; ++src) {
    for (int dst = 0; dst < R; ++dst) {
      const int32_t n = internal::LoadRelaxed(rank_counts + src * R + dst);
      if (!failure.CheckPeerValue(PeerDataField::kNotifyRankCount, v.rank, src, dst, n, 0, max_rank_count)) {
        return failure.Finish(group.status);
      }
      counts[src * R + dst] = n;
    }
  }
  std::vector<int64_t> expert_sums(epr, 0);
  for (int src = 0; src < R; ++src) {
    for (int e = 0; e < epr; ++e) {
      const int32_t n = internal::LoadRelaxed(expert_counts + src * epr + e);
      if (!failure.CheckPeerValue(PeerDataField::kNotifyExpertCount, v.rank, src, e, n, 0, max_expert_count)) {
        return failure.Finish(group.status);
      }
      expert_sums[e] += n;
    }
  }
  for (int dst = 0; dst < R; ++dst) {
    int32_t sum = 0;
    for (int src = 0; src < R; ++src) {
      sum += counts[src * R + dst];
      p.rank_prefix_matrix[src * R + dst] = sum;
    }
  }
  for (int e = 0; e < epr; ++e) {
    const int64_t aligned = (expert_sums[e] + p.expert_alignment - 1) / p.expert_alignment * p.expert_alignment;
    if (aligned > INT32_MAX) {
      return InvalidValue("expert_alignment", p.expert_alignment, "rounds a per-expert count past INT32_MAX");
    }
    if (p.recv_counts != nullptr) p.recv_counts[1 + e] = static_cast<int32_t>(aligned);
    if (p.host_num_recv_tokens_per_expert != nullptr) {
      p.host_num_recv_tokens_per_expert[e] = static_cast<int32_t>(aligned);
    }
  }
  const int32_t num_recv = p.rank_prefix_matrix[(R - 1) * R + v.rank];
  if (p.recv_counts != nullptr) p.recv_counts[0] = num_recv;
  // Last, with release: a thread polling it (IntranodeWaitRecvCounts) then sees the per-expert counts too.
  if (p.host_num_recv_tokens != nullptr) StoreRelease(p.host_num_recv_tokens, num_recv);
  return absl::OkStatus();
}

absl::Status IntranodeDispatch(const IntranodeGroup& group, const IntranodeDispatchParams& p, IntranodeHandle* handle) {
  EPF_ASSIGN_OR_RETURN(const View v, MakeView(group));
  EPF_RETURN_IF_ERROR(intranode_checks::CheckDispatch(group, p, handle, kHost));
  const IntranodeHandle& h = *handle;
  const bool fp8 = p.x_dtype == DType::kFP8E4M3;
  // The receive side is checked against the prefix matrix (the GPU trusts it; the host can afford the check): this
  // rank's column must rise from 0, so that every source's rows lie inside [0, received).
  const int R = v.num_ranks, me = v.rank, C = p.num_sms;
  EPF_RETURN_IF_ERROR(CheckPrefixColumn(h.rank_prefix_matrix, R, me));
  // Then received <= recv_capacity. Worst-case callers (outputs sized without waiting for the count) learn of too
  // little room only here: as the kernel does, this rank moves nothing and never arrives at the barrier, so its peers
  // time out naming it.
  if (const int32_t num_recv = h.rank_prefix_matrix[(R - 1) * R + me]; num_recv > p.recv_capacity) {
    return FinishWith(RecvCapacityRecord(CapacitySite::kDispatch, me, num_recv, p.recv_capacity), group.status);
  }

  const int T = h.num_tokens;
  const size_t row_bytes = fp8 ? p.hidden : static_cast<size_t>(p.hidden) * 2;
  const int num_scales = !fp8 ? 0 : p.num_scales > 0 ? p.num_scales : p.hidden / kFp8ScaleBlock;
  const int K = p.topk_idx != nullptr ? p.num_topk : 0;
  const bool has_weights = p.topk_weights != nullptr;
  const int epr = v.experts_per_rank;
  const IntranodeRegionLayout& l = v.layout;
  const char* x = static_cast<const char*>(p.x);
  char* recv_x = static_cast<char*>(p.recv_x);
  handle->num_channels = C;
  if (p.pad_recv_topk && K > 0) {  // worst-case mode: the rows past the received ones (see IntranodeDispatchParams)
    const size_t from = static_cast<size_t>(h.rank_prefix_matrix[(R - 1) * R + me]) * K;
    const size_t to = static_cast<size_t>(p.recv_capacity) * K;
    std::fill(p.recv_topk_idx + from, p.recv_topk_idx + to, int64_t{-1});
    if (has_weights) std::fill(p.recv_topk_weights + from, p.recv_topk_weights + to, 0.0f);
  }

  FailureRecord failure;
  if (!Barrier(v, &failure)) return failure.Finish(group.status);

  // Slots: send_slot[t][d] = index of token t among this rank's tokens sent to d (cached mode recomputes them from
  // is_token_in_rank, as the kernel does).
  std::vector<int> next_slot(R, 0);
  for (int t = 0; t < T; ++t) {
    for (int d = 0; d < R; ++d) {
      h.send_slot[static_cast<size_t>(t) * R + d] =
          h.is_token_in_rank[static_cast<size_t>(t) * R + d] ? next_slot[d]++ : -1;
    }
  }

  // This rank's own share goes straight into the outputs: it must fit the rows the prefix matrix gives it (a layout
  // whose counts disagree with is_token_in_rank would otherwise overrun recv_x).
  const int my_recv_base = RecvBase(h.rank_prefix_matrix, R, me, me);
  if (next_slot[me] != h.rank_prefix_matrix[me * R + me] - my_recv_base) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "handle.is_token_in_rank sends %d tokens to this rank (%d) but handle.rank_prefix_matrix says %d: the layout "
        "counts and is_token_in_rank disagree",
        next_slot[me], me, h.rank_prefix_matrix[me * R + me] - my_recv_base));
  }

  // Send, channel by channel: range first, then the rows, then the tail (release: the rows before it).
  std::vector<int> channel_begin(R, 0), channel_count(R, 0);
  for (int ch = 0; ch < C; ++ch) {
    const int token_begin = reference::ChannelTokenBegin(T, C, ch);
    const int token_end = reference::ChannelTokenBegin(T, C, ch + 1);
    for (int d = 0; d < R; ++d) {
      channel_begin[d] += channel_count[d];
      channel_count[d] = 0;
      for (int t = token_begin; t < token_end; ++t)
        channel_count[d] += h.is_token_in_rank[static_cast<size_t>(t) * R + d];
      if (d == me) {
        h.recv_channel_prefix[d * C + ch] = channel_begin[d];
      } else {
        StoreRelease(v.DispatchRange(d, me, ch), PackRange(channel_begin[d], channel_begin[d] + channel_count[d]));
      }
    }
    for (int t = token_begin; t < token_end; ++t) {
      for (int d = 0; d < R; ++d) {
        const int slot = h.send_slot[static_cast<size_t>(t) * R + d];
        if (slot < 0) continue;
        const bool local = d == me;
        const size_t row = local ? static_cast<size_t>(my_recv_base) + slot : static_cast<size_t>(slot);
        char* x_dst = local ? recv_x : v.Pool<char>(d, l.staging_x, l.staging_x_pool_bytes, me);
        std::memcpy(x_dst + row * row_bytes, x + static_cast<size_t>(t) * row_bytes, row_bytes);
        if (num_scales > 0) {
          float* dst = local ? p.recv_x_scales : v.Pool<float>(d, l.staging_scales, l.staging_scales_pool_bytes, me);
          std::memcpy(dst + row * num_scales, p.x_scales + static_cast<size_t>(t) * num_scales,
                      num_scales * sizeof(float));
        }
        if (K > 0) {
          int64_t* idx_dst =
              local ? p.recv_topk_idx : v.Pool<int64_t>(d, l.staging_topk_idx, l.staging_topk_idx_pool_bytes, me);
          float* w_dst = !has_weights ? nullptr
                         : local      ? p.recv_topk_weights
                                      : v.Pool<float>(d, l.staging_topk_weights, l.staging_topk_weights_pool_bytes, me);
          for (int k = 0; k < K; ++k) {
            const int64_t expert = p.topk_idx[static_cast<size_t>(t) * K + k];
            const bool here = expert >= static_cast<int64_t>(d) * epr && expert < static_cast<int64_t>(d + 1) * epr;
            idx_dst[row * K + k] = here ? expert - static_cast<int64_t>(d) * epr : -1;
            if (has_weights) w_dst[row * K + k] = here ? p.topk_weights[static_cast<size_t>(t) * K + k] : 0.0f;
          }
        }
        int32_t* src_dst =
            local ? h.recv_src_idx : v.Pool<int32_t>(d, l.staging_src_idx, l.staging_src_idx_pool_bytes, me);
        src_dst[row] = t;
      }
    }
    for (int d = 0; d < R; ++d) {
      // A tail is written only for a non-empty range, so no write can follow the receiver's reset of it.
      if (d != me && channel_count[d] > 0) StoreRelease(v.ChannelTail(d, me, ch), channel_count[d]);
    }
  }

  // Receive every peer's channels: wait for the range, then for the tail, copy, and zero both. Ranges and tails are
  // peer data: a channel's range must start where the previous one ended and end within the rows the prefix matrix
  // gives this source (so the copies stay inside the staging pool and the outputs; the last channel ends exactly
  // there, so every row is written), and its tail must equal the range's count (the sender writes it once, after the
  // rows). Anything else is reported, never used.
  const int epr_bound = v.experts_per_rank - 1;
  for (int k = 1; k < R; ++k) {
    const int src = (me + k) % R;
    const int src_base = RecvBase(h.rank_prefix_matrix, R, src, me);
    const int from_src = h.rank_prefix_matrix[src * R + me] - src_base;
    int expected_begin = 0;
    for (int ch = 0; ch < C; ++ch) {
      int64_t* range_word = v.DispatchRange(me, src, ch);
      int64_t range = 0;
      bool lost = false;
      if (!WaitForPeer([&] { return (range = LoadAcquire(range_word)) != 0; }, group.timeout_ns,
                       LossWords(group.lost_ranks, group.lost_ignore, src), src, &lost)) {
        failure.RecordWait(lost, WaitSite::kDispatchFifoData, me, src, ch);
        return failure.Finish(group.status);
      }
      const int64_t begin = static_cast<int64_t>(static_cast<uint32_t>(range & 0xffffffff));
      const int64_t end = (range >> 32) - 1;
      if (!failure.CheckPeerValue(PeerDataField::kDispatchRangeBegin, me, src, ch, begin, expected_begin,
                                  expected_begin) ||
          !failure.CheckPeerValue(PeerDataField::kDispatchRangeEnd, me, src, ch, end, ch + 1 < C ? begin : from_src,
                                  from_src)) {
        return failure.Finish(group.status);
      }
      const int count = static_cast<int>(end - begin);
      expected_begin = static_cast<int>(end);
      h.recv_channel_prefix[src * C + ch] = static_cast<int>(begin);
      int32_t* tail_word = v.ChannelTail(me, src, ch);
      int32_t tail = 0;
      if (count > 0 && !WaitForPeer([&] { return (tail = LoadAcquire(tail_word)) != 0; }, group.timeout_ns,
                                    LossWords(group.lost_ranks, group.lost_ignore, src), src, &lost)) {
        failure.RecordWait(lost, WaitSite::kDispatchFifoData, me, src, ch);
        return failure.Finish(group.status);
      }
      if (count > 0 && !failure.CheckPeerValue(PeerDataField::kDispatchTail, me, src, ch, tail, count, count)) {
        return failure.Finish(group.status);
      }
      if (count > 0) {
        const size_t recv_row = static_cast<size_t>(src_base) + begin;
        std::memcpy(recv_x + recv_row * row_bytes,
                    v.Pool<char>(me, l.staging_x, l.staging_x_pool_bytes, src) + begin * row_bytes, count * row_bytes);
        if (num_scales > 0) {
          std::memcpy(p.recv_x_scales + recv_row * num_scales,
                      v.Pool<float>(me, l.staging_scales, l.staging_scales_pool_bytes, src) +
                          static_cast<size_t>(begin) * num_scales,
                      static_cast<size_t>(count) * num_scales * sizeof(float));
        }
        if (K > 0) {
          std::memcpy(p.recv_topk_idx + recv_row * K,
                      v.Pool<int64_t>(me, l.staging_topk_idx, l.staging_topk_idx_pool_bytes, src) +
                          static_cast<size_t>(begin) * K,
                      static_cast<size_t>(count) * K * sizeof(int64_t));
          if (has_weights) {
            std::memcpy(p.recv_topk_weights + recv_row * K,
                        v.Pool<float>(me, l.staging_topk_weights, l.staging_topk_weights_pool_bytes, src) +
                            static_cast<size_t>(begin) * K,
                        static_cast<size_t>(count) * K * sizeof(float));
          }
        }
        std::memcpy(h.recv_src_idx + recv_row,
                    v.Pool<int32_t>(me, l.staging_src_idx, l.staging_src_idx_pool_bytes, src) + begin,
                    static_cast<size_t>(count) * sizeof(int32_t));
        // The copies (not the staging pool, which the peer may still write) are checked: callers index with them.
        EPF_RETURN_IF_ERROR(
            CheckReceivedRows(h.recv_src_idx + recv_row, K > 0 ? p.recv_topk_idx + recv_row * K : nullptr, count, K,
                              v.group.config.max_tokens_per_rank - 1, epr_bound, me, src, ch, &failure, group.status));
      }
      // Consumed: the sender wrote its final values before the tail we saw and writes them again only after the
      // next call's barrier, which needs this rank's arrival.
      StoreRelaxed(range_word, int64_t{0});
      StoreRelaxed(tail_word, int32_t{0});
    }
  }
  return absl::OkStatus();
}

absl::Status IntranodeCombine(const IntranodeGroup& group, const IntranodeCombineParams& p, const IntranodeHandle& h) {
  EPF_ASSIGN_OR_RETURN(const View v, MakeView(group));
  EPF_RETURN_IF_ERROR(intranode_checks::CheckCombine(group, p, h, kHost));

  const int R = v.num_ranks, me = v.rank, C = h.num_channels, H = p.hidden, T = h.num_tokens;
  const int K = p.topk_weights != nullptr ? p.num_topk : 0;
  const size_t row_bytes = static_cast<size_t>(H) * 2;
  const IntranodeRegionLayout& l = v.layout;
  const uint16_t* x = static_cast<const uint16_t*>(p.x);

  // The prefix matrix's column for this rank decides which rows of x go back to whom: it must rise from 0 and stay
  // within handle.num_recv_tokens (the rows of x; less only after a worst-case dispatch that moved nothing).
  EPF_RETURN_IF_ERROR(CheckPrefixColumn(h.rank_prefix_matrix, R, me));
  if (const int32_t num_recv = h.rank_prefix_matrix[(R - 1) * R + me]; num_recv > h.num_recv_tokens) {
    return FinishWith(RecvCapacityRecord(CapacitySite::kCombine, me, num_recv, h.num_recv_tokens), group.status);
  }

  FailureRecord failure;
  if (!Barrier(v, &failure)) return failure.Finish(group.status);

  // Send back: the rows received from `dst` in its channel ch are contiguous in x and go to the same slots of dst's
  // staging pool for this rank; the tail (absolute slot end, release) follows the rows.
  for (int k = 1; k < R; ++k) {
    const int dst = (me + k) % R;
    const int base = RecvBase(h.rank_prefix_matrix, R, dst, me);
    const int count = h.rank_prefix_matrix[dst * R + me] - base;
    char* staging_x = v.Pool<char>(dst, l.staging_x, l.staging_x_pool_bytes, me);
    float* staging_w = v.Pool<float>(dst, l.staging_topk_weights, l.staging_topk_weights_pool_bytes, me);
    for (int ch = 0; ch < C; ++ch) {
      // The handle's channel ranges came from dst's dispatch ranges: checked there, checked again here (a handle of
      // a dispatch that failed half way holds stale values), so that the copies stay inside x and the pool.
      const int begin = h.recv_channel_prefix[dst * C + ch];
      const int end = ch + 1 < C ? h.recv_channel_prefix[dst * C + ch + 1] : count;
      if (!failure.CheckPeerValue(PeerDataField::kCombineRange, me, dst, ch, begin, 0, std::max(count, 0)) ||
          !failure.CheckPeerValue(PeerDataField::kCombineRange, me, dst, ch, end, begin, count)) {
        return failure.Finish(group.status);
      }
      if (end <= begin) continue;
      std::memcpy(staging_x + begin * row_bytes, x + (static_cast<size_t>(base) + begin) * H,
                  (end - begin) * row_bytes);
      if (K > 0) {
        std::memcpy(staging_w + static_cast<size_t>(begin) * K,
                    p.topk_weights + (static_cast<size_t>(base) + begin) * K,
                    static_cast<size_t>(end - begin) * K * sizeof(float));
      }
      StoreRelease(v.ChannelTail(dst, me, ch), end);
    }
  }

  // Reduce this rank's tokens, channel by channel (the tails are per channel): float sums in rank order, then the
  // biases, one rounding to BF16: exactly the kernel's and the reference's order of operations.
  const int my_recv_base = RecvBase(h.rank_prefix_matrix, R, me, me);
  const uint16_t* bias_0 = static_cast<const uint16_t*>(p.bias_0);
  const uint16_t* bias_1 = static_cast<const uint16_t*>(p.bias_1);
  uint16_t* combined_x = static_cast<uint16_t*>(p.combined_x);
  std::vector<float> acc(H);
  std::vector<int32_t> seen_tail(R);
  // Per peer: the slot end of this rank's tokens up to the current channel, which is the only nonzero value the
  // peer's tail for the channel can hold (it is written once, after the rows).
  std::vector<int32_t> channel_end(R, 0);
  for (int ch = 0; ch < C; ++ch) {
    const int token_begin = reference::ChannelTokenBegin(T, C, ch);
    const int token_end = reference::ChannelTokenBegin(T, C, ch + 1);
    std::fill(seen_tail.begin(), seen_tail.end(), 0);
    for (int t = token_begin; t < token_end; ++t) {
      for (int d = 0; d < R; ++d) channel_end[d] += h.send_slot[static_cast<size_t>(t) * R + d] >= 0;
    }
    for (int t = token_begin; t < token_end; ++t) {
      const int32_t* slots = h.send_slot + static_cast<size_t>(t) * R;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int d = 0; d < R; ++d) {
        const int slot = slots[d];
        if (slot < 0) continue;
        const uint16_t* row;
        if (d == me) {
          row = x + (static_cast<size_t>(my_recv_base) + slot) * H;
        } else {
          if (seen_tail[d] <= slot) {
            const int32_t* tail_word = v.ChannelTail(me, d, ch);
            bool lost = false;
            if (!WaitForPeer([&] { return (seen_tail[d] = LoadAcquire(tail_word)) != 0; }, group.timeout_ns,
                             LossWords(group.lost_ranks, group.lost_ignore, d), d, &lost)) {
              failure.RecordWait(lost, WaitSite::kCombineFifoData, me, d, ch);
              return failure.Finish(group.status);
            }
            if (!failure.CheckPeerValue(PeerDataField::kCombineTail, me, d, ch, seen_tail[d], channel_end[d],
                                        channel_end[d])) {
              return failure.Finish(group.status);
            }
          }
          row = reinterpret_cast<const uint16_t*>(v.Pool<char>(me, l.staging_x, l.staging_x_pool_bytes, d) +
                                                  static_cast<size_t>(slot) * row_bytes);
        }
        internal::AddBf16Row(acc.data(), row, H);
      }
      const size_t out = static_cast<size_t>(t) * H;
      if (bias_0 != nullptr) internal::AddBf16Row(acc.data(), bias_0 + out, H);
      if (bias_1 != nullptr) internal::AddBf16Row(acc.data(), bias_1 + out, H);
      internal::StoreBf16Row(combined_x + out, acc.data(), H);
      for (int k = 0; k < K; ++k) {
        float sum = 0.0f;
        for (int d = 0; d < R; ++d) {
          const int slot = slots[d];
          if (slot < 0) continue;
          sum += d == me ? p.topk_weights[(static_cast<size_t>(my_recv_base) + slot) * K + k]
                         : v.Pool<float>(me, l.staging_topk_weights, l.staging_topk_weights_pool_bytes,
                                         d)[static_cast<size_t>(slot) * K + k];
        }
        p.combined_topk_weights[static_cast<size_t>(t) * K + k] = sum;
      }
    }
    // Every peer with rows in this channel has published its final tail (the last row's slot is covered), and
    // writes it again only after the next call's barrier.
    for (int d = 0; d < R; ++d) {
      if (d != me) StoreRelaxed(v.ChannelTail(me, d, ch), int32_t{0});
    }
  }
  return absl::OkStatus();
}

}  // namespace epfabric::kernels::host_backend
