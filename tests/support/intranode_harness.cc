#include "intranode_harness.h"

#include <cstring>

#include "absl/strings/str_format.h"

#define EPF_HARNESS_RETURN_IF_ERROR(expr)      \
  do {                                         \
    absl::Status epf_status_ = (expr);         \
    if (!epf_status_.ok()) return epf_status_; \
  } while (0)

namespace epfabric::testing {

using kernels::DType;
using kernels::IntranodeRegionConfig;
namespace ref = kernels::reference;

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    this->~DeviceBuffer();
    device_ = other.device_;
    ptr_ = other.ptr_;
    bytes_ = other.bytes_;
    other.ptr_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    cudaFree(ptr_);
    cudaSetDevice(previous);
    ptr_ = nullptr;
  }
}

absl::Status DeviceBuffer::Allocate(int device, size_t bytes) {
  this->~DeviceBuffer();
  device_ = device;
  bytes_ = bytes;
  EPF_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  EPF_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr_, bytes < 16 ? 16 : bytes));
  return absl::OkStatus();
}

absl::Status DeviceBuffer::Upload(const void* host, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  EPF_CUDA_RETURN_IF_ERROR(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice));
  return absl::OkStatus();
}

absl::Status DeviceBuffer::Download(void* host, size_t bytes) const {
  if (bytes == 0) return absl::OkStatus();
  EPF_CUDA_RETURN_IF_ERROR(cudaMemcpy(host, ptr_, bytes, cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

absl::Status DeviceBuffer::Poison(cudaStream_t stream) {
  EPF_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  EPF_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(ptr_, 0xff, bytes_ < 16 ? 16 : bytes_, stream));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<IntranodeTestGroup>> IntranodeTestGroup::Create(const IntranodeRegionConfig& config) {
  auto group = std::unique_ptr<IntranodeTestGroup>(new IntranodeTestGroup());
  group->config_ = config;
  absl::StatusOr<size_t> region_bytes = kernels::IntranodeRegionBytes(config);
  if (!region_bytes.ok()) return region_bytes.status();
  const int R = config.num_ranks;
  absl::StatusOr<GpuPlacement> placement = PlaceRanks(R);
  if (!placement.ok()) return placement.status();
  group->placement_ = *placement;
  // Peer access between the distinct GPUs in use, once per ordered pair. Ranks on the same GPU need none: a region
  // of the same device is addressed directly (enabling peer access to the own device is an error).
  for (int a = 0; a < placement->num_gpus; ++a) {
    for (int b = 0; b < placement->num_gpus; ++b) {
      if (a == b) continue;
      int can = 0;
      EPF_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can, a, b));
      if (!can) return absl::FailedPreconditionError(absl::StrFormat("GPU %d cannot access GPU %d", a, b));
      EPF_CUDA_RETURN_IF_ERROR(cudaSetDevice(a));
      const cudaError_t err = cudaDeviceEnablePeerAccess(b, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();
      } else {
        EPF_CUDA_RETURN_IF_ERROR(err);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    auto ctx = std::make_unique<RankContext>();
    const int device = placement->device(r);
    ctx->device = device;
    EPF_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    EPF_HARNESS_RETURN_IF_ERROR(kernels::IntranodePreloadKernels());
    // Its own stream per rank (never the legacy default stream, which would serialise ranks on one GPU).
    EPF_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&ctx->stream, cudaStreamNonBlocking));
    EPF_HARNESS_RETURN_IF_ERROR(ctx->region.Allocate(device, *region_bytes));
    EPF_CUDA_RETURN_IF_ERROR(cudaMemset(ctx->region.get(), 0, *region_bytes));
    EPF_HARNESS_RETURN_IF_ERROR(ctx->status.Allocate(device, sizeof(kernels::KernelStatus)));
    EPF_CUDA_RETURN_IF_ERROR(cudaMemset(ctx->status.get(), 0, sizeof(kernels::KernelStatus)));
    const size_t count_bytes = sizeof(int32_t) * (1 + config.num_experts / R);
    EPF_CUDA_RETURN_IF_ERROR(cudaHostAlloc(reinterpret_cast<void**>(&ctx->host_counts), count_bytes,
                                           cudaHostAllocMapped | cudaHostAllocPortable));
    group->ranks_.push_back(std::move(ctx));
  }
  for (int r = 0; r < R; ++r) {
    kernels::IntranodeGroup& g = group->ranks_[r]->group;
    g.config = config;
    g.rank = r;
    for (int p = 0; p < R; ++p) g.peer_regions[p] = group->ranks_[p]->region.get();
    g.status = group->ranks_[r]->status.as<kernels::KernelStatus>();
    g.timeout_ns = kernels::kDefaultWaitTimeoutNs;
  }
  for (int d = 0; d < placement->num_gpus; ++d) {
    EPF_CUDA_RETURN_IF_ERROR(cudaSetDevice(d));
    EPF_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  }
  return group;
}

IntranodeTestGroup::~IntranodeTestGroup() {
  for (auto& ctx : ranks_) {
    cudaSetDevice(ctx->device);
    cudaStreamSynchronize(ctx->stream);
    if (ctx->host_counts != nullptr) cudaFreeHost(ctx->host_counts);
    cudaStreamDestroy(ctx->stream);
  }
}

absl::Status IntranodeTestGroup::SyncAndCheck() {
  absl::Status first = absl::OkStatus();
  for (auto& ctx : ranks_) {
    EPF_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx->device));
    absl::Status s = kernels::ReadKernelStatus(ctx->group.status, ctx->stream);
    if (!s.ok() && first.ok()) first = s;
    EPF_HARNESS_RETURN_IF_ERROR(kernels::ClearKernelStatus(ctx->group.status, ctx->stream));
  }
  for (auto& ctx : ranks_) {
    EPF_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx->device));
    EPF_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx->stream));
  }
  return first;
}

