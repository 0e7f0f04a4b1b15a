// Normal mode of the Buffer: layout, dispatch (also cached) and combine. Each call checks its tensors (dtype, shape,
// and the kernels' rules on sizes, named after the tensors) and the group's generation before the data path runs it.
#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "buffer/buffer_state.h"
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

  return s.path->Layout(topk_idx, stream);
}

absl::StatusOr<DispatchResult> Buffer::Dispatch(const DispatchArgs& args, cudaStream_t stream) {
  absl::StatusOr<DispatchResult> result = DispatchUncounted(args, stream);
  if (!result.ok()) result = state_->NameGoneRanks(result.status());
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
  return s.path->Dispatch(args, stream);
}

absl::StatusOr<CombineResult> Buffer::Combine(const CombineArgs& args, cudaStream_t stream) {
  absl::StatusOr<CombineResult> result = CombineUncounted(args, stream);
  if (!result.ok()) result = state_->NameGoneRanks(result.status());
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
  return s.path->Combine(args, stream);
}

}  // namespace epfabric::client
