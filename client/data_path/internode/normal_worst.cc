// Internode normal mode in worst-case mode (num_worst_tokens; docs/internode-dispatch.md, "Worst-case mode"): the
// RDMA stage with nothing read back to the host, so that on cuda a dispatch and its combine can be captured into a
// CUDA graph. The same composition as normal_stage.cc, with two changes:
//   - the rows a gateway forwards sit at fixed places: host h's at [h * M, h * M + count_h) of H * M rows, padding
//     (top-k -1) after them, so the NVLink stage's size is known before the call (its worst-case mode then sizes the
//     outputs to num_worst_tokens as within one host);
//   - the plan, the gather and the combine's copies are kernels reading the counts on the device, and on cuda the
//     transport steps too (kernels::InternodeIssue / InternodeWait: one block each, bounded waits into the path's
//     status word, read by Check). On the host backend the transport steps are the host path's, so CI runs the rest.
// The calls are counted in the region's `calls` words, so that the host path and calls replayed from graphs agree.
#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "data_path/internode/normal_stage.h"
#include "epfabric/common/status_macros.h"
#include "tensor/tensors.h"

namespace epfabric::client::internal {
namespace {

using kernels::DType;
using kernels::InternodeIssueStep;
using kernels::InternodeWaitWords;

const int32_t* HostInts(const Tensor& t) { return static_cast<const int32_t*>(t.view.data); }

}  // namespace

absl::Status NormalRdmaStage::StepBegin(int call, InternodeWaitWords words, cudaStream_t stream) {
  if (!device_steps()) {
    EPF_ASSIGN_OR_RETURN(host_call_, BeginCall(call, stream));
    if (words == InternodeWaitWords::kSlabFree) {
      EPF_RETURN_IF_ERROR(WaitWords(layout_.slab_free, host_call_ - 1, "release of the previous dispatch's slabs"));
    }
    return QuietAll();
  }
  kernels::InternodeWaitParams p = WaitParams(call, words);
  p.bump = true;
  p.quiet = true;
  return kernels::InternodeWait(p, stream);
}

absl::Status NormalRdmaStage::StepWait(int call, InternodeWaitWords words, bool quiet, cudaStream_t stream) {
  if (!device_steps()) {
    const bool dispatch = words == InternodeWaitWords::kDispatchArrived;
    EPF_RETURN_IF_ERROR(WaitWords(dispatch ? layout_.dispatch_arrived : layout_.combine_arrived, host_call_,
                                  dispatch ? "dispatch rows" : "combine rows"));
    return quiet ? QuietAll() : absl::OkStatus();
  }
  kernels::InternodeWaitParams p = WaitParams(call, words);
  p.quiet = quiet;
  return kernels::InternodeWait(p, stream);
}

kernels::InternodeWaitParams NormalRdmaStage::WaitParams(int call, InternodeWaitWords words) {
  kernels::InternodeWaitParams p;
  p.region = region();
  p.layout = layout_;
  p.call = call;
  p.words = words;
  std::copy_n(device_rings_, num_device_rings_, p.rings);
  p.num_rings = num_device_rings_;
  p.num_hosts = shape_.num_hosts;
  p.self_host = shape_.host;
  p.ranks_per_host = shape_.ranks_per_host;
  p.local_rank = shape_.local_rank;
  p.lost_ranks = lost_ranks_device_;
  RefreshLostIgnore(lost_ranks_, lost_ignore_);
  std::copy_n(lost_ignore_, kernels::kLostRankWords, p.lost_ignore);
  p.timeout_ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(config_.timeout));
  p.status = status_;
  p.rank = lease_->rank();
  return p;
}

