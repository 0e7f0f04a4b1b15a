// epfabric_worker, normal mode: one round's inputs of every rank, the host reference's dispatch and combine, and the
// checked round through the Buffer API.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_format.h"
#include "checks.h"
#include "graphs.h"
#include "memory.h"
#include "worker.h"

namespace epfabric::worker {
namespace {

struct NormalRound {
  ref::DispatchConfig config;
  std::vector<ref::RankInput> inputs;
  std::vector<ref::RankOutput> dispatched;
  std::vector<ref::CombineInput> combine_inputs;
  std::vector<ref::CombineOutput> combined;
  std::vector<double> exact, magnitude;  // this rank's weighted sums [T][hidden]
};

float NormalValue(const ref::DispatchConfig& c, const uint8_t* rows, const float* scales, size_t row, int h) {
  if (c.num_scales == 0) {
    uint16_t bits;
    std::memcpy(&bits, rows + row * c.row_bytes + 2 * h, 2);
    return ref::Bf16ToFloat(bits);
  }
  return host::Fp8E4M3ToFloat(rows[row * c.row_bytes + h]) * scales[row * c.num_scales + h / 128];
}

// What the experts of one rank return for its received rows: per row the sum over its local experts of
// w * f_e(x), accumulated in float (k ascending) and rounded to BF16 — DeepEP's convention (weights applied on the
// expert side, combine sums).
std::vector<uint16_t> NormalExpertOutputs(const ref::DispatchConfig& c, int hidden, int rank, int num_rows,
                                          const uint8_t* recv_x, const float* recv_scales, const int64_t* recv_topk_idx,
                                          const float* recv_topk_weights) {
  const int experts_per_rank = c.num_experts / c.num_ranks;
  std::vector<uint16_t> out(static_cast<size_t>(num_rows) * hidden);
  for (int row = 0; row < num_rows; ++row) {
    for (int h = 0; h < hidden; ++h) {
      const float x = NormalValue(c, recv_x, recv_scales, row, h);
      float acc = 0;
      for (int k = 0; k < c.num_topk; ++k) {
        const int64_t local = recv_topk_idx[static_cast<size_t>(row) * c.num_topk + k];
        if (local < 0) continue;
        acc += recv_topk_weights[static_cast<size_t>(row) * c.num_topk + k] * x *
               ExpertScale(rank * experts_per_rank + local);
      }
      out[static_cast<size_t>(row) * hidden + h] = ref::FloatToBf16(acc);
    }
  }
  return out;
}

// DeepEP's packed UE8M0 scales: int32 [rows, groups / 4], byte g % 4 of word g / 4 the biased exponent of scale g
// (a power of two).
constexpr int kUe8m0ScalesPerWord = 4;

std::vector<int32_t> PackUe8m0(const std::vector<float>& scales, int rows, int groups) {
  std::vector<int32_t> packed(static_cast<size_t>(rows) * groups / kUe8m0ScalesPerWord, 0);
  for (size_t i = 0; i < scales.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &scales[i], sizeof(bits));
    const uint32_t exponent = (bits >> 23) & 0xFF;
    packed[i / kUe8m0ScalesPerWord] |= static_cast<int32_t>(exponent << (8 * (i % kUe8m0ScalesPerWord)));
  }
  return packed;
}

// The received scales as floats (unpacked when --packed_scales), to compare with the reference's.
std::vector<float> DownloadScales(Memory& mem, const Scenario& s, const TensorView& view, int rows, int groups) {
  if (!s.packed_scales) return mem.Download<float>(view, static_cast<size_t>(rows) * groups);
  const auto packed = mem.Download<int32_t>(view, static_cast<size_t>(rows) * groups / kUe8m0ScalesPerWord);
  std::vector<float> scales(packed.size() * kUe8m0ScalesPerWord);
  for (size_t i = 0; i < scales.size(); ++i) {
    const uint32_t bits = ((static_cast<uint32_t>(packed[i / kUe8m0ScalesPerWord]) >> (8 * (i % 4))) & 0xFF) << 23;
    std::memcpy(&scales[i], &bits, sizeof(bits));
  }
  return scales;
}

NormalRound MakeNormalRound(const Scenario& s, int num_ranks, int rank, int round) {
  NormalRound x;
  ref::DispatchConfig& c = x.config;
  c.num_ranks = num_ranks;
  c.row_bytes = s.fp8 ? s.hidden : s.hidden * 2;
  c.num_scales = s.fp8 ? s.hidden / 128 : 0;
  c.num_topk = s.topk;
  c.has_weights = true;
  c.num_experts = s.experts;
  c.num_channels = s.num_sms;
  c.expert_alignment = 1;
  std::mt19937_64 rng = RoundRng(s, round);
  std::uniform_real_distribution<float> weight(0.0f, 1.0f);
  x.inputs.resize(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    ref::RankInput& in = x.inputs[r];
    in.num_tokens = TokensOf(rng, s, r);
    in.routing_topk = s.topk;
    in.topk_idx = RandomTopk(rng, s, r, in.num_tokens);
    in.x.resize(static_cast<size_t>(in.num_tokens) * c.row_bytes);
    if (s.fp8) {
      for (uint8_t& b : in.x) b = host::FloatToFp8E4M3(std::uniform_real_distribution<float>(-4.0f, 4.0f)(rng));
      in.x_scales.resize(static_cast<size_t>(in.num_tokens) * c.num_scales);
      // --packed_scales: powers of two, which DeepEP's packed UE8M0 int32 scales carry exactly.
      std::uniform_int_distribution<int> exponent(-4, 3);
      for (float& scale : in.x_scales) scale = s.packed_scales ? std::ldexp(1.0f, exponent(rng)) : weight(rng) + 0.01f;
    } else {
      for (size_t i = 0; i < in.x.size(); i += 2) {
        const uint16_t v = RandomBf16(rng, 2.0f);
        std::memcpy(&in.x[i], &v, 2);
      }
    }
    in.topk_weights.resize(in.topk_idx.size());
    for (float& w : in.topk_weights) w = weight(rng);
  }
  // Groups across hosts: the internode reference (with one host forced through the internode path, the intranode
  // reference: the outputs must be the same bits).
  ref::InternodeDispatched internode;
  if (s.hosts > 1) {
    internode = ref::InternodeDispatch(x.inputs, c, s.hosts);
    x.dispatched = internode.outputs;
  } else {
    x.dispatched = ref::Dispatch(x.inputs, c);
  }
  x.combine_inputs.resize(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    const ref::RankOutput& o = x.dispatched[r];
    x.combine_inputs[r].x =
        NormalExpertOutputs(c, s.hidden, r, o.num_recv_tokens, o.recv_x.data(), o.recv_x_scales.data(),
                            o.recv_topk_idx.data(), o.recv_topk_weights.data());
    x.combine_inputs[r].topk_weights = o.recv_topk_weights;
  }
  x.combined = s.hosts > 1 ? ref::InternodeCombine(internode, x.combine_inputs, s.hidden, s.topk)
                           : ref::Combine(x.dispatched, x.combine_inputs, s.hidden, s.topk);
  // The weighted sum this rank expects, in double.
  const ref::RankInput& in = x.inputs[rank];
  x.exact.assign(static_cast<size_t>(in.num_tokens) * s.hidden, 0.0);
  x.magnitude.assign(x.exact.size(), 0.0);
  for (int t = 0; t < in.num_tokens; ++t) {
    for (int h = 0; h < s.hidden; ++h) {
      const double v = NormalValue(c, in.x.data(), in.x_scales.data(), t, h);
      for (int k = 0; k < s.topk; ++k) {
        const int64_t e = in.topk_idx[static_cast<size_t>(t) * s.topk + k];
        if (e < 0 || e >= s.experts) continue;
        const double term = double{in.topk_weights[static_cast<size_t>(t) * s.topk + k]} * ExpertScale(e) * v;
        x.exact[static_cast<size_t>(t) * s.hidden + h] += term;
        x.magnitude[static_cast<size_t>(t) * s.hidden + h] += std::fabs(term);
      }
    }
  }
  return x;
}

// Worst-case mode (--worst_tokens): the rows past the `received` ones are padding (top-k -1, weights 0); the
// checks below then compare the received rows only.
void CheckPadding(Checks& checks, const std::vector<int64_t>& idx, const std::vector<float>& w, int received, int rows,
                  int topk) {
  for (int row = received; row < rows; ++row) {
    for (int k = 0; k < topk; ++k) {
      const size_t at = static_cast<size_t>(row) * topk + k;
      if (at < idx.size() && idx[at] != -1) {
        return checks.Fail(absl::StrFormat("padding row %d of %d (after %d received): recv_topk_idx %d", row, rows,
                                           received, idx[at]));
      }
      if (at < w.size() && w[at] != 0.0f) {
        return checks.Fail(absl::StrFormat("padding row %d: recv_topk_weights %g", row, w[at]));
      }
    }
  }
}

template <typename T>
std::vector<T> Rows(std::vector<T> v, int rows, int per_row) {
  v.resize(std::min(v.size(), static_cast<size_t>(rows) * per_row));
  return v;
}

}  // namespace

