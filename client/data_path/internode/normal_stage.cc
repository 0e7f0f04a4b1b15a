// The RDMA stage of normal mode across hosts (normal_stage.h), and the shape of a group across hosts.
#include "data_path/internode/normal_stage.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "epfabric/common/status_macros.h"
#include "tensor/tensors.h"

namespace epfabric::client::internal {
namespace {

using kernels::DType;
namespace transport = kernels::transport;

// Decision 84: in a group that serves both modes, with two channels or more, the last one is low latency's alone.
bool LowLatencyHasTheLastChannel(const Lease& lease) {
  return lease.group().num_normal_bytes() > 0 && lease.group().transport_channels() >= 2;
}

}  // namespace

ChannelRange NormalModeChannels(const Lease& lease) {
  const int channels = static_cast<int>(lease.group().transport_channels());
  return {.first = 0, .count = LowLatencyHasTheLastChannel(lease) ? channels - 1 : channels};
}

ChannelRange LowLatencyChannels(const Lease& lease) {
  const int channels = static_cast<int>(lease.group().transport_channels());
  if (LowLatencyHasTheLastChannel(lease)) return {.first = channels - 1, .count = 1};
  return {.first = 0, .count = channels};
}

absl::StatusOr<InternodeGroupShape> InternodeShapeOf(const Lease& lease) {
  const std::vector<int>& nvl = lease.nvl_ranks();
  const int world = lease.world_size();
  const int per_host = static_cast<int>(nvl.size());
  if (per_host < 1 || world % per_host != 0 || nvl.front() % per_host != 0 ||
      nvl.back() != nvl.front() + per_host - 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "group '%s': this host holds ranks %d..%d of %d; an internode group needs the same number of ranks on every "
        "host, host h holding ranks [h * L, (h + 1) * L)",
        lease.group_name(), nvl.front(), nvl.back(), world));
  }
  InternodeGroupShape shape;
  shape.num_hosts = world / per_host;
  shape.ranks_per_host = per_host;
  shape.host = nvl.front() / per_host;
  shape.local_rank = lease.rank() - nvl.front();
  if (shape.num_hosts > kernels::kMaxInternodeHosts) {
    return kernels::InvalidValue("hosts of the group", shape.num_hosts,
                                 absl::StrCat("at most ", kernels::kMaxInternodeHosts));
  }
  return shape;
}

BufferConfig InnerBufferConfig(const BufferConfig& outer, const InternodeGroupShape& shape) {
  BufferConfig inner = outer;
  inner.max_tokens_per_rank = outer.max_tokens_per_rank * shape.num_hosts;
  inner.num_experts = outer.num_experts / shape.num_hosts;
  return inner;
}

InternodeRowShape InternodeRowShape::Of(const DispatchArgs& args) {
  const int hidden = static_cast<int>(args.x.shape[1]);
  const bool fp8 = args.x.dtype == DType::kFP8E4M3;
  InternodeRowShape rows;
  rows.row_bytes = fp8 ? hidden : hidden * 2;
  // Moved as opaque 4-byte words; the NVLink stage gets them in the caller's dtype.
  rows.scales_dtype = fp8 ? args.x_scales.dtype : DType::kFloat32;
  rows.num_scales = !fp8 ? 0 : rows.scales_dtype == DType::kInt32 ? hidden / 512 : hidden / 128;
  rows.num_topk = args.topk_idx.empty() ? 0 : static_cast<int>(args.topk_idx.shape[1]);
  rows.has_weights = !args.topk_weights.empty();
  return rows;
}