absl::Status IntranodeTestGroup::ResetAll() {
  for (auto& ctx : ranks_) {
    EPF_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx->device));
    EPF_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx->stream));
    EPF_HARNESS_RETURN_IF_ERROR(kernels::IntranodeResetRegion(ctx->group, ctx->stream));
    EPF_HARNESS_RETURN_IF_ERROR(kernels::ClearKernelStatus(ctx->group.status, ctx->stream));
    EPF_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx->stream));
  }
  return absl::OkStatus();
}

ref::DispatchConfig MakeReferenceConfig(const CaseConfig& c) {
  ref::DispatchConfig d;
  d.num_ranks = static_cast<int>(c.num_tokens.size());
  d.row_bytes = c.fp8 ? c.hidden : c.hidden * 2;
  d.num_scales = c.fp8 ? c.hidden / 128 : 0;
  d.num_topk = c.send_topk ? c.num_topk : 0;
  d.has_weights = c.send_topk && c.send_weights;
  d.num_experts = c.num_experts;
  d.num_channels = c.num_sms;
  d.expert_alignment = c.expert_alignment;
  return d;
}

std::vector<ref::RankInput> MakeInputs(const CaseConfig& c, std::mt19937_64& rng) {
  std::vector<ref::RankInput> inputs(c.num_tokens.size());
  const ref::DispatchConfig d = MakeReferenceConfig(c);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (size_t r = 0; r < inputs.size(); ++r) {
    ref::RankInput& in = inputs[r];
    const int T = c.num_tokens[r];
    in.num_tokens = T;
    in.routing_topk = c.num_topk;
    in.x.resize(static_cast<size_t>(T) * d.row_bytes);
    for (size_t i = 0; i + 8 <= in.x.size(); i += 8) {
      const uint64_t bits = rng();
      std::memcpy(in.x.data() + i, &bits, 8);
    }
    in.x_scales.resize(static_cast<size_t>(T) * d.num_scales);
    for (float& s : in.x_scales) s = unit(rng) + 0.5f;
    in.topk_idx.assign(static_cast<size_t>(T) * c.num_topk, -1);
    in.topk_weights.assign(static_cast<size_t>(T) * c.num_topk, 0.0f);
    for (int t = 0; t < T; ++t) {
      for (int k = 0; k < c.num_topk; ++k) {
        int64_t e;
        bool repeated;
        do {
          e = static_cast<int64_t>(rng() % c.num_experts);
          repeated = false;
          for (int j = 0; j < k; ++j) repeated |= in.topk_idx[static_cast<size_t>(t) * c.num_topk + j] == e;
        } while (repeated);
        in.topk_idx[static_cast<size_t>(t) * c.num_topk + k] = e;
        in.topk_weights[static_cast<size_t>(t) * c.num_topk + k] = unit(rng);
      }
      for (int k = 0; k < c.num_topk; ++k) {
        if (unit(rng) < c.empty_slot_fraction) in.topk_idx[static_cast<size_t>(t) * c.num_topk + k] = -1;
      }
    }
  }
  return inputs;
}

