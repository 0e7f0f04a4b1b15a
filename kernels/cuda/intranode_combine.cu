// Combine: block c is channel c, the same token split as the dispatch that filled the handle.
//  - Copy warps return expert outputs: the rows this rank received from source s in s's channel c are contiguous
//    in x (received order), and they go to the same slots in s's staging pool for this rank; a warp copies one row
//    at a time.
//  - The publisher warp turns finished chunks into release stores of s's tail for (this rank, c). It is a warp of
//    its own so that the copy warps never stall on the system-scope fence a release store implies.
//  - Reducer warps build this rank's own tokens of channel c: per token, one warp waits until every peer's tail
//    covers the token's slot, pulls the rows to sum (own rank's from x, peers' from the own staging pool) into
//    shared memory with bulk copies (many KB in flight per warp without registers), sums them in rank order in
//    float, adds the biases and writes BF16.
// Nothing waits for space (the staging pools are full size); the only waits are the barrier and the tails.
#include <cstdint>

#include <cuda_bf16.h>

#include "intranode_common.cuh"

namespace epfabric::kernels::intranode {
namespace {

constexpr int kReducerThreads = kReceiverWarps * 32;
constexpr int kReducerBarrier = 2;

struct SourceRange {
  int begin, end;  // slots of channel c in (dst -> this rank) order
  int64_t x_row0;  // first row of dst's tokens in x
};

__device__ __forceinline__ SourceRange source_range(const CombineKernelParams& p, int dst) {
  const GroupView& g = p.group;
  const int channel = blockIdx.x;
  const int64_t base = recv_base(p.rank_prefix_matrix, g.num_ranks, dst, g.rank);
  const int count = p.rank_prefix_matrix[dst * g.num_ranks + g.rank] - static_cast<int>(base);
  SourceRange r;
  r.begin = p.recv_channel_prefix[dst * p.num_channels + channel];
  r.end = channel + 1 < p.num_channels ? p.recv_channel_prefix[dst * p.num_channels + channel + 1] : count;
  r.x_row0 = base;
  return r;
}

// Copy warp w returns rows begin + w, begin + w + kCopyWarps, ... of every peer in turn (a row per warp: no
// block-level barrier, so loads stay in flight) and counts, per peer, the rows it has finished.
__device__ void copy_rows(const CombineKernelParams& p, volatile int (*s_rows_done)[kMaxNvlPeers]) {
  const GroupView& g = p.group;
  const int num_ranks = g.num_ranks, me = g.rank;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * 2;
  const int num_row_int4 = p.hidden / 8;
  for (int k = 1; k < num_ranks; ++k) {
    const int dst = (me + k) % num_ranks;
    const SourceRange range = source_range(p, dst);
    char* staging_x = section<char>(g, dst, g.staging_x) + me * g.staging_x_pool_bytes;
    float* staging_w = reinterpret_cast<float*>(section<char>(g, dst, g.staging_topk_weights) +
                                                me * g.staging_topk_weights_pool_bytes);
    int done = 0;
    for (int row = range.begin + warp; row < range.end; row += kCopyWarps) {
      const int4* src = reinterpret_cast<const int4*>(p.x + (range.x_row0 + row) * row_bytes);
      int4* dst_row = reinterpret_cast<int4*>(staging_x + row * row_bytes);
      constexpr int kUnroll = 4;
      for (int base = lane; base < num_row_int4; base += 32 * kUnroll) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (base + u * 32 < num_row_int4) v[u] = ptx::ld_nc_global(src + base + u * 32);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (base + u * 32 < num_row_int4) ptx::st_na_global(dst_row + base + u * 32, v[u]);
        }
      }
      if (p.num_topk > 0 && lane < p.num_topk) {
        staging_w[static_cast<int64_t>(row) * p.num_topk + lane] =
            __ldg(p.topk_weights + (range.x_row0 + row) * p.num_topk + lane);
      }
      __syncwarp();
      if (lane == 0) {
        __threadfence_block();
        s_rows_done[warp][dst] = ++done;
      }
    }
  }
}

constexpr int kPublishBatch = 8;

