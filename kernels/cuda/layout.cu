// The dispatch layout: from top-k expert ids, how many tokens go to each rank and expert, and which token goes to
// which rank. One block does it all: at a few thousand tokens the work is a few hundred KB of reads and shared
// memory histograms, and a single block needs no global atomics, no zeroing launch and no cross-block reduction
// (which is what makes DeepEP's multi-block version slower at this size).
#include <cstdint>

#include "intranode_launch.h"

namespace epfabric::kernels::intranode {
namespace {

__global__ void __launch_bounds__(kLayoutThreads, 1)
    dispatch_layout_kernel(const __grid_constant__ LayoutKernelParams p) {
  extern __shared__ int32_t s_counts[];  // [num_experts] experts, then [num_ranks] ranks, then rdma ranks
  const int num_rdma_ranks = (p.num_ranks + kMaxNvlPeers - 1) / kMaxNvlPeers;
  int32_t* s_expert = s_counts;
  int32_t* s_rank = s_counts + p.num_experts;
  int32_t* s_rdma = s_rank + p.num_ranks;
  __shared__ int32_t s_invalid;
  for (int i = threadIdx.x; i < p.num_experts + p.num_ranks + num_rdma_ranks; i += blockDim.x) s_counts[i] = 0;
  if (threadIdx.x == 0) s_invalid = 0;
  __syncthreads();

  const int experts_per_rank = p.num_experts / p.num_ranks;
  int invalid = 0;
  for (int t = threadIdx.x; t < p.num_tokens; t += blockDim.x) {
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
  if (invalid != 0) atomicAdd(&s_invalid, invalid);
  __syncthreads();

  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) p.num_tokens_per_expert[e] = s_expert[e];
  for (int r = threadIdx.x; r < p.num_ranks; r += blockDim.x) p.num_tokens_per_rank[r] = s_rank[r];
  if (p.num_tokens_per_rdma_rank != nullptr) {
    for (int rr = threadIdx.x; rr < num_rdma_ranks; rr += blockDim.x) p.num_tokens_per_rdma_rank[rr] = s_rdma[rr];
  }
  if (p.num_invalid_topk != nullptr && threadIdx.x == 0) *p.num_invalid_topk = s_invalid;
}

}  // namespace

cudaError_t LaunchDispatchLayout(const LayoutKernelParams& params, cudaStream_t stream) {
  const int num_rdma_ranks = (params.num_ranks + kMaxNvlPeers - 1) / kMaxNvlPeers;
  const size_t smem = sizeof(int32_t) * (params.num_experts + params.num_ranks + num_rdma_ranks);
  dispatch_layout_kernel<<<1, kLayoutThreads, smem, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace epfabric::kernels::intranode
