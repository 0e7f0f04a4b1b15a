// Low-latency mode of the Buffer: dispatch and combine with optional receive hooks (the send phase now, the receive
// phase when the caller runs the hook). Tensors are checked before anything runs; the kernels' validation checks the
// args once more before the data path launches them.
#include <algorithm>
#include <utility>

#include "buffer/buffer_state.h"
#include "epfabric/client/buffer.h"
#include "epfabric/common/status_macros.h"

namespace epfabric::client {
namespace {

using internal::ExpectTensor;
using internal::GivenPointer;
using kernels::DType;

// topk_idx [num_tokens, num_topk], num_topk in [1, min(config.max_topk, kLowLatencyMaxTopk)], expert indices in
// range (host memory). Returns num_topk.
absl::StatusOr<int64_t> CheckTopk(Buffer::State& s, const TensorView& topk_idx, int64_t num_tokens,
                                  const char* meaning) {
  EPF_RETURN_IF_ERROR(ExpectTensor(topk_idx, "topk_idx", DType::kInt64, {num_tokens, -1}, meaning));
  const int64_t num_topk = topk_idx.shape[1];
  EPF_RETURN_IF_ERROR(kernels::CheckNumTopk("topk_idx.shape[1] (num_topk)", num_topk,
                                            std::min(s.config.max_topk, kernels::kLowLatencyMaxTopk)));
  return num_topk;
}

// The wait-cost statistics: int64 [num_ranks], added to (nullptr when not given).
absl::StatusOr<int64_t*> WaitCostStats(const Buffer::State& s, const TensorView& stats) {
  if (stats.empty()) return nullptr;
  EPF_RETURN_IF_ERROR(ExpectTensor(stats, "wait_recv_cost_stats", DType::kInt64, {s.num_ranks}, "[num_ranks]"));
  return static_cast<int64_t*>(const_cast<void*>(GivenPointer<void>(stats)));
}

kernels::LowLatencyPhases FirstPhases(bool return_recv_hook) {
  return return_recv_hook ? kernels::LowLatencyPhases::kSend : kernels::LowLatencyPhases::kSendAndRecv;
}

}  // namespace

absl::StatusOr<LowLatencyDispatchResult> Buffer::LowLatencyDispatch(const LowLatencyDispatchArgs& args,
                                                                    cudaStream_t stream) {
  absl::StatusOr<LowLatencyDispatchResult> result = LowLatencyDispatchUncounted(args, stream);
  if (!result.ok()) result = state_->ExplainFirstCall(result.status());
  if (internal::DataPathRecorder* stats = state_->stats.get(); stats != nullptr) {
    stats->Call(kernels::kOpLowLatencyDispatch, result.status());
    if (result.ok()) {
      stats->Sent(args.x.shape.empty() ? 0 : args.x.shape[0], static_cast<int64_t>(args.x.bytes()));
      // Counters only: a failure to copy them must not fail the dispatch.
      (void)stats->AfterLowLatencyDispatch(stream);
    }
  }
  return result;
}

absl::StatusOr<LowLatencyDispatchResult> Buffer::LowLatencyDispatchUncounted(const LowLatencyDispatchArgs& args,
                                                                             cudaStream_t stream) {
  State& s = *state_;
  const BufferConfig& c = s.config;
  EPF_RETURN_IF_ERROR(s.RequireMode(true, "LowLatencyDispatch"));
  EPF_RETURN_IF_ERROR(internal::ExpectDType(args.x, "x", DType::kBF16));
  EPF_RETURN_IF_ERROR(internal::ExpectShape(args.x, "x", {-1, c.hidden}, "[num_tokens, config.hidden]"));
  const int64_t num_tokens = args.x.shape[0];
  EPF_RETURN_IF_ERROR(kernels::CheckNumTokens("x.shape[0] (num_tokens)", num_tokens, c.max_tokens_per_rank));
  EPF_ASSIGN_OR_RETURN(const int64_t num_topk, CheckTopk(s, args.topk_idx, num_tokens, "[num_tokens, num_topk]"));
  EPF_RETURN_IF_ERROR(kernels::CheckLowLatencyScaleOptions(args.use_fp8, args.round_scale, args.use_ue8m0, c.hidden));
  if (!args.cumulative_stats.empty()) {
    EPF_RETURN_IF_ERROR(ExpectTensor(args.cumulative_stats, "cumulative_stats", DType::kInt32, {s.experts_per_rank},
                                     "[num_local_experts]"));
  }
  EPF_ASSIGN_OR_RETURN(int64_t* const wait_cost, WaitCostStats(s, args.wait_recv_cost_stats));
  EPF_RETURN_IF_ERROR(s.path->CheckExpertIndices(args.topk_idx));
  EPF_RETURN_IF_ERROR(s.UsableForLowLatency(stream));

  const int64_t L = s.experts_per_rank, R = s.num_ranks, M = c.max_tokens_per_rank, H = c.hidden, G = H / 128;
  LowLatencyDispatchResult result;
  auto handle = std::make_shared<LowLatencyHandle>();
  EPF_ASSIGN_OR_RETURN(result.packed_recv_x,
                       s.NewTensor(args.use_fp8 ? DType::kFP8E4M3 : DType::kBF16, {L, R * M, H}, stream));
  if (args.use_fp8) {
    EPF_ASSIGN_OR_RETURN(result.packed_recv_x_scales, args.use_ue8m0
                                                          ? s.NewTensor(DType::kInt32, {L, G / 4, R * M}, stream)
                                                          : s.NewTensor(DType::kFloat32, {L, G, R * M}, stream));
  }
  EPF_ASSIGN_OR_RETURN(result.packed_recv_count, s.NewTensor(DType::kInt32, {L}, stream));
  EPF_ASSIGN_OR_RETURN(result.packed_recv_src_info, s.NewTensor(DType::kInt32, {L, R * M}, stream));
  EPF_ASSIGN_OR_RETURN(result.packed_recv_layout_range, s.NewTensor(DType::kInt64, {L, R}, stream));
  // The handle's own tensors in one allocation.
  EPF_ASSIGN_OR_RETURN(
      std::vector<Tensor> own,
      s.NewTensors({{DType::kInt32, {L, R * M}}, {DType::kInt32, {R, M, kernels::kLowLatencyMaxTopk}}}, stream));
  handle->topk_slot = std::move(own[0]);
  handle->token_map = std::move(own[1]);
  // The handle shares src_info and layout_range with the result (views of the same allocations).
  handle->src_info = result.packed_recv_src_info;
  handle->layout_range = result.packed_recv_layout_range;
  handle->raw.packed_recv_src_info = static_cast<const int32_t*>(handle->src_info.view.data);
  handle->raw.packed_recv_layout_range = static_cast<const int64_t*>(handle->layout_range.view.data);
  handle->raw.packed_recv_topk_slot = static_cast<const int32_t*>(handle->topk_slot.view.data);
  handle->raw.packed_recv_token_map = static_cast<const int32_t*>(handle->token_map.view.data);
  handle->raw.num_tokens = static_cast<int>(num_tokens);

  kernels::LowLatencyDispatchArgs d;
  d.x = GivenPointer<void>(args.x);
  d.topk_idx = GivenPointer<int64_t>(args.topk_idx);
  d.num_tokens = static_cast<int>(num_tokens);
  d.num_topk = static_cast<int>(num_topk);
  d.hidden = c.hidden;
  d.max_tokens_per_rank = c.max_tokens_per_rank;
  d.num_experts = c.num_experts;
  d.use_fp8 = args.use_fp8;
  d.round_scale = args.round_scale;
  d.use_ue8m0 = args.use_ue8m0;
  d.cumulative_stats = args.cumulative_stats.empty() ? nullptr : static_cast<int32_t*>(args.cumulative_stats.data);
  d.expert_load = s.stats != nullptr ? s.stats->expert_load() : nullptr;
  d.wait_recv_cost_ns = wait_cost;
  d.packed_recv_x = result.packed_recv_x.view.data;
  d.packed_recv_x_scales = args.use_fp8 ? result.packed_recv_x_scales.view.data : nullptr;
  d.packed_recv_count = static_cast<int32_t*>(result.packed_recv_count.view.data);
  d.packed_recv_src_info = static_cast<int32_t*>(result.packed_recv_src_info.view.data);
  d.packed_recv_layout_range = static_cast<int64_t*>(result.packed_recv_layout_range.view.data);
  d.packed_recv_topk_slot = static_cast<int32_t*>(handle->topk_slot.view.data);
  d.packed_recv_token_map = static_cast<int32_t*>(handle->token_map.view.data);
  // Checked before the cursor moves, so that a refused call leaves every rank's cursor where it was.
  EPF_RETURN_IF_ERROR(s.path->ValidateLowLatencyDispatch(d));
  d.buffer_half = s.cursor.Next();
  d.call_tag = s.NextCallTag();
  handle->buffer_half = d.buffer_half;
  d.phases = FirstPhases(args.return_recv_hook);
  EPF_RETURN_IF_ERROR(s.path->LowLatencyDispatch(d, stream));
  if (args.return_recv_hook) {
    s.recv_hook_pending = true;
    State* state = state_.get();
    // The hook keeps the outputs alive until it ran (it writes into them).
    auto keep = std::make_shared<LowLatencyDispatchResult>(result);
    keep->handle = handle;
    auto ran = std::make_shared<bool>(false);
    d.phases = kernels::LowLatencyPhases::kRecv;
    result.recv_hook = [state, d, keep, ran](cudaStream_t hook_stream) -> absl::Status {
      if (*ran) return absl::FailedPreconditionError("this low-latency dispatch recv_hook has already run");
      *ran = true;
      state->recv_hook_pending = false;
      return state->path->LowLatencyDispatch(d, hook_stream);
    };
  }
  result.handle = std::move(handle);
  return result;
}

absl::StatusOr<LowLatencyCombineResult> Buffer::LowLatencyCombine(const LowLatencyCombineArgs& args,
                                                                  cudaStream_t stream) {
  absl::StatusOr<LowLatencyCombineResult> result = LowLatencyCombineUncounted(args, stream);
  if (state_->stats != nullptr) state_->stats->Call(kernels::kOpLowLatencyCombine, result.status());
  if (!result.ok()) return state_->ExplainFirstCall(result.status());
  return result;
}

absl::StatusOr<LowLatencyCombineResult> Buffer::LowLatencyCombineUncounted(const LowLatencyCombineArgs& args,
                                                                           cudaStream_t stream) {
  State& s = *state_;
  const BufferConfig& c = s.config;
  EPF_RETURN_IF_ERROR(s.RequireMode(true, "LowLatencyCombine"));
  if (args.handle == nullptr) return absl::InvalidArgumentError("handle is null: pass the dispatch's handle");
  const LowLatencyHandle& h = *args.handle;
  const int64_t L = s.experts_per_rank, R = s.num_ranks, M = c.max_tokens_per_rank, H = c.hidden;
  const int64_t num_tokens = h.raw.num_tokens;
  if (!args.zero_copy) {
    EPF_RETURN_IF_ERROR(ExpectTensor(args.x, "x", DType::kBF16, {L, R * M, H},
                                     "[num_local_experts, num_ranks * max_tokens_per_rank, hidden]"));
  }
  EPF_ASSIGN_OR_RETURN(const int64_t num_topk,
                       CheckTopk(s, args.topk_idx, num_tokens, "[num_tokens of the dispatch, num_topk]"));
  EPF_RETURN_IF_ERROR(ExpectTensor(args.topk_weights, "topk_weights", DType::kFloat32, {num_tokens, num_topk},
                                   "[num_tokens, num_topk], as topk_idx"));
  EPF_RETURN_IF_ERROR(s.path->CheckExpertIndices(args.topk_idx));
  if (!args.out.empty()) {
    EPF_RETURN_IF_ERROR(ExpectTensor(args.out, "out", DType::kBF16, {num_tokens, H}, "[num_tokens, hidden]"));
  }
  EPF_ASSIGN_OR_RETURN(int64_t* const wait_cost, WaitCostStats(s, args.wait_recv_cost_stats));
  EPF_RETURN_IF_ERROR(s.UsableForLowLatency(stream));

  LowLatencyCombineResult result;
  if (args.out.empty()) {
    EPF_ASSIGN_OR_RETURN(result.combined_x, s.NewTensor(DType::kBF16, {num_tokens, H}, stream));
  } else {
    result.combined_x.view = args.out;  // the caller owns it
  }
  kernels::LowLatencyCombineArgs cb;
  cb.x = args.zero_copy ? nullptr : GivenPointer<void>(args.x);
  cb.topk_idx = GivenPointer<int64_t>(args.topk_idx);
  cb.topk_weights = GivenPointer<float>(args.topk_weights);
  cb.num_tokens = static_cast<int>(num_tokens);
  cb.num_topk = static_cast<int>(num_topk);
  cb.hidden = c.hidden;
  cb.max_tokens_per_rank = c.max_tokens_per_rank;
  cb.num_experts = c.num_experts;
  cb.handle = h.raw;
  cb.zero_copy = args.zero_copy;
  cb.combined_x = result.combined_x.view.data;
  cb.wait_recv_cost_ns = wait_cost;
  EPF_RETURN_IF_ERROR(s.path->ValidateLowLatencyCombine(cb));
  cb.buffer_half = s.cursor.Next();
  cb.call_tag = s.NextCallTag();
  cb.phases = FirstPhases(args.return_recv_hook);
  EPF_RETURN_IF_ERROR(s.path->LowLatencyCombine(cb, stream));
  if (args.return_recv_hook) {
    s.recv_hook_pending = true;
    State* state = state_.get();
    auto keep_out = std::make_shared<Tensor>(result.combined_x);
    std::shared_ptr<const LowLatencyHandle> keep_handle = args.handle;
    auto ran = std::make_shared<bool>(false);
    cb.phases = kernels::LowLatencyPhases::kRecv;
    result.recv_hook = [state, cb, keep_out, keep_handle, ran](cudaStream_t hook_stream) -> absl::Status {
      if (*ran) return absl::FailedPreconditionError("this low-latency combine recv_hook has already run");
      *ran = true;
      state->recv_hook_pending = false;
      return state->path->LowLatencyCombine(cb, hook_stream);
    };
  }
  return result;
}

}  // namespace epfabric::client
