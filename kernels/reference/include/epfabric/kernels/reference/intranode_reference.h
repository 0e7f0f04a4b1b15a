// Host reference of the intranode mode: the dispatch layout, dispatch (all ranks' inputs -> every rank's outputs,
// handle included) and combine, computed in one process with plain loops. It defines the expected results that
// the GPU kernels are compared with element by element, and is the algorithm the host backend runs.
#pragma once

#include <cstdint>
#include <vector>

namespace epfabric::kernels::reference {

// BF16 <-> float (round to nearest even, as __float2bfloat16_rn).
uint16_t FloatToBf16(float value);
float Bf16ToFloat(uint16_t value);

// First token of `channel` when `num_tokens` are split into `num_channels` balanced contiguous ranges (the same
// split as the kernels).
int ChannelTokenBegin(int num_tokens, int num_channels, int channel);

struct Layout {
  std::vector<int32_t> num_tokens_per_rank;       // [num_ranks]
  std::vector<int32_t> num_tokens_per_rdma_rank;  // [ceil(num_ranks / 8)]
  std::vector<int32_t> num_tokens_per_expert;     // [num_experts]
  std::vector<uint8_t> is_token_in_rank;          // [num_tokens][num_ranks], 0 or 1
  int32_t num_invalid_topk = 0;                   // entries outside [-1, num_experts), treated as -1
};

Layout ComputeLayout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks);

struct DispatchConfig {
  int num_ranks = 1;
  int row_bytes = 0;   // bytes of one x row
  int num_scales = 0;  // floats per row of x_scales (0: none)
  int num_topk = 0;    // 0: no top-k sent
  bool has_weights = false;
  int num_experts = 0;
  int num_channels = 1;
  int expert_alignment = 1;
};

struct RankInput {
  int num_tokens = 0;
  std::vector<uint8_t> x;           // [num_tokens][row_bytes]
  std::vector<float> x_scales;      // [num_tokens][num_scales]
  std::vector<int64_t> topk_idx;    // [num_tokens][topk of the routing] (always used for the layout)
  std::vector<float> topk_weights;  // [num_tokens][topk]
  int routing_topk = 0;             // columns of topk_idx
};

struct RankOutput {
  Layout layout;
  int num_recv_tokens = 0;
  std::vector<int32_t> num_recv_tokens_per_expert;  // aligned, [experts_per_rank]
  std::vector<int32_t> rank_prefix_matrix;          // [num_ranks][num_ranks]
  std::vector<int32_t> recv_channel_prefix;         // [num_ranks][num_channels]
  std::vector<int32_t> send_slot;                   // [num_tokens][num_ranks]
  std::vector<uint8_t> recv_x;                      // [num_recv_tokens][row_bytes]
  std::vector<float> recv_x_scales;                 // [num_recv_tokens][num_scales]
  std::vector<int64_t> recv_topk_idx;               // [num_recv_tokens][num_topk]
  std::vector<float> recv_topk_weights;             // [num_recv_tokens][num_topk]
  std::vector<int32_t> recv_src_idx;                // [num_recv_tokens]
  std::vector<int32_t> recv_src_rank;               // [num_recv_tokens] (not produced by the kernels; for tests)
};

// Layout, notify and dispatch for every rank. Received order on rank d: by source rank, then source token index.
std::vector<RankOutput> Dispatch(const std::vector<RankInput>& inputs, const DispatchConfig& config);

struct CombineInput {
  std::vector<uint16_t> x;          // BF16 [num_recv_tokens][hidden]
  std::vector<float> topk_weights;  // [num_recv_tokens][num_topk] or empty
  std::vector<uint16_t> bias_0;     // BF16 [num_tokens][hidden] or empty
  std::vector<uint16_t> bias_1;
};

struct CombineOutput {
  std::vector<uint16_t> combined_x;          // BF16 [num_tokens][hidden]
  std::vector<float> combined_x_float;       // the float sums before rounding
  std::vector<float> combined_topk_weights;  // [num_tokens][num_topk]
};

// combined_x[t] = bf16(sum over d = 0..R-1 with send_slot[t][d] >= 0 of x_d[row of t on d] + bias_0[t] + bias_1[t]),
// accumulated in float in that order; weights likewise (num_topk = 0: no weights).
std::vector<CombineOutput> Combine(const std::vector<RankOutput>& dispatched, const std::vector<CombineInput>& inputs,
                                   int hidden, int num_topk);

}  // namespace epfabric::kernels::reference