absl::Status RunNormalRound(Buffer& buffer, Memory& mem, const Scenario& s, int round, Checks& checks,
                            RoundStats* stats, NormalGraphs* graphs) {
  const int R = buffer.num_ranks(), rank = buffer.rank();
  const NormalRound x = MakeNormalRound(s, R, rank, round);
  const ref::DispatchConfig& c = x.config;
  const ref::RankInput& in = x.inputs[rank];
  const ref::RankOutput& want = x.dispatched[rank];
  const int T = in.num_tokens, K = s.topk, H = s.hidden;
  mem.Clear();
  auto x_view = mem.Upload(in.x, s.fp8 ? DType::kFP8E4M3 : DType::kBF16, {T, H});
  auto scales_view = s.packed_scales ? mem.Upload(PackUe8m0(in.x_scales, T, c.num_scales), DType::kInt32,
                                                  {T, c.num_scales / kUe8m0ScalesPerWord})
                                     : mem.Upload(in.x_scales, DType::kFloat32, {T, c.num_scales});
  auto idx_view = mem.Upload(in.topk_idx, DType::kInt64, {T, K});
  auto w_view = mem.Upload(in.topk_weights, DType::kFloat32, {T, K});
  for (const auto* v : {&x_view, &scales_view, &idx_view, &w_view}) {
    if (!v->ok()) return v->status();
  }

  auto start = std::chrono::steady_clock::now();
  NoteCallStarted();
  absl::StatusOr<client::DispatchLayout> layout;
  absl::StatusOr<client::DispatchResult> recv;
  if (graphs != nullptr) {
    // Replayed: the layout and the dispatch captured at the first round, this round's inputs copied in.
    std::vector<uint32_t> scale_words;
    std::vector<int64_t> scales_shape{T, c.num_scales};
    if (s.packed_scales) {
      const std::vector<int32_t> packed = PackUe8m0(in.x_scales, T, c.num_scales);
      scale_words.assign(packed.begin(), packed.end());
      scales_shape[1] = c.num_scales / kUe8m0ScalesPerWord;
    } else {
      scale_words.resize(in.x_scales.size());
      if (!scale_words.empty()) std::memcpy(scale_words.data(), in.x_scales.data(), scale_words.size() * 4);
    }
    recv = graphs->Dispatch(buffer, s, in.x, scale_words, s.packed_scales ? DType::kInt32 : DType::kFloat32,
                            scales_shape, in.topk_idx, in.topk_weights, T);
    if (recv.ok()) layout = graphs->layout();
  } else {
    layout = buffer.GetDispatchLayout(*idx_view);
    if (!layout.ok()) return layout.status();
    MaybeDieDuringThisDispatch();
    recv = buffer.Dispatch({.x = *x_view,
                            .x_scales = s.fp8 ? *scales_view : TensorView{},
                            .topk_idx = *idx_view,
                            .topk_weights = *w_view,
                            .layout = &*layout,
                            .num_worst_tokens = s.worst_tokens});
  }
  if (!recv.ok()) return recv.status();
  if (absl::Status done = buffer.Check(); !done.ok()) return done;
  stats->dispatch_ms = MsSince(start);
  NoteDispatchCompleted();

  checks.Exact("num_tokens_per_rank", mem.Download<int32_t>(layout->num_tokens_per_rank.view, R),
               want.layout.num_tokens_per_rank);
  checks.Exact("num_tokens_per_expert", mem.Download<int32_t>(layout->num_tokens_per_expert.view, s.experts),
               want.layout.num_tokens_per_expert);
  checks.Exact("is_token_in_rank", mem.Download<uint8_t>(layout->is_token_in_rank.view, static_cast<size_t>(T) * R),
               want.layout.is_token_in_rank);
  const int N = recv->handle != nullptr ? recv->handle->num_recv_tokens : -1;
  if (N < 0) return absl::InternalError("Dispatch returned no handle");
  // Worst-case mode: N rows, the first `received` of them this rank's (compared), padding after them.
  const bool worst = s.worst_tokens > 0;
  const int received = worst ? std::min(N, want.num_recv_tokens) : N;
  // On a wrong count the comparisons below fail on sizes; the combine still runs (the peers wait for it).
  if (N != (worst ? s.worst_tokens : want.num_recv_tokens)) {
    checks.Fail(absl::StrFormat("num_recv_tokens = %d, expected %d", N, worst ? s.worst_tokens : want.num_recv_tokens));
  }
  if (!worst) {
    checks.Exact("num_recv_tokens_per_expert", recv->num_recv_tokens_per_expert, want.num_recv_tokens_per_expert);
  }
  const auto all_idx = mem.Download<int64_t>(recv->recv_topk_idx.view, static_cast<size_t>(N) * K);
  const auto all_w = mem.Download<float>(recv->recv_topk_weights.view, static_cast<size_t>(N) * K);
  if (worst) CheckPadding(checks, all_idx, all_w, received, N, K);
  const auto recv_x =
      Rows(mem.Download<uint8_t>(recv->recv_x.view, static_cast<size_t>(N) * c.row_bytes), received, c.row_bytes);
  const auto recv_scales =
      Rows(DownloadScales(mem, s, recv->recv_x_scales.view, N, c.num_scales), received, c.num_scales);
  const auto recv_idx = Rows(all_idx, received, K);
  const auto recv_w = Rows(all_w, received, K);
  checks.Exact("recv_x", recv_x, want.recv_x);
  checks.Exact("recv_x_scales", recv_scales, want.recv_x_scales);
  checks.Exact("recv_topk_idx", recv_idx, want.recv_topk_idx);
  checks.Exact("recv_topk_weights", recv_w, want.recv_topk_weights);
  if (s.cached) {
    // The same tokens again without notify: the handle's plan, the same received rows (worst-case: the handle's
    // mode, the same padded shapes).
    NoteCallStarted();
    auto again = buffer.Dispatch({.x = *x_view,
                                  .x_scales = s.fp8 ? *scales_view : TensorView{},
                                  .topk_idx = *idx_view,
                                  .topk_weights = *w_view,
                                  .cached = recv->handle});
    if (!again.ok()) return again.status();
    if (absl::Status done = buffer.Check(); !done.ok()) return done;
    checks.Exact(
        "cached recv_x",
        Rows(mem.Download<uint8_t>(again->recv_x.view, static_cast<size_t>(N) * c.row_bytes), received, c.row_bytes),
        want.recv_x);
    checks.Exact("cached recv_x_scales",
                 Rows(DownloadScales(mem, s, again->recv_x_scales.view, N, c.num_scales), received, c.num_scales),
                 want.recv_x_scales);
    const auto again_idx = mem.Download<int64_t>(again->recv_topk_idx.view, static_cast<size_t>(N) * K);
    const auto again_w = mem.Download<float>(again->recv_topk_weights.view, static_cast<size_t>(N) * K);
    if (worst) CheckPadding(checks, again_idx, again_w, received, N, K);
    checks.Exact("cached recv_topk_idx", Rows(again_idx, received, K), want.recv_topk_idx);
    checks.Exact("cached recv_topk_weights", Rows(again_w, received, K), want.recv_topk_weights);
  }
  for (int d = 0; d < R; ++d) {
    stats->bytes += static_cast<uint64_t>(want.layout.num_tokens_per_rank[d]) * c.row_bytes;
  }
  stats->bytes += static_cast<uint64_t>(N) * H * 2;
  stats->tokens = T;
  if (s.hosts > 1) {
    const int per_host = R / s.hosts, own = rank / per_host;
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < s.hosts; ++h) {
        bool goes = false;
        for (int l = 0; l < per_host && h != own && !goes; ++l) {
          goes = want.layout.is_token_in_rank[static_cast<size_t>(t) * R + h * per_host + l] != 0;
        }
        stats->remote_rows += goes ? 1 : 0;
      }
    }
  }

  // The experts, on what this rank received (when that matched the reference, these equal the reference's).
  // (Worst-case: the padding rows' outputs are zero, as their top-k chose no expert.)
  std::vector<uint16_t> expert_out;
  if (recv_x.size() == want.recv_x.size() && recv_idx.size() == want.recv_topk_idx.size() &&
      recv_w.size() == want.recv_topk_weights.size() && recv_scales.size() == want.recv_x_scales.size()) {
    expert_out =
        NormalExpertOutputs(c, H, rank, received, recv_x.data(), recv_scales.data(), recv_idx.data(), recv_w.data());
  }
  expert_out.resize(static_cast<size_t>(N) * H, 0);
  start = std::chrono::steady_clock::now();
  NoteCallStarted();
  absl::StatusOr<client::CombineResult> combined;
  if (graphs != nullptr) {
    combined = graphs->Combine(buffer, expert_out, H);
  } else {
    auto expert_view = mem.Upload(expert_out, DType::kBF16, {N, H});
    if (!expert_view.ok()) return expert_view.status();
    combined =
        buffer.Combine({.x = *expert_view, .topk_weights = recv->recv_topk_weights.view, .handle = recv->handle});
  }
  if (!combined.ok()) return combined.status();
  if (absl::Status done = buffer.Check(); !done.ok()) return done;
  stats->combine_ms = MsSince(start);

  auto got = mem.Download<uint16_t>(combined->combined_x.view, static_cast<size_t>(T) * H);
  if (s.flip_one_output && !got.empty()) got[0] ^= 0x0100;
  if (s.exact) {
    checks.Exact("combined_x", got, x.combined[rank].combined_x);
    checks.Exact("combined_topk_weights",
                 mem.Download<float>(combined->combined_topk_weights.view, static_cast<size_t>(T) * K),
                 x.combined[rank].combined_topk_weights);
  }
  checks.WeightedSum("combined_x (weighted sum)", got, x.exact, x.magnitude);
  return absl::OkStatus();
}

}  // namespace epfabric::worker