absl::StatusOr<std::unique_ptr<NormalRdmaStage>> NormalRdmaStage::Create(Lease* lease, const BufferConfig& config,
                                                                         const InternodeGroupShape& shape,
                                                                         KernelPath* nvlink,
                                                                         std::shared_ptr<Allocator> allocator,
                                                                         uint64_t rdma_limit) {
  auto path = std::unique_ptr<NormalRdmaStage>(new NormalRdmaStage());
  path->lease_ = lease;
  path->config_ = config;
  path->shape_ = shape;
  path->nvlink_ = nvlink;
  path->allocator_ = std::move(allocator);
  EPF_ASSIGN_OR_RETURN(path->access_, NewRegionAccess(nvlink->backend()));
  path->lost_ranks_ = lease->lost_ranks_words(/*device=*/false);
  InitLostIgnore(path->lost_ranks_, path->lost_ignore_);
  EPF_ASSIGN_OR_RETURN(path->layout_,
                       kernels::ComputeInternodeRdmaLayout({.num_hosts = shape.num_hosts,
                                                            .ranks_per_host = shape.ranks_per_host,
                                                            .max_tokens_per_rank = config.max_tokens_per_rank,
                                                            .max_hidden = config.hidden,
                                                            .max_topk = config.max_topk}));
  path->region_ = lease->rdma_region();
  const uint64_t available = std::min(lease->rdma_region_bytes(), rdma_limit);
  if (path->region_ == nullptr || available < path->layout_.total_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "group '%s' spans %d hosts: its RDMA region%s has %d bytes, this config needs RequiredGroupBytes' rdma = %d "
        "(CreateGroup's %s)",
        lease->group_name(), shape.num_hosts, rdma_limit == UINT64_MAX ? "" : "'s normal-mode part", available,
        path->layout_.total_bytes, rdma_limit == UINT64_MAX ? "num_rdma_bytes" : "num_normal_rdma_bytes"));
  }
  void* commands = lease->commands_region();
  const ChannelRange channels = NormalModeChannels(*lease);
  const uint32_t slots = lease->group().ring_slots();
  if (commands == nullptr || channels.count < 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", lease->group_name(), "' has no transport command rings mapped"));
  }
  for (int c = channels.first; c < channels.first + channels.count; ++c) {
    EPF_ASSIGN_OR_RETURN(transport::RingIssuer ring,
                         transport::RingIssuer::Create(transport::RingAt(commands, c, slots), c, slots));
    path->rings_.push_back(ring);
  }
  if (nvlink->backend() == Backend::kCuda) {
    // The padded (worst-case) calls' steps run on the device: their status word, and the rings as mapped there.
    void* device_commands = lease->commands_region_device();
    if (device_commands == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("group '", lease->group_name(), "': the transport command rings are not mapped for CUDA"));
    }
    path->num_device_rings_ = std::min(channels.count, kernels::kMaxInternodeRings);
    for (int c = 0; c < path->num_device_rings_; ++c) {
      path->device_rings_[c] = {.control = transport::RingAt(device_commands, channels.first + c, slots),
                                .slots = slots,
                                .channel = channels.first + c};
    }
    path->lost_ranks_device_ = lease->lost_ranks_words(/*device=*/true);
    void* status = nullptr;
    EPF_CUDA_RETURN_IF_ERROR(cudaMalloc(&status, sizeof(kernels::KernelStatus)));
    path->status_ = static_cast<kernels::KernelStatus*>(status);
    EPF_CUDA_RETURN_IF_ERROR(cudaMemset(status, 0, sizeof(kernels::KernelStatus)));
  }
  return path;
}

NormalRdmaStage::~NormalRdmaStage() {
  if (status_ != nullptr) cudaFree(status_);
}

absl::StatusOr<Tensor> NormalRdmaStage::NewTensor(DType dtype, std::vector<int64_t> shape, cudaStream_t stream) {
  return internal::NewTensor(allocator_, dtype, std::move(shape), stream);
}

