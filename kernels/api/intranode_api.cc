// Host side of the intranode mode: region layout, input validation (before any launch) and the launches.
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_format.h"
#include "api/intranode_checks.h"
#include "api/launch.h"
#include "api/launch_error.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/kernels/intranode.h"

namespace epfabric::kernels {
namespace {

constexpr size_t kSectionAlignment = 256;
using intranode_checks::kFp8ScaleBlock;
using intranode_checks::kMaxTopk;
constexpr intranode_checks::Backend kCuda = intranode_checks::Backend::kCuda;

size_t AlignUp(size_t bytes) { return (bytes + kSectionAlignment - 1) / kSectionAlignment * kSectionAlignment; }

intranode::GroupView MakeGroupView(const IntranodeGroup& group, const IntranodeRegionLayout& layout) {
  intranode::GroupView v{};
  for (int r = 0; r < kMaxNvlPeers; ++r) v.regions[r] = static_cast<char*>(group.peer_regions[r]);
  v.rank = group.rank;
  v.num_ranks = group.config.num_ranks;
  v.max_channels = group.config.max_channels;
  v.experts_per_rank = group.config.num_experts / group.config.num_ranks;
  v.max_tokens_per_rank = group.config.max_tokens_per_rank;
  v.max_topk = group.config.max_topk;
  v.status = group.status;
  v.timeout_ns = group.timeout_ns;
  v.profile = group.profile_ns;
  v.lost_ranks = group.lost_ranks;
  for (int i = 0; i < kLostRankWords; ++i) v.lost_ignore[i] = group.lost_ignore[i];
  v.barrier_arrive = layout.barrier_arrive;
  v.barrier_epoch = layout.barrier_epoch;
  v.dispatch_range = layout.dispatch_range;
  v.channel_tail = layout.channel_tail;
  v.notify_rank_counts = layout.notify_rank_counts;
  v.notify_expert_counts = layout.notify_expert_counts;
  v.staging_x = layout.staging_x;
  v.staging_x_pool_bytes = layout.staging_x_pool_bytes;
  v.staging_scales = layout.staging_scales;
  v.staging_scales_pool_bytes = layout.staging_scales_pool_bytes;
  v.staging_topk_idx = layout.staging_topk_idx;
  v.staging_topk_idx_pool_bytes = layout.staging_topk_idx_pool_bytes;
  v.staging_topk_weights = layout.staging_topk_weights;
  v.staging_topk_weights_pool_bytes = layout.staging_topk_weights_pool_bytes;
  v.staging_src_idx = layout.staging_src_idx;
  v.staging_src_idx_pool_bytes = layout.staging_src_idx_pool_bytes;
  return v;
}

}  // namespace

absl::StatusOr<IntranodeRegionLayout> ComputeIntranodeRegionLayout(const IntranodeRegionConfig& c) {
  if (c.num_ranks < 1 || c.num_ranks > kMaxNvlPeers) {
    return InvalidValue("config.num_ranks", c.num_ranks, "must be in [1, 8]");
  }
  if (c.max_tokens_per_rank < 1)
    return InvalidValue("config.max_tokens_per_rank", c.max_tokens_per_rank, "must be >= 1");
  if (c.max_hidden < 8 || c.max_hidden % 8 != 0) {
    return InvalidValue("config.max_hidden", c.max_hidden, "must be a positive multiple of 8");
  }
  if (c.max_topk < 0 || c.max_topk > kMaxTopk) return InvalidValue("config.max_topk", c.max_topk, "must be in [0, 32]");
  if (c.num_experts < c.num_ranks || c.num_experts % c.num_ranks != 0) {
    return InvalidValue("config.num_experts", c.num_experts, "must be a positive multiple of num_ranks");
  }
  if (c.max_channels < 1 || c.max_channels > 1024) {
    return InvalidValue("config.max_channels", c.max_channels, "must be in [1, 1024]");
  }
  const size_t ranks = c.num_ranks, channels = c.max_channels, tokens = c.max_tokens_per_rank;
  const size_t experts_per_rank = c.num_experts / c.num_ranks;
  IntranodeRegionLayout l;
  size_t offset = 0;
  auto carve = [&offset](size_t bytes) {
    const size_t at = offset;
    offset += AlignUp(bytes);
    return at;
  };
  l.barrier_arrive = carve(channels * ranks * sizeof(int32_t));
  l.barrier_epoch = carve(channels * sizeof(int32_t));
  l.dispatch_range = carve(ranks * channels * sizeof(int64_t));
  l.channel_tail = carve(ranks * channels * sizeof(int32_t));
  l.notify_rank_counts = carve(ranks * ranks * sizeof(int32_t));
  l.notify_expert_counts = carve(ranks * experts_per_rank * sizeof(int32_t));
  l.signal_bytes = offset;
  auto carve_pools = [&](size_t pool_bytes, size_t* pool) {
    *pool = AlignUp(pool_bytes);
    return carve(*pool * ranks);
  };
  const size_t max_scales = (c.max_hidden + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  l.staging_x = carve_pools(tokens * c.max_hidden * 2, &l.staging_x_pool_bytes);
  l.staging_scales = carve_pools(tokens * max_scales * sizeof(float), &l.staging_scales_pool_bytes);
  l.staging_topk_idx = carve_pools(tokens * c.max_topk * sizeof(int64_t), &l.staging_topk_idx_pool_bytes);
  l.staging_topk_weights = carve_pools(tokens * c.max_topk * sizeof(float), &l.staging_topk_weights_pool_bytes);
  l.staging_src_idx = carve_pools(tokens * sizeof(int32_t), &l.staging_src_idx_pool_bytes);
  l.total_bytes = offset;
  return l;
}

absl::StatusOr<size_t> IntranodeRegionBytes(const IntranodeRegionConfig& config) {
  EPF_ASSIGN_OR_RETURN(const IntranodeRegionLayout layout, ComputeIntranodeRegionLayout(config));
  return layout.total_bytes;
}

int64_t IntranodeWorstCaseRecvTokens(const IntranodeRegionConfig& config) {
  return static_cast<int64_t>(config.num_ranks) * config.max_tokens_per_rank;
}

absl::Status IntranodePreloadKernels() {
  return LaunchError(intranode::PreloadKernels(), "loading the intranode kernels");
}

absl::Status IntranodeResetRegion(const IntranodeGroup& group, cudaStream_t stream) {
  EPF_ASSIGN_OR_RETURN(const IntranodeRegionLayout layout, intranode_checks::CheckGroup(group, kCuda));
  EPF_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(group.peer_regions[group.rank], 0, layout.signal_bytes, stream));
  return absl::OkStatus();
}

absl::Status IntranodeAbandonCall(const IntranodeGroup& group) {
  EPF_ASSIGN_OR_RETURN(const IntranodeRegionLayout layout, intranode_checks::CheckGroup(group, kCuda));
  // A private stream: the caller's may hold work of the failed call that waits for peers.
  cudaStream_t stream = nullptr;
  EPF_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  absl::Status launched = LaunchError(intranode::LaunchAbandonCall(MakeGroupView(group, layout), stream),
                                      "marking this rank's departure from the call");
  const cudaError_t synced = cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  EPF_RETURN_IF_ERROR(launched);
  EPF_CUDA_RETURN_IF_ERROR(synced);
  return absl::OkStatus();
}

absl::Status IntranodeAbandonCallIfFailed(const IntranodeGroup& group, const KernelStatus* failed,
                                          cudaStream_t stream) {
  EPF_ASSIGN_OR_RETURN(const IntranodeRegionLayout layout, intranode_checks::CheckGroup(group, kCuda));
  if (failed == nullptr) return MissingPointer("failed", "always");
  return LaunchError(intranode::LaunchAbandonCall(MakeGroupView(group, layout), stream, failed),
                     "marking this rank's departure from the call");
}

absl::Status ReadKernelStatus(const KernelStatus* status, cudaStream_t stream) {
  if (status == nullptr) return MissingPointer("status", "to read it");
  // On the caller's stream, not the legacy default stream, which would also wait for the other streams' work (a
  // peer rank's kernel in this process may be waiting for this rank).
  KernelStatus host{};
  EPF_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&host, status, sizeof(host), cudaMemcpyDefault, stream));
  EPF_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return KernelStatusToStatus(host);
}

