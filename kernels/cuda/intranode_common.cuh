// Internal device helpers of the intranode kernels: addressing the sections of a region, the per-block cross-rank
// barrier, bulk copies and named barriers.
#pragma once

#include <cstdint>

#include "api/launch.h"
#include "bounded_wait.cuh"
#include "epfabric/kernels/device/ptx.cuh"
#include "launch.cuh"
#include "profile.cuh"

namespace epfabric::kernels::intranode {

// The section at `offset` of rank `region_rank`'s region, as a T*.
template <typename T>
__device__ __forceinline__ T* section(const GroupView& g, int region_rank, uint64_t offset) {
  return reinterpret_cast<T*>(g.regions[region_rank] + offset);
}

// First token of `channel` when `num_tokens` are split into `num_channels` contiguous, balanced ranges.
__device__ __forceinline__ int channel_token_begin(int num_tokens, int num_channels, int channel) {
  return static_cast<int>(static_cast<int64_t>(num_tokens) * channel / num_channels);
}

// Row of the first token received from `src` on rank `dst`: rank_prefix_matrix is inclusive over sources.
__device__ __forceinline__ int recv_base(const int32_t* rank_prefix_matrix, int num_ranks, int src, int dst) {
  return src == 0 ? 0 : rank_prefix_matrix[(src - 1) * num_ranks + dst];
}

using ptx::named_barrier;

// Progress counters in shared memory that one warp publishes and another polls (copy warps -> publisher warp): an
// atomic exchange after a CTA fence, read with atomic loads, so that the hand-off is explicit (and visible as such
// to compute-sanitizer's racecheck, which does not model volatile flags).
__device__ __forceinline__ void publish_progress(int* counter, int value) {
  __threadfence_block();
  atomicExch_block(counter, value);
}
__device__ __forceinline__ int read_progress(int* counter) { return atomicAdd_block(counter, 0); }

__device__ __forceinline__ uint32_t lanemask_lt() {
  uint32_t mask;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(mask));
  return mask;
}

// Cross-rank barrier for block `lane` of this launch: every block of every rank calls it with its own index, so
// that a rank only writes into a peer's region after that peer has finished every earlier kernel on its stream
// (stream order: its block `lane` of this launch only starts once its previous launch has ended). Counters are
// monotonic (no reset needed between calls). Writes of the calling block before the barrier are visible to the
// peers after it: the arrival is a system-scope release, and a release is cumulative over what the block's other
// threads wrote before the __syncthreads that precedes it (so no separate system fence, which cost ~1-2 us per
// kernel). Split in two so that a block can do local work between arriving and waiting: block_barrier_arrive
// (threads < num_ranks, after a __syncthreads) then block_barrier_wait (every thread of the block).
__device__ __forceinline__ void block_barrier_arrive(const GroupView& g, int lane) {
  if (threadIdx.x < g.num_ranks) {
    const int peer = static_cast<int>(threadIdx.x);
    ptx::red_add_release_sys_global(section<int32_t>(g, peer, g.barrier_arrive) + lane * g.num_ranks + g.rank, 1);
  }
}

// Returns false (every thread of the block) when a peer did not arrive in time.
__device__ __forceinline__ bool block_barrier_wait(const GroupView& g, int lane) {
  bool failed = false;
  if (threadIdx.x < g.num_ranks) {
    const int peer = static_cast<int>(threadIdx.x);
    const int32_t* epoch = section<int32_t>(g, g.rank, g.barrier_epoch) + lane;
    const int32_t target = static_cast<int32_t>(static_cast<uint32_t>(*epoch) + 1u);
    const int32_t* arrived = section<int32_t>(g, g.rank, g.barrier_arrive) + lane * g.num_ranks + peer;
    // Peer data: a peer is at most two arrivals ahead of this rank's completed barriers (its next arrival needs
    // this rank's current one); a counter further ahead (or behind) is stale or corrupt and would let the block
    // through without the peer: recorded, never trusted.
    int32_t ahead = 0;
    failed = !bounded_wait(
        [&] {
          ahead = static_cast<int32_t>(static_cast<uint32_t>(ptx::ld_acquire_sys_global(arrived)) -
                                       static_cast<uint32_t>(target - 1));
          return ahead != 0;
        },
        g.timeout_ns, g.status, WaitSite::kBarrier, g.rank, peer, lane, loss_words(g, peer));
    // It left the call (IntranodeAbandonCall) and will not arrive: the marker plus at most the 2 arrivals a live
    // rank can be ahead. Any other large count is corrupt (checked below).
    if (!failed && ahead >= kAbandonArrivals && ahead <= kAbandonArrivals + 2) {
      record_wait_end(g.status, kKernelStatusPeerLeftCall, WaitSite::kBarrier, g.rank, peer, lane);
      failed = true;
    }
    failed = failed || !check_peer_value(g.status, PeerDataField::kBarrierArrivals, g.rank, peer, lane, ahead, 1, 2);
  }
  failed = __syncthreads_or(failed);
  if (!failed && threadIdx.x == 0) {
    int32_t* epoch = section<int32_t>(g, g.rank, g.barrier_epoch) + lane;
    *epoch = static_cast<int32_t>(static_cast<uint32_t>(*epoch) + 1u);
  }
  return !failed;
}

__device__ __forceinline__ bool block_barrier(const GroupView& g, int lane) {
  __syncthreads();
  block_barrier_arrive(g, lane);
  return block_barrier_wait(g, lane);
}

// Copies `num_int4` 16-byte words with `num_threads` threads (thread index `tid`), four loads in flight per thread
// before the stores. kFromPeerWrites selects L2-only loads for data other GPUs wrote during this kernel.
template <bool kFromPeerWrites>
__device__ __forceinline__ void group_copy_int4(int4* __restrict__ dst, const int4* __restrict__ src, int64_t num_int4,
                                                int tid, int num_threads) {
  constexpr int kUnroll = 4;
  for (int64_t base = tid; base < num_int4; base += static_cast<int64_t>(num_threads) * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * num_threads;
      if (i < num_int4) v[u] = kFromPeerWrites ? ptx::ld_cg_global(src + i) : ptx::ld_nc_global(src + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * num_threads;
      if (i < num_int4) ptx::st_na_global(dst + i, v[u]);
    }
  }
}

// Copies `num_words` 4-byte words (metadata rows that need not be 16-byte aligned).
template <bool kFromPeerWrites>
__device__ __forceinline__ void group_copy_words(int32_t* __restrict__ dst, const int32_t* __restrict__ src,
                                                 int64_t num_words, int tid, int num_threads) {
  for (int64_t i = tid; i < num_words; i += num_threads) {
    dst[i] = kFromPeerWrites ? ptx::ld_cg_global(src + i) : __ldg(src + i);
  }
}

}  // namespace epfabric::kernels::intranode
