#include "epfabric/kernels/reference/low_latency_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "epfabric/kernels/reference/fp8.h"

namespace epfabric::kernels::host {
namespace {

bool Masked(const std::vector<bool>& mask, int rank) { return rank < static_cast<int>(mask.size()) && mask[rank]; }

bool ValidExpert(int64_t e, int num_experts) { return e >= 0 && e < num_experts; }

// First top-k position of `expert` in the token's row, or -1.
int FirstSlot(const int64_t* row, int num_topk, int64_t expert) {
  for (int k = 0; k < num_topk; ++k) {
    if (row[k] == expert) return k;
  }
  return -1;
}

// Where (expert e, source rank s, token t) landed in rank e/L's packed layout, or -1.
int64_t PackedSlot(const LowLatencyShape& shape, const LowLatencyDispatchOutput& out, int local_expert, int src_rank,
                   int token) {
  const int64_t range = out.layout_range[static_cast<size_t>(local_expert) * shape.num_ranks + src_rank];
  const int64_t begin = range >> 32;
  const int32_t count = static_cast<int32_t>(range & 0xFFFFFFFF);
  const size_t base = static_cast<size_t>(local_expert) * shape.recv_slots();
  for (int j = 0; j < count; ++j) {
    if (out.src_info[base + begin + j] == token) return begin + j;
  }
  return -1;
}

// Visits every (token, k, value-row) contribution of rank s's combine in order.
template <typename Visit>
void ForEachContribution(const LowLatencyShape& shape, const std::vector<LowLatencyRankInput>& inputs,
                         const std::vector<std::vector<uint16_t>>& expert_outputs,
                         const std::vector<LowLatencyDispatchOutput>& dispatched, const std::vector<bool>& rank_masked,
                         int s, Visit visit) {
  const int L = shape.num_local_experts();
  const LowLatencyRankInput& in = inputs[s];
  for (int t = 0; t < in.num_tokens; ++t) {
    const int64_t* row = &in.topk_idx[static_cast<size_t>(t) * shape.num_topk];
    for (int k = 0; k < shape.num_topk; ++k) {
      const int64_t e = row[k];
      if (!ValidExpert(e, shape.num_experts)) continue;
      const int r = static_cast<int>(e / L);
      if (Masked(rank_masked, r)) continue;
      const int local = static_cast<int>(e % L);
      const int64_t p = PackedSlot(shape, dispatched[r], local, s, t);
      if (p < 0) continue;  // cannot happen with consistent inputs
      const uint16_t* values = &expert_outputs[r][(static_cast<size_t>(local) * shape.recv_slots() + p) * shape.hidden];
      visit(t, in.topk_weights[static_cast<size_t>(t) * shape.num_topk + k], values);
    }
  }
}

}  // namespace

std::vector<LowLatencyDispatchOutput> LowLatencyDispatchReference(const LowLatencyShape& shape,
                                                                  const LowLatencyDispatchOptions& options,
                                                                  const std::vector<LowLatencyRankInput>& inputs,
                                                                  const std::vector<bool>& rank_masked) {
  const int R = shape.num_ranks, L = shape.num_local_experts(), H = shape.hidden, K = shape.num_topk;
  const size_t slots = shape.recv_slots();
  const int G = H / 128;
  const size_t elem = options.use_fp8 ? 1 : 2;

  // Quantise every token of every rank once (the sender quantises once per token).
  std::vector<std::vector<uint8_t>> fp8(R);
  std::vector<std::vector<float>> token_scales(R);
  if (options.use_fp8) {
    for (int s = 0; s < R; ++s) {
      fp8[s].resize(static_cast<size_t>(inputs[s].num_tokens) * H);
      token_scales[s].resize(static_cast<size_t>(inputs[s].num_tokens) * G);
      for (int t = 0; t < inputs[s].num_tokens; ++t) {
        QuantizeRowFp8(&inputs[s].x[static_cast<size_t>(t) * H], H, options.round_scale, &fp8[s][size_t(t) * H],
                       &token_scales[s][size_t(t) * G]);
      }
    }
  }

  std::vector<LowLatencyDispatchOutput> outputs(R);
  for (int r = 0; r < R; ++r) {
    LowLatencyDispatchOutput& out = outputs[r];
    out.packed_recv_x.assign(L * slots * H * elem, 0);
    if (options.use_fp8 && options.use_ue8m0) out.ue8m0_scales.assign(L * slots * G, 0);
    if (options.use_fp8 && !options.use_ue8m0) out.scales.assign(L * slots * G, 0.0f);
    out.packed_recv_count.assign(L, 0);
    out.src_info.assign(L * slots, 0);
    out.layout_range.assign(static_cast<size_t>(L) * R, 0);
    out.topk_slot.assign(L * slots, 0);
    out.token_map.assign(static_cast<size_t>(R) * shape.max_tokens_per_rank * kReferenceMaxTopk, -1);
    if (Masked(rank_masked, r)) continue;
    for (int local = 0; local < L; ++local) {
      const int64_t expert = static_cast<int64_t>(r) * L + local;
      int begin = 0;
      for (int s = 0; s < R; ++s) {
        int count = 0;
        if (!Masked(rank_masked, s)) {
          for (int t = 0; t < inputs[s].num_tokens; ++t) {
            const int k0 = FirstSlot(&inputs[s].topk_idx[static_cast<size_t>(t) * K], K, expert);
            if (k0 < 0) continue;
            const size_t p = static_cast<size_t>(local) * slots + begin + count;
            out.src_info[p] = t;
            out.topk_slot[p] = k0;
            out.token_map[(static_cast<size_t>(s) * shape.max_tokens_per_rank + t) * kReferenceMaxTopk + k0] =
                static_cast<int32_t>(p);
            if (options.use_fp8) {
              std::memcpy(&out.packed_recv_x[p * H], &fp8[s][static_cast<size_t>(t) * H], H);
              for (int g = 0; g < G; ++g) {
                const float scale = token_scales[s][static_cast<size_t>(t) * G + g];
                if (options.use_ue8m0) {
                  const size_t pack = g / 4;
                  out.ue8m0_scales[((static_cast<size_t>(local) * (G / 4) + pack) * slots + begin + count) * 4 +
                                   g % 4] = Ue8m0FromScale(scale);
                } else {
                  out.scales[(static_cast<size_t>(local) * G + g) * slots + begin + count] = scale;
                }
              }
            } else {
              std::memcpy(&out.packed_recv_x[p * H * 2], &inputs[s].x[static_cast<size_t>(t) * H], H * 2);
            }
            ++count;
          }
        }
        out.layout_range[static_cast<size_t>(local) * R + s] =
            (static_cast<int64_t>(begin) << 32) | static_cast<uint32_t>(count);
        begin += count;
      }
      out.packed_recv_count[local] = begin;
    }
  }
  return outputs;
}

std::vector<std::vector<uint16_t>> LowLatencyCombineReference(const LowLatencyShape& shape,
                                                              const std::vector<LowLatencyRankInput>& inputs,
                                                              const std::vector<std::vector<uint16_t>>& expert_outputs,
                                                              const std::vector<LowLatencyDispatchOutput>& dispatched,
                                                              const std::vector<bool>& rank_masked) {
  const int H = shape.hidden, K = shape.num_topk, L = shape.num_local_experts();
  std::vector<std::vector<uint16_t>> combined(shape.num_ranks);
  std::vector<float> acc(H), partial(H);
  for (int s = 0; s < shape.num_ranks; ++s) {
    const LowLatencyRankInput& in = inputs[s];
    combined[s].assign(static_cast<size_t>(in.num_tokens) * H, 0);
    for (int t = 0; t < in.num_tokens; ++t) {
      const int64_t* row = &in.topk_idx[static_cast<size_t>(t) * K];
      const float* weights = &in.topk_weights[static_cast<size_t>(t) * K];
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int r = 0; r < shape.num_ranks; ++r) {
        if (Masked(rank_masked, r)) continue;
        bool any = false;
        std::fill(partial.begin(), partial.end(), 0.0f);
        for (int k = 0; k < K; ++k) {
          const int64_t e = row[k];
          if (!ValidExpert(e, shape.num_experts) || e / L != r || FirstSlot(row, K, e) != k) continue;
          float w = weights[k];
          for (int kk = k + 1; kk < K; ++kk) {
            if (row[kk] == e) w += weights[kk];
          }
          const int64_t p = PackedSlot(shape, dispatched[r], static_cast<int>(e % L), s, t);
          if (p < 0) continue;  // cannot happen with consistent inputs
          const uint16_t* values = &expert_outputs[r][(static_cast<size_t>(e % L) * shape.recv_slots() + p) * H];
          for (int i = 0; i < H; ++i) partial[i] = std::fmaf(Bf16ToFloat(values[i]), w, partial[i]);
          any = true;
        }
        if (!any) continue;
        for (int i = 0; i < H; ++i) acc[i] = acc[i] + Bf16ToFloat(FloatToBf16(partial[i]));
      }
      for (int i = 0; i < H; ++i) combined[s][static_cast<size_t>(t) * H + i] = FloatToBf16(acc[i]);
    }
  }
  return combined;
}