absl::Status PipelineRunner::Prepare(const std::vector<ref::RankInput>& inputs) {
  const int R = group_->num_ranks();
  const ref::DispatchConfig d = MakeReferenceConfig(config_);
  for (int dev = 0; dev < group_->placement().num_gpus; ++dev) {
    EPF_HARNESS_RETURN_IF_ERROR(CheckBlocksFit(group_->placement(), config_.num_sms, dev));
  }
  buffers_.clear();
  for (int r = 0; r < R; ++r) {
    auto b = std::make_unique<RankBuffers>();
    const ref::RankInput& in = inputs[r];
    const int T = in.num_tokens;
    const int K = config_.num_topk;
    const int dev = group_->rank(r).device;
    const cudaStream_t stream = group_->rank(r).stream;
    b->num_tokens = T;
    EPF_HARNESS_RETURN_IF_ERROR(b->x.Allocate(dev, in.x.size()));
    EPF_HARNESS_RETURN_IF_ERROR(b->x.Upload(in.x.data(), in.x.size()));
    EPF_HARNESS_RETURN_IF_ERROR(b->x_scales.Allocate(dev, in.x_scales.size() * sizeof(float)));
    EPF_HARNESS_RETURN_IF_ERROR(b->x_scales.Upload(in.x_scales.data(), in.x_scales.size() * sizeof(float)));
    EPF_HARNESS_RETURN_IF_ERROR(b->topk_idx.Allocate(dev, in.topk_idx.size() * sizeof(int64_t)));
    EPF_HARNESS_RETURN_IF_ERROR(b->topk_idx.Upload(in.topk_idx.data(), in.topk_idx.size() * sizeof(int64_t)));
    EPF_HARNESS_RETURN_IF_ERROR(b->topk_weights.Allocate(dev, in.topk_weights.size() * sizeof(float)));
    EPF_HARNESS_RETURN_IF_ERROR(b->topk_weights.Upload(in.topk_weights.data(), in.topk_weights.size() * sizeof(float)));
    EPF_HARNESS_RETURN_IF_ERROR(b->num_tokens_per_rank.Allocate(dev, R * sizeof(int32_t)));
    EPF_HARNESS_RETURN_IF_ERROR(b->num_tokens_per_expert.Allocate(dev, config_.num_experts * sizeof(int32_t)));
    EPF_HARNESS_RETURN_IF_ERROR(b->is_token_in_rank.Allocate(dev, static_cast<size_t>(T) * R));
    EPF_HARNESS_RETURN_IF_ERROR(b->num_invalid_topk.Allocate(dev, sizeof(int32_t)));
    EPF_HARNESS_RETURN_IF_ERROR(b->rank_prefix_matrix.Allocate(dev, R * R * sizeof(int32_t)));
    EPF_HARNESS_RETURN_IF_ERROR(b->recv_counts.Allocate(dev, (1 + config_.num_experts / R) * sizeof(int32_t)));
    EPF_HARNESS_RETURN_IF_ERROR(b->recv_channel_prefix.Allocate(dev, R * config_.num_sms * sizeof(int32_t)));
    EPF_HARNESS_RETURN_IF_ERROR(b->send_slot.Allocate(dev, static_cast<size_t>(T) * R * sizeof(int32_t)));
    for (DeviceBuffer* p :
         {&b->num_tokens_per_rank, &b->num_tokens_per_expert, &b->is_token_in_rank, &b->num_invalid_topk,
          &b->rank_prefix_matrix, &b->recv_counts, &b->recv_channel_prefix, &b->send_slot}) {
      EPF_HARNESS_RETURN_IF_ERROR(p->Poison(stream));
    }
    (void)K;
    (void)d;
    buffers_.push_back(std::move(b));
  }
  return group_->SyncAndCheck();
}

absl::Status PipelineRunner::LaunchLayout(int r) {
  RankBuffers& b = *buffers_[r];
  RankContext& ctx = group_->rank(r);
  EPF_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx.device));
  kernels::DispatchLayoutParams p;
  p.topk_idx = b.topk_idx.as<int64_t>();
  p.num_tokens = b.num_tokens;
  p.num_topk = config_.num_topk;
  p.num_experts = config_.num_experts;
  p.num_ranks = group_->num_ranks();
  p.num_tokens_per_rank = b.num_tokens_per_rank.as<int32_t>();
  p.num_tokens_per_expert = b.num_tokens_per_expert.as<int32_t>();
  p.is_token_in_rank = b.is_token_in_rank.as<bool>();
  p.num_invalid_topk = b.num_invalid_topk.as<int32_t>();
  return kernels::GetDispatchLayout(p, ctx.stream);
}

absl::Status PipelineRunner::RunLayout() {
  for (int r = 0; r < group_->num_ranks(); ++r) EPF_HARNESS_RETURN_IF_ERROR(LaunchLayout(r));
  return group_->SyncAndCheck();
}

