// epfabric_worker --graph (cuda): a round's dispatch and its combine as two CUDA graphs, captured at the first round on
// a stream of their own and replayed every round with that round's inputs copied into the captured input tensors
// (the number of tokens is baked into the graph: --fixed_tokens). The outputs are the captured ones, so each round's
// checks read what the replay wrote. Low latency, or normal mode in worst-case mode (--worst_tokens; the layout is
// captured with the dispatch).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker.h"

namespace epfabric::worker {

// Outputs stay at the addresses captured, and nothing is allocated in stream order while capturing: a bump
// allocator over one cudaMalloc'd arena (the Buffer of a --graph run takes it).
class ArenaAllocator final : public client::Allocator {
 public:
  explicit ArenaAllocator(size_t bytes);
  ~ArenaAllocator() override;
  absl::StatusOr<void*> Allocate(size_t bytes, cudaStream_t stream) override;
  void Free(void* /*ptr*/, cudaStream_t /*stream*/) override {}

 private:
  void* base_ = nullptr;
  size_t size_ = 0;
  size_t used_ = 0;
};

// The stream, the captured graphs and the input tensors (cudaMalloc'd: they outlive the round) of one mode.
class GraphRunner {
 public:
  GraphRunner() = default;
  ~GraphRunner();
  GraphRunner(const GraphRunner&) = delete;
  GraphRunner& operator=(const GraphRunner&) = delete;

 protected:
  // Captures what `call` launches on stream_ (made at the first capture) into `*exec`.
  absl::Status Capture(const char* what, const std::function<absl::Status()>& call, cudaGraphExec_t* exec);
  absl::StatusOr<TensorView> Alloc(size_t bytes, DType dtype, std::vector<int64_t> shape);
  // Copies this round's inputs into the captured tensors, replays `exec` and waits for it.
  struct Input {
    void* dst;
    const void* src;
    size_t bytes;
  };
  absl::Status CopyAndReplay(std::initializer_list<Input> inputs, cudaGraphExec_t exec);

  cudaStream_t stream_ = nullptr;
  cudaGraphExec_t dispatch_ = nullptr, combine_ = nullptr;

 private:
  std::vector<void*> owned_;
};

class LowLatencyGraphs final : public GraphRunner {
 public:
  // Copies the inputs into the captured tensors and replays the dispatch (capturing it first), then waits for it.
  absl::StatusOr<client::LowLatencyDispatchResult> Dispatch(Buffer& buffer, const Scenario& s,
                                                            const std::vector<uint16_t>& x,
                                                            const std::vector<int64_t>& topk_idx,
                                                            const std::vector<float>& topk_weights, int num_tokens);
  // The same for the combine of that dispatch, with `expert_outputs` (bf16 [L][R*M][hidden]).
  absl::StatusOr<client::LowLatencyCombineResult> Combine(Buffer& buffer, const std::vector<uint16_t>& expert_outputs,
                                                          int num_local_experts, int64_t slots, int hidden);

 private:
  TensorView x_, topk_idx_, topk_weights_, expert_;
  client::LowLatencyDispatchResult recv_;
  client::LowLatencyCombineResult combined_;
};

// Normal mode: GetDispatchLayout + Dispatch (with s.worst_tokens) in one graph, Combine in the other.
class NormalGraphs final : public GraphRunner {
 public:
  // `x` holds the rows' bytes (BF16 or FP8), `scales` the scale words (float, or packed int32 with
  // --packed_scales); `scales_shape` is their tensor shape.
  absl::StatusOr<client::DispatchResult> Dispatch(Buffer& buffer, const Scenario& s, const std::vector<uint8_t>& x,
                                                  const std::vector<uint32_t>& scales, DType scales_dtype,
                                                  std::vector<int64_t> scales_shape,
                                                  const std::vector<int64_t>& topk_idx,
                                                  const std::vector<float>& topk_weights, int num_tokens);
  const client::DispatchLayout& layout() const { return layout_; }
  // The combine of that dispatch with `expert_outputs` (bf16 [num_worst_tokens][hidden]).
  absl::StatusOr<client::CombineResult> Combine(Buffer& buffer, const std::vector<uint16_t>& expert_outputs,
                                                int hidden);

 private:
  TensorView x_, scales_, topk_idx_, topk_weights_, expert_;
  client::DispatchLayout layout_;
  client::DispatchResult recv_;
  client::CombineResult combined_;
};

}  // namespace epfabric::worker
