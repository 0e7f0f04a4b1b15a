// Combine: block c is channel c, the same token split as the dispatch that filled the handle.
//  - Sender warps return expert outputs: the rows this rank received from source s in s's channel c are
//    contiguous in x (received order), and they go to the same slots in s's staging pool for this rank, so each
//    (source, channel) is one bulk copy, published in chunks through s's tail for (this rank, c).
//  - Reducer warps build this rank's own tokens of channel c: one warp per token sums, in rank order, the row of
//    every rank the token went to (the own rank's row straight from x, a peer's row from the own staging pool once
//    that peer's tail covers the slot), adds the biases and writes BF16.
// Nothing waits for space (the staging pools are full size); the only waits are the barrier and the tails.
#include <cstdint>

#include <cuda_bf16.h>

#include "intranode_common.cuh"

namespace epfabric::kernels::intranode {
namespace {

constexpr int kSenderThreads = kSenderWarps * 32;
constexpr int kReducerThreads = kReceiverWarps * 32;
constexpr int kSenderBarrier = 1;
constexpr int kReducerBarrier = 2;

__device__ void send_rows(const CombineKernelParams& p) {
  const GroupView& g = p.group;
  const int num_ranks = g.num_ranks, me = g.rank;
  const int channel = blockIdx.x;
  const int row_bytes = p.hidden * 2;
  for (int k = 1; k < num_ranks; ++k) {
    const int dst = (me + k) % num_ranks;
    const int count = p.rank_prefix_matrix[dst * num_ranks + me] - recv_base(p.rank_prefix_matrix, num_ranks, dst, me);
    const int begin = p.recv_channel_prefix[dst * p.num_channels + channel];
    const int end = channel + 1 < p.num_channels ? p.recv_channel_prefix[dst * p.num_channels + channel + 1] : count;
    const int64_t x_row0 = recv_base(p.rank_prefix_matrix, num_ranks, dst, me);
    char* staging_x = section<char>(g, dst, g.staging_x) + me * g.staging_x_pool_bytes;
    float* staging_w = reinterpret_cast<float*>(section<char>(g, dst, g.staging_topk_weights) +
                                                me * g.staging_topk_weights_pool_bytes);
    int32_t* tail = section<int32_t>(g, dst, g.channel_tail) + me * g.max_channels + channel;
    for (int row = begin; row < end; row += kCombineChunkRows) {
      const int num_rows = min(kCombineChunkRows, end - row);
      group_copy_int4<false>(reinterpret_cast<int4*>(staging_x + static_cast<int64_t>(row) * row_bytes),
                             reinterpret_cast<const int4*>(p.x + (x_row0 + row) * row_bytes),
                             static_cast<int64_t>(num_rows) * row_bytes / 16, threadIdx.x, kSenderThreads);
      if (p.num_topk > 0) {
        group_copy_words<false>(reinterpret_cast<int32_t*>(staging_w + static_cast<int64_t>(row) * p.num_topk),
                                reinterpret_cast<const int32_t*>(p.topk_weights + (x_row0 + row) * p.num_topk),
                                static_cast<int64_t>(num_rows) * p.num_topk, threadIdx.x, kSenderThreads);
      }
      named_barrier(kSenderBarrier, kSenderThreads);
      if (threadIdx.x == 0) ptx::st_release_sys_global(tail, row + num_rows);
    }
  }
}

// Adds the 8 BF16 values of `v` to `acc`.
__device__ __forceinline__ void accumulate_bf16x8(float* acc, const int4& v) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(pairs[j]);
    acc[2 * j] += f.x;
    acc[2 * j + 1] += f.y;
  }
}