// Lane d of the publisher warp forwards the copy warps' progress towards rank d as release stores of d's tail
// (absolute slot end), in batches of kPublishBatch rows: every release store costs a system-scope fence.
__device__ void publish_rows(const CombineKernelParams& p, const volatile int (*s_rows_done)[kMaxNvlPeers]) {
  const GroupView& g = p.group;
  const int lane = threadIdx.x % 32;
  const int channel = blockIdx.x;
  if (lane >= g.num_ranks || lane == g.rank) return;
  const SourceRange range = source_range(p, lane);
  int32_t* tail = section<int32_t>(g, lane, g.channel_tail) + g.rank * g.max_channels + channel;
  int published = range.begin;
  const uint64_t start = ptx::global_timer_ns();
  for (uint32_t iter = 0; published < range.end; ++iter) {
    // Rows before the first one some copy warp has not finished are complete.
    int complete = range.end;
    for (int w = 0; w < kCopyWarps; ++w) complete = min(complete, range.begin + w + s_rows_done[w][lane] * kCopyWarps);
    if (complete >= published + kPublishBatch || (complete == range.end && complete > published)) {
      ptx::st_release_sys_global(tail, complete);
      published = complete;
    } else if ((iter & 255u) == 255u && ptx::global_timer_ns() - start > g.timeout_ns) {
      // Unreachable unless a copy warp died: they never wait on anything.
      record_timeout(g.status, WaitSite::kCombineFifoSpace, g.rank, lane, channel);
      return;
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

__device__ bool wait_bulk_copies(const GroupView& g, uint64_t* bar, uint32_t parity) {
  const uint64_t start = ptx::global_timer_ns();
  for (uint32_t iter = 0;; ++iter) {
    if (ptx::mbarrier_try_wait_parity(bar, parity)) return true;
    if ((iter & 63u) == 63u && ptx::global_timer_ns() - start > g.timeout_ns) {
      record_timeout(g.status, WaitSite::kCombineFifoData, g.rank, -1, static_cast<int>(blockIdx.x));
      return false;
    }
  }
}

__device__ void reduce_tokens(const CombineKernelParams& p, int token_begin, int token_end, char* s_buffers,
                              uint64_t* s_bars) {
  const GroupView& g = p.group;
  const int num_ranks = g.num_ranks, me = g.rank;
  const int channel = blockIdx.x;
  const int rtid = threadIdx.x - kSenderWarps * 32;
  const int warp = rtid / 32, lane = rtid % 32;
  const int row_bytes = p.hidden * 2;
  const int my_recv_base = recv_base(p.rank_prefix_matrix, num_ranks, me, me);
  const int32_t* tails = section<int32_t>(g, me, g.channel_tail);
  const char* staging_x = section<char>(g, me, g.staging_x);
  const char* staging_w = section<char>(g, me, g.staging_topk_weights);
  char* buffer = s_buffers + warp * kReduceBufferBytes;
  uint64_t* bar = s_bars + warp;
  __shared__ const char* s_src_row[kReceiverWarps][kMaxNvlPeers];
  __shared__ const float* s_src_w[kReceiverWarps][kMaxNvlPeers];
  __shared__ bool s_src_peer[kReceiverWarps][kMaxNvlPeers];
  __shared__ int s_failed;
  if (rtid == 0) s_failed = 0;
  if (lane == 0) {
    ptx::mbarrier_init(bar, 1);
    ptx::fence_mbarrier_init();
  }
  named_barrier(kReducerBarrier, kReducerThreads);

  uint32_t parity = 0;
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
      s_src_row[warp][index] = peer ? staging_x + lane * g.staging_x_pool_bytes + static_cast<int64_t>(slot) * row_bytes
                                    : p.x + static_cast<int64_t>(my_recv_base + slot) * row_bytes;
      s_src_w[warp][index] =
          peer ? reinterpret_cast<const float*>(staging_w + lane * g.staging_topk_weights_pool_bytes) +
                     static_cast<int64_t>(slot) * p.num_topk
               : p.topk_weights + static_cast<int64_t>(my_recv_base + slot) * p.num_topk;
      s_src_peer[warp][index] = peer;
    }
    __syncwarp();
    const int num_sources = __popc(contributes);
    const int4* bias_0 =
        p.bias_0 != nullptr ? reinterpret_cast<const int4*>(p.bias_0 + static_cast<int64_t>(t) * row_bytes) : nullptr;
    const int4* bias_1 =
        p.bias_1 != nullptr ? reinterpret_cast<const int4*>(p.bias_1 + static_cast<int64_t>(t) * row_bytes) : nullptr;
    int4* out = reinterpret_cast<int4*>(p.combined_x + static_cast<int64_t>(t) * row_bytes);
    // The peers' rows were written by other GPUs and observed through the tails' acquire loads (generic proxy);
    // the bulk copies read them through the async proxy.
    if (lane == 0 && num_sources > 0) ptx::fence_proxy_async_global();
    const int chunk = num_sources > 0 ? min(row_bytes, (kReduceBufferBytes / num_sources) & ~15) : row_bytes;
    for (int offset = 0; offset < row_bytes; offset += chunk) {
      const int bytes = min(chunk, row_bytes - offset);
      if (num_sources > 0) {
        if (lane == 0) {
          ptx::mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>(bytes * num_sources));
          for (int s = 0; s < num_sources; ++s) {
            ptx::bulk_copy_global_to_shared(buffer + s * chunk, s_src_row[warp][s] + offset, bytes, bar);
          }
        }
        failed = __any_sync(0xffffffffu, !wait_bulk_copies(g, bar, parity));
        parity ^= 1u;
        if (failed) break;
      }
      const int first = offset / 16;
      for (int i = lane; i < bytes / 16; i += 32) {
        float acc[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
        for (int s = 0; s < num_sources; ++s) {
          accumulate_bf16x8(acc, *reinterpret_cast<const int4*>(buffer + s * chunk + i * 16));
        }
        if (bias_0 != nullptr) accumulate_bf16x8(acc, ptx::ld_nc_global(bias_0 + first + i));
        if (bias_1 != nullptr) accumulate_bf16x8(acc, ptx::ld_nc_global(bias_1 + first + i));
        int4 packed;
        __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
        for (int j = 0; j < 4; ++j) pairs[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
        ptx::st_na_global(out + first + i, packed);
      }
      // Every lane is done reading the buffer before the next bulk copies overwrite it.
      __syncwarp();
      if (lane == 0) ptx::fence_proxy_async_shared();
    }
    if (__any_sync(0xffffffffu, failed)) {
      if (lane == 0) s_failed = 1;
      break;
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
  extern __shared__ __align__(128) char s_buffers[];  // [kReceiverWarps][kReduceBufferBytes]
  __shared__ __align__(8) uint64_t s_bars[kReceiverWarps];
  __shared__ int s_rows_done[kCopyWarps][kMaxNvlPeers];  // rows finished per copy warp and destination
  const int channel = blockIdx.x;
  if (threadIdx.x < kCopyWarps * kMaxNvlPeers) s_rows_done[threadIdx.x / kMaxNvlPeers][threadIdx.x % kMaxNvlPeers] = 0;
  if (!block_barrier(p.group, channel)) return;
  const int warp = threadIdx.x / 32;
  if (warp < kCopyWarps) {
    copy_rows(p, s_rows_done);
  } else if (warp == kCopyWarps) {
    publish_rows(p, s_rows_done);
  } else {
    reduce_tokens(p, channel_token_begin(p.num_tokens, p.num_channels, channel),
                  channel_token_begin(p.num_tokens, p.num_channels, channel + 1), s_buffers, s_bars);
  }
}

}  // namespace

cudaError_t LaunchCombine(const CombineKernelParams& params, cudaStream_t stream) {
  constexpr int kDynamicSmem = kReceiverWarps * kReduceBufferBytes;
  cudaError_t err = cudaFuncSetAttribute(combine_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kDynamicSmem);
  if (err != cudaSuccess) return err;
  combine_kernel<<<params.num_channels, kThreadsPerBlock, kDynamicSmem, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace epfabric::kernels::intranode
