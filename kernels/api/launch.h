// Internal: the contract between the host-side API (kernels/api/*.cc) and the device code (kernels/cuda/*.cu): the
// parameter blocks that the kernels receive by value (as __grid_constant__), and the launch functions that the .cu
// files define and the API calls after validation. Plain C++ (no absl, no device code) so that nvcc and the host
// compiler see the same structs. Dependencies point one way: kernels/cuda includes this header, kernels/api never
// includes anything of kernels/cuda.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "epfabric/kernels/low_latency_layout.h"
#include "epfabric/kernels/status_word.h"

namespace epfabric::kernels::intranode {

// Threads per block of dispatch/combine. Dispatch splits the 32 warps at run time: warps [0, num_copy_warps) copy
// rows, warp num_copy_warps publishes their progress to the peers, the rest receive (docs/intranode-kernels.md).
inline constexpr int kThreadsPerBlock = 1024;
inline constexpr int kMaxCopyWarps = kThreadsPerBlock / 32 - 6;  // leaves the publisher and 5 receiver warps
// The combine sender's bulk-copy chunks (IntranodeCombineChunkBytes): multiples of 16 bytes, at most this.
inline constexpr int kMaxCombineChunkBytes = 24576;
inline constexpr int kLayoutThreads = 512;
inline constexpr int kNotifyThreads = 256;

// Where the group lives: all regions and the offsets of the sections (copied from IntranodeRegionLayout).
struct GroupView {
  char* regions[kMaxNvlPeers];
  int rank;
  int num_ranks;
  int max_channels;
  int experts_per_rank;
  int max_tokens_per_rank;  // bounds for the values read from peers (see docs/data-layout.md, "Untrusted values")
  int max_topk;
  KernelStatus* status;
  uint64_t timeout_ns;
  uint64_t* profile;           // null unless a benchmark asks for a timeline
  const uint64_t* lost_ranks;  // optional: ranks the daemon published as lost (status_word.h)
  uint64_t lost_ignore[kLostRankWords];
  uint64_t barrier_arrive, barrier_epoch, dispatch_range, channel_tail, notify_rank_counts, notify_expert_counts;
  uint64_t staging_x, staging_x_pool_bytes, staging_scales, staging_scales_pool_bytes, staging_topk_idx,
      staging_topk_idx_pool_bytes, staging_topk_weights, staging_topk_weights_pool_bytes, staging_src_idx,
      staging_src_idx_pool_bytes;
};

struct LayoutKernelParams {
  const int64_t* topk_idx;
  int num_tokens, num_topk, num_experts, num_ranks;
  int32_t* num_tokens_per_rank;
  int32_t* num_tokens_per_rdma_rank;
  int32_t* num_tokens_per_expert;
  bool* is_token_in_rank;
  int32_t* num_invalid_topk;
};

struct NotifyKernelParams {
  GroupView group;
  const int32_t* num_tokens_per_rank;
  const int32_t* num_tokens_per_expert;
  int expert_alignment;
  int32_t* rank_prefix_matrix;
  int32_t* recv_counts;
  int32_t* host_num_recv_tokens;
  int32_t* host_num_recv_tokens_per_expert;
};

struct DispatchKernelParams {
  GroupView group;
  const char* x;
  const float* x_scales;
  const int64_t* topk_idx;
  const float* topk_weights;
  const bool* is_token_in_rank;
  const int32_t* rank_prefix_matrix;
  int num_tokens;
  int row_bytes;   // bytes of one x row (hidden * element size); a multiple of 16
  int num_scales;  // 4-byte words per row of x_scales, float or packed UE8M0 (0 for BF16)
  int num_topk;    // 0 without topk_idx
  bool has_weights;
  int num_channels;
  int num_copy_warps;  // 1..kMaxCopyWarps, chosen by the API (IntranodeDispatchCopyWarps)
  char* recv_x;
  float* recv_x_scales;
  int64_t* recv_topk_idx;
  float* recv_topk_weights;
  int32_t* recv_src_idx;
  int32_t* recv_channel_prefix;
  int32_t* send_slot;
  int recv_capacity;   // rows of the recv tensors: a rank that receives more moves nothing (worst-case mode)
  bool pad_recv_topk;  // rows [received, recv_capacity) of recv_topk_idx get -1, of recv_topk_weights 0
};

struct CombineKernelParams {
  GroupView group;
  const char* x;  // BF16 rows in the received order
  const float* topk_weights;
  const char* bias_0;
  const char* bias_1;
  const int32_t* rank_prefix_matrix;
  const int32_t* recv_channel_prefix;
  const int32_t* send_slot;
  int num_tokens;
  int hidden;
  int num_topk;  // 0 without weights
  int num_channels;
  int send_chunk_bytes;  // 16 .. kMaxCombineChunkBytes, a multiple of 16, chosen by the API
                         // (IntranodeCombineChunkBytes)
  int x_rows;  // rows of x: a rank that received more (a worst-case dispatch that overflowed) combines nothing
  char* combined_x;
  float* combined_topk_weights;
};

cudaError_t LaunchDispatchLayout(const LayoutKernelParams& params, cudaStream_t stream);
cudaError_t LaunchNotify(const NotifyKernelParams& params, cudaStream_t stream);
cudaError_t LaunchDispatch(const DispatchKernelParams& params, cudaStream_t stream);
cudaError_t LaunchCombine(const CombineKernelParams& params, cudaStream_t stream);
// With `only_if_failed`: nothing unless that status word records a failure when the kernel runs.
cudaError_t LaunchAbandonCall(const GroupView& group, cudaStream_t stream,
                              const KernelStatus* only_if_failed = nullptr);
// Loads the layout, notify, dispatch and combine kernels on the current device (launch.cuh, preload_kernel).
cudaError_t PreloadKernels();

}  // namespace epfabric::kernels::intranode