__device__ void reduce_tokens(const CombineKernelParams& p, int token_begin, int token_end) {
  const GroupView& g = p.group;
  const int num_ranks = g.num_ranks, me = g.rank;
  const int channel = blockIdx.x;
  const int rtid = threadIdx.x - kSenderThreads;
  const int warp = rtid / 32, lane = rtid % 32;
  const int num_row_int4 = p.hidden / 8;
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * 2;
  const int my_recv_base = recv_base(p.rank_prefix_matrix, num_ranks, me, me);
  const int32_t* tails = section<int32_t>(g, me, g.channel_tail);
  const char* staging_x = section<char>(g, me, g.staging_x);
  const float* staging_w = reinterpret_cast<const float*>(section<char>(g, me, g.staging_topk_weights));
  __shared__ const int4* s_src_row[kReceiverWarps][kMaxNvlPeers];
  __shared__ const float* s_src_w[kReceiverWarps][kMaxNvlPeers];
  __shared__ bool s_src_peer[kReceiverWarps][kMaxNvlPeers];
  __shared__ int s_failed;
  if (rtid == 0) s_failed = 0;
  named_barrier(kReducerBarrier, kReducerThreads);

  int cached_tail = 0;  // lane d: the last tail seen from rank d in this channel
  for (int t = token_begin + warp; t < token_end; t += kReceiverWarps) {
    const int slot = lane < num_ranks ? p.send_slot[static_cast<int64_t>(t) * num_ranks + lane] : -1;
    bool failed = false;
    if (slot >= 0 && lane != me && cached_tail <= slot) {
      const int32_t* tail = tails + lane * g.max_channels + channel;
      failed = !bounded_wait(
          [&] {
            cached_tail = ptx::ld_acquire_sys_global(tail);
            return cached_tail > slot;
          },
          g.timeout_ns, g.status, WaitSite::kCombineFifoData, me, lane, channel);
    }
    if (__any_sync(0xffffffffu, failed)) {
      if (lane == 0) s_failed = 1;
      break;
    }
    // The contributing rows, in rank order.
    const uint32_t contributes = __ballot_sync(0xffffffffu, slot >= 0);
    if (slot >= 0) {
      const int index = __popc(contributes & lanemask_lt());
      const bool peer = lane != me;
      s_src_row[warp][index] =
          peer ? reinterpret_cast<const int4*>(staging_x + lane * g.staging_x_pool_bytes + slot * row_bytes)
               : reinterpret_cast<const int4*>(p.x + (my_recv_base + slot) * row_bytes);
      s_src_w[warp][index] = peer ? reinterpret_cast<const float*>(reinterpret_cast<const char*>(staging_w) +
                                                                   lane * g.staging_topk_weights_pool_bytes) +
                                        static_cast<int64_t>(slot) * p.num_topk
                                  : p.topk_weights + static_cast<int64_t>(my_recv_base + slot) * p.num_topk;
      s_src_peer[warp][index] = peer;
    }
    __syncwarp();
    const int num_sources = __popc(contributes);
    const int4* bias_0 = p.bias_0 != nullptr ? reinterpret_cast<const int4*>(p.bias_0 + t * row_bytes) : nullptr;
    const int4* bias_1 = p.bias_1 != nullptr ? reinterpret_cast<const int4*>(p.bias_1 + t * row_bytes) : nullptr;
    int4* out = reinterpret_cast<int4*>(p.combined_x + t * row_bytes);
    constexpr int kUnroll = 2;
    for (int base = lane; base < num_row_int4; base += 32 * kUnroll) {
      float acc[kUnroll][8];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[u][j] = 0.0f;
      }
      for (int s = 0; s < num_sources; ++s) {
        const int4* src = s_src_row[warp][s];
        const bool peer = s_src_peer[warp][s];
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int i = base + u * 32;
          if (i < num_row_int4) v[u] = peer ? ptx::ld_cg_global(src + i) : ptx::ld_nc_global(src + i);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (base + u * 32 < num_row_int4) accumulate_bf16x8(acc[u], v[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32;
        if (i >= num_row_int4) continue;
        if (bias_0 != nullptr) accumulate_bf16x8(acc[u], ptx::ld_nc_global(bias_0 + i));
        if (bias_1 != nullptr) accumulate_bf16x8(acc[u], ptx::ld_nc_global(bias_1 + i));
        int4 packed;
        __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
        for (int j = 0; j < 4; ++j) pairs[j] = __floats2bfloat162_rn(acc[u][2 * j], acc[u][2 * j + 1]);
        ptx::st_na_global(out + i, packed);
      }
    }
    if (p.num_topk > 0 && lane < p.num_topk) {
      float sum = 0.0f;
      for (int s = 0; s < num_sources; ++s) {
        const float* w = s_src_w[warp][s] + lane;
        sum += s_src_peer[warp][s] ? __int_as_float(ptx::ld_cg_global(reinterpret_cast<const int32_t*>(w))) : __ldg(w);
      }
      p.combined_topk_weights[static_cast<int64_t>(t) * p.num_topk + lane] = sum;
    }
    __syncwarp();
  }
  // Zero the tails of this channel once every reducer warp is past its last wait: each peer's last tail value
  // covers the last slot of the channel, so nothing writes them again before the next call's barrier.
  named_barrier(kReducerBarrier, kReducerThreads);
  if (s_failed == 0 && rtid < num_ranks && rtid != me) {
    section<int32_t>(g, me, g.channel_tail)[rtid * g.max_channels + channel] = 0;
  }
}

__global__ void __launch_bounds__(kThreadsPerBlock, 1) combine_kernel(const __grid_constant__ CombineKernelParams p) {
  const int channel = blockIdx.x;
  if (!block_barrier(p.group, channel)) return;
  if (threadIdx.x < kSenderThreads) {
    send_rows(p);
  } else {
    reduce_tokens(p, channel_token_begin(p.num_tokens, p.num_channels, channel),
                  channel_token_begin(p.num_tokens, p.num_channels, channel + 1));
  }
}

}  // namespace

cudaError_t LaunchCombine(const CombineKernelParams& params, cudaStream_t stream) {
  combine_kernel<<<params.num_channels, kThreadsPerBlock, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace epfabric::kernels::intranode