std::vector<std::vector<double>> LowLatencyCombineExact(const LowLatencyShape& shape,
                                                        const std::vector<LowLatencyRankInput>& inputs,
                                                        const std::vector<std::vector<uint16_t>>& expert_outputs,
                                                        const std::vector<LowLatencyDispatchOutput>& dispatched,
                                                        const std::vector<bool>& rank_masked,
                                                        std::vector<std::vector<double>>* magnitudes) {
  const int H = shape.hidden;
  std::vector<std::vector<double>> combined(shape.num_ranks);
  if (magnitudes != nullptr) magnitudes->assign(shape.num_ranks, {});
  for (int s = 0; s < shape.num_ranks; ++s) {
    combined[s].assign(static_cast<size_t>(inputs[s].num_tokens) * H, 0.0);
    if (magnitudes != nullptr) (*magnitudes)[s].assign(combined[s].size(), 0.0);
    ForEachContribution(shape, inputs, expert_outputs, dispatched, rank_masked, s,
                        [&](int t, float w, const uint16_t* values) {
                          double* a = &combined[s][static_cast<size_t>(t) * H];
                          for (int i = 0; i < H; ++i) a[i] += static_cast<double>(Bf16ToFloat(values[i])) * w;
                          if (magnitudes == nullptr) return;
                          double* m = &(*magnitudes)[s][static_cast<size_t>(t) * H];
                          for (int i = 0; i < H; ++i)
                            m[i] += std::fabs(static_cast<double>(Bf16ToFloat(values[i])) * w);
                        });
  }
  return combined;
}

}  // namespace epfabric::kernels::host