absl::Status PipelineRunner::LaunchNotify(int r) {
  RankBuffers& b = *buffers_[r];
  RankContext& ctx = group_->rank(r);
  EPF_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx.device));
  kernels::IntranodeNotifyParams p;
  p.num_tokens_per_rank = b.num_tokens_per_rank.as<int32_t>();
  p.num_tokens_per_expert = b.num_tokens_per_expert.as<int32_t>();
  p.num_tokens = b.num_tokens;
  p.num_experts = config_.num_experts;
  p.expert_alignment = config_.expert_alignment;
  p.rank_prefix_matrix = b.rank_prefix_matrix.as<int32_t>();
  p.recv_counts = b.recv_counts.as<int32_t>();
  p.host_num_recv_tokens = ctx.host_counts;
  p.host_num_recv_tokens_per_expert = ctx.host_counts + 1;
  return kernels::IntranodeNotify(ctx.group, p, ctx.stream);
}

absl::Status PipelineRunner::RunNotify() {
  const int R = group_->num_ranks();
  for (int r = 0; r < R; ++r) {
    RankContext& ctx = group_->rank(r);
    for (int i = 0; i < 1 + config_.num_experts / R; ++i) ctx.host_counts[i] = -1;
  }
  for (int r = 0; r < R; ++r) EPF_HARNESS_RETURN_IF_ERROR(LaunchNotify(r));
  for (int r = 0; r < R; ++r) {
    RankContext& ctx = group_->rank(r);
    absl::StatusOr<int32_t> n = kernels::IntranodeWaitRecvCounts(ctx.host_counts, 10ull * 1000 * 1000 * 1000);
    if (!n.ok()) {
      absl::Status kernel_status = group_->SyncAndCheck();
      return kernel_status.ok() ? n.status() : kernel_status;
    }
    EPF_HARNESS_RETURN_IF_ERROR(AllocateRecv(r, *n));
  }
  EPF_HARNESS_RETURN_IF_ERROR(group_->SyncAndCheck());
  return PoisonRecv();
}

absl::Status PipelineRunner::AllocateRecv(int r, int rows) {
  RankBuffers& b = *buffers_[r];
  RankContext& ctx = group_->rank(r);
  b.num_recv_tokens = rows;
  const ref::DispatchConfig d = MakeReferenceConfig(config_);
  const size_t n = static_cast<size_t>(rows);
  const int K = config_.num_topk;
  EPF_HARNESS_RETURN_IF_ERROR(b.recv_x.Allocate(ctx.device, n * d.row_bytes));
  EPF_HARNESS_RETURN_IF_ERROR(b.recv_x_scales.Allocate(ctx.device, n * d.num_scales * sizeof(float)));
  EPF_HARNESS_RETURN_IF_ERROR(b.recv_topk_idx.Allocate(ctx.device, n * K * sizeof(int64_t)));
  EPF_HARNESS_RETURN_IF_ERROR(b.recv_topk_weights.Allocate(ctx.device, n * K * sizeof(float)));
  EPF_HARNESS_RETURN_IF_ERROR(b.recv_src_idx.Allocate(ctx.device, n * sizeof(int32_t)));
  return absl::OkStatus();
}

absl::Status PipelineRunner::PoisonRecv() {
  for (int r = 0; r < group_->num_ranks(); ++r) {
    RankBuffers& b = *buffers_[r];
    const cudaStream_t stream = group_->rank(r).stream;
    for (DeviceBuffer* p : {&b.recv_x, &b.recv_x_scales, &b.recv_topk_idx, &b.recv_topk_weights, &b.recv_src_idx,
                            &b.recv_channel_prefix, &b.send_slot}) {
      EPF_HARNESS_RETURN_IF_ERROR(p->Poison(stream));
    }
  }
  return group_->SyncAndCheck();
}

