// Dispatch (normal and cached): block c is channel c. It owns the contiguous token range c of this rank (as a
// sender) and the channel-c traffic of every peer (as a receiver).
//  1. arrive at the barrier (block-level, see block_barrier_arrive/wait), so that no peer still reads what we are
//     about to overwrite; while the peers arrive,
//  2. every thread helps compute, for the channel's tokens, their slot among the tokens this rank sends to each
//     destination (a block scan of is_token_in_rank), written to the handle as send_slot; then wait at the barrier;
//  3. copy warps copy each token once from x (one load, up to num_ranks stores): into the peer's staging pool at
//     the token's slot, or straight into recv_x for this rank's own share; the publisher warp turns their progress
//     into release stores of the running count into the peer's tail, which tell the receiver how far it may read;
//  4. receiver warps poll the tails of the peers and copy each newly visible run of rows (contiguous, since the
//     slots of one channel are consecutive) from the own staging pool into recv_x, then zero the signals they
//     consumed so that the region is clean for the next call.
// The staging pools hold max_tokens_per_rank rows per peer, so a sender never waits for space: the only waits are
// the barrier and the receivers' waits on tails. In worst-case mode (outputs sized without a host wait for the count)
// the kernel also pads the top-k rows past the received ones, and refuses to run when more rows arrive than fit.
#include <cstdint>

#include "intranode_common.cuh"