absl::StatusOr<std::shared_ptr<InternodeHandle>> NormalRdmaStage::Plan(const DispatchArgs& args, int num_tokens,
                                                                       cudaStream_t stream) {
  const int H = shape_.num_hosts, L = shape_.ranks_per_host, R = H * L, M = config_.max_tokens_per_rank;
  auto plan = std::make_shared<InternodeHandle>();
  std::vector<uint8_t> in_rank(static_cast<size_t>(num_tokens) * R);
  if (!in_rank.empty()) {
    EPF_RETURN_IF_ERROR(
        access_->ToHost(in_rank.data(), args.layout->is_token_in_rank.view.data, in_rank.size(), stream));
  }
  // [0, H): counts; then H rows of M token indices.
  std::vector<int32_t> send_plan(static_cast<size_t>(H) * (M + 1), 0);
  std::vector<int32_t> send_slot(static_cast<size_t>(num_tokens) * H, -1);
  for (int t = 0; t < num_tokens; ++t) {
    for (int h = 0; h < H; ++h) {
      // With one host every token goes to it, so that the intranode stage sees the intranode path's input.
      bool any = H == 1;
      for (int l = 0; l < L && !any; ++l) any = in_rank[static_cast<size_t>(t) * R + h * L + l] != 0;
      if (!any) continue;
      const int row = send_plan[h]++;
      send_plan[H + static_cast<size_t>(h) * M + row] = t;
      send_slot[static_cast<size_t>(t) * H + h] = row;
    }
  }
  plan->send_counts.assign(send_plan.begin(), send_plan.begin() + H);
  EPF_ASSIGN_OR_RETURN(plan->send_tokens, NewTensor(DType::kInt32, {static_cast<int64_t>(send_plan.size())}, stream));
  EPF_ASSIGN_OR_RETURN(plan->send_slot, NewTensor(DType::kInt32, {num_tokens, H}, stream));
  EPF_RETURN_IF_ERROR(access_->FromHost(plan->send_tokens.view.data, send_plan.data(), send_plan.size() * 4, stream));
  if (!send_slot.empty()) {
    EPF_RETURN_IF_ERROR(access_->FromHost(plan->send_slot.view.data, send_slot.data(), send_slot.size() * 4, stream));
  }
  return plan;
}

kernels::InternodePackParams NormalRdmaStage::PackParams(const DispatchArgs& args, const InternodeHandle& plan,
                                                         int row_bytes, int num_scales, int num_topk) const {
  kernels::InternodePackParams p;
  p.x = internal::GivenData(args.x);
  p.row_bytes = row_bytes;
  // Copied bit for bit (packed UE8M0 int32 words too): the pack moves scale words without arithmetic.
  p.x_scales = num_scales > 0 ? static_cast<const float*>(args.x_scales.data) : nullptr;
  p.num_scales = num_scales;
  p.topk_idx = num_topk > 0 ? static_cast<const int64_t*>(args.topk_idx.data) : nullptr;
  p.topk_weights =
      num_topk > 0 && !args.topk_weights.empty() ? static_cast<const float*>(args.topk_weights.data) : nullptr;
  p.num_topk = num_topk;
  p.num_tokens = static_cast<int>(args.x.shape[0]);
  p.num_hosts = shape_.num_hosts;
  p.self_host = shape_.host;
  p.experts_per_host = config_.num_experts / shape_.num_hosts;
  p.send_counts = static_cast<const int32_t*>(plan.send_tokens.view.data);
  p.send_tokens = p.send_counts + shape_.num_hosts;
  p.max_rows = config_.max_tokens_per_rank;
  p.region = region();
  p.layout = layout_;
  return p;
}

absl::Status NormalRdmaStage::SendRows(const DispatchArgs& args, const InternodeHandle& plan, uint64_t call,
                                       int row_bytes, int num_scales, int num_topk, cudaStream_t stream) {
  // The gateways have copied out the previous dispatch's rows, and our previous puts from the send slabs are done.
  EPF_RETURN_IF_ERROR(WaitWords(layout_.slab_free, call - 1, "release of the previous dispatch's slabs"));
  EPF_RETURN_IF_ERROR(QuietAll());
  const kernels::InternodePackParams p = PackParams(args, plan, row_bytes, num_scales, num_topk);
  EPF_RETURN_IF_ERROR(access_->Pack(p, stream));  // also the count words the puts below send
  EPF_RETURN_IF_ERROR(access_->Sync(stream));
  return IssueDispatchRows(plan.send_counts.data(), row_bytes, num_scales, num_topk, p.topk_weights != nullptr);
}

