// Normal mode of the Buffer: layout, dispatch (also cached) and combine. Each call checks its tensors (dtype, shape,
// and the kernels' rules on sizes, named after the tensors) before anything runs, allocates the outputs and hands
// params structs to the data path.
#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "buffer_internal.h"
#include "epfabric/client/buffer.h"
#include "epfabric/common/status_macros.h"

namespace epfabric::client {
namespace {

using internal::ExpectShape;
using internal::ExpectTensor;
using internal::GivenPointer;
using kernels::DType;

// The layout's tensors, as dispatch expects them.
absl::Status CheckLayout(const DispatchLayout& l, int64_t num_tokens, int num_ranks, int num_experts) {
  EPF_RETURN_IF_ERROR(ExpectTensor(l.num_tokens_per_rank.view, "layout.num_tokens_per_rank", DType::kInt32, {num_ranks},
                                   "[num_ranks]"));
  EPF_RETURN_IF_ERROR(ExpectTensor(l.num_tokens_per_expert.view, "layout.num_tokens_per_expert", DType::kInt32,
                                   {num_experts}, "[num_experts]"));
  return ExpectTensor(l.is_token_in_rank.view, "layout.is_token_in_rank", DType::kBool, {num_tokens, num_ranks},
                      "[num_tokens, num_ranks]");
}

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

absl::StatusOr<DispatchLayout> Buffer::GetDispatchLayout(const TensorView& topk_idx, cudaStream_t stream) {
  State& s = *state_;
  EPF_RETURN_IF_ERROR(s.RequireMode(false, "GetDispatchLayout"));
  EPF_RETURN_IF_ERROR(ExpectTensor(topk_idx, "topk_idx", DType::kInt64, {-1, -1}, "[num_tokens, num_topk]"));
  const int64_t num_tokens = topk_idx.shape[0], num_topk = topk_idx.shape[1];
  EPF_RETURN_IF_ERROR(
      kernels::CheckNumTokens("topk_idx.shape[0] (num_tokens)", num_tokens, s.config.max_tokens_per_rank));
  EPF_RETURN_IF_ERROR(kernels::CheckNumTopk("topk_idx.shape[1] (num_topk)", num_topk, s.config.max_topk));
  EPF_RETURN_IF_ERROR(s.path->CheckExpertIndices(topk_idx));
  EPF_RETURN_IF_ERROR(s.Usable());  // local: no generation needed

  DispatchLayout layout;
  EPF_ASSIGN_OR_RETURN(layout.num_tokens_per_rank, s.NewTensor(DType::kInt32, {s.num_ranks}, stream));
  EPF_ASSIGN_OR_RETURN(layout.num_tokens_per_expert, s.NewTensor(DType::kInt32, {s.config.num_experts}, stream));
  EPF_ASSIGN_OR_RETURN(layout.is_token_in_rank, s.NewTensor(DType::kBool, {num_tokens, s.num_ranks}, stream));
  kernels::DispatchLayoutParams p;
  p.topk_idx = static_cast<const int64_t*>(topk_idx.data);
  p.num_tokens = static_cast<int>(num_tokens);
  p.num_topk = static_cast<int>(num_topk);
  p.num_experts = s.config.num_experts;
  p.num_ranks = s.num_ranks;
  p.num_tokens_per_rank = static_cast<int32_t*>(layout.num_tokens_per_rank.view.data);
  p.num_tokens_per_expert = static_cast<int32_t*>(layout.num_tokens_per_expert.view.data);
  p.is_token_in_rank = static_cast<bool*>(layout.is_token_in_rank.view.data);
  EPF_RETURN_IF_ERROR(s.path->Layout(p, &layout, stream));
  return layout;
}

absl::StatusOr<DispatchResult> Buffer::Dispatch(const DispatchArgs& args, cudaStream_t stream) {
  absl::StatusOr<DispatchResult> result = DispatchUncounted(args, stream);
  if (internal::DataPathRecorder* stats = state_->stats.get(); stats != nullptr) {
    stats->Call(kernels::kOpDispatch, result.status());
    if (result.ok()) {
      const int64_t rows = args.x.shape.empty() ? 0 : args.x.shape[0];
      stats->Sent(rows, static_cast<int64_t>(args.x.bytes()));
      // A worst-case dispatch does not know what it received (that would need the wait it exists to avoid).
      if (!result->handle->worst_case) {
        stats->Received(result->handle->num_recv_tokens, static_cast<int64_t>(result->recv_x.view.bytes()));
        stats->AddExpertCounts(result->num_recv_tokens_per_expert);
      }
    }
  }
  return result;
}

absl::StatusOr<DispatchResult> Buffer::DispatchUncounted(const DispatchArgs& args, cudaStream_t stream) {
  State& s = *state_;
  const BufferConfig& c = s.config;
  EPF_RETURN_IF_ERROR(s.RequireMode(false, "Dispatch"));
  // ---- validation: nothing is launched before all of it passed ----
  const TensorView& x = args.x;
  EPF_RETURN_IF_ERROR(kernels::CheckDispatchDType("x.dtype", x.dtype));
  const bool fp8 = x.dtype == DType::kFP8E4M3;
  EPF_RETURN_IF_ERROR(ExpectShape(x, "x", {-1, -1}, "[num_tokens, hidden]"));
  const int64_t num_tokens = x.shape[0], hidden = x.shape[1];
  EPF_RETURN_IF_ERROR(kernels::CheckNumTokens("x.shape[0] (num_tokens)", num_tokens, c.max_tokens_per_rank));
  EPF_RETURN_IF_ERROR(kernels::CheckDispatchHidden("x.shape[1] (hidden)", hidden, x.dtype, c.hidden));
  // Scale words per token: float per 128 channels, or DeepEP's packed UE8M0 int32 (4 exponents of 128 channels each).
  int64_t num_scales = 0;
  if (fp8) {
    if (args.x_scales.empty()) return absl::InvalidArgumentError("x_scales is not given: required for fp8_e4m3 x");
    if (args.x_scales.dtype == DType::kInt32) {
      if (hidden % 512 != 0) {
        return kernels::InvalidValue("x.shape[1] (hidden)", hidden,
                                     "must be a multiple of 512 with int32 (packed UE8M0) x_scales");
      }
      num_scales = hidden / 512;
      EPF_RETURN_IF_ERROR(
          ExpectShape(args.x_scales, "x_scales", {num_tokens, num_scales}, "[num_tokens, hidden / 512], int32"));
    } else {
      if (args.x_scales.dtype != DType::kFloat32) {
        return absl::InvalidArgumentError(
            absl::StrCat("x_scales.dtype = ", kernels::DTypeName(args.x_scales.dtype),
                         ": expected float32 [num_tokens, hidden / 128] or int32 (packed UE8M0) [num_tokens, "
                         "hidden / 512]"));
      }
      num_scales = hidden / 128;
      EPF_RETURN_IF_ERROR(
          ExpectShape(args.x_scales, "x_scales", {num_tokens, num_scales}, "[num_tokens, hidden / 128]"));
    }
  } else if (!args.x_scales.empty()) {
    return absl::InvalidArgumentError("x_scales is given for bf16 x: only fp8_e4m3 x has scales");
  }
  int64_t num_topk = 0;
  if (!args.topk_idx.empty()) {
    EPF_RETURN_IF_ERROR(
        ExpectTensor(args.topk_idx, "topk_idx", DType::kInt64, {num_tokens, -1}, "[num_tokens, num_topk]"));
    num_topk = args.topk_idx.shape[1];
    EPF_RETURN_IF_ERROR(kernels::CheckNumTopk("topk_idx.shape[1] (num_topk)", num_topk, c.max_topk));
  }
  if (!args.topk_weights.empty()) {
    if (args.topk_idx.empty()) return absl::InvalidArgumentError("topk_weights is given without topk_idx");
    EPF_RETURN_IF_ERROR(ExpectTensor(args.topk_weights, "topk_weights", DType::kFloat32, {num_tokens, num_topk},
                                     "[num_tokens, num_topk], as topk_idx"));
  }
  if (args.expert_alignment < 1) {
    return kernels::InvalidValue("expert_alignment", args.expert_alignment, "must be >= 1");
  }
  if (args.num_worst_tokens < 0) {
    return kernels::InvalidValue("num_worst_tokens", args.num_worst_tokens, "must be >= 0 (0: wait for the count)");
  }
  const bool worst_case = args.num_worst_tokens > 0;
  const bool cached = args.cached != nullptr;
  if (cached) {
    if (args.cached->num_tokens != num_tokens) {
      return kernels::InvalidValue(
          "x.shape[0] (num_tokens)", num_tokens,
          absl::StrCat("must equal the cached handle's num_tokens = ", args.cached->num_tokens));
    }
    if (worst_case && !args.cached->worst_case && args.num_worst_tokens < args.cached->num_recv_tokens) {
      return kernels::InvalidValue(
          "num_worst_tokens", args.num_worst_tokens,
          absl::StrCat("is less than the cached handle's num_recv_tokens = ", args.cached->num_recv_tokens));
    }
  } else {
    if (args.layout == nullptr) return absl::InvalidArgumentError("layout is null: required unless cached");
    EPF_RETURN_IF_ERROR(CheckLayout(*args.layout, num_tokens, s.num_ranks, c.num_experts));
  }
  EPF_RETURN_IF_ERROR(s.UsableForNormal());
  EPF_RETURN_IF_ERROR(s.path->CheckDispatchExpertIndices(args, stream));
  if (s.internode != nullptr) return s.internode->Dispatch(args, stream);

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
    EPF_ASSIGN_OR_RETURN(handle->rank_prefix_matrix, s.NewTensor(DType::kInt32, {s.num_ranks, s.num_ranks}, stream));
    kernels::IntranodeNotifyParams np;
    np.num_tokens_per_rank = static_cast<const int32_t*>(args.layout->num_tokens_per_rank.view.data);
    np.num_tokens_per_expert = static_cast<const int32_t*>(args.layout->num_tokens_per_expert.view.data);
    np.num_tokens = static_cast<int>(num_tokens);
    np.num_experts = c.num_experts;
    np.expert_alignment = args.expert_alignment;
    np.rank_prefix_matrix = static_cast<int32_t*>(handle->rank_prefix_matrix.view.data);
    if (worst_case) {
      // No wait: the dispatch kernel reads the count from the prefix matrix and checks it against the rows.
      EPF_RETURN_IF_ERROR(s.path->NotifyNoWait(np, stream));
      handle->num_recv_tokens = args.num_worst_tokens;
      handle->worst_case = true;
    } else {
      EPF_ASSIGN_OR_RETURN(handle->num_recv_tokens, s.path->Notify(np, &result.num_recv_tokens_per_expert, stream));
      EPF_RETURN_IF_ERROR(CheckRecvCounts(handle->num_recv_tokens, result.num_recv_tokens_per_expert, s.num_ranks, c,
                                          args.expert_alignment));
    }
  }
  const int64_t num_recv = handle->num_recv_tokens;