namespace epfabric::kernels::intranode {
namespace {

constexpr int kReceiverBarrier = 2;

// Packs a channel's slot range for the receiver: high word end + 1 (never 0, so 0 means "not yet written").
__device__ __forceinline__ int64_t pack_range(int begin, int end) {
  return (static_cast<int64_t>(end + 1) << 32) | static_cast<uint32_t>(begin);
}

// Step 2: send_slot for tokens [token_begin, token_end) and, per destination, the channel's first slot and count.
// The tokens before the channel only need counting (one parallel pass); the channel's own tokens are scanned in
// order, a tile of kThreadsPerBlock tokens at a time.
__device__ void compute_send_slots(const DispatchKernelParams& p, int token_begin, int token_end, int* s_begin,
                                   int* s_count) {
  const int num_ranks = p.group.num_ranks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ int s_warp_prefix[kThreadsPerBlock / 32][kMaxNvlPeers];
  __shared__ int s_running[kMaxNvlPeers];
  if (threadIdx.x < kMaxNvlPeers) s_running[threadIdx.x] = 0;
  __syncthreads();
  {
    int before[kMaxNvlPeers] = {};
#pragma unroll 4
    for (int t = threadIdx.x; t < token_begin; t += kThreadsPerBlock) {
      const bool* row = p.is_token_in_rank + static_cast<int64_t>(t) * num_ranks;
#pragma unroll
      for (int d = 0; d < kMaxNvlPeers; ++d) {
        if (d < num_ranks) before[d] += row[d] ? 1 : 0;
      }
    }
#pragma unroll
    for (int d = 0; d < kMaxNvlPeers; ++d) {
      const int sum = __reduce_add_sync(0xffffffffu, before[d]);
      if (lane == 0 && d < num_ranks && sum != 0) atomicAdd_block(&s_running[d], sum);
    }
  }
  __syncthreads();
  if (threadIdx.x < num_ranks) s_begin[threadIdx.x] = s_running[threadIdx.x];
  for (int tile = token_begin; tile < token_end; tile += kThreadsPerBlock) {
    const int t = tile + static_cast<int>(threadIdx.x);
    const bool valid = t < token_end;
    uint32_t masks[kMaxNvlPeers];
#pragma unroll
    for (int d = 0; d < kMaxNvlPeers; ++d) {
      const bool flag = d < num_ranks && valid && p.is_token_in_rank[static_cast<int64_t>(t) * num_ranks + d];
      masks[d] = __ballot_sync(0xffffffffu, flag);
      if (lane == 0) s_warp_prefix[warp][d] = __popc(masks[d]);
    }
    __syncthreads();
    if (threadIdx.x < num_ranks) {
      const int d = threadIdx.x;
      int running = s_running[d];
      for (int w = 0; w < kThreadsPerBlock / 32; ++w) {
        const int count = s_warp_prefix[w][d];
        s_warp_prefix[w][d] = running;
        running += count;
      }
      s_running[d] = running;
    }
    __syncthreads();
    if (valid) {
#pragma unroll
      for (int d = 0; d < kMaxNvlPeers; ++d) {
        if (d >= num_ranks) break;
        const int slot = s_warp_prefix[warp][d] + __popc(masks[d] & lanemask_lt());
        p.send_slot[static_cast<int64_t>(t) * num_ranks + d] = (masks[d] >> lane) & 1u ? slot : -1;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x < num_ranks) s_count[threadIdx.x] = s_running[threadIdx.x] - s_begin[threadIdx.x];
  __syncthreads();
}

// Step 3a, copy warps: warp w sends the channel's tokens w, w + num_copy_warps, ... and after each one records how
// many of its tokens are complete (shared memory, CTA-scope release) for the publisher.
__device__ void send_tokens(const DispatchKernelParams& p, int token_begin, int token_end, int* s_warp_done) {
  const GroupView& g = p.group;
  const int num_ranks = g.num_ranks, me = g.rank;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int num_row_int4 = p.row_bytes / 16;
  const int my_recv_base = recv_base(p.rank_prefix_matrix, num_ranks, me, me);
  __shared__ int4* s_dst_row[kMaxCopyWarps][kMaxNvlPeers];

  int done = 0;
  for (int t = token_begin + warp; t < token_end; t += p.num_copy_warps) {
    const int my_slot = lane < num_ranks ? p.send_slot[static_cast<int64_t>(t) * num_ranks + lane] : -1;
    // Lane d: where the row goes on destination d (or null).
    if (lane < num_ranks) {
      int4* dst = nullptr;
      if (my_slot >= 0) {
        dst = lane == me
                  ? reinterpret_cast<int4*>(p.recv_x + static_cast<int64_t>(my_recv_base + my_slot) * p.row_bytes)
                  : reinterpret_cast<int4*>(section<char>(g, lane, g.staging_x) + me * g.staging_x_pool_bytes +
                                            static_cast<int64_t>(my_slot) * p.row_bytes);
      }
      s_dst_row[warp][lane] = dst;
    }
    __syncwarp();
    const int4* src = reinterpret_cast<const int4*>(p.x + static_cast<int64_t>(t) * p.row_bytes);
    constexpr int kUnroll = 4;
    for (int base = lane; base < num_row_int4; base += 32 * kUnroll) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * 32 < num_row_int4) v[u] = ptx::ld_nc_global(src + base + u * 32);
      }
      for (int d = 0; d < num_ranks; ++d) {
        int4* dst = s_dst_row[warp][d];
        if (dst == nullptr) continue;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (base + u * 32 < num_row_int4) ptx::st_na_global(dst + base + u * 32, v[u]);
        }
      }
    }
    // Metadata: scales, top-k (remapped to the destination's local expert ids), source index.
    for (int d = 0; d < num_ranks; ++d) {
      const int slot = __shfl_sync(0xffffffffu, my_slot, d);
      if (slot < 0) continue;
      const bool local = d == me;
      const int64_t row = local ? my_recv_base + slot : slot;
      if (p.num_scales > 0) {
        float* dst =
            local ? p.recv_x_scales
                  : reinterpret_cast<float*>(section<char>(g, d, g.staging_scales) + me * g.staging_scales_pool_bytes);
        for (int i = lane; i < p.num_scales; i += 32) {
          dst[row * p.num_scales + i] = __ldg(p.x_scales + static_cast<int64_t>(t) * p.num_scales + i);
        }
      }
      if (p.num_topk > 0 && lane < p.num_topk) {
        const int experts_per_rank = g.experts_per_rank;
        const int64_t expert = __ldg(p.topk_idx + static_cast<int64_t>(t) * p.num_topk + lane);
        const bool here = expert >= static_cast<int64_t>(d) * experts_per_rank &&
                          expert < static_cast<int64_t>(d + 1) * experts_per_rank;
        int64_t* idx_dst = local ? p.recv_topk_idx
                                 : reinterpret_cast<int64_t*>(section<char>(g, d, g.staging_topk_idx) +
                                                              me * g.staging_topk_idx_pool_bytes);
        idx_dst[row * p.num_topk + lane] = here ? expert - static_cast<int64_t>(d) * experts_per_rank : -1;
        if (p.has_weights) {
          float* w_dst = local ? p.recv_topk_weights
                               : reinterpret_cast<float*>(section<char>(g, d, g.staging_topk_weights) +
                                                          me * g.staging_topk_weights_pool_bytes);
          w_dst[row * p.num_topk + lane] =
              here ? __ldg(p.topk_weights + static_cast<int64_t>(t) * p.num_topk + lane) : 0.0f;
        }
      }
      if (lane == 0) {
        int32_t* src_dst = local ? p.recv_src_idx
                                 : reinterpret_cast<int32_t*>(section<char>(g, d, g.staging_src_idx) +
                                                              me * g.staging_src_idx_pool_bytes);
        src_dst[row] = t;
      }
    }
    __syncwarp();
    if (lane == 0) publish_progress(&s_warp_done[warp], ++done);
  }
}