absl::StatusOr<DispatchResult> NormalRdmaStage::Dispatch(const DispatchArgs& args, cudaStream_t stream) {
  if (args.cached != nullptr && args.cached->internode == nullptr) {
    return absl::InvalidArgumentError("cached: the handle is not from an internode dispatch");
  }
  if (args.cached == nullptr && (args.topk_idx.empty() || args.topk_idx.shape[1] == 0)) {
    return absl::InvalidArgumentError(
        "topk_idx is not given: an internode group needs it for a dispatch that is not cached (the gateways route "
        "by it)");
  }
  // Worst-case mode runs the padded path (no host wait); a cached dispatch follows its handle.
  const bool padded = args.cached != nullptr ? args.cached->internode->padded : args.num_worst_tokens > 0;
  if (!padded) EPF_RETURN_IF_ERROR(RefuseCaptureAcrossHosts(nvlink_->backend(), stream));
  last_call_device_ = padded && device_steps();
  leave_launched_ = false;
  absl::StatusOr<DispatchResult> result = padded ? RunPaddedDispatch(args, stream) : RunDispatch(args, stream);
  if (!result.ok()) FailCall(stream);
  return result;
}

absl::StatusOr<CombineResult> NormalRdmaStage::Combine(const CombineArgs& args, cudaStream_t stream) {
  if (args.handle->internode == nullptr || args.handle->internode->inner == nullptr) {
    return absl::InvalidArgumentError("handle is not from an internode dispatch");
  }
  const bool padded = args.handle->internode->padded;
  if (!padded) EPF_RETURN_IF_ERROR(RefuseCaptureAcrossHosts(nvlink_->backend(), stream));
  last_call_device_ = padded && device_steps();
  leave_launched_ = false;
  absl::StatusOr<CombineResult> result = padded ? RunPaddedCombine(args, stream) : RunCombine(args, stream);
  if (!result.ok()) FailCall(stream);
  return result;
}

void NormalRdmaStage::FailCall(cudaStream_t stream) {
  if (device_steps()) {
    // The device steps already launched issue on the same rings as LeaveCall: they end first (their waits are
    // bounded). While capturing nothing ran, and the capture itself fails.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) return;
    access_->Sync(stream).IgnoreError();
    // The call's leave step ran and found a failure: the device already marked the peers, and a second mark would
    // read as corrupt at them. Check reports that failure.
    if (leave_launched_ && !kernels::ReadKernelStatus(status_, stream).ok()) return;
  }
  LeaveCall();
}