  // ---- outputs ----
  EPF_ASSIGN_OR_RETURN(result.recv_x, s.NewTensor(x.dtype, {num_recv, hidden}, stream));
  if (fp8) {
    EPF_ASSIGN_OR_RETURN(result.recv_x_scales, s.NewTensor(args.x_scales.dtype, {num_recv, num_scales}, stream));
  }
  if (num_topk > 0) {
    EPF_ASSIGN_OR_RETURN(result.recv_topk_idx, s.NewTensor(DType::kInt64, {num_recv, num_topk}, stream));
    if (!args.topk_weights.empty()) {
      EPF_ASSIGN_OR_RETURN(result.recv_topk_weights, s.NewTensor(DType::kFloat32, {num_recv, num_topk}, stream));
    }
  }
  // The handle's own tensors (the prefix matrix came with notify) in one allocation.
  EPF_ASSIGN_OR_RETURN(std::vector<Tensor> own, s.NewTensors({{DType::kInt32, {s.num_ranks, c.num_sms}},
                                                              {DType::kInt32, {num_tokens, s.num_ranks}},
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
  EPF_RETURN_IF_ERROR(s.path->Dispatch(dp, &raw, stream));
  result.handle = std::move(handle);
  return result;
}

absl::StatusOr<CombineResult> Buffer::Combine(const CombineArgs& args, cudaStream_t stream) {
  absl::StatusOr<CombineResult> result = CombineUncounted(args, stream);
  if (state_->stats != nullptr) state_->stats->Call(kernels::kOpCombine, result.status());
  return result;
}

absl::StatusOr<CombineResult> Buffer::CombineUncounted(const CombineArgs& args, cudaStream_t stream) {
  State& s = *state_;
  const BufferConfig& c = s.config;
  EPF_RETURN_IF_ERROR(s.RequireMode(false, "Combine"));
  if (args.handle == nullptr) return absl::InvalidArgumentError("handle is null: pass the dispatch's handle");
  const DispatchHandle& h = *args.handle;
  EPF_RETURN_IF_ERROR(internal::ExpectDType(args.x, "x", DType::kBF16));
  EPF_RETURN_IF_ERROR(ExpectShape(args.x, "x", {h.num_recv_tokens, -1}, "[num_recv_tokens of the handle, hidden]"));
  const int64_t hidden = args.x.shape[1];
  EPF_RETURN_IF_ERROR(kernels::CheckCombineHidden("x.shape[1] (hidden)", hidden, c.hidden));
  int64_t num_topk = 0;
  if (!args.topk_weights.empty()) {
    EPF_RETURN_IF_ERROR(ExpectTensor(args.topk_weights, "topk_weights", DType::kFloat32, {h.num_recv_tokens, -1},
                                     "[num_recv_tokens, num_topk]"));
    num_topk = args.topk_weights.shape[1];
    EPF_RETURN_IF_ERROR(kernels::CheckNumTopk("topk_weights.shape[1] (num_topk)", num_topk, c.max_topk));
  }
  for (const auto& [bias, name] : {std::pair{&args.bias_0, "bias_0"}, std::pair{&args.bias_1, "bias_1"}}) {
    if (bias->empty()) continue;
    EPF_RETURN_IF_ERROR(ExpectTensor(*bias, name, DType::kBF16, {h.num_tokens, hidden}, "[num_tokens, hidden]"));
  }
  EPF_RETURN_IF_ERROR(s.UsableForNormal());
  if (s.internode != nullptr) return s.internode->Combine(args, stream);

  CombineResult result;
  EPF_ASSIGN_OR_RETURN(result.combined_x, s.NewTensor(DType::kBF16, {h.num_tokens, hidden}, stream));
  if (num_topk > 0) {
    EPF_ASSIGN_OR_RETURN(result.combined_topk_weights, s.NewTensor(DType::kFloat32, {h.num_tokens, num_topk}, stream));
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
  EPF_RETURN_IF_ERROR(s.path->Combine(cp, h.raw, stream));
  return result;
}

}  // namespace epfabric::client
