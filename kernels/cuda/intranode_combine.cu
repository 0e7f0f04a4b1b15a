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

// What a reducer warp knows about one of its tokens once every contributing row is visible. Warp-uniform.
struct ReduceToken {
  int t = -1;           // token index; -1 = none
  int num_sources = 0;  // contributing rows
  int chunk = 0;        // bytes per source per stage
  int num_chunks = 0;   // stages of the row (at least 1)
  int meta = 0;         // which of the two shared-memory metadata slots holds its row pointers
};

// The reducer warps build this rank's own tokens of channel c. Warp w takes tokens begin + w, begin + w + 16, ...
// A token's rows (own rank's from x, peers' from the own staging pool once the peer's tail covers the token's slot)
// are pulled chunk by chunk into shared memory with bulk copies, two stages per warp: the next chunk (of the same
// or the next token) loads while the warp sums the current one in float, in rank order, adds bias_0 then bias_1,
// and stores BF16.
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
  char* buffers = s_buffers + warp * kReduceStages * kReduceStageBytes;
  uint64_t* bars = s_bars + warp * kReduceStages;
  __shared__ const char* s_src_row[kReceiverWarps][2][kMaxNvlPeers];
  __shared__ const float* s_src_w[kReceiverWarps][2][kMaxNvlPeers];
  __shared__ bool s_src_peer[kReceiverWarps][2][kMaxNvlPeers];
  __shared__ int s_failed;
  if (rtid == 0) s_failed = 0;
  if (lane == 0) {
    for (int s = 0; s < kReduceStages; ++s) ptx::mbarrier_init(bars + s, 1);
    ptx::fence_mbarrier_init();
  }
  named_barrier(kReducerBarrier, kReducerThreads);

  int cached_tail = 0;  // lane d: the last tail seen from rank d in this channel
  // Looks at token t: returns false (without waiting) if some peer's row is not visible yet and `block` is false;
  // with `block`, waits (bounded) and returns false only on a timeout. On success fills `tok` (metadata slot `meta`).
  auto prepare = [&](int t, int meta, bool block, ReduceToken& tok, bool& failed) -> bool {
    const int slot = lane < num_ranks ? p.send_slot[static_cast<int64_t>(t) * num_ranks + lane] : -1;
    bool lane_failed = false;
    const bool fresh = __any_sync(0xffffffffu, slot >= 0 && lane != me && cached_tail <= slot);
    if (slot >= 0 && lane != me && cached_tail <= slot) {
      const int32_t* tail = tails + lane * g.max_channels + channel;
      cached_tail = ptx::ld_acquire_sys_global(tail);
      if (cached_tail <= slot && block) {
        lane_failed = !bounded_wait(
            [&] {
              cached_tail = ptx::ld_acquire_sys_global(tail);
              return cached_tail > slot;
            },
            g.timeout_ns, g.status, WaitSite::kCombineFifoData, me, lane, channel);
      }
    }
    failed = __any_sync(0xffffffffu, lane_failed);
    if (failed) return false;
    if (__any_sync(0xffffffffu, slot >= 0 && lane != me && cached_tail <= slot)) return false;
    const uint32_t contributes = __ballot_sync(0xffffffffu, slot >= 0);
    if (slot >= 0) {
      const int index = __popc(contributes & lanemask_lt());
      const bool peer = lane != me;
      s_src_row[warp][meta][index] =
          peer ? staging_x + lane * g.staging_x_pool_bytes + static_cast<int64_t>(slot) * row_bytes
               : p.x + static_cast<int64_t>(my_recv_base + slot) * row_bytes;
      s_src_w[warp][meta][index] =
          peer ? reinterpret_cast<const float*>(staging_w + lane * g.staging_topk_weights_pool_bytes) +
                     static_cast<int64_t>(slot) * p.num_topk
               : p.topk_weights + static_cast<int64_t>(my_recv_base + slot) * p.num_topk;
      s_src_peer[warp][meta][index] = peer;
    }
    __syncwarp();
    tok.t = t;
    tok.meta = meta;
    tok.num_sources = __popc(contributes);
    tok.chunk = tok.num_sources > 0 ? min(row_bytes, (kReduceStageBytes / tok.num_sources) & ~15) : row_bytes;
    tok.num_chunks = (row_bytes + tok.chunk - 1) / tok.chunk;
    // The peers' rows were written by other GPUs and observed through the tails' acquire loads (generic proxy);
    // the bulk copies read them through the async proxy.
    if (lane == 0 && tok.num_sources > 0 && (p.reducer_variant == 0 || fresh)) ptx::fence_proxy_async_global();
    return true;
  };
  bool pending[kReduceStages] = {false, false};  // warp-uniform: bulk copies in flight into the stage
  auto issue = [&](const ReduceToken& tok, int chunk_index, int stage) {
    pending[stage] = tok.num_sources > 0;
    if (lane != 0 || tok.num_sources == 0) return;
    const int offset = chunk_index * tok.chunk;
    const int bytes = min(tok.chunk, row_bytes - offset);
    ptx::mbarrier_arrive_expect_tx(bars + stage, static_cast<uint32_t>(bytes * tok.num_sources));
    for (int s = 0; s < tok.num_sources; ++s) {
      ptx::bulk_copy_global_to_shared(buffers + stage * kReduceStageBytes + s * tok.chunk,
                                      s_src_row[warp][tok.meta][s] + offset, bytes, bars + stage);
    }
  };
  auto reduce_chunk = [&](const ReduceToken& tok, int chunk_index, int stage) {
    const int offset = chunk_index * tok.chunk;
    const int bytes = min(tok.chunk, row_bytes - offset);
    const int first = offset / 16;
    const char* buffer = buffers + stage * kReduceStageBytes;
    const int4* bias_0 =
        p.bias_0 != nullptr ? reinterpret_cast<const int4*>(p.bias_0 + static_cast<int64_t>(tok.t) * row_bytes) : nullptr;
    const int4* bias_1 =
        p.bias_1 != nullptr ? reinterpret_cast<const int4*>(p.bias_1 + static_cast<int64_t>(tok.t) * row_bytes) : nullptr;
    int4* out = reinterpret_cast<int4*>(p.combined_x + static_cast<int64_t>(tok.t) * row_bytes);
    for (int i = lane; i < bytes / 16; i += 32) {
      float acc[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
      for (int s = 0; s < tok.num_sources; ++s) {
        accumulate_bf16x8(acc, *reinterpret_cast<const int4*>(buffer + s * tok.chunk + i * 16));
      }
      if (bias_0 != nullptr) accumulate_bf16x8(acc, ptx::ld_nc_global(bias_0 + first + i));
      if (bias_1 != nullptr) accumulate_bf16x8(acc, ptx::ld_nc_global(bias_1 + first + i));
      int4 packed;
      __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
      for (int j = 0; j < 4; ++j) pairs[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
      ptx::st_na_global(out + first + i, packed);
    }
    // Every lane is done reading the stage before a later bulk copy overwrites it.
    __syncwarp();
    if (lane == 0) ptx::fence_proxy_async_shared();
  };
  auto finish_weights = [&](const ReduceToken& tok) {
    if (p.num_topk > 0 && lane < p.num_topk) {
      float sum = 0.0f;
      for (int s = 0; s < tok.num_sources; ++s) {
        const float* w = s_src_w[warp][tok.meta][s] + lane;
        sum += s_src_peer[warp][tok.meta][s] ? __int_as_float(ptx::ld_cg_global(reinterpret_cast<const int32_t*>(w)))
                                             : __ldg(w);
      }
      p.combined_topk_weights[static_cast<int64_t>(tok.t) * p.num_topk + lane] = sum;
    }
  };

  uint32_t parity[kReduceStages] = {0, 0};
  bool failed = false;
  ReduceToken cur;
  int cur_chunk = 0, stage = 0;
  int next_t = token_begin + warp;
  if (next_t < token_end) {
    prepare(next_t, 0, /*block=*/true, cur, failed);
    next_t += kReceiverWarps;
    if (!failed) issue(cur, 0, stage);
  }
  // Invariant: `cur` chunk `cur_chunk` has been issued into `stage`.
  while (!failed && cur.t >= 0) {
    // The item after the current one: the next chunk of this token, or the first chunk of the next token if its
    // rows are already visible (if not, it is prepared after the current chunk is summed, waiting then).
    bool next_issued = false;
    int next_chunk = cur_chunk + 1;
    ReduceToken following = cur;
    if (next_chunk >= cur.num_chunks) {
      next_chunk = 0;
      following = ReduceToken{};
      if (next_t < token_end && prepare(next_t, cur.meta ^ 1, /*block=*/false, following, failed)) next_t += kReceiverWarps;
      if (failed) break;
    }
    if (following.t >= 0) {
      issue(following, next_chunk, stage ^ 1);
      next_issued = true;
    }
    if (pending[stage]) {
      pending[stage] = false;
      failed = __any_sync(0xffffffffu, !wait_bulk_copies(g, bars + stage, parity[stage]));
      parity[stage] ^= 1u;
      if (failed) break;
    }
    reduce_chunk(cur, cur_chunk, stage);
    if (cur_chunk + 1 == cur.num_chunks) finish_weights(cur);
    if (!next_issued && cur_chunk + 1 == cur.num_chunks && next_t < token_end) {
      prepare(next_t, cur.meta ^ 1, /*block=*/true, following, failed);
      next_t += kReceiverWarps;
      if (failed) break;
      issue(following, 0, stage ^ 1);
    }
    cur = following;
    cur_chunk = next_chunk;
    stage ^= 1;
  }
  if (failed) {
    // Let issued bulk copies land before the block exits (their shared memory must outlive them).
    for (int s = 0; s < kReduceStages; ++s) {
      if (pending[s]) (void)wait_bulk_copies(g, bars + s, parity[s]);
    }
    if (lane == 0) s_failed = 1;
  }
  // Zero the tails of this channel once every reducer warp is past its last wait: each peer's last tail value
  // covers the last slot of the channel, so nothing writes them again before the next call's barrier.
  named_barrier(kReducerBarrier, kReducerThreads);
  if (s_failed == 0 && rtid < num_ranks && rtid != me) {
    section<int32_t>(g, me, g.channel_tail)[rtid * g.max_channels + channel] = 0;
  }
}

// EXPERIMENT: the reducer with register loads (no bulk copies): one token per warp, two 16-byte positions per lane
// and source in flight.
__device__ void reduce_tokens_registers(const CombineKernelParams& p, int token_begin, int token_end) {
  const GroupView& g = p.group;
  const int num_ranks = g.num_ranks, me = g.rank;
  const int channel = blockIdx.x;
  const int rtid = threadIdx.x - kSenderWarps * 32;
  const int warp = rtid / 32, lane = rtid % 32;
  const int row_bytes = p.hidden * 2;
  const int row_int4 = p.hidden / 8;
  const int my_recv_base = recv_base(p.rank_prefix_matrix, num_ranks, me, me);
  const int32_t* tails = section<int32_t>(g, me, g.channel_tail);
  const char* staging_x = section<char>(g, me, g.staging_x);
  const char* staging_w = section<char>(g, me, g.staging_topk_weights);
  __shared__ const int4* s_row[kReceiverWarps][kMaxNvlPeers];
  __shared__ const float* s_w[kReceiverWarps][kMaxNvlPeers];
  __shared__ bool s_peer[kReceiverWarps][kMaxNvlPeers];
  __shared__ int s_failed_r;
  if (rtid == 0) s_failed_r = 0;
  named_barrier(kReducerBarrier, kReducerThreads);
  int cached_tail = 0;
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
      if (lane == 0) s_failed_r = 1;
      break;
    }
    const uint32_t contributes = __ballot_sync(0xffffffffu, slot >= 0);
    if (slot >= 0) {
      const int index = __popc(contributes & lanemask_lt());
      const bool peer = lane != me;
      s_row[warp][index] = reinterpret_cast<const int4*>(
          peer ? staging_x + lane * g.staging_x_pool_bytes + static_cast<int64_t>(slot) * row_bytes
               : p.x + static_cast<int64_t>(my_recv_base + slot) * row_bytes);
      s_w[warp][index] = peer ? reinterpret_cast<const float*>(staging_w + lane * g.staging_topk_weights_pool_bytes) +
                                    static_cast<int64_t>(slot) * p.num_topk
                              : p.topk_weights + static_cast<int64_t>(my_recv_base + slot) * p.num_topk;
      s_peer[warp][index] = peer;
    }
    __syncwarp();
    const int num_sources = __popc(contributes);
    const int4* bias_0 =
        p.bias_0 != nullptr ? reinterpret_cast<const int4*>(p.bias_0 + static_cast<int64_t>(t) * row_bytes) : nullptr;
    const int4* bias_1 =
        p.bias_1 != nullptr ? reinterpret_cast<const int4*>(p.bias_1 + static_cast<int64_t>(t) * row_bytes) : nullptr;
    int4* out = reinterpret_cast<int4*>(p.combined_x + static_cast<int64_t>(t) * row_bytes);
    auto load = [&](int s, int i) {
      return s_peer[warp][s] ? ptx::ld_cg_global(s_row[warp][s] + i) : ptx::ld_nc_global(s_row[warp][s] + i);
    };
    for (int i0 = lane; i0 < row_int4; i0 += 64) {
      const int i1 = i0 + 32;
      const bool has1 = i1 < row_int4;
      float acc0[8], acc1[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc0[j] = acc1[j] = 0.0f;
      int s = 0;
      for (; s + 1 < num_sources; s += 2) {
        const int4 a0 = load(s, i0), b0 = load(s + 1, i0);
        int4 a1 = make_int4(0, 0, 0, 0), b1 = a1;
        if (has1) {
          a1 = load(s, i1);
          b1 = load(s + 1, i1);
        }
        accumulate_bf16x8(acc0, a0);
        accumulate_bf16x8(acc0, b0);
        accumulate_bf16x8(acc1, a1);
        accumulate_bf16x8(acc1, b1);
      }
      if (s < num_sources) {
        const int4 a0 = load(s, i0);
        int4 a1 = make_int4(0, 0, 0, 0);
        if (has1) a1 = load(s, i1);
        accumulate_bf16x8(acc0, a0);
        accumulate_bf16x8(acc1, a1);
      }
      if (bias_0 != nullptr) {
        accumulate_bf16x8(acc0, ptx::ld_nc_global(bias_0 + i0));
        if (has1) accumulate_bf16x8(acc1, ptx::ld_nc_global(bias_0 + i1));
      }
      if (bias_1 != nullptr) {
        accumulate_bf16x8(acc0, ptx::ld_nc_global(bias_1 + i0));
        if (has1) accumulate_bf16x8(acc1, ptx::ld_nc_global(bias_1 + i1));
      }
      int4 packed;
      __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
      for (int j = 0; j < 4; ++j) pairs[j] = __floats2bfloat162_rn(acc0[2 * j], acc0[2 * j + 1]);
      ptx::st_na_global(out + i0, packed);
      if (has1) {
#pragma unroll
        for (int j = 0; j < 4; ++j) pairs[j] = __floats2bfloat162_rn(acc1[2 * j], acc1[2 * j + 1]);
        ptx::st_na_global(out + i1, packed);
      }
    }
    if (p.num_topk > 0 && lane < p.num_topk) {
      float sum = 0.0f;
      for (int s = 0; s < num_sources; ++s) {
        const float* w = s_w[warp][s] + lane;
        sum += s_peer[warp][s] ? __int_as_float(ptx::ld_cg_global(reinterpret_cast<const int32_t*>(w))) : __ldg(w);
      }
      p.combined_topk_weights[static_cast<int64_t>(t) * p.num_topk + lane] = sum;
    }
    __syncwarp();
  }
  named_barrier(kReducerBarrier, kReducerThreads);
  if (s_failed_r == 0 && rtid < num_ranks && rtid != me) {
    section<int32_t>(g, me, g.channel_tail)[rtid * g.max_channels + channel] = 0;
  }
}

