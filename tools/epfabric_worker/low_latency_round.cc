// epfabric_worker, low-latency mode: one round's inputs of every rank, the host reference (with FP8 emulation), and
// the checked round through the Buffer API.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "checks.h"
#include "graphs.h"
#include "memory.h"
#include "worker.h"

namespace epfabric::worker {
namespace {

struct LowLatencyRound {
  host::LowLatencyShape shape;
  std::vector<host::LowLatencyRankInput> inputs;
  std::vector<host::LowLatencyDispatchOutput> dispatched;
  std::vector<std::vector<uint16_t>> expert_outputs;
  std::vector<std::vector<uint16_t>> combined;
  std::vector<double> exact, magnitude, exact_bf16;  // this rank's [T][hidden]
};

// The experts of `rank`: f_e of every valid packed row, BF16 [L][R*M][hidden]; rows past the counts are zero.
std::vector<uint16_t> LowLatencyExpertOutputs(const host::LowLatencyShape& shape, bool fp8, int rank,
                                              const int32_t* count, const uint8_t* packed_x, const float* scales) {
  const int L = shape.num_local_experts(), H = shape.hidden, G = H / 128;
  const size_t slots = shape.recv_slots();
  std::vector<uint16_t> out(static_cast<size_t>(L) * slots * H, 0);
  for (int e = 0; e < L; ++e) {
    const float scale = ExpertScale(static_cast<int64_t>(rank) * L + e);
    for (int j = 0; j < std::min<int>(count[e], static_cast<int>(slots)); ++j) {
      const size_t row = static_cast<size_t>(e) * slots + j;
      for (int h = 0; h < H; ++h) {
        float v;
        if (fp8) {
          v = host::Fp8E4M3ToFloat(packed_x[row * H + h]) * scales[(static_cast<size_t>(e) * G + h / 128) * slots + j];
        } else {
          uint16_t bits;
          std::memcpy(&bits, packed_x + (row * H + h) * 2, 2);
          v = ref::Bf16ToFloat(bits);
        }
        out[row * H + h] = ref::FloatToBf16(v * scale);
      }
    }
  }
  return out;
}

LowLatencyRound MakeLowLatencyRound(const Scenario& s, int num_ranks, int rank, int round) {
  LowLatencyRound x;
  x.shape = {.num_ranks = num_ranks,
             .num_experts = s.experts,
             .hidden = s.hidden,
             .max_tokens_per_rank = s.tokens,
             .num_topk = s.topk};
  std::mt19937_64 rng = RoundRng(s, round);
  std::uniform_real_distribution<float> weight(0.0f, 1.0f);
  x.inputs.resize(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    host::LowLatencyRankInput& in = x.inputs[r];
    in.num_tokens = TokensOf(rng, s, r);
    in.topk_idx = RandomTopk(rng, s, r, in.num_tokens);
    in.x.resize(static_cast<size_t>(in.num_tokens) * s.hidden);
    // Magnitudes differ between 128-channel groups, so that the FP8 scales differ.
    for (size_t i = 0; i < in.x.size(); ++i) in.x[i] = RandomBf16(rng, (i / 128) % 3 == 0 ? 0.01f : 8.0f);
    in.topk_weights.resize(in.topk_idx.size());
    for (float& w : in.topk_weights) w = weight(rng);
  }
  x.dispatched = host::LowLatencyDispatchReference(x.shape, {.use_fp8 = s.fp8}, x.inputs);
  x.expert_outputs.resize(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    const host::LowLatencyDispatchOutput& o = x.dispatched[r];
    x.expert_outputs[r] =
        LowLatencyExpertOutputs(x.shape, s.fp8, r, o.packed_recv_count.data(), o.packed_recv_x.data(), o.scales.data());
  }
  x.combined = host::LowLatencyCombineReference(x.shape, x.inputs, x.expert_outputs, x.dispatched);
  const host::LowLatencyRankInput& in = x.inputs[rank];
  const int T = in.num_tokens, H = s.hidden;
  x.exact.assign(static_cast<size_t>(T) * H, 0.0);
  x.magnitude.assign(x.exact.size(), 0.0);
  x.exact_bf16.assign(x.exact.size(), 0.0);
  std::vector<uint8_t> q(H);
  std::vector<float> q_scales(H / 128);
  for (int t = 0; t < T; ++t) {
    const uint16_t* row = &in.x[static_cast<size_t>(t) * H];
    if (s.fp8) host::QuantizeRowFp8(row, H, /*round_scale=*/false, q.data(), q_scales.data());
    for (int h = 0; h < H; ++h) {
      const double original = ref::Bf16ToFloat(row[h]);
      const double sent = s.fp8 ? double{host::Fp8E4M3ToFloat(q[h]) * q_scales[h / 128]} : original;
      for (int k = 0; k < s.topk; ++k) {
        const int64_t e = in.topk_idx[static_cast<size_t>(t) * s.topk + k];
        if (e < 0 || e >= s.experts) continue;
        const double w = in.topk_weights[static_cast<size_t>(t) * s.topk + k];
        x.exact[static_cast<size_t>(t) * H + h] += w * ExpertScale(e) * sent;
        x.magnitude[static_cast<size_t>(t) * H + h] += std::fabs(w * ExpertScale(e) * sent);
        x.exact_bf16[static_cast<size_t>(t) * H + h] += w * ExpertScale(e) * original;
      }
    }
  }
  return x;
}

std::vector<bool> MaskFlags(const std::vector<int>& masked, int num_ranks) {
  std::vector<bool> flags(num_ranks, false);
  for (int r : masked) flags[r] = true;
  return flags;
}

// Every rank's combined rows when `masked` take no part (kernels/reference: nothing dispatched to or from them, their
// experts count as zero), with the experts applied to the reference's dispatch without them.
std::vector<std::vector<uint16_t>> MaskedCombineReference(const LowLatencyRound& x, const Scenario& s,
                                                          const std::vector<int>& masked) {
  const std::vector<bool> flags = MaskFlags(masked, x.shape.num_ranks);
  const auto dispatched = host::LowLatencyDispatchReference(x.shape, {.use_fp8 = s.fp8}, x.inputs, flags);
  std::vector<std::vector<uint16_t>> expert_outputs(x.shape.num_ranks);
  for (int r = 0; r < x.shape.num_ranks; ++r) {
    const host::LowLatencyDispatchOutput& o = dispatched[r];
    expert_outputs[r] =
        LowLatencyExpertOutputs(x.shape, s.fp8, r, o.packed_recv_count.data(), o.packed_recv_x.data(), o.scales.data());
  }
  return host::LowLatencyCombineReference(x.shape, x.inputs, expert_outputs, dispatched, flags);
}

// A dispatch that ran with ranks masked: per (local expert, source) the count is the masked reference's (0 from a
// masked source), except that a source first masked during this call (`masked_before` lacks it: it was lost while
// the call waited for it) may also have delivered its rows for that expert before it went, all of them: the
// unmasked reference's count. The segments follow each other in source order, and packed_recv_count is their sum.
void CheckMaskedLayout(const LowLatencyRound& x, int rank, const std::vector<int>& masked_before,
                       const std::vector<int>& masked, const std::vector<int32_t>& count,
                       const std::vector<int64_t>& layout_range, Checks& checks) {
  const int R = x.shape.num_ranks, L = x.shape.num_local_experts();
  const std::vector<bool> before = MaskFlags(masked_before, R);
  const auto reference =
      host::LowLatencyDispatchReference(x.shape, {.use_fp8 = false}, x.inputs, MaskFlags(masked, R))[rank];
  const host::LowLatencyDispatchOutput& full = x.dispatched[rank];
  for (int e = 0; e < L; ++e) {
    int64_t begin = 0;
    for (int src = 0; src < R; ++src) {
      const size_t at = static_cast<size_t>(e) * R + src;
      const int64_t got_begin = layout_range[at] >> 32, got = static_cast<uint32_t>(layout_range[at]);
      const int64_t want = static_cast<uint32_t>(reference.layout_range[at]);
      const int64_t all = static_cast<uint32_t>(full.layout_range[at]);
      const bool lost_now = std::find(masked.begin(), masked.end(), src) != masked.end() && !before[src];
      if (got != want && !(lost_now && got == all)) {
        checks.Fail(absl::StrCat("packed_recv_layout_range[expert ", e, "][source ", src, "]: count ", got,
                                 ", expected ", want, lost_now ? absl::StrCat(" or ", all, " (lost in this call)") : "",
                                 " with rank(s) ", absl::StrJoin(masked, ","), " masked"));
      }
      if (got_begin != begin) {
        checks.Fail(absl::StrCat("packed_recv_layout_range[expert ", e, "][source ", src, "]: begins at ", got_begin,
                                 ", expected ", begin));
      }
      begin += got;
    }
    if (count[e] != begin) {
      checks.Fail(absl::StrCat("packed_recv_count[expert ", e, "] = ", count[e], ", the segments sum to ", begin));
    }
  }
}

}  // namespace

absl::Status RunLowLatencyRound(Buffer& buffer, Memory& mem, const Scenario& s, int round, Checks& checks,
                                RoundStats* stats, LowLatencyGraphs* graphs) {
  const int R = buffer.num_ranks(), rank = buffer.rank();
  const LowLatencyRound x = MakeLowLatencyRound(s, R, rank, round);
  const host::LowLatencyRankInput& in = x.inputs[rank];
  const host::LowLatencyDispatchOutput& want = x.dispatched[rank];
  const int T = in.num_tokens, K = s.topk, H = s.hidden, L = x.shape.num_local_experts(), G = H / 128;
  const size_t slots = x.shape.recv_slots();
  const size_t elem = s.fp8 ? 1 : 2;
  mem.Clear();
  auto x_view = mem.Upload(in.x, DType::kBF16, {T, H});
  auto idx_view = mem.Upload(in.topk_idx, DType::kInt64, {T, K});
  auto w_view = mem.Upload(in.topk_weights, DType::kFloat32, {T, K});
  for (const auto* v : {&x_view, &idx_view, &w_view}) {
    if (!v->ok()) return v->status();
  }
  // The ranks masked now (nonzero entries of the Buffer's rank mask).
  auto masked_ranks = [&] {
    std::vector<int> masked;
    const auto mask = mem.Download<int32_t>(buffer.LowLatencyRankMask(), R);
    for (int r = 0; r < static_cast<int>(mask.size()); ++r) {
      if (mask[r] != 0) masked.push_back(r);
    }
    return masked;
  };
  const std::vector<int> masked_before = s.shrink ? masked_ranks() : std::vector<int>{};
  auto start = std::chrono::steady_clock::now();
  NoteCallStarted();
  MaybeDieDuringThisDispatch();
  // --hooks: odd rounds run DeepEP's receive hooks (send phase, then the hook) instead of one call.
  const bool hook = s.hooks && round % 2 == 1 && graphs == nullptr;
  auto recv = graphs != nullptr
                  ? graphs->Dispatch(buffer, s, in.x, in.topk_idx, in.topk_weights, T)
                  : buffer.LowLatencyDispatch(
                        {.x = *x_view, .topk_idx = *idx_view, .use_fp8 = s.fp8, .return_recv_hook = hook});
  if (!recv.ok()) return recv.status();
  if (hook) {
    if (absl::Status received = recv->recv_hook(nullptr); !received.ok()) return received;
  }
  if (absl::Status done = buffer.Check(); !done.ok()) return done;
  stats->dispatch_ms = MsSince(start);
  NoteDispatchCompleted();
  // Without --shrink, a rank masked now (its daemon published it as lost, or a wait on it timed out) fails the round:
  // nothing is compared, but the combine still runs (the other survivors wait for it), and the round reports the
  // masked ranks. With --shrink the round goes on, checked against the reference without them.
  auto masked_error = [&](const std::vector<int>& masked) {
    return absl::UnavailableError(absl::StrCat("low-latency round ", round, " ran with rank(s) ",
                                               absl::StrJoin(masked, ","), " masked (lost or silent), seen after ",
                                               stats->combine_ms > 0 ? "the combine" : "the dispatch", " (",
                                               MsSince(start), " ms into it)"));
  };
  const std::vector<int> masked_in_dispatch = masked_ranks();
  if (!masked_in_dispatch.empty()) {
    NoteMaskSeen();
    stats->first_masked_ok_unix_ns = absl::GetCurrentTimeNanos();
  }
  if (!masked_in_dispatch.empty() && !s.shrink) {
    const std::vector<uint16_t> zeros(static_cast<size_t>(L) * slots * H, 0);
    auto expert_view = mem.Upload(zeros, DType::kBF16, {L, static_cast<int64_t>(slots), H});
    if (!expert_view.ok()) return expert_view.status();
    auto combined =
        graphs != nullptr
            ? graphs->Combine(buffer, zeros, L, static_cast<int64_t>(slots), H)
            : buffer.LowLatencyCombine(
                  {.x = *expert_view, .topk_idx = *idx_view, .topk_weights = *w_view, .handle = recv->handle});
    if (!combined.ok()) return combined.status();
    if (absl::Status done = buffer.Check(); !done.ok()) return done;
    return masked_error(masked_in_dispatch);
  }

  const auto count = mem.Download<int32_t>(recv->packed_recv_count.view, L);
  const auto layout_range = mem.Download<int64_t>(recv->packed_recv_layout_range.view, L * R);
  const auto packed_x = mem.Download<uint8_t>(recv->packed_recv_x.view, L * slots * H * elem);
  const auto scales = mem.Download<float>(recv->packed_recv_x_scales.view, s.fp8 ? L * slots * G : 0);
  const auto src_info = mem.Download<int32_t>(recv->packed_recv_src_info.view, L * slots);
  const bool usable = count.size() == static_cast<size_t>(L) && packed_x.size() == L * slots * H * elem &&
                      src_info.size() == L * slots && scales.size() == (s.fp8 ? L * slots * G : 0) &&
                      layout_range.size() == static_cast<size_t>(L) * R;
  // When the outputs are too small nothing is compared; the combine still runs (the peers wait for it).
  if (!usable) checks.Fail("low-latency dispatch outputs are smaller than [L, R*M, hidden]");
  if (masked_in_dispatch.empty()) {
    checks.Exact("packed_recv_count", count, want.packed_recv_count);
    checks.Exact("packed_recv_layout_range", layout_range, want.layout_range);
  } else if (usable) {
    CheckMaskedLayout(x, rank, masked_before, masked_in_dispatch, count, layout_range, checks);
  }
  // Row by row per (local expert, source rank) segment: where the reference put the source's rows, and where this
  // call put them (the same place unless a source was masked, whose rows are then absent and the later ones move up).
  uint64_t received = 0;
  for (int e = 0; usable && e < L; ++e) {
    received += static_cast<size_t>(std::max(0, std::min<int>(count[e], static_cast<int>(slots))));
    for (int src = 0; src < R; ++src) {
      const int64_t got_range = layout_range[static_cast<size_t>(e) * R + src];
      const int64_t want_range = want.layout_range[static_cast<size_t>(e) * R + src];
      const size_t got_begin = static_cast<size_t>(got_range >> 32), want_begin = static_cast<size_t>(want_range >> 32);
      const size_t n = std::min<size_t>(static_cast<uint32_t>(got_range), static_cast<uint32_t>(want_range));
      if (n == 0 || got_begin + n > slots) continue;  // a bad range was reported by the layout checks
      const size_t base = static_cast<size_t>(e) * slots;
      const std::string where = absl::StrCat("[expert ", e, "][source ", src, "]");
      checks.Exact(absl::StrCat("packed_recv_x", where),
                   std::vector<uint8_t>(packed_x.begin() + (base + got_begin) * H * elem,
                                        packed_x.begin() + (base + got_begin + n) * H * elem),
                   want.packed_recv_x.data() + (base + want_begin) * H * elem, n * H * elem);
      checks.Exact(absl::StrCat("packed_recv_src_info", where),
                   std::vector<int32_t>(src_info.begin() + base + got_begin, src_info.begin() + base + got_begin + n),
                   want.src_info.data() + base + want_begin, n);
      for (int g = 0; s.fp8 && g < G; ++g) {
        const size_t at = (static_cast<size_t>(e) * G + g) * slots;
        checks.Exact(absl::StrCat("packed_recv_x_scales", where, "[group ", g, "]"),
                     std::vector<float>(scales.begin() + at + got_begin, scales.begin() + at + got_begin + n),
                     want.scales.data() + at + want_begin, n);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) stats->bytes += in.topk_idx[static_cast<size_t>(t) * K + k] >= 0 ? H * elem : 0;
  }
  stats->bytes += received * H * 2;

  const std::vector<uint16_t> expert_out =
      usable ? LowLatencyExpertOutputs(x.shape, s.fp8, rank, count.data(), packed_x.data(), scales.data())
             : std::vector<uint16_t>(static_cast<size_t>(L) * slots * H, 0);
  auto expert_view = mem.Upload(expert_out, DType::kBF16, {L, static_cast<int64_t>(slots), H});
  if (!expert_view.ok()) return expert_view.status();
  start = std::chrono::steady_clock::now();
  NoteCallStarted();
  auto combined = graphs != nullptr ? graphs->Combine(buffer, expert_out, L, static_cast<int64_t>(slots), H)
                                    : buffer.LowLatencyCombine({.x = *expert_view,
                                                                .topk_idx = *idx_view,
                                                                .topk_weights = *w_view,
                                                                .handle = recv->handle,
                                                                .return_recv_hook = hook});
  if (!combined.ok()) return combined.status();
  if (hook) {
    if (absl::Status received = combined->recv_hook(nullptr); !received.ok()) return received;
  }
  if (absl::Status done = buffer.Check(); !done.ok()) return done;
  stats->combine_ms = MsSince(start);
  // A rank lost during the combine is masked there: without --shrink its outputs are missing from this round's
  // result and the round fails; with it the result is checked against the reference without the masked ranks.
  const std::vector<int> masked = masked_ranks();
  if (!masked.empty() && masked_in_dispatch.empty()) {
    NoteMaskSeen();
    stats->first_masked_ok_unix_ns = absl::GetCurrentTimeNanos();
  }
  if (!masked.empty() && !s.shrink) return masked_error(masked);
  stats->masked = masked;
  auto got = mem.Download<uint16_t>(combined->combined_x.view, static_cast<size_t>(T) * H);
  if (s.flip_one_output && !got.empty()) got[0] ^= 0x0100;
  if (s.flip_masked_output && !masked.empty() && !got.empty()) got[0] ^= 0x0100;
  if (!masked.empty()) {
    // Every element against the reference that excludes exactly the masked ranks (bit-exact: the same operations).
    checks.Exact(absl::StrCat("combined_x (rank(s) ", absl::StrJoin(masked, ","), " masked)"), got,
                 MaskedCombineReference(x, s, masked)[rank]);
    return absl::OkStatus();
  }
  if (s.exact) checks.Exact("combined_x", got, x.combined[rank]);
  checks.WeightedSum("combined_x (weighted sum)", got, x.exact, x.magnitude);
  for (size_t i = 0; i < got.size() && i < x.exact_bf16.size(); ++i) {
    const double err = std::fabs(ref::Bf16ToFloat(got[i]) - x.exact_bf16[i]);
    if (x.magnitude[i] > 0) checks.max_rel_err_vs_bf16 = std::max(checks.max_rel_err_vs_bf16, err / x.magnitude[i]);
  }
  return absl::OkStatus();
}

}  // namespace epfabric::worker