namespace epfabric::kernels::low_latency {

// What both low-latency kernels get: where the regions are, which half and phases the call uses, how to fail.
struct GroupView {
  LowLatencyLayout layout;
  // Every rank's region by rank: in the parameters for one NVLink domain (at most kMaxNvlPeers ranks), in device
  // memory (LowLatencyContext::peer_region_table, [num_ranks]) for a wide group. `self` is this rank's own.
  uint8_t* regions[kMaxNvlPeers];
  uint8_t* const* region_table;
  uint8_t* self;
  int rank;
  int num_ranks;
  int half;
  int phases;    // LowLatencyPhases bits: 1 = send, 2 = receive, 4 = combine weights only, 8 = weights published
  uint32_t tag;  // the call's tag (LowLatencyDispatchArgs::call_tag): every signal of the call carries it
  // This rank's slots in a full half (LowLatencySourceSlots(layout, rank)): where it writes a same-host rank's half.
  LowLatencySlots own;
  // Across hosts (LowLatencyContext::remote_ranks): the ranks on other hosts; a region of such a rank r is this
  // rank's outbox for it (layout.outbox), and what r sends this rank is read from `inbox` (full halves).
  LowLatencyRankSet remote;
  uint8_t* inbox;
  int32_t* rank_mask;
  KernelStatus* status;
  uint64_t timeout_ns;
  uint64_t* profile;           // null unless a benchmark asks for a timeline
  const uint64_t* lost_ranks;  // optional: ranks the daemon published as lost (status_word.h)
  uint64_t lost_ignore[kLostRankWords];
};

struct DispatchKernelParams {
  GroupView g;
  const uint16_t* x;
  const int64_t* topk_idx;
  int num_tokens;
  int num_topk;
  bool use_fp8;  // picks the kernel instantiation
  bool round_scale;
  bool use_ue8m0;
  bool message_per_expert;
  int32_t* cumulative_stats;
  uint64_t* expert_load;
  int64_t* wait_recv_cost_ns;  // optional [num_ranks], added to
  uint8_t* packed_recv_x;
  void* packed_recv_x_scales;
  int32_t* packed_recv_count;
  int32_t* packed_recv_src_info;
  int64_t* packed_recv_layout_range;
  int32_t* packed_recv_topk_slot;
  int32_t* packed_recv_token_map;
};

struct CombineKernelParams {
  GroupView g;
  const uint16_t* x;  // the expert outputs (the zero-copy buffer when the call is zero-copy)
  const int64_t* topk_idx;
  const float* topk_weights;
  int num_tokens;
  int num_topk;
  const int32_t* token_map;
  uint16_t* combined_x;
  int64_t* wait_recv_cost_ns;  // optional [num_ranks], added to
};

// Across hosts with device-issued puts (epfabric/kernels/low_latency_remote.h): one ring as the issuer sees it.
struct RemoteRing {
  void* control;             // RingControl, device pointer of the mapped command region
  unsigned long long* next;  // device memory: the next index to reserve
  uint32_t slots;
  int channel;
};

struct RemoteIssueKernelParams {
  GroupView g;  // the region of a rank r on another host is this rank's outbox for it
  RemoteRing rings[kMaxNvlPeers];
  int num_rings;
  uint64_t rdma_offset;
  int step;  // LowLatencyRemoteStep
  int num_tokens;
  const int32_t* token_map;
};

// One cooperative grid of `num_blocks` blocks (every block must be resident: blocks wait for each other's work).
cudaError_t LaunchDispatch(const DispatchKernelParams& params, int num_blocks, cudaStream_t stream);
cudaError_t LaunchCombine(const CombineKernelParams& params, int num_blocks, cudaStream_t stream);
// One warp per rank of the group, 8 per block; the warps of ranks on other hosts issue.
cudaError_t LaunchRemoteIssue(const RemoteIssueKernelParams& params, cudaStream_t stream);
// Loads the low-latency dispatch, combine and remote-issue kernels on the current device (launch.cuh,
// preload_kernel).
cudaError_t PreloadKernels();
cudaError_t PreloadRemoteIssue();

}  // namespace epfabric::kernels::low_latency
