// Host backend of the low-latency mode: dispatch and combine run by the CPU over the regions of MakeLowLatencyLayout
// with the protocol of kernels/cuda/low_latency_{dispatch,combine}.cu (docs/low-latency-kernels.md,
// docs/host-backend.md):
//  - dispatch send: clean the other half's signals, one message per (token, destination rank) at slot
//    [this rank][token] (FP8 quantised once per token, exactly as fp8.cc), the per-(expert, source) token lists, then
//    per expert `-count-1` with a release store into the expert's rank;
//  - dispatch receive: acquire every (local expert, source) count, fan the messages out into the packed layout;
//  - combine send: clean the other half's signals, publish this rank's top-k weights + a weights flag to every rank
//    (alone: kCombineWeights), reduce per (source rank, token) over this rank's experts (fmaf, top-k order, one bf16
//    rounding) into the source's combine_recv row, then raise the combine flag on every rank;
//  - combine receive: acquire every rank's combine flag, add the partial rows in rank order.
// Signals are released only after the other half was cleaned, so a peer that reaches the next call (it must have
// seen this call's signals) never writes into a half that is still being cleaned.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_format.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/kernels/host_backend.h"
#include "epfabric/kernels/host_backend_numeric.h"
#include "epfabric/kernels/reference/fp8.h"
#include "host_backend/host_sync.h"

namespace epfabric::kernels::host_backend {
namespace {

using internal::BoundedWait;
using internal::FailureRecord;
using internal::LoadAcquire;
using internal::LossWords;
using internal::RankLost;
using internal::StoreRelease;

// The regions of the group for one call: this rank, its half, the masked ranks.
struct View {
  const LowLatencyContext& ctx;
  const LowLatencyLayout& l;
  int half;
  int rank;
  int num_ranks;
  LowLatencySlots own;       // this rank's slots in a full half
  LowLatencyRankSet masked;  // ranks that take no part (ctx.rank_mask, plus peers that timed out in this call)
  uint32_t tag;              // the call's tag: every signal it writes carries it, every signal it reads must
  // The Buffer masks lost ranks (ctx.rank_mask set): a lost peer is skipped without failing the call. Otherwise a
  // lost or silent peer fails the call, and after a failure this rank raises no further signal (as the GPU's
  // may_signal), so that no peer returns data that depends on what this rank skipped.
  bool shrink;

