// The plain structs of the internode normal mode (internode.h has the API and the algorithm): the RDMA region's
// layout and the params of its two data steps. No absl, so that device code includes it too.
#pragma once

#include <cstddef>
#include <cstdint>

namespace epfabric::kernels {

// The most hosts of one group (the send lists and per-host words are sized by it).
inline constexpr int kMaxInternodeHosts = 64;

struct InternodeShape {
  int num_hosts = 0;            // 1..kMaxInternodeHosts
  int ranks_per_host = 0;       // 1..kMaxNvlPeers
  int max_tokens_per_rank = 0;  // the most tokens one rank dispatches per call
  int max_hidden = 0;           // elements; rows are sized for BF16
  int max_topk = 0;
};

// Byte offsets inside a rank's RDMA region. A "slab" holds max_tokens_per_rank rows of one array; each array has
// one slab per host: send slabs are indexed by the destination host, receive slabs by the source host.
struct InternodeRdmaLayout {
  // Words (uint64/int64, one per host), zeroed by a reset. The arrival and free words only grow (signal adds).
  size_t dispatch_count = 0;    // int64 [H]: rows the rank of host h sent in its last dispatch (put before the signal)
  size_t dispatch_arrived = 0;  // uint64 [H]: dispatches whose rows from host h are in place
  size_t slab_free = 0;         // uint64 [H]: dispatches whose rows the gateway on host h has copied out
  size_t combine_arrived = 0;   // uint64 [H]: combines whose reduced rows from host h are in place
  size_t send_count = 0;        // int64 [H]: the source of the count puts
  size_t signal_bytes = 0;
  // Dispatch.
  size_t send_x = 0, recv_x = 0, x_slab_bytes = 0;  // rows of up to max_hidden * 2 bytes
  size_t send_scales = 0, recv_scales = 0, scales_slab_bytes = 0;
  size_t send_topk_idx = 0, recv_topk_idx = 0, topk_idx_slab_bytes = 0;
  size_t send_topk_weights = 0, recv_topk_weights = 0, topk_weights_slab_bytes = 0;
  // Combine: the gateway's reduced BF16 rows and summed weights, per source host.
  size_t combine_send_x = 0, combine_recv_x = 0, combine_x_slab_bytes = 0;
  size_t combine_send_weights = 0, combine_recv_weights = 0, combine_weights_slab_bytes = 0;
  size_t total_bytes = 0;
};

// Dispatch, step 1 on the source: rows of the tokens that go to host h, in token order, into slab h of each array —
// the receive slab for the own host (no transfer needed), the send slab for the others.
struct InternodePackParams {
  const void* x = nullptr;          // [num_tokens, row_bytes / element size]
  int row_bytes = 0;                // bytes of one x row (BF16: 2 * hidden, FP8: hidden); a multiple of 8
  const float* x_scales = nullptr;  // optional [num_tokens, num_scales]
  int num_scales = 0;
  const int64_t* topk_idx = nullptr;    // optional [num_tokens, num_topk], global expert ids
  const float* topk_weights = nullptr;  // optional [num_tokens, num_topk]
  int num_topk = 0;
  int num_tokens = 0;
  int num_hosts = 0;
  int self_host = 0;
  int experts_per_host = 0;  // top-k entries of host h become e - h * experts_per_host, or -1 on other hosts
  // send_tokens[h * max_rows + i] = the i-th token (ascending) that goes to host h; send_counts[h] tokens.
  const int32_t* send_tokens = nullptr;
  const int32_t* send_counts = nullptr;
  int max_rows = 0;  // slab capacity in rows (max_tokens_per_rank)
  // Slab bases: slab h of an array starts at base + h * slab_bytes; h == self_host uses the receive base.
  uint8_t* region = nullptr;  // this rank's RDMA region
  InternodeRdmaLayout layout;
};

// Combine, last step on the source: combined_x[t] = bf16(sum over hosts h = 0..H-1 with send_slot[t][h] >= 0 of
// the partial row of t from host h, + bias_0[t] + bias_1[t]), in float in that order; weights likewise.
struct InternodeReduceParams {
  int num_tokens = 0;
  int hidden = 0;
  int num_topk = 0;  // 0: no weights
  int num_hosts = 0;
  const int32_t* send_slot = nullptr;  // [num_tokens, num_hosts]: the token's row in the slabs of host h, or -1
  const uint8_t* region = nullptr;     // this rank's RDMA region: partial rows in the combine receive slabs
  InternodeRdmaLayout layout;
  const void* bias_0 = nullptr;  // optional BF16 [num_tokens, hidden]
  const void* bias_1 = nullptr;
  void* combined_x = nullptr;              // BF16 [num_tokens, hidden]
  float* combined_topk_weights = nullptr;  // with num_topk > 0: [num_tokens, num_topk]
};

}  // namespace epfabric::kernels
