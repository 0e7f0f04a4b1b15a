// The dispatch layout: from top-k expert ids, how many tokens go to each rank and expert, and which token goes to
// which rank. One thread block cluster does it all: each of its blocks histograms a share of the tokens in its own
// shared memory, then the blocks sum the histograms through distributed shared memory and write the counts. No
// global atomics, no zeroing launch, no scratch memory to reset, and 8 SMs instead of one for the shared-memory
// atomics (which is what a single block spends most of its time on).
#include <cstdint>

#include <cooperative_groups.h>

#include "api/launch.h"
#include "launch.cuh"

namespace epfabric::kernels::intranode {
namespace {

namespace cg = cooperative_groups;

constexpr int kLayoutBlocks = 8;  // one portable-size cluster

__global__ void __cluster_dims__(kLayoutBlocks, 1, 1) __launch_bounds__(kLayoutThreads, 1)
    dispatch_layout_kernel(const __grid_constant__ LayoutKernelParams p) {
  // Histogram bins: [num_experts] experts, [num_ranks] ranks, [num_rdma_ranks] rdma ranks, 1 invalid-entry count.
  extern __shared__ int32_t s_counts[];
  cg::cluster_group cluster = cg::this_cluster();
  const int num_rdma_ranks = (p.num_ranks + kMaxNvlPeers - 1) / kMaxNvlPeers;
  const int num_bins = p.num_experts + p.num_ranks + num_rdma_ranks + 1;
  int32_t* s_expert = s_counts;
  int32_t* s_rank = s_counts + p.num_experts;
  int32_t* s_rdma = s_rank + p.num_ranks;
  int32_t* s_invalid = s_rdma + num_rdma_ranks;
  for (int i = threadIdx.x; i < num_bins; i += blockDim.x) s_counts[i] = 0;
  __syncthreads();

  const int experts_per_rank = p.num_experts / p.num_ranks;
  int invalid = 0;
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < p.num_tokens; t += gridDim.x * blockDim.x) {
    const int64_t* row = p.topk_idx + static_cast<int64_t>(t) * p.num_topk;
    uint64_t rank_mask = 0;
    for (int k = 0; k < p.num_topk; ++k) {
      const int64_t expert = __ldg(row + k);
      if (expert < -1 || expert >= p.num_experts) {
        ++invalid;
        continue;
      }
      if (expert < 0) continue;
      atomicAdd(&s_expert[expert], 1);
      rank_mask |= 1ull << (static_cast<int>(expert) / experts_per_rank);
    }
    bool* in_rank = p.is_token_in_rank + static_cast<int64_t>(t) * p.num_ranks;
    uint32_t rdma_mask = 0;
    for (int r = 0; r < p.num_ranks; ++r) {
      const bool in = (rank_mask >> r) & 1u;
      in_rank[r] = in;
      if (in) {
        atomicAdd(&s_rank[r], 1);
        rdma_mask |= 1u << (r / kMaxNvlPeers);
      }
    }
    if (p.num_tokens_per_rdma_rank != nullptr) {
      for (int rr = 0; rr < num_rdma_ranks; ++rr) {
        if ((rdma_mask >> rr) & 1u) atomicAdd(&s_rdma[rr], 1);
      }
    }
  }
  if (invalid != 0) atomicAdd(s_invalid, invalid);

  // Sum the blocks' histograms: block b owns every kLayoutBlocks-th share of the bins.
  cluster.sync();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < num_bins; i += gridDim.x * blockDim.x) {
    int32_t sum = 0;
    for (int b = 0; b < kLayoutBlocks; ++b) sum += cluster.map_shared_rank(s_counts, b)[i];
    if (i < p.num_experts) {
      p.num_tokens_per_expert[i] = sum;
    } else if (i < p.num_experts + p.num_ranks) {
      p.num_tokens_per_rank[i - p.num_experts] = sum;
    } else if (i < num_bins - 1) {
      if (p.num_tokens_per_rdma_rank != nullptr) p.num_tokens_per_rdma_rank[i - p.num_experts - p.num_ranks] = sum;
    } else if (p.num_invalid_topk != nullptr) {
      *p.num_invalid_topk = sum;
    }
  }
  // No block may exit (and free its shared memory) while another still reads it.
  cluster.sync();
}

}  // namespace

cudaError_t PreloadLayout() { return preload_kernel(dispatch_layout_kernel); }

cudaError_t LaunchDispatchLayout(const LayoutKernelParams& params, cudaStream_t stream) {
  const int num_rdma_ranks = (params.num_ranks + kMaxNvlPeers - 1) / kMaxNvlPeers;
  const size_t smem = sizeof(int32_t) * (params.num_experts + params.num_ranks + num_rdma_ranks + 1);
  return launch_kernel(dispatch_layout_kernel, params,
                       LaunchShape{.blocks = kLayoutBlocks, .threads = kLayoutThreads, .dynamic_smem_bytes = smem},
                       stream);
}

}  // namespace epfabric::kernels::intranode
