// A single-process stand-in for a group of intranode ranks: each rank gets a region (cudaMalloc on its device), a
// stream, a status word and mapped host counters. Rank r runs on GPU r mod n (gpu_placement.h): with fewer GPUs
// than ranks, ranks share a GPU and reach each other's regions by plain device pointers (same device: no peer
// access, no IPC); ranks on different GPUs use peer access. Every rank has its own stream, so that kernels of ranks
// on one GPU run concurrently, and PipelineRunner refuses a channel count whose blocks cannot all be resident at once
// (num_sms x ranks per GPU > SMs). Shared by intranode_gpu_test and intranode_bench. Also holds the per-call device
// buffers of one rank and the random input generator, so both programs run the same pipeline.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epfabric/kernels/intranode.h"
#include "epfabric/kernels/reference/intranode_reference.h"
#include "gpu_placement.h"

namespace epfabric::testing {

// Device memory on one GPU (freed on that GPU).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  ~DeviceBuffer();

  // Allocates `bytes` (at least 16, so that a zero-size tensor still has an aligned, non-null pointer).
  absl::Status Allocate(int device, size_t bytes);
  absl::Status Upload(const void* host, size_t bytes);
  absl::Status Download(void* host, size_t bytes) const;
  // Fills with 0xFF bytes so that an element the kernel did not write cannot pass a comparison.
  absl::Status Poison(cudaStream_t stream);

  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  int device_ = 0;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

struct RankContext {
  int device = 0;
  cudaStream_t stream = nullptr;
  DeviceBuffer region;
  DeviceBuffer status;             // KernelStatus
  int32_t* host_counts = nullptr;  // mapped: [0] num_recv_tokens, [1..] per expert
  kernels::IntranodeGroup group;
};

class IntranodeTestGroup {
 public:
  // Places rank r on GPU r mod (visible GPUs), enables peer access between the distinct GPUs used, allocates and
  // zeroes the regions. FailedPrecondition without a GPU or when two GPUs used cannot access each other.
  static absl::StatusOr<std::unique_ptr<IntranodeTestGroup>> Create(const kernels::IntranodeRegionConfig& config);
  ~IntranodeTestGroup();

  int num_ranks() const { return static_cast<int>(ranks_.size()); }
  RankContext& rank(int r) { return *ranks_[r]; }
  const kernels::IntranodeRegionConfig& config() const { return config_; }
  const GpuPlacement& placement() const { return placement_; }

  // Synchronises every rank's stream and returns the first non-OK kernel status (then clears all of them).
  absl::Status SyncAndCheck();
  // Zeroes every region's signals and clears the status words (after a timeout).
  absl::Status ResetAll();

 private:
  kernels::IntranodeRegionConfig config_;
  GpuPlacement placement_;
  std::vector<std::unique_ptr<RankContext>> ranks_;
};

// What one dispatch/combine test or benchmark case is.
struct CaseConfig {
  int hidden = 7168;
  std::vector<int> num_tokens;  // per rank
  int num_topk = 8;
  int num_experts = 256;
  bool fp8 = false;
  bool send_topk = true;     // pass topk_idx to dispatch
  bool send_weights = true;  // pass topk_weights to dispatch (needs send_topk)
  bool with_bias = false;    // combine biases
  int num_sms = 24;
  int expert_alignment = 1;
  double empty_slot_fraction = 0.0;  // fraction of top-k entries set to -1
};

// Random inputs for every rank (distinct experts per token), from `rng`.
std::vector<kernels::reference::RankInput> MakeInputs(const CaseConfig& c, std::mt19937_64& rng);
kernels::reference::DispatchConfig MakeReferenceConfig(const CaseConfig& c);

// Device buffers of one rank for one case.
struct RankBuffers {
  int num_tokens = 0;
  int num_recv_tokens = 0;  // known after notify
  DeviceBuffer x, x_scales, topk_idx, topk_weights;
  DeviceBuffer num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, num_invalid_topk;
  DeviceBuffer rank_prefix_matrix, recv_counts, recv_channel_prefix, send_slot, recv_src_idx;
  DeviceBuffer recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights;
  DeviceBuffer combine_x, combine_weights, bias_0, bias_1, combined_x, combined_weights;
  kernels::IntranodeHandle handle;
};

// Runs the whole pipeline step by step over all ranks (launching every rank before waiting on any).
class PipelineRunner {
 public:
  PipelineRunner(IntranodeTestGroup* group, CaseConfig config) : group_(group), config_(std::move(config)) {}

  // Allocates and uploads inputs; allocates layout/handle buffers (recv buffers come after notify). Fails when
  // num_sms blocks per rank cannot all be resident with the other ranks on the same GPU (CheckBlocksFit).
  absl::Status Prepare(const std::vector<kernels::reference::RankInput>& inputs);
  absl::Status RunLayout();
  // Notify, then waits for the mapped counts and allocates the recv buffers (poisoned).
  absl::Status RunNotify();
  // Allocates the recv tensors of `rank` for `rows` rows (the handle's num_recv_tokens = rows).
  absl::Status AllocateRecv(int rank, int rows);
  absl::Status PoisonRecv();
  absl::Status RunDispatch();
  // Uploads combine inputs (x rows, weights, biases) and poisons the outputs.
  absl::Status PrepareCombine(const std::vector<kernels::reference::CombineInput>& inputs);
  absl::Status RunCombine();

  // Launch-only variants for timing (no host sync inside); `rank` selects one rank.
  absl::Status LaunchLayout(int rank);
  absl::Status LaunchNotify(int rank);
  absl::Status LaunchDispatch(int rank);
  absl::Status LaunchCombine(int rank);

  RankBuffers& buffers(int rank) { return *buffers_[rank]; }
  const CaseConfig& config() const { return config_; }

 private:
  IntranodeTestGroup* group_;
  CaseConfig config_;
  std::vector<std::unique_ptr<RankBuffers>> buffers_;
};

template <typename T>
absl::StatusOr<std::vector<T>> DownloadVector(const DeviceBuffer& buffer, size_t count) {
  std::vector<T> out(count);
  if (count == 0) return out;
  absl::Status s = buffer.Download(out.data(), count * sizeof(T));
  if (!s.ok()) return s;
  return out;
}

}  // namespace epfabric::testing