absl::StatusOr<DispatchResult> NormalRdmaStage::RunDispatch(const DispatchArgs& args, cudaStream_t stream) {
  const int H = shape_.num_hosts, self = shape_.host, M = config_.max_tokens_per_rank;
  const kernels::InternodeRdmaLayout& l = layout_;
  const int num_tokens = static_cast<int>(args.x.shape[0]);
  const int hidden = static_cast<int>(args.x.shape[1]);
  const bool fp8 = args.x.dtype == DType::kFP8E4M3;
  const InternodeRowShape rows = InternodeRowShape::Of(args);
  const int row_bytes = rows.row_bytes, num_scales = rows.num_scales, num_topk = rows.num_topk;
  const DType scales_dtype = rows.scales_dtype;
  const bool has_weights = rows.has_weights;
  const bool cached = args.cached != nullptr;

  std::shared_ptr<const InternodeHandle> plan;
  if (cached) {
    plan = args.cached->internode;
  } else {
    EPF_ASSIGN_OR_RETURN(plan, Plan(args, num_tokens, stream));
  }
  EPF_ASSIGN_OR_RETURN(const uint64_t call, BeginCall(kDispatchCall, stream));
  EPF_RETURN_IF_ERROR(SendRows(args, *plan, call, row_bytes, num_scales, num_topk, stream));
  EPF_RETURN_IF_ERROR(WaitWords(l.dispatch_arrived, call, "dispatch rows"));

  // What every host sent this gateway.
  std::vector<uint64_t> words(H);
  EPF_RETURN_IF_ERROR(access_->ReadWords(region() + l.dispatch_count, words.data(), H));
  std::vector<int32_t> recv_counts(H);
  int64_t num_fwd = 0;
  for (int h = 0; h < H; ++h) {
    const uint64_t n = h == self ? static_cast<uint64_t>(plan->send_counts[h]) : words[h];
    if (n > static_cast<uint64_t>(M)) {
      return absl::DataLossError(absl::StrFormat(
          "rank %d read an internode row count of %d from rank %d: outside [0, %d] (max_tokens_per_rank): stale or "
          "corrupt peer data",
          lease_->rank(), n, PeerRank(h), M));
    }
    recv_counts[h] = static_cast<int32_t>(n);
    num_fwd += n;
  }
  if (cached && recv_counts != plan->recv_counts) {
    return absl::FailedPreconditionError(
        "cached internode dispatch: the hosts sent other row counts than in the cached handle's dispatch");
  }

  // The gateway's tokens: what host 0 sent, then host 1, ... (each in its source's token order).
  Tensor x_fwd, scales_fwd, idx_fwd, w_fwd;
  EPF_ASSIGN_OR_RETURN(x_fwd, NewTensor(args.x.dtype, {num_fwd, hidden}, stream));
  if (fp8) {
    EPF_ASSIGN_OR_RETURN(scales_fwd, NewTensor(scales_dtype, {num_fwd, num_scales}, stream));
  }
  if (num_topk > 0) {
    EPF_ASSIGN_OR_RETURN(idx_fwd, NewTensor(DType::kInt64, {num_fwd, num_topk}, stream));
  }
  if (has_weights) {
    EPF_ASSIGN_OR_RETURN(w_fwd, NewTensor(DType::kFloat32, {num_fwd, num_topk}, stream));
  }
  int64_t row = 0;
  for (int h = 0; h < H; ++h) {
    const size_t n = recv_counts[h];
    auto gather = [&](const Tensor& dst, size_t recv, size_t slab_bytes, size_t row_size) -> absl::Status {
      if (n == 0 || dst.view.data == nullptr) return absl::OkStatus();
      return access_->Copy(static_cast<uint8_t*>(dst.view.data) + row * row_size, region() + recv + h * slab_bytes,
                           n * row_size, stream);
    };
    EPF_RETURN_IF_ERROR(gather(x_fwd, l.recv_x, l.x_slab_bytes, row_bytes));
    if (fp8) EPF_RETURN_IF_ERROR(gather(scales_fwd, l.recv_scales, l.scales_slab_bytes, num_scales * sizeof(float)));
    if (num_topk > 0) {
      EPF_RETURN_IF_ERROR(gather(idx_fwd, l.recv_topk_idx, l.topk_idx_slab_bytes, num_topk * sizeof(int64_t)));
    }
    if (has_weights) {
      EPF_RETURN_IF_ERROR(gather(w_fwd, l.recv_topk_weights, l.topk_weights_slab_bytes, num_topk * sizeof(float)));
    }
    row += n;
  }
  EPF_RETURN_IF_ERROR(access_->Sync(stream));
  EPF_RETURN_IF_ERROR(IssueSlabFree());
  std::shared_ptr<InternodeHandle> recorded;
  if (!cached) {
    recorded = std::make_shared<InternodeHandle>(*plan);
    recorded->recv_counts = recv_counts;
  }
  return NvlinkDispatch(args, {x_fwd, scales_fwd, idx_fwd, w_fwd}, std::move(recorded), stream);
}

absl::StatusOr<DispatchResult> NormalRdmaStage::NvlinkDispatch(const DispatchArgs& args, const ForwardedRows& fwd,
                                                               std::shared_ptr<InternodeHandle> recorded,
                                                               cudaStream_t stream) {
  const bool cached = args.cached != nullptr;
  DispatchArgs inner_args;
  inner_args.x = fwd.x.view;
  inner_args.x_scales = fwd.x_scales.view;
  inner_args.topk_idx = fwd.topk_idx.view;
  inner_args.topk_weights = fwd.topk_weights.view;
  inner_args.expert_alignment = args.expert_alignment;
  // The NVLink stage sizes the outputs: with num_worst_tokens, DeepEP's shapes and padding.
  inner_args.num_worst_tokens = args.num_worst_tokens;
  DispatchLayout inner_layout;
  if (cached) {
    inner_args.cached = args.cached->internode->inner;
  } else {
    // The forwarded indices are peer data: checked as the Buffer checks its caller's (host memory now; device memory
    // by the layout kernel, whose count the NVLink stage's dispatch refuses).
    EPF_RETURN_IF_ERROR(Annotate(nvlink_->CheckExpertIndices(fwd.topk_idx.view)));
    EPF_ASSIGN_OR_RETURN(inner_layout, Stage(nvlink_->Layout(fwd.topk_idx.view, stream)));
    inner_args.layout = &inner_layout;
  }
  EPF_ASSIGN_OR_RETURN(DispatchResult result, Stage(nvlink_->Dispatch(inner_args, stream)));

  auto handle = std::make_shared<DispatchHandle>(*result.handle);
  handle->num_tokens = static_cast<int>(args.x.shape[0]);
  handle->hidden = static_cast<int>(args.x.shape[1]);
  handle->is_token_in_rank = cached ? args.cached->is_token_in_rank : args.layout->is_token_in_rank;
  if (cached) {
    handle->internode = args.cached->internode;
  } else {
    recorded->inner = result.handle;
    handle->internode = std::move(recorded);
  }
  result.handle = std::move(handle);
  return result;
}