absl::Status ClearKernelStatus(KernelStatus* status, cudaStream_t stream) {
  if (status == nullptr) return MissingPointer("status", "to clear it");
  EPF_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(status, 0, sizeof(KernelStatus), stream));
  return absl::OkStatus();
}

absl::Status GetDispatchLayout(const DispatchLayoutParams& p, cudaStream_t stream) {
  EPF_RETURN_IF_ERROR(intranode_checks::CheckLayout(p));
  intranode::LayoutKernelParams k{p.topk_idx,
                                  p.num_tokens,
                                  p.num_topk,
                                  p.num_experts,
                                  p.num_ranks,
                                  p.num_tokens_per_rank,
                                  p.num_tokens_per_rdma_rank,
                                  p.num_tokens_per_expert,
                                  p.is_token_in_rank,
                                  p.num_invalid_topk};
  return LaunchError(intranode::LaunchDispatchLayout(k, stream), "dispatch layout launch");
}

absl::Status IntranodeNotify(const IntranodeGroup& group, const IntranodeNotifyParams& p, cudaStream_t stream) {
  EPF_ASSIGN_OR_RETURN(const IntranodeRegionLayout layout, intranode_checks::CheckGroup(group, kCuda));
  EPF_RETURN_IF_ERROR(intranode_checks::CheckNotify(group, p));
  intranode::NotifyKernelParams k{};
  k.group = MakeGroupView(group, layout);
  k.num_tokens_per_rank = p.num_tokens_per_rank;
  k.num_tokens_per_expert = p.num_tokens_per_expert;
  k.expert_alignment = p.expert_alignment;
  k.rank_prefix_matrix = p.rank_prefix_matrix;
  k.recv_counts = p.recv_counts;
  k.host_num_recv_tokens = p.host_num_recv_tokens;
  k.host_num_recv_tokens_per_expert = p.host_num_recv_tokens_per_expert;
  return LaunchError(intranode::LaunchNotify(k, stream), "notify launch");
}

