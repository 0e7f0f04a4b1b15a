// epfabric_worker --graph (graphs.h).
#include "graphs.h"

#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"

namespace epfabric::worker {
namespace {

absl::Status CudaError(const char* what, cudaError_t err) {
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

}  // namespace

ArenaAllocator::ArenaAllocator(size_t bytes) {
  if (cudaMalloc(&base_, bytes) == cudaSuccess) size_ = bytes;
}

ArenaAllocator::~ArenaAllocator() { cudaFree(base_); }

absl::StatusOr<void*> ArenaAllocator::Allocate(size_t bytes, cudaStream_t /*stream*/) {
  const size_t at = (used_ + 255) / 256 * 256;
  if (at + bytes > size_)
    return absl::ResourceExhaustedError(absl::StrCat("the worker's arena is full (", size_, " bytes)"));
  used_ = at + bytes;
  return static_cast<char*>(base_) + at;
}

GraphRunner::~GraphRunner() {
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (dispatch_ != nullptr) cudaGraphExecDestroy(dispatch_);
  if (combine_ != nullptr) cudaGraphExecDestroy(combine_);
  for (void* p : owned_) cudaFree(p);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status GraphRunner::Capture(const char* what, const std::function<absl::Status()>& call, cudaGraphExec_t* exec) {
  if (stream_ == nullptr) {
    if (cudaError_t err = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); err != cudaSuccess) {
      return CudaError("cudaStreamCreate", err);
    }
  }
  cudaGraph_t graph = nullptr;
  if (cudaError_t err = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal); err != cudaSuccess) {
    return CudaError("begin capture", err);
  }
  const absl::Status called = call();
  const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
  if (!called.ok()) return absl::Status(called.code(), absl::StrCat("capturing the ", what, ": ", called.message()));
  if (ended != cudaSuccess) return CudaError(absl::StrCat("end capture (", what, ")").c_str(), ended);
  const cudaError_t made = cudaGraphInstantiate(exec, graph, 0);
  cudaGraphDestroy(graph);
  if (made != cudaSuccess) return CudaError(absl::StrCat("instantiate (", what, ")").c_str(), made);
  return absl::OkStatus();
}

absl::StatusOr<TensorView> GraphRunner::Alloc(size_t bytes, DType dtype, std::vector<int64_t> shape) {
  void* p = nullptr;
  if (cudaError_t err = cudaMalloc(&p, std::max<size_t>(bytes, 256)); err != cudaSuccess) {
    return CudaError("cudaMalloc", err);
  }
  owned_.push_back(p);
  return TensorView{.data = p, .dtype = dtype, .shape = std::move(shape)};
}

absl::Status GraphRunner::CopyAndReplay(std::initializer_list<Input> inputs, cudaGraphExec_t exec) {
  for (const Input& in : inputs) {
    if (in.bytes == 0) continue;
    if (cudaError_t err = cudaMemcpyAsync(in.dst, in.src, in.bytes, cudaMemcpyHostToDevice, stream_);
        err != cudaSuccess) {
      return CudaError("copy into a captured input", err);
    }
  }
  if (cudaError_t err = cudaGraphLaunch(exec, stream_); err != cudaSuccess) return CudaError("cudaGraphLaunch", err);
  if (cudaError_t err = cudaStreamSynchronize(stream_); err != cudaSuccess) return CudaError("replay", err);
  return absl::OkStatus();
}

absl::StatusOr<client::LowLatencyDispatchResult> LowLatencyGraphs::Dispatch(Buffer& buffer, const Scenario& s,
                                                                            const std::vector<uint16_t>& x,
                                                                            const std::vector<int64_t>& topk_idx,
                                                                            const std::vector<float>& topk_weights,
                                                                            int num_tokens) {
  const int64_t T = num_tokens, H = s.hidden, K = s.topk;
  if (dispatch_ == nullptr) {
    auto xv = Alloc(T * H * 2, DType::kBF16, {T, H});
    auto iv = Alloc(T * K * 8, DType::kInt64, {T, K});
    auto wv = Alloc(T * K * 4, DType::kFloat32, {T, K});
    for (const auto* v : {&xv, &iv, &wv}) {
      if (!v->ok()) return v->status();
    }
    x_ = *xv;
    topk_idx_ = *iv;
    topk_weights_ = *wv;
    const absl::Status captured = Capture(
        "dispatch",
        [&]() -> absl::Status {
          auto recv = buffer.LowLatencyDispatch({.x = x_, .topk_idx = topk_idx_, .use_fp8 = s.fp8}, stream_);
          if (recv.ok()) recv_ = std::move(*recv);
          return recv.status();
        },
        &dispatch_);
    if (!captured.ok()) return captured;
  }
  const absl::Status replayed = CopyAndReplay({{x_.data, x.data(), x.size() * 2},
                                               {topk_idx_.data, topk_idx.data(), topk_idx.size() * 8},
                                               {topk_weights_.data, topk_weights.data(), topk_weights.size() * 4}},
                                              dispatch_);
  if (!replayed.ok()) return replayed;
  return recv_;
}

absl::StatusOr<client::LowLatencyCombineResult> LowLatencyGraphs::Combine(Buffer& buffer,
                                                                          const std::vector<uint16_t>& expert_outputs,
                                                                          int num_local_experts, int64_t slots,
                                                                          int hidden) {
  if (combine_ == nullptr) {
    const size_t bytes = static_cast<size_t>(num_local_experts) * slots * hidden * 2;
    auto ev = Alloc(bytes, DType::kBF16, {num_local_experts, slots, hidden});
    if (!ev.ok()) return ev.status();
    expert_ = *ev;
    const absl::Status captured = Capture(
        "combine",
        [&]() -> absl::Status {
          auto combined = buffer.LowLatencyCombine(
              {.x = expert_, .topk_idx = topk_idx_, .topk_weights = topk_weights_, .handle = recv_.handle}, stream_);
          if (combined.ok()) combined_ = std::move(*combined);
          return combined.status();
        },
        &combine_);
    if (!captured.ok()) return captured;
  }
  const absl::Status replayed =
      CopyAndReplay({{expert_.data, expert_outputs.data(), expert_outputs.size() * 2}}, combine_);
  if (!replayed.ok()) return replayed;
  return combined_;
}

absl::StatusOr<client::DispatchResult> NormalGraphs::Dispatch(Buffer& buffer, const Scenario& s,
                                                              const std::vector<uint8_t>& x,
                                                              const std::vector<uint32_t>& scales, DType scales_dtype,
                                                              std::vector<int64_t> scales_shape,
                                                              const std::vector<int64_t>& topk_idx,
                                                              const std::vector<float>& topk_weights, int num_tokens) {
  const int64_t T = num_tokens, K = s.topk;
  if (dispatch_ == nullptr) {
    auto xv = Alloc(x.size(), s.fp8 ? DType::kFP8E4M3 : DType::kBF16, {T, s.hidden});
    auto sv = Alloc(scales.size() * 4, scales_dtype, std::move(scales_shape));
    auto iv = Alloc(T * K * 8, DType::kInt64, {T, K});
    auto wv = Alloc(T * K * 4, DType::kFloat32, {T, K});
    for (const auto* v : {&xv, &sv, &iv, &wv}) {
      if (!v->ok()) return v->status();
    }
    x_ = *xv;
    scales_ = *sv;
    topk_idx_ = *iv;
    topk_weights_ = *wv;
    const absl::Status captured = Capture(
        "layout and dispatch",
        [&]() -> absl::Status {
          auto layout = buffer.GetDispatchLayout(topk_idx_, stream_);
          if (!layout.ok()) return layout.status();
          layout_ = std::move(*layout);
          auto recv = buffer.Dispatch({.x = x_,
                                       .x_scales = s.fp8 ? scales_ : TensorView{},
                                       .topk_idx = topk_idx_,
                                       .topk_weights = topk_weights_,
                                       .layout = &layout_,
                                       .num_worst_tokens = s.worst_tokens},
                                      stream_);
          if (recv.ok()) recv_ = std::move(*recv);
          return recv.status();
        },
        &dispatch_);
    if (!captured.ok()) return captured;
  }
  const absl::Status replayed = CopyAndReplay({{x_.data, x.data(), x.size()},
                                               {scales_.data, scales.data(), scales.size() * 4},
                                               {topk_idx_.data, topk_idx.data(), topk_idx.size() * 8},
                                               {topk_weights_.data, topk_weights.data(), topk_weights.size() * 4}},
                                              dispatch_);
  if (!replayed.ok()) return replayed;
  return recv_;
}

absl::StatusOr<client::CombineResult> NormalGraphs::Combine(Buffer& buffer, const std::vector<uint16_t>& expert_outputs,
                                                            int hidden) {
  if (combine_ == nullptr) {
    const int64_t rows = static_cast<int64_t>(expert_outputs.size()) / hidden;
    auto ev = Alloc(expert_outputs.size() * 2, DType::kBF16, {rows, hidden});
    if (!ev.ok()) return ev.status();
    expert_ = *ev;
    const absl::Status captured = Capture(
        "combine",
        [&]() -> absl::Status {
          auto combined = buffer.Combine(
              {.x = expert_, .topk_weights = recv_.recv_topk_weights.view, .handle = recv_.handle}, stream_);
          if (combined.ok()) combined_ = std::move(*combined);
          return combined.status();
        },
        &combine_);
    if (!captured.ok()) return captured;
  }
  const absl::Status replayed =
      CopyAndReplay({{expert_.data, expert_outputs.data(), expert_outputs.size() * 2}}, combine_);
  if (!replayed.ok()) return replayed;
  return combined_;
}

}  // namespace epfabric::worker
