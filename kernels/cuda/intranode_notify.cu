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
  __shared__ int32_t num_recv_shared;
  // A barrier that failed (timeout, lost peer: recorded in the status word) ends the host's wait for the count at
  // once instead of at its own timeout.
  auto stop = [&] {
    if (threadIdx.x == 0 && p.host_num_recv_tokens != nullptr) {
      __threadfence_system();
      *reinterpret_cast<volatile int32_t*>(p.host_num_recv_tokens) = kRecvCountKernelFailed;
    }
  };
  // Lane 0 of the barrier: the notify launch has one block on every rank.
  if (!block_barrier(g, 0)) return stop();

  for (int i = threadIdx.x; i < num_ranks * num_ranks; i += blockDim.x) {
    const int dst = i / num_ranks, r = i % num_ranks;
    section<int32_t>(g, dst, g.notify_rank_counts)[g.rank * num_ranks + r] = p.num_tokens_per_rank[r];
  }
  for (int i = threadIdx.x; i < num_ranks * experts_per_rank; i += blockDim.x) {
    const int dst = i / experts_per_rank, e = i % experts_per_rank;
    section<int32_t>(g, dst, g.notify_expert_counts)[g.rank * experts_per_rank + e] = p.num_tokens_per_expert[i];
  }
  if (!block_barrier(g, 0)) return stop();

  // The counts are peer data: each is checked as it is loaded (a source sends at most max_tokens_per_rank tokens to
  // a rank and has at most max_tokens_per_rank * max_topk entries for one expert); a bad one is recorded in the
  // status word and counts as 0, so the prefix matrix stays consistent and within the worst case for a dispatch that
  // follows without a host wait, and the host counter gets kRecvCountBadPeerData instead of a count.
  const int32_t* rank_counts = section<int32_t>(g, g.rank, g.notify_rank_counts);
  const int32_t* expert_counts = section<int32_t>(g, g.rank, g.notify_expert_counts);
  const int64_t max_expert_count = static_cast<int64_t>(g.max_tokens_per_rank) * max(g.max_topk, 1);
  auto rank_count = [&](int src, int dst, bool& bad) {
    const int32_t n = ptx::ld_cg_global(rank_counts + src * num_ranks + dst);
    if (check_peer_value(g.status, PeerDataField::kNotifyRankCount, g.rank, src, dst, n, 0, g.max_tokens_per_rank)) {
      return n;
    }
    bad = true;
    return 0;
  };
  bool bad = false;
  for (int i = threadIdx.x; i < num_ranks * num_ranks; i += blockDim.x) {
    const int src = i / num_ranks, dst = i % num_ranks;
    int32_t sum = 0;
    for (int s = 0; s <= src; ++s) sum += rank_count(s, dst, bad);
    p.rank_prefix_matrix[i] = sum;
  }
  for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x) {
    int64_t sum = 0;
    for (int s = 0; s < num_ranks; ++s) {
      const int32_t n = ptx::ld_cg_global(expert_counts + s * experts_per_rank + e);
      if (check_peer_value(g.status, PeerDataField::kNotifyExpertCount, g.rank, s, e, n, 0, max_expert_count)) {
        sum += n;
      } else {
        bad = true;
      }
    }
    const int64_t aligned = (sum + p.expert_alignment - 1) / p.expert_alignment * p.expert_alignment;
    const int32_t clamped = static_cast<int32_t>(min(aligned, static_cast<int64_t>(INT32_MAX)));
    if (p.recv_counts != nullptr) p.recv_counts[1 + e] = clamped;
    if (p.host_num_recv_tokens_per_expert != nullptr) {
      *reinterpret_cast<volatile int32_t*>(p.host_num_recv_tokens_per_expert + e) = clamped;
    }
  }
  if (threadIdx.x == 0) {
    int32_t num_recv = 0;
    for (int s = 0; s < num_ranks; ++s) num_recv += rank_count(s, g.rank, bad);
    if (p.recv_counts != nullptr) p.recv_counts[0] = num_recv;
    num_recv_shared = num_recv;
  }
  bad = __syncthreads_or(bad);
  if (threadIdx.x == 0 && p.host_num_recv_tokens != nullptr) {
    // The per-expert counters (written by other threads before __syncthreads_or) become visible first: the host
    // polls this one.
    __threadfence_system();
    *reinterpret_cast<volatile int32_t*>(p.host_num_recv_tokens) = bad ? kRecvCountBadPeerData : num_recv_shared;
  }
}

// One thread per (barrier lane, peer): the marker of IntranodeAbandonCall.
__global__ void abandon_call_kernel(const __grid_constant__ GroupView g, const KernelStatus* only_if_failed) {
  if (only_if_failed != nullptr && !status_failed(only_if_failed)) return;
  const int total = g.max_channels * g.num_ranks;
  ptx::fence_acq_rel_sys();
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int lane = i / g.num_ranks, peer = i % g.num_ranks;
    if (peer == g.rank) continue;
    ptx::red_add_release_sys_global(section<int32_t>(g, peer, g.barrier_arrive) + lane * g.num_ranks + g.rank,
                                    kAbandonArrivals);
  }
}

}  // namespace

cudaError_t LaunchAbandonCall(const GroupView& group, cudaStream_t stream, const KernelStatus* only_if_failed) {
  abandon_call_kernel<<<1, kNotifyThreads, 0, stream>>>(group, only_if_failed);
  return cudaGetLastError();
}

cudaError_t PreloadNotify() { return preload_kernel(notify_kernel); }

cudaError_t LaunchNotify(const NotifyKernelParams& params, cudaStream_t stream) {
  return launch_kernel(notify_kernel, params, LaunchShape{.blocks = 1, .threads = kNotifyThreads}, stream);
}

}  // namespace epfabric::kernels::intranode