__global__ void __launch_bounds__(kThreadsPerBlock, 1) combine_kernel(const __grid_constant__ CombineKernelParams p) {
  extern __shared__ __align__(128) char s_buffers[];  // [kReceiverWarps][kReduceStages][kReduceStageBytes]
  __shared__ __align__(8) uint64_t s_bars[kReceiverWarps * kReduceStages];
  __shared__ int s_rows_done[kCopyWarps][kMaxNvlPeers];  // rows finished per copy warp and destination
  const int channel = blockIdx.x;
  if (threadIdx.x < kCopyWarps * kMaxNvlPeers) s_rows_done[threadIdx.x / kMaxNvlPeers][threadIdx.x % kMaxNvlPeers] = 0;
  if (threadIdx.x == 0) profile_mark(p.group.profile, 0);
  if (!block_barrier(p.group, channel)) return;
  if (threadIdx.x == 0) profile_mark(p.group.profile, 1);
  const int warp = threadIdx.x / 32;
  if (warp < kCopyWarps) {
    copy_rows(p, s_rows_done);
  } else if (warp == kCopyWarps) {
    publish_rows(p, s_rows_done);
  } else if (p.reducer_variant == 2) {
    reduce_tokens_registers(p, channel_token_begin(p.num_tokens, p.num_channels, channel),
                            channel_token_begin(p.num_tokens, p.num_channels, channel + 1));
  } else {
    reduce_tokens(p, channel_token_begin(p.num_tokens, p.num_channels, channel),
                  channel_token_begin(p.num_tokens, p.num_channels, channel + 1), s_buffers, s_bars);
  }
  if (threadIdx.x % 32 == 0) profile_warp_end(p.group.profile, warp);
}

}  // namespace

cudaError_t LaunchCombine(const CombineKernelParams& params, cudaStream_t stream) {
  constexpr int kDynamicSmem = kReceiverWarps * kReduceStages * kReduceStageBytes;
  cudaError_t err = cudaFuncSetAttribute(combine_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kDynamicSmem);
  if (err != cudaSuccess) return err;
  combine_kernel<<<params.num_channels, kThreadsPerBlock, kDynamicSmem, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace epfabric::kernels::intranode
