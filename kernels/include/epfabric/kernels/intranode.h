// Normal-mode intranode expert parallelism over NVLink (DeepEP's "intranode" mode): the dispatch layout, the
// counts exchange (notify), dispatch (also cached, reusing a handle) and combine. Plain C++: raw device pointers,
// sizes and a cudaStream_t; every function validates its inputs before launching anything and returns an
// absl::Status. See docs/intranode-kernels.md for the algorithm, the received-token order and the handle.
//
// Memory model in one paragraph: every rank of an NVLink domain owns one contiguous communication region, all
// regions are allocated for the same IntranodeRegionConfig (so every section lies at the same offset on every
// rank), and each kernel receives the table of all regions (`peer_regions[r]` = rank r's region as mapped in this
// process, the own one included). Senders push into the receiver's region with NVLink stores; each receiver copies
// from its own region into the caller's output tensors. Signals in the region are either monotonic barrier
// counters or counters that their owner zeroes after it consumed them, so a region is clean after every
// successful call; after a timeout, call IntranodeResetRegion on every rank before the next call.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epfabric/kernels/common.h"
#include "epfabric/kernels/status_word.h"

namespace epfabric::kernels {

// ---------------------------------------------------------------------------------------------------------------
// Region: sizing and carving, computed by one function so that the daemon's allocation and the kernels' pointers
// can never disagree.

// What a region is sized for. All ranks of a group use the same configuration.
struct IntranodeRegionConfig {
  int num_ranks = 0;            // ranks in the NVLink domain, 1..kMaxNvlPeers
  int max_tokens_per_rank = 0;  // the most tokens any rank dispatches in one call
  int max_hidden = 0;           // the widest hidden size (elements); staging rows are sized for BF16
  int max_topk = 0;             // the most top-k slots per token
  int num_experts = 0;          // total experts; a multiple of num_ranks
  int max_channels = 0;         // the most SMs (= channels) a dispatch/combine call may use
};

// Byte offsets of every section from the start of a region, and the total size. Staging sections hold one pool per
// peer rank (`*_pool_bytes` apart); inside a pool, rows are packed with the strides of the current call.
struct IntranodeRegionLayout {
  // Signals (zeroed by IntranodeResetRegion).
  size_t barrier_arrive = 0;        // int32 [max_channels][num_ranks]: monotonic arrivals per barrier lane
  size_t barrier_epoch = 0;         // int32 [max_channels]: barriers this rank completed per lane
  size_t dispatch_range = 0;        // int64 [num_ranks][max_channels]: a sender's channel slot range, 0 = unset
  size_t channel_tail = 0;          // int32 [num_ranks][max_channels]: tokens/rows a sender has made visible
  size_t notify_rank_counts = 0;    // int32 [num_ranks][num_ranks]: per source, its num_tokens_per_rank
  size_t notify_expert_counts = 0;  // int32 [num_ranks][experts_per_rank]: per source, tokens per local expert
  size_t signal_bytes = 0;          // size of the signal sections together (they start at offset 0)
  // Staging pools, one per peer rank (indexed by the rank at the other end of the transfer).
  size_t staging_x = 0;
  size_t staging_x_pool_bytes = 0;
  size_t staging_scales = 0;
  size_t staging_scales_pool_bytes = 0;
  size_t staging_topk_idx = 0;
  size_t staging_topk_idx_pool_bytes = 0;
  size_t staging_topk_weights = 0;
  size_t staging_topk_weights_pool_bytes = 0;
  size_t staging_src_idx = 0;
  size_t staging_src_idx_pool_bytes = 0;
  size_t total_bytes = 0;
};

// Validates `config` and computes where everything lies.
absl::StatusOr<IntranodeRegionLayout> ComputeIntranodeRegionLayout(const IntranodeRegionConfig& config);

// The number of bytes a daemon must allocate per rank for `config` (= ComputeIntranodeRegionLayout().total_bytes).
absl::StatusOr<size_t> IntranodeRegionBytes(const IntranodeRegionConfig& config);

// The most tokens one rank can receive in one dispatch: what a caller allocates when it does not wait for the
// counts (CUDA-graph capturable "worst case" mode).
int64_t IntranodeWorstCaseRecvTokens(const IntranodeRegionConfig& config);

// The group as a kernel sees it: this rank, all regions, where to report a timeout, and how long to wait.
struct IntranodeGroup {
  IntranodeRegionConfig config;
  int rank = 0;
  void* peer_regions[kMaxNvlPeers] = {};  // index = rank in the NVLink domain; [rank] is this rank's own region
  KernelStatus* status = nullptr;         // device-writable (device or mapped host memory); required
  uint64_t timeout_ns = kDefaultWaitTimeoutNs;
  uint64_t* profile_ns = nullptr;  // benchmarks only: kernel timeline (see kProfileSlotsPerBlock in status_word.h)
  // Optional kLostRankWords words the daemon writes (status_word.h): a wait on a rank published as lost ends at once
  // with an error naming it (UNAVAILABLE) instead of at the timeout. Device-readable (mapped host memory) for CUDA.
  const uint64_t* lost_ranks = nullptr;
  // Ranks whose bit is ignored: those already lost when the caller's Buffer was made (a rank restarting while this
  // one starts is awaited, not reported lost), until their bit clears (LowLatencyContext has the same).
  uint64_t lost_ignore[kLostRankWords] = {};
};

// Loads the normal-mode kernels on the current device. Call it once per device before the first launch, while no
// kernel that waits for another rank runs there: CUDA loads kernels lazily, and a launch that must load code waits
// for the kernels running on the device (a peer's spinning kernel then holds it up to its timeout).
absl::Status IntranodePreloadKernels();

// Zeroes the signal sections of this rank's region (stream-ordered). Needed after a timeout (and before first use
// if the memory is not known to be zero). All ranks must reset before any of them issues the next call.
absl::Status IntranodeResetRegion(const IntranodeGroup& group, cudaStream_t stream);

// After this rank's call failed where its peers may wait for it (a group across hosts: its RDMA stage failed): adds
// kAbandonArrivals to its arrival counter at every peer and barrier lane, so that a peer's barrier wait ends at once
// (UNAVAILABLE "rank P left the call") instead of at its timeout. On a private stream, waited for; every rank resets
// before the next call.
absl::Status IntranodeAbandonCall(const IntranodeGroup& group);
// The same in stream order on `stream` (capturable), and only if `failed` (device memory: another path's status word,
// e.g. the RDMA stage of a group across hosts in worst-case mode) records a failure when the kernel runs.
absl::Status IntranodeAbandonCallIfFailed(const IntranodeGroup& group, const KernelStatus* failed, cudaStream_t stream);

// Synchronises `stream`, reads `status` back and converts it (absl::DeadlineExceededError names the rank waited
// for). Does not clear the word; use ClearKernelStatus.
absl::Status ReadKernelStatus(const KernelStatus* status, cudaStream_t stream);
absl::Status ClearKernelStatus(KernelStatus* status, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// Layout.

struct DispatchLayoutParams {
  const int64_t* topk_idx = nullptr;  // [num_tokens, num_topk], -1 = no expert
  int num_tokens = 0;
  int num_topk = 0;
  int num_experts = 0;
  int num_ranks = 0;
  // Outputs (device memory).
  int32_t* num_tokens_per_rank = nullptr;       // [num_ranks]
  int32_t* num_tokens_per_rdma_rank = nullptr;  // optional, [ceil(num_ranks / kMaxNvlPeers)]
  int32_t* num_tokens_per_expert = nullptr;     // [num_experts]
  bool* is_token_in_rank = nullptr;             // [num_tokens, num_ranks]
  // Optional: the number of top-k entries outside [-1, num_experts) (they are treated as -1).
  int32_t* num_invalid_topk = nullptr;
};

absl::Status GetDispatchLayout(const DispatchLayoutParams& params, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// Notify: exchanges the counts, computes the rank prefix matrix and publishes what this rank will receive.

struct IntranodeNotifyParams {
  const int32_t* num_tokens_per_rank = nullptr;    // [num_ranks] (layout output)
  const int32_t* num_tokens_per_expert = nullptr;  // [num_experts] (layout output)
  int num_tokens = 0;
  int num_experts = 0;
  int expert_alignment = 1;  // each per-expert receive count is rounded up to a multiple of this
  // Outputs.
  int32_t* rank_prefix_matrix = nullptr;  // device [num_ranks][num_ranks]: [s][d] = tokens sent to d by ranks 0..s
  int32_t* recv_counts = nullptr;         // optional device [1 + experts_per_rank]: num_recv_tokens, per expert
  // Optional mapped host memory (device pointers of cudaHostAlloc(..., cudaHostAllocMapped) buffers), set by the
  // kernel; the caller sets them to -1 before the launch (IntranodeWaitRecvCounts does the waiting).
  int32_t* host_num_recv_tokens = nullptr;
  int32_t* host_num_recv_tokens_per_expert = nullptr;  // [experts_per_rank]
};

absl::Status IntranodeNotify(const IntranodeGroup& group, const IntranodeNotifyParams& params, cudaStream_t stream);

// Polls a mapped host counter until the kernel wrote it (value >= 0), up to `timeout_ns`. Host pointer form.
// Returns DataLossError when notify wrote kRecvCountBadPeerData and AbortedError for kRecvCountKernelFailed
// (status_word.h; in both cases the status word names the peer).
absl::StatusOr<int32_t> IntranodeWaitRecvCounts(const volatile int32_t* host_num_recv_tokens, uint64_t timeout_ns);

// ---------------------------------------------------------------------------------------------------------------
// Dispatch. Received order: by source rank, then by source token index (see docs/intranode-kernels.md).

// The handle: what dispatch records for combine and for cached dispatch. Device memory owned by the caller.
struct IntranodeHandle {
  int num_tokens = 0;  // tokens this rank dispatched
  // Rows received (rank_prefix_matrix[num_ranks - 1][rank]); after a worst-case dispatch, the rows its outputs have
  // (at least the rows received), which is what combine's x has.
  int num_recv_tokens = 0;
  int num_channels = 0;                    // = num_sms of the dispatch that filled it; combine uses the same
  const bool* is_token_in_rank = nullptr;  // [num_tokens, num_ranks]
  int32_t* rank_prefix_matrix = nullptr;   // [num_ranks][num_ranks]
  int32_t* recv_channel_prefix = nullptr;  // [num_ranks][num_channels]: first slot of channel c from source s
  int32_t* send_slot = nullptr;            // [num_tokens][num_ranks]: token's row among tokens sent to d, or -1
  int32_t* recv_src_idx = nullptr;         // [num_recv_tokens]: the token's index on its source rank
};

struct IntranodeDispatchParams {
  const void* x = nullptr;  // [num_tokens, hidden], BF16 or FP8 e4m3
  DType x_dtype = DType::kBF16;
  // FP8 only: [num_tokens, num_scales] 4-byte scale words, copied as they are: float scales per 128 channels, or
  // DeepEP's packed UE8M0 int32 words (4 exponents each, hidden / 512 per token) read through this pointer.
  const float* x_scales = nullptr;
  int num_scales = 0;  // FP8 only: scale words per token, 1..hidden / 128; 0 = hidden / 128
  int hidden = 0;
  const int64_t* topk_idx = nullptr;    // optional [num_tokens, num_topk]
  const float* topk_weights = nullptr;  // optional [num_tokens, num_topk] (needs topk_idx)
  int num_topk = 0;
  int num_experts = 0;
  int num_sms = 20;  // blocks = channels
  // Rows allocated in the recv tensors. Without a host wait for the count (worst-case mode) the kernel compares it
  // with the rows that arrive: a rank with too little room moves nothing and records kKernelStatusRecvCapacity.
  int recv_capacity = 0;
  // Worst-case mode: rows [received, recv_capacity) of recv_topk_idx are set to -1 and of recv_topk_weights to 0
  // (DeepEP's num_worst_tokens outputs); recv_x, recv_x_scales and recv_src_idx rows there are left as they are.
  bool pad_recv_topk = false;
  // Outputs.
  void* recv_x = nullptr;              // [recv_capacity, hidden]
  float* recv_x_scales = nullptr;      // FP8 only: [recv_capacity, num_scales], the words of x_scales
  int64_t* recv_topk_idx = nullptr;    // with topk_idx: [recv_capacity, num_topk], local expert ids or -1
  float* recv_topk_weights = nullptr;  // with topk_weights: [recv_capacity, num_topk], 0 where idx is -1
};

// The GPU kinds whose measured settings the normal-mode kernels take (sweeps on 2 x H100 and 2 x H200; every
// other GPU takes the H100 settings), and the current device's: kH200 where its memory moves 4 TB/s or more
// (found once per device).
enum class TunedGpu { kH100, kH200 };
TunedGpu CurrentTunedGpu();

// The warps of each dispatch block that copy rows (the publisher and the receivers take the rest), chosen from the
// rank count, the row size, the block count and the GPU (docs/intranode-kernels.md, "Warp roles"). Exposed for the
// benchmark's timelines.
int IntranodeDispatchCopyWarps(int num_ranks, int row_bytes, int num_sms, TunedGpu gpu);

// The bytes of each bulk copy of the combine's sender (it streams a channel's rows through four shared-memory stages
// of this size), chosen from the rank count, the channel count and the GPU (docs/intranode-kernels.md, "Combine
// chunks").
int IntranodeCombineChunkBytes(int num_ranks, int num_channels, TunedGpu gpu);

// Dispatch. `handle` must have num_tokens, is_token_in_rank and rank_prefix_matrix (from notify, or from an
// earlier dispatch for cached mode) set and its output arrays allocated; dispatch fills recv_channel_prefix,
// send_slot and recv_src_idx and sets handle->num_channels.
absl::Status IntranodeDispatch(const IntranodeGroup& group, const IntranodeDispatchParams& params,
                               IntranodeHandle* handle, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// Combine: combined_x[t] = bias_0[t] + bias_1[t] + sum over ranks d with send_slot[t][d] >= 0 of x_d[row of t on d]
// (float accumulation in a fixed rank order 0..R-1, BF16 out); combined_topk_weights[t][k] = the same sum of the
// received top-k weights.

struct IntranodeCombineParams {
  const void* x = nullptr;  // BF16 [handle.num_recv_tokens, hidden], in the received order
  int hidden = 0;
  const float* topk_weights = nullptr;  // optional [num_recv_tokens, num_topk]
  int num_topk = 0;
  const void* bias_0 = nullptr;  // optional BF16 [num_tokens, hidden]
  const void* bias_1 = nullptr;  // optional BF16 [num_tokens, hidden]
  // Outputs.
  void* combined_x = nullptr;              // BF16 [handle.num_tokens, hidden]
  float* combined_topk_weights = nullptr;  // with topk_weights: [num_tokens, num_topk]
};

absl::Status IntranodeCombine(const IntranodeGroup& group, const IntranodeCombineParams& params,
                              const IntranodeHandle& handle, cudaStream_t stream);

}  // namespace epfabric::kernels
