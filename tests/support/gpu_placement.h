// Which GPU each rank of a GPU test or benchmark uses. With fewer GPUs than ranks the ranks share GPUs: rank r runs
// on GPU r mod n (n = visible GPUs, at most the number of ranks), so that 2 or 4 ranks run on a one-GPU machine.
// Used by the in-process harnesses (intranode_harness, low_latency_harness.h), the product-level tests (one daemon
// and one client process per rank, several daemons with the same --device) and the benchmarks. No gtest here: the
// benchmarks include it too.
//
// Ranks that share a GPU inside one process must be able to run at the same time, because their kernels wait for
// each other: each rank has its own stream, and the blocks of all ranks on a GPU must be resident together.
// MaxBlocksPerRank gives the grid size that guarantees that for kernels of at most one block per SM (the intranode
// and low-latency kernels are __launch_bounds__(..., 1) with 512 or 1024 threads).
#pragma once

#include <algorithm>
#include <string>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"

namespace epfabric::testing {

// Number of usable CUDA devices; 0 when there is no driver or no device.
inline int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

// Streaming multiprocessors of `device` (0 when it cannot be read).
inline int SmCount(int device) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return sms;
}

struct GpuPlacement {
  int num_ranks = 1;
  int num_gpus = 1;  // GPUs used: min(visible, num_ranks)

  int device(int rank) const { return rank % num_gpus; }
  // Ranks on the busiest GPU (ceil(num_ranks / num_gpus)).
  int ranks_per_gpu() const { return (num_ranks + num_gpus - 1) / num_gpus; }
  // True when at least two ranks run on one GPU: their "peer" traffic then stays in that GPU's memory and they
  // share its SMs, so timings are not comparable with NVLink figures.
  bool shared() const { return num_ranks > num_gpus; }
  std::string ToString() const {
    return absl::StrFormat("%d rank(s) on %d GPU(s)%s", num_ranks, num_gpus,
                           shared() ? absl::StrFormat(", up to %d ranks per GPU", ranks_per_gpu()) : "");
  }
};

// Places `num_ranks` ranks on the GPUs `visible` (default: what CUDA sees). FailedPrecondition without a GPU.
inline absl::StatusOr<GpuPlacement> PlaceRanks(int num_ranks, int visible = -1) {
  if (visible < 0) visible = CudaDeviceCount();
  if (visible < 1) return absl::FailedPreconditionError("no CUDA device");
  if (num_ranks < 1) return absl::InvalidArgumentError(absl::StrFormat("num_ranks %d < 1", num_ranks));
  return GpuPlacement{.num_ranks = num_ranks, .num_gpus = std::min(visible, num_ranks)};
}

// Blocks each rank may launch so that every rank's grid on a GPU is resident at once, for kernels of at most one
// block per SM: the SM count of the GPU divided by the ranks on the busiest GPU (all of it when no GPU is shared).
inline int MaxBlocksPerRank(const GpuPlacement& placement, int device = 0) {
  return SmCount(device) / placement.ranks_per_gpu();
}

// OK when `blocks` per rank fit (see MaxBlocksPerRank); otherwise FailedPrecondition saying why, so that a shape
// that cannot run concurrently fails clearly instead of timing out in a kernel's wait.
inline absl::Status CheckBlocksFit(const GpuPlacement& placement, int blocks, int device = 0) {
  const int max = MaxBlocksPerRank(placement, device);
  if (blocks <= max) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrFormat(
      "%d blocks per rank do not fit: %d ranks share GPU %d (%d SMs), at most %d blocks per rank can be resident "
      "together (a rank's kernel would wait for a peer whose blocks cannot be scheduled)",
      blocks, placement.ranks_per_gpu(), device, SmCount(device), max));
}

}  // namespace epfabric::testing
