// Single-process host reference of low-latency dispatch and combine: all ranks' inputs in, every rank's outputs out.
// It is the oracle of the GPU tests and defines the exact output layout (docs/low-latency-kernels.md):
//  - For local expert e of rank r and source rank s, the tokens of s that chose e land at packed slots
//    [begin(e, s), begin(e, s) + count(e, s)) where begin(e, s) = sum of count(e, s') over s' < s, in increasing
//    source token index. The layout is compact (DeepGEMM's masked layout: the first packed_recv_count[e] rows are
//    valid) and deterministic.
//  - topk_idx entries outside [0, num_experts) are ignored; an expert that appears twice in one token's top-k
//    receives the token once (at its first top-k position) and combine adds it with every weight it appears with.
//  - A masked rank sends nothing, receives nothing, and its experts' outputs count as zero in combine.
//  - Combine reduces in two steps, as the kernels do: each expert rank r sums, per token, its own experts' outputs
//    (k ascending, fmaf into a float starting at 0, weight of an expert = the sum of its weights over duplicate
//    positions) and rounds that partial sum to bf16; the token's rank adds the partial sums of r = 0, 1, ... in
//    float and rounds to bf16.
#pragma once

#include <cstdint>
#include <vector>

namespace epfabric::kernels::host {

struct LowLatencyShape {
  int num_ranks = 1;
  int num_experts = 0;
  int hidden = 0;
  int max_tokens_per_rank = 0;
  int num_topk = 0;
  int num_local_experts() const { return num_experts / num_ranks; }
  int recv_slots() const { return num_ranks * max_tokens_per_rank; }
};

struct LowLatencyDispatchOptions {
  bool use_fp8 = true;
  bool round_scale = false;
  bool use_ue8m0 = false;
};

// One rank's dispatch input.
struct LowLatencyRankInput {
  int num_tokens = 0;
  std::vector<uint16_t> x;          // bf16 [num_tokens][hidden]
  std::vector<int64_t> topk_idx;    // [num_tokens][num_topk]
  std::vector<float> topk_weights;  // [num_tokens][num_topk] (combine)
};

// One rank's dispatch output, laid out exactly as the kernel writes it. Slots past the counts are left zero here
// (the kernel leaves them untouched): compare only valid slots.
struct LowLatencyDispatchOutput {
  std::vector<uint8_t> packed_recv_x;      // [L][R*M][hidden * element size] (fp8: 1 byte, bf16: 2 bytes)
  std::vector<float> scales;               // float scales: [L][G][R*M]
  std::vector<uint8_t> ue8m0_scales;       // ue8m0: bytes of int32 [L][G/4][R*M] (4 bytes per int32, little end)
  std::vector<int32_t> packed_recv_count;  // [L]
  std::vector<int32_t> src_info;           // [L][R*M]
  std::vector<int64_t> layout_range;       // [L][R]: (begin << 32) | count
  std::vector<int32_t> topk_slot;          // [L][R*M]
  std::vector<int32_t> token_map;          // [R][M][kMaxTopk]: packed index or -1
};

inline constexpr int kReferenceMaxTopk = 16;  // = kernels::kLowLatencyMaxTopk

// `rank_masked[r]` (may be empty) marks ranks that take no part.
std::vector<LowLatencyDispatchOutput> LowLatencyDispatchReference(const LowLatencyShape& shape,
                                                                  const LowLatencyDispatchOptions& options,
                                                                  const std::vector<LowLatencyRankInput>& inputs,
                                                                  const std::vector<bool>& rank_masked = {});

// Combine: `expert_outputs[r]` is rank r's bf16 [L][R*M][hidden] input, `dispatched[r]` its dispatch output (for
// src_info/layout). Returns each rank's combined bf16 [num_tokens][hidden], computed with exactly the kernels'
// operations (see the two-step reduction above), so the GPU result is bit-exact.
std::vector<std::vector<uint16_t>> LowLatencyCombineReference(const LowLatencyShape& shape,
                                                              const std::vector<LowLatencyRankInput>& inputs,
                                                              const std::vector<std::vector<uint16_t>>& expert_outputs,
                                                              const std::vector<LowLatencyDispatchOutput>& dispatched,
                                                              const std::vector<bool>& rank_masked = {});

// The same sum in double precision, not rounded (for tolerance checks independent of the operation order). When
// `magnitudes` is set it receives, per element, the sum of |weight * value| over the terms.
std::vector<std::vector<double>> LowLatencyCombineExact(const LowLatencyShape& shape,
                                                        const std::vector<LowLatencyRankInput>& inputs,
                                                        const std::vector<std::vector<uint16_t>>& expert_outputs,
                                                        const std::vector<LowLatencyDispatchOutput>& dispatched,
                                                        const std::vector<bool>& rank_masked = {},
                                                        std::vector<std::vector<double>>* magnitudes = nullptr);

}  // namespace epfabric::kernels::host