constexpr int kPublishBatch = 8;

// Step 3b, the publisher warp: all tokens before the first one some copy warp has not finished are complete; lane d
// counts those that went to peer d and publishes the count with a release store of d's tail. The copy warps never
// wait for this (the release store's system-scope fence is the slow part).
__device__ void publish_tokens(const DispatchKernelParams& p, int token_begin, int token_end, int* s_warp_done) {
  const GroupView& g = p.group;
  const int lane = threadIdx.x % 32;
  const int channel = blockIdx.x;
  const int num_ranks = g.num_ranks;
  const bool publishes = lane < num_ranks && lane != g.rank;
  int32_t* tail = publishes ? section<int32_t>(g, lane, g.channel_tail) + g.rank * g.max_channels + channel : nullptr;
  int complete = token_begin;  // tokens [token_begin, complete) are complete
  int sent = 0;                // lane d: of those, the ones sent to d
  int published = 0;           // lane d: the last value stored into d's tail
  const uint64_t start = ptx::global_timer_ns();
  for (uint32_t iter = 0; complete < token_end; ++iter) {
    // Lane w: the first token of copy warp w that is not complete.
    int pending = token_end;
    if (lane < p.num_copy_warps)
      pending = min(token_end, token_begin + lane + read_progress(&s_warp_done[lane]) * p.num_copy_warps);
    const int next = __reduce_min_sync(0xffffffffu, pending);
    // Batches of kPublishBatch tokens: every release store costs a system-scope fence on this SM.
    if (next >= complete + kPublishBatch || (next == token_end && next > complete)) {
      if (publishes) {
        for (int t = complete; t < next; ++t) sent += p.send_slot[static_cast<int64_t>(t) * num_ranks + lane] >= 0;
        // Only a tail that grew is stored: once it reaches the range's count the receiver may consume it and zero the
        // word, and a repeated store of the same value landing after that zero would leave a stale tail that the
        // next kernel using these words (combine, or the next dispatch) takes for fresh data.
        if (sent > published) {
          // Release: orders the copy warps' stores (observed through s_warp_done) before the tail.
          ptx::st_release_sys_global(tail, sent);
          published = sent;
        }
      }
      complete = next;
    } else if ((iter & 255u) == 255u && ptx::global_timer_ns() - start > g.timeout_ns) {
      // Unreachable unless a copy warp died: they never wait on anything.
      record_timeout(g.status, WaitSite::kDispatchFifoSpace, g.rank, -1, channel);
      return;
    }
  }
}