absl::Status PipelineRunner::LaunchDispatch(int r) {
  RankBuffers& b = *buffers_[r];
  RankContext& ctx = group_->rank(r);
  EPF_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx.device));
  kernels::IntranodeHandle& h = b.handle;
  h.num_tokens = b.num_tokens;
  h.num_recv_tokens = b.num_recv_tokens;
  h.is_token_in_rank = b.is_token_in_rank.as<bool>();
  h.rank_prefix_matrix = b.rank_prefix_matrix.as<int32_t>();
  h.recv_channel_prefix = b.recv_channel_prefix.as<int32_t>();
  h.send_slot = b.send_slot.as<int32_t>();
  h.recv_src_idx = b.recv_src_idx.as<int32_t>();
  kernels::IntranodeDispatchParams p;
  p.x = b.x.get();
  p.x_dtype = config_.fp8 ? DType::kFP8E4M3 : DType::kBF16;
  p.x_scales = config_.fp8 ? b.x_scales.as<float>() : nullptr;
  p.hidden = config_.hidden;
  p.topk_idx = config_.send_topk ? b.topk_idx.as<int64_t>() : nullptr;
  p.topk_weights = config_.send_topk && config_.send_weights ? b.topk_weights.as<float>() : nullptr;
  p.num_topk = config_.num_topk;
  p.num_experts = config_.num_experts;
  p.num_sms = config_.num_sms;
  p.recv_capacity = b.num_recv_tokens;
  p.recv_x = b.recv_x.get();
  p.recv_x_scales = config_.fp8 ? b.recv_x_scales.as<float>() : nullptr;
  p.recv_topk_idx = b.recv_topk_idx.as<int64_t>();
  p.recv_topk_weights = b.recv_topk_weights.as<float>();
  return kernels::IntranodeDispatch(ctx.group, p, &h, ctx.stream);
}

absl::Status PipelineRunner::RunDispatch() {
  for (int r = 0; r < group_->num_ranks(); ++r) EPF_HARNESS_RETURN_IF_ERROR(LaunchDispatch(r));
  return group_->SyncAndCheck();
}

absl::Status PipelineRunner::PrepareCombine(const std::vector<ref::CombineInput>& inputs) {
  for (int r = 0; r < group_->num_ranks(); ++r) {
    RankBuffers& b = *buffers_[r];
    RankContext& ctx = group_->rank(r);
    const ref::CombineInput& in = inputs[r];
    EPF_HARNESS_RETURN_IF_ERROR(b.combine_x.Allocate(ctx.device, in.x.size() * 2));
    EPF_HARNESS_RETURN_IF_ERROR(b.combine_x.Upload(in.x.data(), in.x.size() * 2));
    EPF_HARNESS_RETURN_IF_ERROR(b.combine_weights.Allocate(ctx.device, in.topk_weights.size() * sizeof(float)));
    EPF_HARNESS_RETURN_IF_ERROR(b.combine_weights.Upload(in.topk_weights.data(), in.topk_weights.size() * 4));
    EPF_HARNESS_RETURN_IF_ERROR(b.bias_0.Allocate(ctx.device, in.bias_0.size() * 2));
    EPF_HARNESS_RETURN_IF_ERROR(b.bias_0.Upload(in.bias_0.data(), in.bias_0.size() * 2));
    EPF_HARNESS_RETURN_IF_ERROR(b.bias_1.Allocate(ctx.device, in.bias_1.size() * 2));
    EPF_HARNESS_RETURN_IF_ERROR(b.bias_1.Upload(in.bias_1.data(), in.bias_1.size() * 2));
    EPF_HARNESS_RETURN_IF_ERROR(
        b.combined_x.Allocate(ctx.device, static_cast<size_t>(b.num_tokens) * config_.hidden * 2));
    EPF_HARNESS_RETURN_IF_ERROR(
        b.combined_weights.Allocate(ctx.device, static_cast<size_t>(b.num_tokens) * config_.num_topk * 4));
    EPF_HARNESS_RETURN_IF_ERROR(b.combined_x.Poison(ctx.stream));
    EPF_HARNESS_RETURN_IF_ERROR(b.combined_weights.Poison(ctx.stream));
  }
  return group_->SyncAndCheck();
}

absl::Status PipelineRunner::LaunchCombine(int r) {
  RankBuffers& b = *buffers_[r];
  RankContext& ctx = group_->rank(r);
  EPF_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx.device));
  const bool weights = config_.send_topk && config_.send_weights;
  kernels::IntranodeCombineParams p;
  p.x = b.combine_x.get();
  p.hidden = config_.hidden;
  p.topk_weights = weights ? b.combine_weights.as<float>() : nullptr;
  p.num_topk = config_.num_topk;
  p.bias_0 = config_.with_bias ? b.bias_0.get() : nullptr;
  p.bias_1 = config_.with_bias ? b.bias_1.get() : nullptr;
  p.combined_x = b.combined_x.get();
  p.combined_topk_weights = weights ? b.combined_weights.as<float>() : nullptr;
  return kernels::IntranodeCombine(ctx.group, p, b.handle, ctx.stream);
}

absl::Status PipelineRunner::RunCombine() {
  for (int r = 0; r < group_->num_ranks(); ++r) EPF_HARNESS_RETURN_IF_ERROR(LaunchCombine(r));
  return group_->SyncAndCheck();
}

}  // namespace epfabric::testing