absl::Status NormalRdmaStage::StepIssue(InternodeIssueStep step, const Tensor& counts, const InternodeRowShape& rows,
                                        cudaStream_t stream) {
  if (!device_steps()) {
    switch (step) {
      case InternodeIssueStep::kDispatchRows:
        return IssueDispatchRows(HostInts(counts), rows.row_bytes, rows.num_scales, rows.num_topk, rows.has_weights);
      case InternodeIssueStep::kSlabFree:
        return IssueSlabFree();
      case InternodeIssueStep::kCombineRows:
        return IssueCombineRows(HostInts(counts), rows.row_bytes / 2, rows.num_topk);
      case InternodeIssueStep::kLeave:
        return absl::OkStatus();  // the host backend's steps return their errors: FailCall leaves
    }
  }
  kernels::InternodeIssueParams p;
  p.step = step;
  std::copy_n(device_rings_, num_device_rings_, p.rings);
  p.num_rings = num_device_rings_;
  p.layout = layout_;
  p.num_hosts = shape_.num_hosts;
  p.self_host = shape_.host;
  p.ranks_per_host = shape_.ranks_per_host;
  p.local_rank = shape_.local_rank;
  p.max_rows = config_.max_tokens_per_rank;
  p.counts = HostInts(counts);  // device memory on cuda
  p.row_bytes = rows.row_bytes;
  p.num_scales = rows.num_scales;
  p.num_topk = rows.num_topk;
  p.has_weights = rows.has_weights;
  p.timeout_ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(config_.timeout));
  p.status = status_;
  p.rank = lease_->rank();
  return kernels::InternodeIssue(p, stream);
}

absl::Status NormalRdmaStage::StepLeaveIfFailed(const InternodeRowShape& rows, cudaStream_t stream) {
  if (!device_steps()) return absl::OkStatus();
  // What LeaveCall does on the host, in stream order: the peers on other hosts stop waiting for this rank's words,
  // and this host's ranks for its arrival at the NVLink stage's barriers (this call's, or the next call's after a
  // combine). Check then reports the failure without leaving again (a second mark would read as corrupt).
  EPF_RETURN_IF_ERROR(StepIssue(InternodeIssueStep::kLeave, Tensor(), rows, stream));
  EPF_RETURN_IF_ERROR(nvlink_->AbandonCallIfFailed(status_, stream));
  leave_launched_ = true;
  return absl::OkStatus();
}

absl::StatusOr<DispatchResult> NormalRdmaStage::RunPaddedDispatch(const DispatchArgs& args, cudaStream_t stream) {
  const int H = shape_.num_hosts, M = config_.max_tokens_per_rank;
  const int num_tokens = static_cast<int>(args.x.shape[0]);
  const int hidden = static_cast<int>(args.x.shape[1]);
  const InternodeRowShape rows = InternodeRowShape::Of(args);
  const bool cached = args.cached != nullptr;

  // The call counted, the gateways done with our previous rows, our previous puts from the send slabs complete.
  EPF_RETURN_IF_ERROR(StepBegin(kDispatchCall, InternodeWaitWords::kSlabFree, stream));
  std::shared_ptr<const InternodeHandle> plan;
  Tensor recv_counts;  // what the gather finds (a cached dispatch checks it against its handle's)
  if (cached) {
    plan = args.cached->internode;
    EPF_ASSIGN_OR_RETURN(recv_counts, NewTensor(DType::kInt32, {H}, stream));
  } else {
    auto fresh = std::make_shared<InternodeHandle>();
    fresh->padded = true;
    EPF_ASSIGN_OR_RETURN(fresh->send_tokens, NewTensor(DType::kInt32, {H + static_cast<int64_t>(H) * M}, stream));
    EPF_ASSIGN_OR_RETURN(fresh->send_slot, NewTensor(DType::kInt32, {num_tokens, H}, stream));
    EPF_ASSIGN_OR_RETURN(fresh->recv_counts_tensor, NewTensor(DType::kInt32, {H}, stream));
    recv_counts = fresh->recv_counts_tensor;
    EPF_RETURN_IF_ERROR(
        access_->Plan({.is_token_in_rank = static_cast<const bool*>(args.layout->is_token_in_rank.view.data),
                       .num_tokens = num_tokens,
                       .num_hosts = H,
                       .ranks_per_host = shape_.ranks_per_host,
                       .max_rows = M,
                       .send_plan = static_cast<int32_t*>(fresh->send_tokens.view.data),
                       .send_slot = static_cast<int32_t*>(fresh->send_slot.view.data)},
                      stream));
    plan = std::move(fresh);
  }
  EPF_RETURN_IF_ERROR(access_->Pack(PackParams(args, *plan, rows.row_bytes, rows.num_scales, rows.num_topk), stream));
  EPF_RETURN_IF_ERROR(StepIssue(InternodeIssueStep::kDispatchRows, plan->send_tokens, rows, stream));
  EPF_RETURN_IF_ERROR(StepWait(kDispatchCall, InternodeWaitWords::kDispatchArrived, /*quiet=*/false, stream));

  // Every host's rows at h * M, padding after them.
  const int64_t num_fwd = static_cast<int64_t>(H) * M;
  Tensor x_fwd, scales_fwd, idx_fwd, w_fwd;
  EPF_ASSIGN_OR_RETURN(x_fwd, NewTensor(args.x.dtype, {num_fwd, hidden}, stream));
  if (rows.num_scales > 0) {
    EPF_ASSIGN_OR_RETURN(scales_fwd, NewTensor(rows.scales_dtype, {num_fwd, rows.num_scales}, stream));
  }
  if (rows.num_topk > 0) {
    EPF_ASSIGN_OR_RETURN(idx_fwd, NewTensor(DType::kInt64, {num_fwd, rows.num_topk}, stream));
  }
  if (rows.has_weights) {
    EPF_ASSIGN_OR_RETURN(w_fwd, NewTensor(DType::kFloat32, {num_fwd, rows.num_topk}, stream));
  }
  EPF_RETURN_IF_ERROR(access_->Gather({.region = region(),
                                       .layout = layout_,
                                       .num_hosts = H,
                                       .self_host = shape_.host,
                                       .ranks_per_host = shape_.ranks_per_host,
                                       .rank = lease_->rank(),
                                       .max_rows = M,
                                       .send_counts = HostInts(plan->send_tokens),
                                       .expected_counts = cached ? HostInts(plan->recv_counts_tensor) : nullptr,
                                       .recv_counts = static_cast<int32_t*>(recv_counts.view.data),
                                       .row_bytes = rows.row_bytes,
                                       .num_scales = rows.num_scales,
                                       .num_topk = rows.num_topk,
                                       .x = x_fwd.view.data,
                                       .x_scales = static_cast<uint32_t*>(scales_fwd.view.data),
                                       .topk_idx = static_cast<int64_t*>(idx_fwd.view.data),
                                       .topk_weights = static_cast<float*>(w_fwd.view.data),
                                       .status = status_},
                                      stream));
  EPF_RETURN_IF_ERROR(StepIssue(InternodeIssueStep::kSlabFree, Tensor(), rows, stream));
  EPF_RETURN_IF_ERROR(StepLeaveIfFailed(rows, stream));

  // The NVLink stage in its worst-case mode: padding rows choose no expert, so they go nowhere.
  return NvlinkDispatch(args, {x_fwd, scales_fwd, idx_fwd, w_fwd},
                        cached ? nullptr : std::make_shared<InternodeHandle>(*plan), stream);
}