  uint8_t* OwnHalf(int h) const { return static_cast<uint8_t*>(ctx.peer_regions[rank]) + l.half_bytes * h; }
  bool Masked(int r) const { return masked.has(r); }
  // Across hosts (LowLatencyContext::remote_ranks): rank r is on another host; this rank writes its slots of r's half
  // into its outbox for r (compact), and what r sends this rank lands in the inbox.
  bool Remote(int r) const { return ctx.remote_ranks.has(r); }
  const uint8_t* InHalf(int s) const {
    const void* base = Remote(s) ? ctx.remote_inbox : ctx.peer_regions[rank];
    return static_cast<const uint8_t*>(base) + l.half_bytes * half;
  }
  // Where this rank writes a field of its slots of rank r's half (`field` maps slots to the field's offset): r's
  // region, or its outbox for r.
  template <typename Field>
  uint8_t* Dst(int r, Field field) const {
    if (Remote(r)) return static_cast<uint8_t*>(ctx.peer_regions[r]) + l.outbox_half_bytes * half + field(l.outbox);
    return static_cast<uint8_t*>(ctx.peer_regions[r]) + l.half_bytes * half + field(own);
  }
  // After writing `bytes` at Dst(r, field): sends the range to the same slots of r's inbox when r is on another host
  // (the transport keeps the order of one rank's sends, so a signal sent after data arrives after it). A failed send
  // is recorded by the caller's put function; the receiver's bounded wait ends the call.
  template <typename Field>
  void Sent(int r, Field field, size_t bytes) const {
    // Without a put function the caller relays the outboxes itself between phases (cuda's relay, run here by the
    // tests: client/internode_low_latency_relay.cc).
    if (!Remote(r) || bytes == 0 || ctx.remote_put == nullptr) return;
    (void)ctx.remote_put(ctx.remote_put_arg, r, l.outbox_half_bytes * half + field(l.outbox),
                         l.half_bytes * half + field(own), bytes);
  }
  // A flag: the call's tag.
  template <typename Field>
  void Signal(int r, Field field) const {
    StoreRelease(reinterpret_cast<int32_t*>(Dst(r, field)), static_cast<int32_t>(tag));
    Sent(r, field, sizeof(int32_t));
  }
  template <typename Field>
  void SignalCount(int r, Field field, int count) const {
    StoreRelease(reinterpret_cast<uint64_t*>(Dst(r, field)), LowLatencyCountSignal(tag, count));
    Sent(r, field, sizeof(uint64_t));
  }
  bool IsTag(const int32_t* flag) const { return static_cast<uint32_t>(LoadAcquire(flag)) == tag; }
  // Waits (bounded) until `ready()`, for a signal of rank s; the wait's time is added to `*cost` when given. With
  // shrink it ends early when s is published lost. Without, a call that meets any lost rank fails, so the wait ends
  // when any rank of the group is published lost (`*lost_rank` names it), and at once after an earlier failure of
  // this call (as the GPU's waits give up once the status word holds one). False: `*lost` says whether a loss ended
  // it (else a timeout, or the earlier failure).
  template <typename Ready>
  bool Wait(int s, Ready&& ready, int64_t* cost, const FailureRecord& failure, bool* lost, int* lost_rank) const {
    *lost = false;
    *lost_rank = s;
    if (!shrink && failure.failed()) return ready();
    auto give_up = [&] {
      if (shrink) return *lost = RankLost(LossWords(ctx.lost_ranks, ctx.lost_ignore, s), s);
      for (int r = 0; r < num_ranks; ++r) {
        if (RankLost(LossWords(ctx.lost_ranks, ctx.lost_ignore, r), r)) {
          *lost_rank = r;
          return *lost = true;
        }
      }
      return false;
    };
    const auto start = std::chrono::steady_clock::now();
    const bool reached = BoundedWait(ready, ctx.timeout_ns, give_up);
    if (cost != nullptr) {
      const int64_t waited =
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
      *cost += std::max<int64_t>(waited, 1);
    }
    return reached;
  }
  // After a wait on rank s that ended without its signal: a lost rank is masked without failing the call when the
  // Buffer masks (shrink); otherwise, and for a silent rank, the call fails (an earlier failure stays the one named).
  void WaitFailed(FailureRecord* failure, bool lost, int lost_rank, WaitSite site, int s, int channel) {
    if (!shrink && failure->failed()) return;
    if (!lost || !shrink) failure->RecordWait(lost, site, rank, lost ? lost_rank : s, channel);
    MaskAfterTimeout(s);
  }
  bool MaySignal(const FailureRecord& failure) const { return shrink || !failure.failed(); }
  // A peer that did not answer in time: skipped for the rest of the call and, as on the GPU, in later calls.
  void MaskAfterTimeout(int r) {
    masked.add(r);
    if (ctx.rank_mask != nullptr) internal::StoreRelease(ctx.rank_mask + r, int32_t{1});
  }
};

View MakeView(const LowLatencyContext& ctx, int half, uint32_t tag) {
  View v{ctx,      ctx.layout,    half,
         ctx.rank, ctx.num_ranks, LowLatencySourceSlots(ctx.layout, ctx.rank),
         {},       tag,           ctx.rank_mask != nullptr};
  if (ctx.rank_mask != nullptr) {
    for (int r = 0; r < ctx.num_ranks; ++r) {
      if (LoadAcquire(ctx.rank_mask + r) != 0) v.masked.add(r);
    }
  }
  return v;
}

// Zeroes the signals of the half the previous call used and the next call will use (see the file comment).
void CleanOtherHalfSignals(const View& v) {
  std::memset(v.OwnHalf(v.half ^ 1), 0, v.l.signal_bytes);
  if (v.ctx.remote_inbox != nullptr) {
    std::memset(static_cast<uint8_t*>(v.ctx.remote_inbox) + v.l.half_bytes * (v.half ^ 1), 0, v.l.signal_bytes);
  }
  // The outboxes too: a relay sends a staged signal only when it is nonzero (as the cuda kernels do).
  for (int r = 0; r < v.num_ranks; ++r) {
    if (v.Remote(r)) {
      std::memset(static_cast<uint8_t*>(v.ctx.peer_regions[r]) + v.l.outbox_half_bytes * (v.half ^ 1), 0,
                  v.l.outbox_signal_bytes);
    }
  }
  // The release stores that follow publish the zeroes together with the data.
}

absl::Status ValidateContext(const LowLatencyContext& ctx, KernelStatus* dummy, LowLatencyContext* checked) {
  *checked = ctx;
  // The host reports timeouts through the return value; a status word is optional here.
  if (checked->status == nullptr) checked->status = dummy;
  if (ctx.timeout_ns == 0) return InvalidValue("ctx.timeout_ns", 0, "must be positive");
  return absl::OkStatus();
}

void DispatchSend(View& v, const LowLatencyDispatchArgs& a) {
  const LowLatencyLayout& l = v.l;
  const int H = l.hidden, L = l.num_local_experts, E = l.num_experts, K = a.num_topk;
  const int G = H / kFp8GroupSize;
  CleanOtherHalfSignals(v);
  const uint16_t* x = static_cast<const uint16_t*>(a.x);
  std::vector<uint8_t> fp8(a.use_fp8 ? H : 0);
  std::vector<float> scales(a.use_fp8 ? G : 0);
  // Messages: one per (token, destination rank holding at least one of its experts).
  for (int t = 0; t < a.num_tokens; ++t) {
    LowLatencyRankSet dst_ranks;
    for (int k = 0; k < K; ++k) {
      const int64_t e = a.topk_idx[static_cast<size_t>(t) * K + k];
      if (e >= 0 && e < E && !v.Masked(static_cast<int>(e / L))) dst_ranks.add(static_cast<int>(e / L));
    }
    if (dst_ranks.empty()) continue;
    const uint16_t* row = x + static_cast<size_t>(t) * H;
    if (a.use_fp8) internal::QuantizeRowFp8Fast(row, H, a.round_scale, fp8.data(), scales.data());
    const auto msg_field = [&](const LowLatencySlots& s) {
      return s.msgs + static_cast<size_t>(t) * l.dispatch_msg_bytes;
    };
    for (int r = 0; r < v.num_ranks; ++r) {
      if (!dst_ranks.has(r)) continue;
      uint8_t* msg = v.Dst(r, msg_field);
      const int32_t header[4] = {t, 0, 0, 0};
      std::memcpy(msg, header, sizeof(header));
      uint8_t* payload = msg + kLowLatencyMessageHeaderBytes;
      if (a.use_fp8) {
        std::memcpy(payload, fp8.data(), H);
        std::memcpy(payload + H, scales.data(), G * sizeof(float));
      } else {
        std::memcpy(payload, row, static_cast<size_t>(H) * 2);
      }
      v.Sent(r, msg_field,
             kLowLatencyMessageHeaderBytes + (a.use_fp8 ? H + G * sizeof(float) : static_cast<size_t>(H) * 2));
    }
  }
  // Routing: per global expert, the tokens that chose it (first top-k position), ascending, then the count. The
  // release store of the count publishes the list and every message above (and the cleaning) to the expert's rank.
  for (int e = 0; e < E; ++e) {
    const int r = e / L, local = e % L;
    if (v.Masked(r)) continue;
    const auto table_field = [&](const LowLatencySlots& s) { return s.table + local * s.table_stride; };
    const auto count_field = [&](const LowLatencySlots& s) { return s.count + local * s.count_stride; };
    int32_t* table = reinterpret_cast<int32_t*>(v.Dst(r, table_field));
    int count = 0;
    for (int t = 0; t < a.num_tokens; ++t) {
      const int64_t* row = a.topk_idx + static_cast<size_t>(t) * K;
      for (int k = 0; k < K; ++k) {
        if (row[k] == e) {
          table[count++] = t | (k << 16);
          break;
        }
      }
    }
    v.Sent(r, table_field, static_cast<size_t>(count) * sizeof(int32_t));
    v.SignalCount(r, count_field, count);
  }
}

void DispatchRecv(View& v, const LowLatencyDispatchArgs& a, FailureRecord* failure) {
  const LowLatencyLayout& l = v.l;
  const int H = l.hidden, M = l.max_tokens_per_rank, R = v.num_ranks, L = l.num_local_experts;
  const int G = H / kFp8GroupSize;
  const size_t slots = static_cast<size_t>(R) * M;
  const size_t row_bytes = a.use_fp8 ? static_cast<size_t>(H) : static_cast<size_t>(H) * 2;
  uint8_t* packed_x = static_cast<uint8_t*>(a.packed_recv_x);
  // The token map (an output of this phase) is reset here; the GPU does it in the send phase because its receive
  // blocks cannot order a reset before their own writes without a grid-wide sync.
  std::fill(a.packed_recv_token_map, a.packed_recv_token_map + slots * kLowLatencyMaxTopk, -1);
  std::vector<int> counts(R);
  for (int local = 0; local < L; ++local) {
    for (int s = 0; s < R; ++s) {
      counts[s] = 0;
      if (v.Masked(s)) continue;
      const uint64_t* signal = reinterpret_cast<const uint64_t*>(v.InHalf(s) + l.dispatch_count_offset) + local * R + s;
      int64_t count = -1;
      bool lost = false;
      int lost_rank = s;
      // Only this call's signal ends the wait: a value with another tag is an earlier call's or client's.
      if (v.Wait(
              s, [&] { return (count = LowLatencyCountOf(LoadAcquire(signal), v.tag)) >= 0; },
              a.wait_recv_cost_ns != nullptr ? a.wait_recv_cost_ns + s : nullptr, *failure, &lost, &lost_rank)) {
        // Peer data: a source lists at most max_tokens_per_rank tokens per expert (so the compact rows of all
        // sources fit the R * M slots). A bad count is reported and counts as 0.
        if (failure->CheckPeerValue(PeerDataField::kLowLatencyRecvCount, v.rank, s, local, count, 0, M)) {
          counts[s] = static_cast<int>(count);
        }
      } else {
        v.WaitFailed(failure, lost, lost_rank, WaitSite::kLowLatencyRecvCount, s, local);
      }
    }
    int begin = 0;
    for (int s = 0; s < R; ++s) {
      const int count = counts[s];
      a.packed_recv_layout_range[local * R + s] = (static_cast<int64_t>(begin) << 32) | static_cast<uint32_t>(count);
      const int32_t* table = reinterpret_cast<const int32_t*>(v.InHalf(s) + l.dispatch_table_offset) +
                             (static_cast<size_t>(local) * R + s) * M;
      const uint8_t* msgs = v.InHalf(s) + l.dispatch_msgs_offset + static_cast<size_t>(s) * M * l.dispatch_msg_bytes;
      for (int j = 0; j < count; ++j) {
        // Peer data: the token must have a message slot (t < M) and k0 a top-k position; a bad entry is reported
        // and its row left unwritten.
        const int32_t entry = internal::LoadRelaxed(table + j);
        const int t = entry & 0xFFFF, k0 = entry >> 16;
        if (!failure->CheckPeerValue(PeerDataField::kLowLatencyRoutingToken, v.rank, s, local, t, 0, M - 1) ||
            !failure->CheckPeerValue(PeerDataField::kLowLatencyRoutingTopk, v.rank, s, local, k0, 0,
                                     kLowLatencyMaxTopk - 1)) {
          continue;
        }
        const size_t pos = begin + j;
        const size_t slot = static_cast<size_t>(local) * slots + pos;
        const uint8_t* payload = msgs + static_cast<size_t>(t) * l.dispatch_msg_bytes + kLowLatencyMessageHeaderBytes;
        std::memcpy(packed_x + slot * row_bytes, payload, row_bytes);
        if (a.use_fp8) {
          const uint8_t* scales = payload + H;
          for (int g = 0; g < G; ++g) {
            uint32_t bits;
            std::memcpy(&bits, scales + g * sizeof(float), sizeof(bits));
            if (a.use_ue8m0) {
              // The biased exponent of the power-of-two scale, byte g % 4 of int32 [local][g / 4][pos].
              static_cast<uint8_t*>(a.packed_recv_x_scales)
                  [((static_cast<size_t>(local) * (G / kUe8m0ScalesPerInt32) + g / kUe8m0ScalesPerInt32) * slots +
                    pos) *
                       4 +
                   g % kUe8m0ScalesPerInt32] = static_cast<uint8_t>((bits >> 23) & 0xFF);
            } else {
              static_cast<uint32_t*>(a.packed_recv_x_scales)[(static_cast<size_t>(local) * G + g) * slots + pos] = bits;
            }
          }
        }
        a.packed_recv_src_info[slot] = t;
        a.packed_recv_topk_slot[slot] = k0;
        a.packed_recv_token_map[(static_cast<size_t>(s) * M + t) * kLowLatencyMaxTopk + k0] =
            static_cast<int32_t>(slot);
      }
      begin += count;
    }
    a.packed_recv_count[local] = begin;
    if (a.cumulative_stats != nullptr) a.cumulative_stats[local] += begin;
    if (a.expert_load != nullptr) a.expert_load[local] += static_cast<uint64_t>(begin);
  }
}

// The first part of combine's send phase (alone: LowLatencyPhases::kCombineWeights).
void CombinePublishWeights(View& v, const LowLatencyCombineArgs& a) {
  const LowLatencyLayout& l = v.l;
  const int R = v.num_ranks, L = l.num_local_experts, E = l.num_experts;
  const int K = a.num_topk;
  CleanOtherHalfSignals(v);
  const auto weights_field = [](const LowLatencySlots& s) { return s.weights; };
  // This rank's weights into every expert's rank (duplicates of an expert summed into its first position), then the
  // weights flags (release: the weights before them).
  for (int t = 0; t < a.num_tokens; ++t) {
    const int64_t* row = a.topk_idx + static_cast<size_t>(t) * K;
    const float* w = a.topk_weights + static_cast<size_t>(t) * K;
    for (int k = 0; k < K; ++k) {
      const int64_t e = row[k];
      if (e < 0 || e >= E) continue;
      const int r = static_cast<int>(e / L);
      if (v.Masked(r)) continue;
      bool first = true;
      for (int kk = 0; kk < k; ++kk) first = first && row[kk] != e;
      if (!first) continue;
      float sum = w[k];
      for (int kk = k + 1; kk < K; ++kk) {
        if (row[kk] == e) sum = sum + w[kk];
      }
      reinterpret_cast<float*>(v.Dst(r, weights_field))[static_cast<size_t>(t) * kLowLatencyMaxTopk + k] = sum;
    }
  }
  for (int r = 0; r < R; ++r) {
    if (v.Masked(r)) continue;
    v.Sent(r, weights_field, static_cast<size_t>(a.num_tokens) * kLowLatencyMaxTopk * sizeof(float));
    v.Signal(r, [](const LowLatencySlots& s) { return s.weights_flag; });
  }
}

// The rest of combine's send phase (alone: LowLatencyPhases::kSendWeightsPublished).
void CombineSendPartials(View& v, const LowLatencyCombineArgs& a, const uint16_t* x, FailureRecord* failure) {
  const LowLatencyLayout& l = v.l;
  const int H = l.hidden, M = l.max_tokens_per_rank, R = v.num_ranks;
  // Partial sums per (source rank, token) over this rank's experts, in top-k order.
  // What source s published lands in its own inbox half (InHalf(s)).
  LowLatencyRankSet have_weights;
  std::vector<float> acc(H);
  int32_t rows[kLowLatencyMaxTopk];
  float row_weights[kLowLatencyMaxTopk];
  for (int s = 0; s < R; ++s) {
    for (int t = 0; t < M; ++t) {
      if (v.Masked(s)) break;
      const int32_t* map = a.handle.packed_recv_token_map + (static_cast<size_t>(s) * M + t) * kLowLatencyMaxTopk;
      int num_present = 0;
      for (int k = 0; k < kLowLatencyMaxTopk; ++k) {
        if (map[k] >= 0) rows[num_present++] = map[k];
      }
      if (num_present == 0) continue;
      if (!have_weights.has(s)) {
        const int32_t* weights_flag = reinterpret_cast<const int32_t*>(v.InHalf(s) + l.weights_flag_offset) + s;
        bool lost = false;
        int lost_rank = s;
        if (!v.Wait(
                s, [&] { return v.IsTag(weights_flag); }, nullptr, *failure, &lost, &lost_rank)) {
          v.WaitFailed(failure, lost, lost_rank, WaitSite::kLowLatencyCombineFlag, s, t);
          break;
        }
        have_weights.add(s);
      }
      num_present = 0;
      for (int k = 0; k < kLowLatencyMaxTopk; ++k) {
        if (map[k] >= 0) {
          row_weights[num_present++] = reinterpret_cast<const float*>(
              v.InHalf(s) + l.combine_weights_offset)[(static_cast<size_t>(s) * M + t) * kLowLatencyMaxTopk + k];
        }
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int j = 0; j < num_present; ++j) {
        internal::FmaBf16Row(acc.data(), x + static_cast<size_t>(rows[j]) * H, row_weights[j], H);
      }
      const auto row_field = [&](const LowLatencySlots& slots) { return slots.recv + t * slots.recv_stride; };
      internal::StoreBf16Row(reinterpret_cast<uint16_t*>(v.Dst(s, row_field)), acc.data(), H);
      v.Sent(s, row_field, static_cast<size_t>(H) * 2);
    }
  }
  // A rank skipped in this call (masked after its weights did not come) gets no flag: its rows were not written.
  for (int r = 0; r < R; ++r) {
    if (!v.Masked(r) && v.MaySignal(*failure)) {
      v.Signal(r, [](const LowLatencySlots& slots) { return slots.combine_flag; });
    }
  }
}

void CombineRecv(View& v, const LowLatencyCombineArgs& a, FailureRecord* failure) {
  const LowLatencyLayout& l = v.l;
  const int H = l.hidden, R = v.num_ranks, L = l.num_local_experts, E = l.num_experts, K = a.num_topk;
  for (int r = 0; r < R; ++r) {
    if (v.Masked(r)) continue;
    const int32_t* flag = reinterpret_cast<const int32_t*>(v.InHalf(r) + l.combine_flag_offset) + r;
    bool lost = false;
    int lost_rank = r;
    if (!v.Wait(
            r, [&] { return v.IsTag(flag); }, a.wait_recv_cost_ns != nullptr ? a.wait_recv_cost_ns + r : nullptr,
            *failure, &lost, &lost_rank)) {
      v.WaitFailed(failure, lost, lost_rank, WaitSite::kLowLatencyCombineFlag, r, -1);
    }
  }
  uint16_t* out = static_cast<uint16_t*>(a.combined_x);
  std::vector<float> acc(H);
  for (int t = 0; t < a.num_tokens; ++t) {
    LowLatencyRankSet ranks;
    for (int k = 0; k < K; ++k) {
      const int64_t e = a.topk_idx[static_cast<size_t>(t) * K + k];
      if (e >= 0 && e < E && !v.Masked(static_cast<int>(e / L))) ranks.add(static_cast<int>(e / L));
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int r = 0; r < R; ++r) {
      if (!ranks.has(r)) continue;
      const uint16_t* recv = reinterpret_cast<const uint16_t*>(v.InHalf(r) + l.combine_recv_offset);
      internal::AddBf16Row(acc.data(), recv + (static_cast<size_t>(t) * R + r) * H, H);
    }
    internal::StoreBf16Row(out + static_cast<size_t>(t) * H, acc.data(), H);
  }
}

}  // namespace

absl::Status LowLatencyDispatch(const LowLatencyContext& ctx, const LowLatencyDispatchArgs& args) {
  KernelStatus dummy{};
  LowLatencyContext checked;
  EPF_RETURN_IF_ERROR(ValidateContext(ctx, &dummy, &checked));
  EPF_RETURN_IF_ERROR(ValidateLowLatencyDispatch(checked, args));
  View v = MakeView(ctx, args.buffer_half, args.call_tag);
  FailureRecord failure;
  if (LowLatencySends(args.phases)) DispatchSend(v, args);
  if (LowLatencyReceives(args.phases)) DispatchRecv(v, args, &failure);
  return failure.Finish(ctx.status);
}

absl::Status LowLatencyCombine(const LowLatencyContext& ctx, const LowLatencyCombineArgs& args) {
  KernelStatus dummy{};
  LowLatencyContext checked;
  EPF_RETURN_IF_ERROR(ValidateContext(ctx, &dummy, &checked));
  EPF_RETURN_IF_ERROR(ValidateLowLatencyCombine(checked, args));
  View v = MakeView(ctx, args.buffer_half, args.call_tag);
  FailureRecord failure;
  const uint16_t* x = static_cast<const uint16_t*>(args.zero_copy ? LowLatencyCombineInputBuffer(ctx) : args.x);
  const bool published = args.phases == LowLatencyPhases::kSendWeightsPublished;
  if (args.phases == LowLatencyPhases::kCombineWeights || (LowLatencySends(args.phases) && !published)) {
    CombinePublishWeights(v, args);
  }
  if (LowLatencySends(args.phases)) CombineSendPartials(v, args, x, &failure);
  if (LowLatencyReceives(args.phases)) CombineRecv(v, args, &failure);
  return failure.Finish(ctx.status);
}

absl::Status LowLatencyResetRegion(const LowLatencyContext& ctx) {
  if (ctx.rank < 0 || ctx.rank >= ctx.num_ranks || ctx.num_ranks > kMaxLowLatencyRanks) {
    return InvalidValue("ctx.rank", ctx.rank, "must be in [0, num_ranks)");
  }
  if (ctx.peer_regions[ctx.rank] == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat("ctx.peer_regions[%d] is null", ctx.rank));
  }
  if (ctx.layout.signal_bytes == 0) return absl::InvalidArgumentError("ctx.layout is empty: use MakeLowLatencyLayout");
  for (int half = 0; half < 2; ++half) {
    std::memset(static_cast<uint8_t*>(ctx.peer_regions[ctx.rank]) + half * ctx.layout.half_bytes, 0,
                ctx.layout.signal_bytes);
    if (ctx.remote_inbox != nullptr) {
      std::memset(static_cast<uint8_t*>(ctx.remote_inbox) + half * ctx.layout.half_bytes, 0, ctx.layout.signal_bytes);
    }
    // The outboxes' signals too, as the cuda paths' resets do: a relay sends a staged signal that is nonzero.
    for (int r = 0; r < ctx.num_ranks; ++r) {
      if (!ctx.remote_ranks.has(r) || ctx.peer_regions[r] == nullptr) continue;
      std::memset(static_cast<uint8_t*>(ctx.peer_regions[r]) + half * ctx.layout.outbox_half_bytes, 0,
                  ctx.layout.outbox_signal_bytes);
    }
  }
  return absl::OkStatus();
}

}  // namespace epfabric::kernels::host_backend
