// The kernel path's shared part (kernel_path.h): normal mode's calls over the backend's launches, and the kernels'
// views of the group.
#include "data_path/kernel_path.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "data_path/lost_ranks.h"
#include "epfabric/common/status_macros.h"
#include "tensor/tensors.h"

namespace epfabric::client::internal {
namespace {

using kernels::DType;

// The counts notify derived from the peers' counts size the outputs: the kernels check every peer's count, and the
// results are checked once more here before anything is allocated (a value outside these bounds cannot come from a
// correct group).
absl::Status CheckRecvCounts(int64_t num_recv, const std::vector<int32_t>& per_expert, int num_ranks,
                             const BufferConfig& c, int expert_alignment) {
  const int64_t max_recv = static_cast<int64_t>(num_ranks) * c.max_tokens_per_rank;
  if (num_recv < 0 || num_recv > max_recv) {
    return absl::DataLossError(absl::StrFormat(
        "notify returned num_recv_tokens = %d: outside [0, %d] (num_ranks * max_tokens_per_rank): stale or corrupt "
        "peer data",
        num_recv, max_recv));
  }
  const int64_t max_entries = max_recv * std::max(c.max_topk, 1);
  const int64_t max_per_expert = (max_entries + expert_alignment - 1) / expert_alignment * expert_alignment;
  for (size_t e = 0; e < per_expert.size(); ++e) {
    if (per_expert[e] < 0 || per_expert[e] > max_per_expert) {
      return absl::DataLossError(absl::StrFormat(
          "notify returned num_recv_tokens_per_expert[%d] = %d: outside [0, %d]: stale or corrupt peer data", e,
          per_expert[e], max_per_expert));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<KernelPath>> KernelPath::Create(Backend backend, const KernelPathConfig& config,
                                                               const ReachAcrossHosts& reach) {
  return backend == Backend::kCuda ? NewCudaPath(config, reach) : NewHostPath(config, reach);
}

absl::StatusOr<Tensor> KernelPath::NewTensor(DType dtype, std::vector<int64_t> shape, cudaStream_t stream) {
  return internal::NewTensor(config_.allocator, dtype, std::move(shape), stream);
}

absl::StatusOr<DispatchLayout> KernelPath::LayoutOver(const TensorView& topk_idx, int num_ranks, int num_experts,
                                                      cudaStream_t stream) {
  const int64_t num_tokens = topk_idx.shape[0], num_topk = topk_idx.shape[1];
  DispatchLayout layout;
  EPF_ASSIGN_OR_RETURN(layout.num_tokens_per_rank, NewTensor(DType::kInt32, {num_ranks}, stream));
  EPF_ASSIGN_OR_RETURN(layout.num_tokens_per_expert, NewTensor(DType::kInt32, {num_experts}, stream));
  EPF_ASSIGN_OR_RETURN(layout.is_token_in_rank, NewTensor(DType::kBool, {num_tokens, num_ranks}, stream));
  kernels::DispatchLayoutParams p;
  p.topk_idx = static_cast<const int64_t*>(topk_idx.data);
  p.num_tokens = static_cast<int>(num_tokens);
  p.num_topk = static_cast<int>(num_topk);
  p.num_experts = num_experts;
  p.num_ranks = num_ranks;
  p.num_tokens_per_rank = static_cast<int32_t*>(layout.num_tokens_per_rank.view.data);
  p.num_tokens_per_expert = static_cast<int32_t*>(layout.num_tokens_per_expert.view.data);
  p.is_token_in_rank = static_cast<bool*>(layout.is_token_in_rank.view.data);
  EPF_RETURN_IF_ERROR(LaunchLayout(p, &layout, stream));
  return layout;
}

absl::StatusOr<DispatchResult> KernelPath::Dispatch(const DispatchArgs& args, cudaStream_t stream) {
  const BufferConfig& c = config_.config;
  const int num_ranks = config_.num_ranks;
  EPF_RETURN_IF_ERROR(CheckLayoutIndices(args, c.num_experts, stream));
  const TensorView& x = args.x;
  const bool fp8 = x.dtype == DType::kFP8E4M3;
  const int64_t num_tokens = x.shape[0], hidden = x.shape[1];
  // Scale words per token: float per 128 channels, or DeepEP's packed UE8M0 int32 (4 exponents of 128 channels each).
  const int64_t num_scales = !fp8 ? 0 : args.x_scales.dtype == DType::kInt32 ? hidden / 512 : hidden / 128;
  const int64_t num_topk = args.topk_idx.empty() ? 0 : args.topk_idx.shape[1];
  const bool worst_case = args.num_worst_tokens > 0;
  const bool cached = args.cached != nullptr;

  // ---- notify (unless cached): exchange the counts and learn how many rows arrive ----
  auto handle = std::make_shared<DispatchHandle>();
  handle->num_tokens = static_cast<int>(num_tokens);
  handle->hidden = static_cast<int>(hidden);
  DispatchResult result;
  if (cached) {
    handle->is_token_in_rank = args.cached->is_token_in_rank;
    handle->rank_prefix_matrix = args.cached->rank_prefix_matrix;
    handle->num_recv_tokens = worst_case ? args.num_worst_tokens : args.cached->num_recv_tokens;
    handle->worst_case = worst_case || args.cached->worst_case;
  } else {
    handle->is_token_in_rank = args.layout->is_token_in_rank;
    EPF_ASSIGN_OR_RETURN(handle->rank_prefix_matrix, NewTensor(DType::kInt32, {num_ranks, num_ranks}, stream));
    kernels::IntranodeNotifyParams np;
    np.num_tokens_per_rank = static_cast<const int32_t*>(args.layout->num_tokens_per_rank.view.data);
    np.num_tokens_per_expert = static_cast<const int32_t*>(args.layout->num_tokens_per_expert.view.data);
    np.num_tokens = static_cast<int>(num_tokens);
    np.num_experts = c.num_experts;
    np.expert_alignment = args.expert_alignment;
    np.rank_prefix_matrix = static_cast<int32_t*>(handle->rank_prefix_matrix.view.data);
    if (worst_case) {
      // No wait: the dispatch kernel reads the count from the prefix matrix and checks it against the rows.
      EPF_RETURN_IF_ERROR(NotifyNoWait(np, stream));
      handle->num_recv_tokens = args.num_worst_tokens;
      handle->worst_case = true;
    } else {
      EPF_ASSIGN_OR_RETURN(handle->num_recv_tokens, Notify(np, &result.num_recv_tokens_per_expert, stream));
      EPF_RETURN_IF_ERROR(CheckRecvCounts(handle->num_recv_tokens, result.num_recv_tokens_per_expert, num_ranks, c,
                                          args.expert_alignment));
    }
  }
  const int64_t num_recv = handle->num_recv_tokens;

  // ---- outputs ----
  EPF_ASSIGN_OR_RETURN(result.recv_x, NewTensor(x.dtype, {num_recv, hidden}, stream));
  if (fp8) {
    EPF_ASSIGN_OR_RETURN(result.recv_x_scales, NewTensor(args.x_scales.dtype, {num_recv, num_scales}, stream));
  }
  if (num_topk > 0) {
    EPF_ASSIGN_OR_RETURN(result.recv_topk_idx, NewTensor(DType::kInt64, {num_recv, num_topk}, stream));
    if (!args.topk_weights.empty()) {
      EPF_ASSIGN_OR_RETURN(result.recv_topk_weights, NewTensor(DType::kFloat32, {num_recv, num_topk}, stream));
    }
  }
  // The handle's own tensors (the prefix matrix came with notify) in one allocation.
  EPF_ASSIGN_OR_RETURN(std::vector<Tensor> own, NewTensors(config_.allocator,
                                                           {{DType::kInt32, {num_ranks, c.num_sms}},
                                                            {DType::kInt32, {num_tokens, num_ranks}},
                                                            {DType::kInt32, {num_recv}}},
                                                           stream));
  handle->recv_channel_prefix = std::move(own[0]);
  handle->send_slot = std::move(own[1]);
  handle->recv_src_idx = std::move(own[2]);

  kernels::IntranodeHandle& raw = handle->raw;
  raw.num_tokens = handle->num_tokens;
  raw.num_recv_tokens = handle->num_recv_tokens;
  raw.is_token_in_rank = static_cast<const bool*>(handle->is_token_in_rank.view.data);
  raw.rank_prefix_matrix = static_cast<int32_t*>(handle->rank_prefix_matrix.view.data);
  raw.recv_channel_prefix = static_cast<int32_t*>(handle->recv_channel_prefix.view.data);
  raw.send_slot = static_cast<int32_t*>(handle->send_slot.view.data);
  raw.recv_src_idx = static_cast<int32_t*>(handle->recv_src_idx.view.data);

  kernels::IntranodeDispatchParams dp;
  dp.x = GivenPointer<void>(x);
  dp.x_dtype = x.dtype;
  dp.x_scales = fp8 ? GivenPointer<float>(args.x_scales) : nullptr;  // the words, float or int32
  dp.num_scales = static_cast<int>(num_scales);
  dp.hidden = static_cast<int>(hidden);
  dp.topk_idx = GivenPointer<int64_t>(args.topk_idx);
  dp.topk_weights = GivenPointer<float>(args.topk_weights);
  dp.num_topk = static_cast<int>(num_topk);
  dp.num_experts = c.num_experts;
  dp.num_sms = c.num_sms;
  dp.recv_capacity = static_cast<int>(num_recv);
  dp.recv_x = result.recv_x.view.data;
  dp.recv_x_scales = fp8 ? static_cast<float*>(result.recv_x_scales.view.data) : nullptr;
  dp.recv_topk_idx = num_topk > 0 ? static_cast<int64_t*>(result.recv_topk_idx.view.data) : nullptr;
  dp.recv_topk_weights = !args.topk_weights.empty() ? static_cast<float*>(result.recv_topk_weights.view.data) : nullptr;
  dp.pad_recv_topk = handle->worst_case;
  EPF_RETURN_IF_ERROR(LaunchDispatch(dp, &raw, stream));
  result.handle = std::move(handle);
  return result;
}

absl::StatusOr<CombineResult> KernelPath::Combine(const CombineArgs& args, cudaStream_t stream) {
  const DispatchHandle& h = *args.handle;
  const int64_t hidden = args.x.shape[1];
  const int64_t num_topk = args.topk_weights.empty() ? 0 : args.topk_weights.shape[1];
  CombineResult result;
  EPF_ASSIGN_OR_RETURN(result.combined_x, NewTensor(DType::kBF16, {h.num_tokens, hidden}, stream));
  if (num_topk > 0) {
    EPF_ASSIGN_OR_RETURN(result.combined_topk_weights, NewTensor(DType::kFloat32, {h.num_tokens, num_topk}, stream));
  }
  kernels::IntranodeCombineParams cp;
  cp.x = GivenPointer<void>(args.x);
  cp.hidden = static_cast<int>(hidden);
  cp.topk_weights = GivenPointer<float>(args.topk_weights);
  cp.num_topk = static_cast<int>(num_topk);
  cp.bias_0 = GivenPointer<void>(args.bias_0);
  cp.bias_1 = GivenPointer<void>(args.bias_1);
  cp.combined_x = result.combined_x.view.data;
  cp.combined_topk_weights = num_topk > 0 ? static_cast<float*>(result.combined_topk_weights.view.data) : nullptr;
  EPF_RETURN_IF_ERROR(LaunchCombine(cp, h.raw, stream));
  return result;
}

kernels::IntranodeGroup MakeIntranodeGroup(const KernelPathConfig& c, kernels::KernelStatus* status) {
  kernels::IntranodeGroup group;
  group.config = {.num_ranks = c.num_ranks,
                  .max_tokens_per_rank = c.config.max_tokens_per_rank,
                  .max_hidden = c.config.hidden,
                  .max_topk = c.config.max_topk,
                  .num_experts = c.config.num_experts,
                  .max_channels = c.config.num_sms};
  group.rank = c.rank;
  for (int r = 0; r < c.num_ranks; ++r) group.peer_regions[r] = c.peer_regions[r];
  group.status = status;
  group.lost_ranks = c.lost_ranks;
  InitLostIgnore(c.lost_ranks_host, group.lost_ignore);
  group.timeout_ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(c.config.timeout));
  return group;
}

absl::StatusOr<kernels::LowLatencyContext> MakeLowLatencyContext(const KernelPathConfig& c,
                                                                 kernels::KernelStatus* status, int32_t* rank_mask,
                                                                 const ReachAcrossHosts& reach) {
  kernels::LowLatencyContext ll;
  EPF_ASSIGN_OR_RETURN(ll.layout, kernels::MakeLowLatencyLayout(c.config.max_tokens_per_rank, c.config.hidden,
                                                                c.num_ranks, c.config.num_experts));
  ll.rank = c.rank;
  ll.num_ranks = c.num_ranks;
  for (int r = 0; r < c.num_ranks; ++r) ll.peer_regions[r] = c.peer_regions[r];
  // Without enable_shrink the kernels mask nothing: a lost or silent peer fails the call (may_signal).
  ll.rank_mask = c.config.enable_shrink ? rank_mask : nullptr;
  ll.lost_ranks = c.lost_ranks;
  InitLostIgnore(c.lost_ranks_host, ll.lost_ignore);
  ll.status = status;
  ll.timeout_ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(c.config.timeout));
  ll.num_blocks = c.config.low_latency_sms;
  if (reach != nullptr) reach(&ll);
  return ll;
}

}  // namespace epfabric::client::internal