absl::StatusOr<CombineResult> NormalRdmaStage::InnerCombine(const CombineArgs& args, cudaStream_t stream) {
  // The NVLink stage: each gateway's tokens reduced over this host's ranks. With one host this is the whole combine
  // (biases included), so a one-host group gives the intranode path's bits.
  CombineArgs inner_args;
  inner_args.x = args.x;
  inner_args.topk_weights = args.topk_weights;
  inner_args.handle = args.handle->internode->inner;
  if (shape_.num_hosts == 1) {
    inner_args.bias_0 = args.bias_0;
    inner_args.bias_1 = args.bias_1;
  }
  return Stage(nvlink_->Combine(inner_args, stream));
}

absl::StatusOr<CombineResult> NormalRdmaStage::RunCombine(const CombineArgs& args, cudaStream_t stream) {
  const int H = shape_.num_hosts, self = shape_.host;
  const kernels::InternodeRdmaLayout& l = layout_;
  const InternodeHandle& plan = *args.handle->internode;
  const int hidden = static_cast<int>(args.x.shape[1]);
  const int num_topk = args.topk_weights.empty() ? 0 : static_cast<int>(args.topk_weights.shape[1]);
  EPF_ASSIGN_OR_RETURN(CombineResult partial, InnerCombine(args, stream));

  EPF_ASSIGN_OR_RETURN(const uint64_t call, BeginCall(kCombineCall, stream));
  EPF_RETURN_IF_ERROR(QuietAll());  // our previous combine's puts from the send slabs are done
  const size_t x_row = static_cast<size_t>(hidden) * 2, w_row = static_cast<size_t>(num_topk) * sizeof(float);
  int64_t row = 0;
  for (int h = 0; h < H; ++h) {
    const size_t n = plan.recv_counts[h];
    if (n > 0) {
      const size_t x_base = h == self ? l.combine_recv_x : l.combine_send_x;
      EPF_RETURN_IF_ERROR(access_->Copy(region() + x_base + h * l.combine_x_slab_bytes,
                                        static_cast<uint8_t*>(partial.combined_x.view.data) + row * x_row, n * x_row,
                                        stream));
      if (num_topk > 0) {
        const size_t w_base = h == self ? l.combine_recv_weights : l.combine_send_weights;
        EPF_RETURN_IF_ERROR(access_->Copy(region() + w_base + h * l.combine_weights_slab_bytes,
                                          static_cast<uint8_t*>(partial.combined_topk_weights.view.data) + row * w_row,
                                          n * w_row, stream));
      }
    }
    row += n;
  }
  EPF_RETURN_IF_ERROR(access_->Sync(stream));
  // Every other host summed our rows of the previous combine: its receive slab for us is free again.
  EPF_RETURN_IF_ERROR(WaitWords(l.combine_free, host_combines_, "release of the previous combine's receive slabs"));
  EPF_RETURN_IF_ERROR(IssueCombineRows(plan.recv_counts.data(), hidden, num_topk));
  EPF_RETURN_IF_ERROR(WaitWords(l.combine_arrived, call, "combine rows"));
  // Our rows are in place at their sources before we return: a process that detaches right after its last combine
  // must not take commands still in its rings with it (a lease's end drops what its rings hold).
  EPF_RETURN_IF_ERROR(QuietAll());
  EPF_ASSIGN_OR_RETURN(CombineResult result, SumHosts(args, plan, stream));
  // The sum has read the receive slabs (on cuda: once the stream is done) before the peers may write them again.
  EPF_RETURN_IF_ERROR(access_->Sync(stream));
  EPF_RETURN_IF_ERROR(IssueCombineFree());
  ++host_combines_;
  return result;
}