absl::StatusOr<int32_t> IntranodeWaitRecvCounts(const volatile int32_t* host_num_recv_tokens, uint64_t timeout_ns) {
  if (host_num_recv_tokens == nullptr) return MissingPointer("host_num_recv_tokens", "to wait on it");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(timeout_ns);
  while (true) {
    const int32_t value = *host_num_recv_tokens;
    if (value >= 0) return value;
    if (value == kRecvCountBadPeerData) {
      return absl::DataLossError("notify read a bad count from a peer (stale or corrupt peer data)");
    }
    if (value == kRecvCountKernelFailed) {
      return absl::AbortedError("notify stopped at its barrier (the kernel status names the peer)");
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError("notify did not publish the received token count in time");
    }
    std::this_thread::yield();
  }
}

absl::Status IntranodeDispatch(const IntranodeGroup& group, const IntranodeDispatchParams& p, IntranodeHandle* handle,
                               cudaStream_t stream) {
  EPF_ASSIGN_OR_RETURN(const IntranodeRegionLayout layout, intranode_checks::CheckGroup(group, kCuda));
  EPF_RETURN_IF_ERROR(intranode_checks::CheckDispatch(group, p, handle, kCuda));
  const IntranodeHandle& h = *handle;
  const bool fp8 = p.x_dtype == DType::kFP8E4M3;
  intranode::DispatchKernelParams k{};
  k.group = MakeGroupView(group, layout);
  k.x = static_cast<const char*>(p.x);
  k.x_scales = p.x_scales;
  k.topk_idx = p.topk_idx;
  k.topk_weights = p.topk_weights;
  k.is_token_in_rank = h.is_token_in_rank;
  k.rank_prefix_matrix = h.rank_prefix_matrix;
  k.num_tokens = h.num_tokens;
  k.row_bytes = fp8 ? p.hidden : p.hidden * 2;
  k.num_scales = !fp8 ? 0 : p.num_scales > 0 ? p.num_scales : p.hidden / kFp8ScaleBlock;
  k.num_topk = p.topk_idx != nullptr ? p.num_topk : 0;
  k.has_weights = p.topk_weights != nullptr;
  k.num_channels = p.num_sms;
  k.num_copy_warps = IntranodeDispatchCopyWarps(group.config.num_ranks, k.row_bytes, p.num_sms, CurrentTunedGpu());
  k.recv_x = static_cast<char*>(p.recv_x);
  k.recv_x_scales = p.recv_x_scales;
  k.recv_topk_idx = p.recv_topk_idx;
  k.recv_topk_weights = p.recv_topk_weights;
  k.recv_src_idx = h.recv_src_idx;
  k.recv_channel_prefix = h.recv_channel_prefix;
  k.send_slot = h.send_slot;
  k.recv_capacity = p.recv_capacity;
  k.pad_recv_topk = p.pad_recv_topk && p.recv_topk_idx != nullptr;
  handle->num_channels = p.num_sms;
  return LaunchError(intranode::LaunchDispatch(k, stream), "dispatch launch");
}

absl::Status IntranodeCombine(const IntranodeGroup& group, const IntranodeCombineParams& p, const IntranodeHandle& h,
                              cudaStream_t stream) {
  EPF_ASSIGN_OR_RETURN(const IntranodeRegionLayout layout, intranode_checks::CheckGroup(group, kCuda));
  EPF_RETURN_IF_ERROR(intranode_checks::CheckCombine(group, p, h, kCuda));
  intranode::CombineKernelParams k{};
  k.group = MakeGroupView(group, layout);
  k.x = static_cast<const char*>(p.x);
  k.topk_weights = p.topk_weights;
  k.bias_0 = static_cast<const char*>(p.bias_0);
  k.bias_1 = static_cast<const char*>(p.bias_1);
  k.rank_prefix_matrix = h.rank_prefix_matrix;
  k.recv_channel_prefix = h.recv_channel_prefix;
  k.send_slot = h.send_slot;
  k.num_tokens = h.num_tokens;
  k.hidden = p.hidden;
  k.num_topk = p.topk_weights != nullptr ? p.num_topk : 0;
  k.num_channels = h.num_channels;
  k.send_chunk_bytes = IntranodeCombineChunkBytes(group.config.num_ranks, h.num_channels, CurrentTunedGpu());
  k.x_rows = h.num_recv_tokens;
  k.combined_x = static_cast<char*>(p.combined_x);
  k.combined_topk_weights = p.combined_topk_weights;
  return LaunchError(intranode::LaunchCombine(k, stream), "combine launch");
}

}  // namespace epfabric::kernels