// Step 4, receiver warps.
__device__ void receive_tokens(const DispatchKernelParams& p) {
  const GroupView& g = p.group;
  const int num_ranks = g.num_ranks, me = g.rank;
  const int channel = blockIdx.x;
  // The receiver warps are those after the publisher.
  const int first_thread = (p.num_copy_warps + 1) * 32;
  const int num_threads = kThreadsPerBlock - first_thread;
  const int rtid = threadIdx.x - first_thread;
  __shared__ int s_range_begin[kMaxNvlPeers], s_range_count[kMaxNvlPeers], s_consumed[kMaxNvlPeers];
  __shared__ int s_work_src, s_work_from, s_work_to;  // s_work_src: peer, -1 = all done, -2 = abort

  if (rtid < kMaxNvlPeers) {
    s_range_count[rtid] = -1;
    s_consumed[rtid] = 0;
  }
  named_barrier(kReceiverBarrier, num_threads);
  int64_t* ranges = section<int64_t>(g, me, g.dispatch_range);
  int32_t* tails = section<int32_t>(g, me, g.channel_tail);
  int rotation = 0;  // round-robin over peers: the next poll starts after the peer served last
  while (true) {
    if (rtid == 0) {
      int found = -1, from = 0, to = 0;
      bool all_done = false, bad = false;
      const uint64_t start = ptx::global_timer_ns();
      for (uint32_t iter = 0;; ++iter) {
        all_done = true;
        int first_pending = -1;
        for (int k = 0; k < num_ranks - 1 && found < 0; ++k) {
          const int offset = (rotation + k) % (num_ranks - 1);
          const int src = (me + 1 + offset) % num_ranks;
          if (s_range_count[src] < 0) {
            const int64_t range = ptx::ld_acquire_sys_global(ranges + src * g.max_channels + channel);
            if (range != 0) {
              // Peer data: the range must lie within the rows the prefix matrix gives this source, so that the
              // copies stay inside the staging pool and recv_x. A bad range stops the receivers (as a timeout does).
              const int64_t begin = static_cast<int64_t>(static_cast<uint32_t>(range & 0xffffffff));
              const int64_t end = (range >> 32) - 1;
              const int from_src =
                  p.rank_prefix_matrix[src * num_ranks + me] - recv_base(p.rank_prefix_matrix, num_ranks, src, me);
              if (!check_peer_value(g.status, PeerDataField::kDispatchRangeBegin, me, src, channel, begin, 0,
                                    from_src) ||
                  !check_peer_value(g.status, PeerDataField::kDispatchRangeEnd, me, src, channel, end, begin,
                                    from_src)) {
                p.recv_channel_prefix[src * p.num_channels + channel] = 0;
                bad = true;
                break;
              }
              s_range_begin[src] = static_cast<int>(begin);
              s_range_count[src] = static_cast<int>(end - begin);
              p.recv_channel_prefix[src * p.num_channels + channel] = static_cast<int>(begin);
            }
          }
          if (s_range_count[src] < 0 || s_consumed[src] < s_range_count[src]) {
            all_done = false;
            if (first_pending < 0) first_pending = src;
          }
          if (s_range_count[src] > s_consumed[src]) {
            const int tail = ptx::ld_acquire_sys_global(tails + src * g.max_channels + channel);
            if (tail > s_range_count[src]) {  // peer data: never past the range it published
              record_bad_peer_data(g.status, PeerDataField::kDispatchTail, me, src, channel, tail, 0,
                                   s_range_count[src]);
              bad = true;
              break;
            }
            if (tail > s_consumed[src]) {
              found = src;
              from = s_consumed[src];
              to = tail;
              rotation = (offset + 1) % (num_ranks - 1);
            }
          }
        }
        if (bad) {
          found = -2;
          break;
        }
        if (found >= 0 || all_done) break;
        if ((iter & 63u) == 63u) {
          if (status_failed(g.status)) {
            found = -2;
            break;
          }
          if (peer_lost(loss_words(g, first_pending), first_pending)) {
            record_peer_lost(g.status, WaitSite::kDispatchFifoData, me, first_pending, channel);
            found = -2;
            break;
          }
          if (ptx::global_timer_ns() - start > g.timeout_ns) {
            record_timeout(g.status, WaitSite::kDispatchFifoData, me, first_pending, channel);
            found = -2;
            break;
          }
        }
      }
      if (found >= 0) s_consumed[found] = to;
      s_work_src = found;
      s_work_from = from;
      s_work_to = to;
    }
    named_barrier(kReceiverBarrier, num_threads);
    const int src = s_work_src;
    if (src < 0) {
      // All done: zero the signals this channel consumed (the senders wrote their last values before the final
      // tail we saw, and a peer writes them again only after the next call's barrier).
      if (src == -1 && rtid < num_ranks && rtid != me) {
        ranges[rtid * g.max_channels + channel] = 0;
        tails[rtid * g.max_channels + channel] = 0;
      }
      break;
    }
    const int first_slot = s_range_begin[src] + s_work_from;
    const int num_rows = s_work_to - s_work_from;
    const int64_t recv_row = recv_base(p.rank_prefix_matrix, num_ranks, src, me) + first_slot;
    group_copy_int4<true>(
        reinterpret_cast<int4*>(p.recv_x + recv_row * p.row_bytes),
        reinterpret_cast<const int4*>(section<char>(g, me, g.staging_x) + src * g.staging_x_pool_bytes +
                                      static_cast<int64_t>(first_slot) * p.row_bytes),
        static_cast<int64_t>(num_rows) * p.row_bytes / 16, rtid, num_threads);
    if (p.num_scales > 0) {
      group_copy_words<true>(
          reinterpret_cast<int32_t*>(p.recv_x_scales + recv_row * p.num_scales),
          reinterpret_cast<const int32_t*>(section<char>(g, me, g.staging_scales) + src * g.staging_scales_pool_bytes) +
              static_cast<int64_t>(first_slot) * p.num_scales,
          static_cast<int64_t>(num_rows) * p.num_scales, rtid, num_threads);
    }
    if (p.num_topk > 0) {
      // Peer data that callers index with: local expert ids in [-1, experts_per_rank); a bad one is recorded and
      // stored as -1.
      const int64_t* staged_idx = reinterpret_cast<const int64_t*>(section<char>(g, me, g.staging_topk_idx) +
                                                                   src * g.staging_topk_idx_pool_bytes) +
                                  static_cast<int64_t>(first_slot) * p.num_topk;
      int64_t* out_idx = p.recv_topk_idx + recv_row * p.num_topk;
      for (int64_t i = rtid; i < static_cast<int64_t>(num_rows) * p.num_topk; i += num_threads) {
        const int64_t e = ptx::ld_cg_global(staged_idx + i);
        out_idx[i] =
            check_peer_value(g.status, PeerDataField::kDispatchTopkIdx, me, src, channel, e, -1, g.experts_per_rank - 1)
                ? e
                : -1;
      }
      if (p.has_weights) {
        group_copy_words<true>(reinterpret_cast<int32_t*>(p.recv_topk_weights + recv_row * p.num_topk),
                               reinterpret_cast<const int32_t*>(section<char>(g, me, g.staging_topk_weights) +
                                                                src * g.staging_topk_weights_pool_bytes) +
                                   static_cast<int64_t>(first_slot) * p.num_topk,
                               static_cast<int64_t>(num_rows) * p.num_topk, rtid, num_threads);
      }
    }
    {
      // Peer data that callers index with: token indices on the source, in [0, max_tokens_per_rank); a bad one is
      // recorded and stored as -1.
      const int32_t* staged_src = reinterpret_cast<const int32_t*>(section<char>(g, me, g.staging_src_idx) +
                                                                   src * g.staging_src_idx_pool_bytes) +
                                  first_slot;
      for (int i = rtid; i < num_rows; i += num_threads) {
        const int32_t t = ptx::ld_cg_global(staged_src + i);
        p.recv_src_idx[recv_row + i] = check_peer_value(g.status, PeerDataField::kDispatchSrcIdx, me, src, channel, t,
                                                        0, g.max_tokens_per_rank - 1)
                                           ? t
                                           : -1;
      }
    }
    named_barrier(kReceiverBarrier, num_threads);
  }
}