absl::StatusOr<CombineResult> NormalRdmaStage::SumHosts(const CombineArgs& args, const InternodeHandle& plan,
                                                        cudaStream_t stream) {
  const int hidden = static_cast<int>(args.x.shape[1]);
  const int num_topk = args.topk_weights.empty() ? 0 : static_cast<int>(args.topk_weights.shape[1]);
  CombineResult result;
  const int num_tokens = args.handle->num_tokens;
  EPF_ASSIGN_OR_RETURN(result.combined_x, NewTensor(DType::kBF16, {num_tokens, hidden}, stream));
  if (num_topk > 0) {
    EPF_ASSIGN_OR_RETURN(result.combined_topk_weights, NewTensor(DType::kFloat32, {num_tokens, num_topk}, stream));
  }
  kernels::InternodeReduceParams r;
  r.num_tokens = num_tokens;
  r.hidden = hidden;
  r.num_topk = num_topk;
  r.num_hosts = shape_.num_hosts;
  r.send_slot = static_cast<const int32_t*>(plan.send_slot.view.data);
  r.region = region();
  r.layout = layout_;
  if (shape_.num_hosts > 1) {
    r.bias_0 = args.bias_0.empty() ? nullptr : args.bias_0.data;
    r.bias_1 = args.bias_1.empty() ? nullptr : args.bias_1.data;
  }
  r.combined_x = result.combined_x.view.data;
  r.combined_topk_weights = num_topk > 0 ? static_cast<float*>(result.combined_topk_weights.view.data) : nullptr;
  EPF_RETURN_IF_ERROR(access_->Reduce(r, stream));
  return result;
}

absl::Status NormalRdmaStage::Check(cudaStream_t stream) {
  if (status_ != nullptr) {
    // The padded calls' device steps: their record names whom a wait was for, or a ring the daemon stopped (a peer
    // lost, a refused command: its own record says more). The device already told the peers (StepLeaveIfFailed).
    // Reported once; every rank then resets.
    absl::Status own = kernels::ReadKernelStatus(status_, stream);
    if (!own.ok()) {
      for (const transport::RingIssuer& ring : rings_) {
        if (absl::Status ring_error = transport::RingErrorStatus(ring.channel(), ring.control()); !ring_error.ok()) {
          own = ring_error;
          break;
        }
      }
      kernels::ClearKernelStatus(status_, stream).IgnoreError();
      access_->Sync(stream).IgnoreError();
      return own;
    }
  }
  absl::Status inner = Annotate(nvlink_->Check(stream));
  // The NVLink stage of a call whose RDMA stage ran on the device failed: the peers on other hosts learn it now, as
  // from a host-driven call's error.
  if (!inner.ok() && last_call_device_) {
    last_call_device_ = false;  // once: a second mark would read as corrupt at the peers
    LeaveCall();
  }
  return inner;
}

absl::Status NormalRdmaStage::Annotate(absl::Status status) const {
  if (status.ok()) return status;
  const int first = shape_.host * shape_.ranks_per_host;
  return absl::Status(status.code(),
                      absl::StrFormat("host %d's NVLink stage (its local rank i is group rank %d + i): %s", shape_.host,
                                      first, status.message()));
}

absl::Status NormalRdmaStage::Reset(cudaStream_t stream) {
  // Our sends are complete before the words are zeroed, so none lands in a peer after its own reset.
  EPF_RETURN_IF_ERROR(QuietAll());
  EPF_RETURN_IF_ERROR(Annotate(nvlink_->Reset(stream)));
  EPF_RETURN_IF_ERROR(access_->Zero(region_, layout_.signal_bytes, stream));
  if (status_ != nullptr) {
    EPF_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(status_, 0, sizeof(kernels::KernelStatus), stream));
  }
  EPF_RETURN_IF_ERROR(access_->Sync(stream));  // the calls words too: the next call is the first
  host_combines_ = 0;
  return absl::OkStatus();
}

}  // namespace epfabric::client::internal
