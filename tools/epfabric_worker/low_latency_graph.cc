// epfabric_worker --graph (low_latency_graph.h).
#include "low_latency_graph.h"

#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"

namespace epfabric::worker {
namespace {

absl::Status CudaError(const char* what, cudaError_t err) {
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

// Captures what `call` launches on `stream` and instantiates it into `*exec`.
absl::Status CaptureInto(cudaStream_t stream, const char* what, const std::function<absl::Status()>& call,
                         cudaGraphExec_t* exec) {
  cudaGraph_t graph = nullptr;
  if (cudaError_t err = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal); err != cudaSuccess) {
    return CudaError("begin capture", err);
  }
  const absl::Status called = call();
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  if (!called.ok()) return absl::Status(called.code(), absl::StrCat("capturing the ", what, ": ", called.message()));
  if (ended != cudaSuccess) return CudaError(absl::StrCat("end capture (", what, ")").c_str(), ended);
  const cudaError_t made = cudaGraphInstantiate(exec, graph, 0);
  cudaGraphDestroy(graph);
  if (made != cudaSuccess) return CudaError(absl::StrCat("instantiate (", what, ")").c_str(), made);
  return absl::OkStatus();
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

LowLatencyGraphs::~LowLatencyGraphs() {
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (dispatch_ != nullptr) cudaGraphExecDestroy(dispatch_);
  if (combine_ != nullptr) cudaGraphExecDestroy(combine_);
  for (void* p : owned_) cudaFree(p);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status LowLatencyGraphs::Copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_); err != cudaSuccess) {
    return CudaError("copy into a captured input", err);
  }
  return absl::OkStatus();
}

absl::Status LowLatencyGraphs::Replay(cudaGraphExec_t exec) {
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
    if (cudaError_t err = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); err != cudaSuccess) {
      return CudaError("cudaStreamCreate", err);
    }
    auto alloc = [&](size_t bytes, DType dtype, std::vector<int64_t> shape) -> absl::StatusOr<TensorView> {
      void* p = nullptr;
      if (cudaError_t err = cudaMalloc(&p, std::max<size_t>(bytes, 256)); err != cudaSuccess) {
        return CudaError("cudaMalloc", err);
      }
      owned_.push_back(p);
      return TensorView{.data = p, .dtype = dtype, .shape = std::move(shape)};
    };
    auto xv = alloc(T * H * 2, DType::kBF16, {T, H});
    auto iv = alloc(T * K * 8, DType::kInt64, {T, K});
    auto wv = alloc(T * K * 4, DType::kFloat32, {T, K});
    for (const auto* v : {&xv, &iv, &wv}) {
      if (!v->ok()) return v->status();
    }
    x_ = *xv;
    topk_idx_ = *iv;
    topk_weights_ = *wv;
    const absl::Status captured = CaptureInto(
        stream_, "dispatch",
        [&]() -> absl::Status {
          auto recv = buffer.LowLatencyDispatch({.x = x_, .topk_idx = topk_idx_, .use_fp8 = s.fp8}, stream_);
          if (recv.ok()) recv_ = std::move(*recv);
          return recv.status();
        },
        &dispatch_);
    if (!captured.ok()) return captured;
  }
  if (absl::Status c = Copy(x_.data, x.data(), x.size() * 2); !c.ok()) return c;
  if (absl::Status c = Copy(topk_idx_.data, topk_idx.data(), topk_idx.size() * 8); !c.ok()) return c;
  if (absl::Status c = Copy(topk_weights_.data, topk_weights.data(), topk_weights.size() * 4); !c.ok()) return c;
  if (absl::Status replayed = Replay(dispatch_); !replayed.ok()) return replayed;
  return recv_;
}

absl::StatusOr<client::LowLatencyCombineResult> LowLatencyGraphs::Combine(Buffer& buffer,
                                                                          const std::vector<uint16_t>& expert_outputs,
                                                                          int num_local_experts, int64_t slots,
                                                                          int hidden) {
  if (combine_ == nullptr) {
    void* p = nullptr;
    const size_t bytes = static_cast<size_t>(num_local_experts) * slots * hidden * 2;
    if (cudaError_t err = cudaMalloc(&p, std::max<size_t>(bytes, 256)); err != cudaSuccess) {
      return CudaError("cudaMalloc", err);
    }
    owned_.push_back(p);
    expert_ = {.data = p, .dtype = DType::kBF16, .shape = {num_local_experts, slots, hidden}};
    const absl::Status captured = CaptureInto(
        stream_, "combine",
        [&]() -> absl::Status {
          auto combined = buffer.LowLatencyCombine(
              {.x = expert_, .topk_idx = topk_idx_, .topk_weights = topk_weights_, .handle = recv_.handle}, stream_);
          if (combined.ok()) combined_ = std::move(*combined);
          return combined.status();
        },
        &combine_);
    if (!captured.ok()) return captured;
  }
  if (absl::Status c = Copy(expert_.data, expert_outputs.data(), expert_outputs.size() * 2); !c.ok()) return c;
  if (absl::Status replayed = Replay(combine_); !replayed.ok()) return replayed;
  return combined_;
}

}  // namespace epfabric::worker
