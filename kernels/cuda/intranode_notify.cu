// Notify: every rank writes its per-rank and per-expert token counts into every region of the group (its own
// included), a barrier makes them visible, and each rank then derives the rank prefix matrix and what it will
// receive. Two barriers, one block: the cost is two NVLink round trips.
#include <cstdint>

#include "intranode_common.cuh"

namespace epfabric::kernels::intranode {
namespace {

__global__ void __launch_bounds__(kNotifyThreads, 1) notify_kernel(const __grid_constant__ NotifyKernelParams p) {
  const GroupView& g = p.group;
  const int num_ranks = g.num_ranks;
  const int experts_per_rank = g.experts_per_rank;
  // Lane 0 of the barrier: the notify launch has one block on every rank.
  if (!block_barrier(g, 0)) return;

  for (int i = threadIdx.x; i < num_ranks * num_ranks; i += blockDim.x) {
    const int dst = i / num_ranks, r = i % num_ranks;
    section<int32_t>(g, dst, g.notify_rank_counts)[g.rank * num_ranks + r] = p.num_tokens_per_rank[r];
  }
  for (int i = threadIdx.x; i < num_ranks * experts_per_rank; i += blockDim.x) {
    const int dst = i / experts_per_rank, e = i % experts_per_rank;
    section<int32_t>(g, dst, g.notify_expert_counts)[g.rank * experts_per_rank + e] = p.num_tokens_per_expert[i];
  }
  if (!block_barrier(g, 0)) return;

  const int32_t* rank_counts = section<int32_t>(g, g.rank, g.notify_rank_counts);
  const int32_t* expert_counts = section<int32_t>(g, g.rank, g.notify_expert_counts);
  for (int i = threadIdx.x; i < num_ranks * num_ranks; i += blockDim.x) {
    const int src = i / num_ranks, dst = i % num_ranks;
    int32_t sum = 0;
    for (int s = 0; s <= src; ++s) sum += ptx::ld_cg_global(rank_counts + s * num_ranks + dst);
    p.rank_prefix_matrix[i] = sum;
  }
  for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x) {
    int32_t sum = 0;
    for (int s = 0; s < num_ranks; ++s) sum += ptx::ld_cg_global(expert_counts + s * experts_per_rank + e);
    const int32_t aligned = (sum + p.expert_alignment - 1) / p.expert_alignment * p.expert_alignment;
    if (p.recv_counts != nullptr) p.recv_counts[1 + e] = aligned;
    if (p.host_num_recv_tokens_per_expert != nullptr) {
      *reinterpret_cast<volatile int32_t*>(p.host_num_recv_tokens_per_expert + e) = aligned;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t num_recv = 0;
    for (int s = 0; s < num_ranks; ++s) num_recv += ptx::ld_cg_global(rank_counts + s * num_ranks + g.rank);
    if (p.recv_counts != nullptr) p.recv_counts[0] = num_recv;
    if (p.host_num_recv_tokens != nullptr) {
      // The per-expert counters (written by other threads before __syncthreads) become visible first: the host
      // polls this one.
      __threadfence_system();
      *reinterpret_cast<volatile int32_t*>(p.host_num_recv_tokens) = num_recv;
    }
  }
}

}  // namespace

cudaError_t LaunchNotify(const NotifyKernelParams& params, cudaStream_t stream) {
  return launch_kernel(notify_kernel, params, LaunchShape{.blocks = 1, .threads = kNotifyThreads}, stream);
}

}  // namespace epfabric::kernels::intranode