// Worst-case mode: the rows past the received ones have no expert (-1) and weight 0, as DeepEP's num_worst_tokens
// outputs, so that callers can treat every row alike. Every thread of the grid takes a share: the rows are disjoint
// from everything else the kernel writes.
__device__ void pad_recv_topk(const DispatchKernelParams& p, int num_recv) {
  const int64_t end = static_cast<int64_t>(p.recv_capacity) * p.num_topk;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i =
           static_cast<int64_t>(num_recv) * p.num_topk + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < end; i += stride) {
    p.recv_topk_idx[i] = -1;
    if (p.has_weights) p.recv_topk_weights[i] = 0.0f;
  }
}

__global__ void __launch_bounds__(kThreadsPerBlock, 1) dispatch_kernel(const __grid_constant__ DispatchKernelParams p) {
  const GroupView& g = p.group;
  const int channel = blockIdx.x;
  // The rows this rank receives (stream order: notify, or the cached handle, wrote the prefix matrix). Without a host
  // wait for the count (worst-case mode) only the kernel can compare it with the rows allocated: a rank with too
  // little room moves nothing and never arrives at the barrier, so nothing is written out of bounds and its peers
  // time out naming it, as for any failed rank.
  const int num_recv = p.rank_prefix_matrix[(g.num_ranks - 1) * g.num_ranks + g.rank];
  if (num_recv > p.recv_capacity) {
    if (channel == 0 && threadIdx.x == 0) {
      record_recv_capacity(g.status, CapacitySite::kDispatch, g.rank, num_recv, p.recv_capacity);
    }
    return;
  }
  const int token_begin = channel_token_begin(p.num_tokens, p.num_channels, channel);
  const int token_end = channel_token_begin(p.num_tokens, p.num_channels, channel + 1);
  __shared__ int s_begin[kMaxNvlPeers], s_count[kMaxNvlPeers];
  __shared__ int s_warp_done[kMaxCopyWarps];
  if (threadIdx.x < kMaxCopyWarps) s_warp_done[threadIdx.x] = 0;
  if (threadIdx.x == 0) profile_mark(g.profile, 0);

  // Arrive, compute the slots (local work: reads inputs, writes this call's send_slot), then wait for the peers:
  // the slot scan overlaps the barrier's round trip.
  __syncthreads();
  block_barrier_arrive(g, channel);
  compute_send_slots(p, token_begin, token_end, s_begin, s_count);
  if (p.pad_recv_topk && p.num_topk > 0) pad_recv_topk(p, num_recv);
  if (!block_barrier_wait(g, channel)) return;
  if (threadIdx.x == 0) profile_mark(g.profile, 1);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < p.num_copy_warps) {
    send_tokens(p, token_begin, token_end, s_warp_done);
  } else if (warp == p.num_copy_warps) {
    // Lane d tells peer d which of its staging rows this channel will fill (the own share's range is recorded
    // directly), before its first tail. The publisher has time to spare here (no row is complete yet), while the
    // release store's system-scope fence held up every copy warp when the block waited for it (2 x H200: ~1 us).
    if (lane < g.num_ranks) {
      if (lane == g.rank) {
        p.recv_channel_prefix[lane * p.num_channels + channel] = s_begin[lane];
      } else {
        ptx::st_release_sys_global(section<int64_t>(g, lane, g.dispatch_range) + g.rank * g.max_channels + channel,
                                   pack_range(s_begin[lane], s_begin[lane] + s_count[lane]));
      }
    }
    publish_tokens(p, token_begin, token_end, s_warp_done);
  } else {
    receive_tokens(p);
  }
  if (threadIdx.x % 32 == 0) profile_warp_end(g.profile, warp);
}

}  // namespace

cudaError_t PreloadDispatch() { return preload_kernel(dispatch_kernel); }

cudaError_t LaunchDispatch(const DispatchKernelParams& params, cudaStream_t stream) {
  return launch_kernel(dispatch_kernel, params, LaunchShape{.blocks = params.num_channels, .threads = kThreadsPerBlock},
                       stream);
}

}  // namespace epfabric::kernels::intranode
