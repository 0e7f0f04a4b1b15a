// epfabric_worker --graph (low latency, cuda): a round's dispatch and its combine as two CUDA graphs, captured at the
// first round on a stream of their own and replayed every round with that round's inputs copied into the captured
// input tensors (the number of tokens is baked into the graph: --fixed_tokens). The outputs are the captured ones,
// so each round's checks read what the replay wrote.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
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

class LowLatencyGraphs {
 public:
  LowLatencyGraphs() = default;
  ~LowLatencyGraphs();
  LowLatencyGraphs(const LowLatencyGraphs&) = delete;
  LowLatencyGraphs& operator=(const LowLatencyGraphs&) = delete;

  // Copies the inputs into the captured tensors and replays the dispatch (capturing it first), then waits for it.
  absl::StatusOr<client::LowLatencyDispatchResult> Dispatch(Buffer& buffer, const Scenario& s,
                                                            const std::vector<uint16_t>& x,
                                                            const std::vector<int64_t>& topk_idx,
                                                            const std::vector<float>& topk_weights, int num_tokens);
  // The same for the combine of that dispatch, with `expert_outputs` (bf16 [L][R*M][hidden]).
  absl::StatusOr<client::LowLatencyCombineResult> Combine(Buffer& buffer, const std::vector<uint16_t>& expert_outputs,
                                                          int num_local_experts, int64_t slots, int hidden);

 private:
  absl::Status Copy(void* dst, const void* src, size_t bytes);
  absl::Status Replay(cudaGraphExec_t exec);

  cudaStream_t stream_ = nullptr;
  cudaGraphExec_t dispatch_ = nullptr, combine_ = nullptr;
  std::vector<void*> owned_;
  TensorView x_, topk_idx_, topk_weights_, expert_;
  client::LowLatencyDispatchResult recv_;
  client::LowLatencyCombineResult combined_;
};

}  // namespace epfabric::worker