absl::StatusOr<CombineResult> NormalRdmaStage::RunPaddedCombine(const CombineArgs& args, cudaStream_t stream) {
  const InternodeHandle& plan = *args.handle->internode;
  const int hidden = static_cast<int>(args.x.shape[1]);
  const int num_topk = args.topk_weights.empty() ? 0 : static_cast<int>(args.topk_weights.shape[1]);
  EPF_ASSIGN_OR_RETURN(CombineResult partial, InnerCombine(args, stream));  // H * M rows, as gathered

  // The call counted, our previous combine's puts from the send slabs complete.
  EPF_RETURN_IF_ERROR(StepBegin(kCombineCall, InternodeWaitWords::kNone, stream));
  EPF_RETURN_IF_ERROR(access_->Scatter(
      {.x = partial.combined_x.view.data,
       .topk_weights = num_topk > 0 ? static_cast<const float*>(partial.combined_topk_weights.view.data) : nullptr,
       .hidden = hidden,
       .num_topk = num_topk,
       .num_hosts = shape_.num_hosts,
       .self_host = shape_.host,
       .max_rows = config_.max_tokens_per_rank,
       .recv_counts = HostInts(plan.recv_counts_tensor),
       .region = region(),
       .layout = layout_},
      stream));
  const InternodeRowShape rows{.row_bytes = hidden * 2, .num_topk = num_topk};
  EPF_RETURN_IF_ERROR(StepIssue(InternodeIssueStep::kCombineRows, plan.recv_counts_tensor, rows, stream));
  // Our rows are in place at their sources before the call ends (a lease's end drops what its rings hold).
  EPF_RETURN_IF_ERROR(StepWait(kCombineCall, InternodeWaitWords::kCombineArrived, /*quiet=*/true, stream));
  EPF_RETURN_IF_ERROR(StepLeaveIfFailed(rows, stream));
  return SumHosts(args, plan, stream);
}

}  // namespace epfabric::client::internal
