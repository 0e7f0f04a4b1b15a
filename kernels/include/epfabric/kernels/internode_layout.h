// The plain structs of the internode normal mode (internode.h has the API and the algorithm): the RDMA region's
// layout and the params of its steps. No absl, so that device code includes it too.
#pragma once

#include <cstddef>
#include <cstdint>

#include "epfabric/kernels/status_word.h"

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
  // uint64 [H]: host-issued combines whose rows from this rank the rank on host h has summed (its receive slab for
  // this host is free for the next combine's rows). Padded (device-issued) combines do not count here.
  size_t combine_free = 0;
  size_t send_count = 0;  // int64 [H]: the source of the count puts
  // uint64 [2]: this rank's dispatches and combines so far (written by this rank only: the waits' targets). In the
  // region rather than in the client so that a call replayed from a CUDA graph counts too.
  size_t calls = 0;
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

// ---- Worst-case mode (num_worst_tokens) across hosts: the RDMA stage with nothing waited for on the host, so that a
// call can be captured into a CUDA graph (docs/internode-dispatch.md, "Worst-case mode"). The data steps below run
// on both backends; the transport steps (InternodeIssueParams, InternodeWaitParams) are kernels on cuda and host code
// in the client on the host backend.

// Dispatch, first step on the source (not cached): the tokens that go to each host (any of its ranks), in token
// order. With one host every token goes to it.
struct InternodePlanParams {
  const bool* is_token_in_rank = nullptr;  // [num_tokens, num_hosts * ranks_per_host]
  int num_tokens = 0;
  int num_hosts = 0;
  int ranks_per_host = 0;
  int max_rows = 0;
  int32_t* send_plan = nullptr;  // out: [num_hosts] counts, then [num_hosts][max_rows] tokens (InternodePackParams')
  int32_t* send_slot = nullptr;  // out: [num_tokens, num_hosts]: the token's row in host h's slabs, or -1
};

// Dispatch, on the gateway once every host's rows are in: the forwarded tokens at fixed places (host h's rows at
// [h * max_rows, h * max_rows + count_h), padding after them: x 0, scales 0, top-k -1, weights 0), so that the
// NVLink stage's input has a size known before the call. Counts read from the region are peer data: one outside
// [0, max_rows] is recorded in `status` and read as 0; with a failure already recorded every other host's count
// reads as 0 (its rows may not have arrived).
struct InternodeGatherParams {
  const uint8_t* region = nullptr;  // this rank's RDMA region
  InternodeRdmaLayout layout;
  int num_hosts = 0;
  int self_host = 0;
  int ranks_per_host = 0;  // with self_host and rank: whom a bad count is from (group rank host * L + local index)
  int rank = 0;
  int max_rows = 0;
  const int32_t* send_counts = nullptr;      // [num_hosts]: this rank's plan (the own host's rows)
  const int32_t* expected_counts = nullptr;  // optional [num_hosts]: a cached dispatch's (the handle's recv_counts)
  int32_t* recv_counts = nullptr;            // out [num_hosts]: the rows of each host
  int row_bytes = 0;                         // a multiple of 16
  int num_scales = 0;                        // 4-byte scale words per row
  int num_topk = 0;
  void* x = nullptr;  // out [num_hosts * max_rows] rows of each array (scales, top-k and weights optional)
  uint32_t* x_scales = nullptr;
  int64_t* topk_idx = nullptr;
  float* topk_weights = nullptr;
  KernelStatus* status = nullptr;  // cuda: device memory; the host backend returns DataLoss instead
};

// Combine, on the gateway: the NVLink stage's reduced rows ([num_hosts * max_rows], as gathered) back into the
// slabs: host h's recv_counts[h] rows into combine send slab h, the own host's into its receive slab.
struct InternodeScatterParams {
  const void* x = nullptr;              // BF16 [num_hosts * max_rows, hidden]
  const float* topk_weights = nullptr;  // optional [num_hosts * max_rows, num_topk]
  int hidden = 0;
  int num_topk = 0;
  int num_hosts = 0;
  int self_host = 0;
  int max_rows = 0;
  const int32_t* recv_counts = nullptr;  // [num_hosts], from the gather (clamped to [0, max_rows])
  uint8_t* region = nullptr;
  InternodeRdmaLayout layout;
};

// A ring of the transport as the cuda steps use it: the issue step reserves slots in shared memory, starting from the
// ring's `reserved` word and storing it back when done, so that host issuers (the host-driven calls of the same
// Buffer) carry on from it. One block per launch: no two launches of a Buffer issue at once (stream order).
struct InternodeRing {
  void* control = nullptr;  // RingControl, device pointer of the mapped command region
  uint32_t slots = 0;
  int channel = 0;
};
inline constexpr int kMaxInternodeRings = 8;

enum class InternodeIssueStep : int32_t {
  kDispatchRows = 1,  // per other host: its rows (x, scales, top-k, weights), the count word, then dispatch_arrived
  kSlabFree = 2,      // per other host: slab_free (its rows were copied out)
  kCombineRows = 3,   // per other host: the reduced rows and weights of its tokens, then combine_arrived
  // Only after a failure recorded in `status` (every other step then sends nothing): per other host,
  // kInternodeLeftCallWord added to each word this rank owes it, so that its waits end at once.
  kLeave = 4,
};

struct InternodeIssueParams {
  InternodeIssueStep step = InternodeIssueStep::kDispatchRows;
  InternodeRing rings[kMaxInternodeRings];  // host h's commands go on rings[h % num_rings]
  int num_rings = 0;
  InternodeRdmaLayout layout;
  int num_hosts = 0;
  int self_host = 0;
  int ranks_per_host = 0;
  int local_rank = 0;
  int max_rows = 0;
  const int32_t* counts = nullptr;  // [num_hosts] rows per host: the plan's (dispatch) or the gather's (combine)
  int row_bytes = 0;                // dispatch: x row bytes; combine: 2 * hidden
  int num_scales = 0;
  int num_topk = 0;
  bool has_weights = false;
  uint64_t timeout_ns = 0;
  KernelStatus* status = nullptr;
  int rank = 0;
};

// Which words a wait step waits on (one per other host, to reach this rank's call count + target_offset).
enum class InternodeWaitWords : int32_t {
  kNone = 0,
  kDispatchArrived = 1,
  kSlabFree = 2,  // target: the previous dispatch
  kCombineArrived = 3,
};

struct InternodeWaitParams {
  uint8_t* region = nullptr;  // this rank's RDMA region (device mapping)
  InternodeRdmaLayout layout;
  int call = 0;       // 0: dispatches, 1: combines (the `calls` word)
  bool bump = false;  // the call's first step: count the call first
  InternodeWaitWords words = InternodeWaitWords::kNone;
  bool quiet = false;  // then wait until every command issued on the rings so far is complete
  InternodeRing rings[kMaxInternodeRings];
  int num_rings = 0;
  int num_hosts = 0;
  int self_host = 0;
  int ranks_per_host = 0;
  int local_rank = 0;
  const uint64_t* lost_ranks = nullptr;       // the daemon's lost-ranks words (mapped), optional
  uint64_t lost_ignore[kLostRankWords] = {};  // ranks lost before the Buffer was made (awaited, not reported)
  uint64_t timeout_ns = 0;
  KernelStatus* status = nullptr;
  int rank = 0;
};

// What a rank whose call failed adds to every word it owes its peers (InternodePath::LeaveCall): far above any count
// of calls, so a waiting peer tells it apart.
inline constexpr uint64_t kInternodeLeftCallWord = uint64_t{1} << 48;

}  // namespace epfabric::kernels
