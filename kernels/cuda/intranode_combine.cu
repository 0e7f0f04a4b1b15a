// Combine: block c is channel c, the same token split as the dispatch that filled the handle.
//  - The sender warp returns expert outputs: the rows this rank received from source s in s's channel c are
//    contiguous in x (received order), and they go to the same slots in s's staging pool for this rank; one lane
//    streams them with bulk copies (TMA) through shared memory, so the SM's load/store units stay with the reducers.
//  - The publisher warp turns completed chunks into release stores of s's tail for (this rank, c). It is a warp of
//    its own so that the sender never stalls on the system-scope fence a release store implies.
//  - Reducer warps build this rank's own tokens of channel c: per token, one warp waits until every peer's tail
//    covers the token's slot, loads the rows to sum (own rank's from x, peers' from the own staging pool), sums
//    them in rank order in float, adds the biases and writes BF16.
// Nothing waits for space (the staging pools are full size); the only waits are the barrier and the tails.
#include <cstdint>

#include <cuda_bf16.h>

#include "intranode_common.cuh"

namespace epfabric::kernels::intranode {
namespace {

// Warp roles of the combine block (32 warps): 0 sends (bulk copies), 1 publishes tails, the rest reduce.
constexpr int kSenderWarp = 0;
constexpr int kPublisherWarp = 1;
constexpr int kFirstReducerWarp = 2;
constexpr int kReducerWarps = kThreadsPerBlock / 32 - kFirstReducerWarp;
constexpr int kReducerThreads = kReducerWarps * 32;
constexpr int kReducerBarrier = 2;
// The sender's chunks (p.send_chunk_bytes each): stages of shared memory (dynamic), two loads ahead and one store in
// flight.
constexpr int kSendStages = 4;

// The chunk size the API chose, or the default when it is not one the stages can hold (a multiple of 16 bytes up to
// kMaxCombineChunkBytes): the launch sized the stages from the same function.
__host__ __device__ __forceinline__ int send_chunk_bytes(const CombineKernelParams& p) {
  const int bytes = p.send_chunk_bytes;
  return bytes >= 16 && bytes <= kMaxCombineChunkBytes && bytes % 16 == 0 ? bytes : 16384;
}

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
  // The channel ranges came from dst's dispatch ranges (checked there; stale if that dispatch failed half way): a
  // range outside [0, count] is recorded and sent as empty, so the copies stay inside x and dst's pool.
  if (!check_peer_value(g.status, PeerDataField::kCombineRange, g.rank, dst, channel, r.begin, 0, max(count, 0)) ||
      !check_peer_value(g.status, PeerDataField::kCombineRange, g.rank, dst, channel, r.end, r.begin, count)) {
    r.begin = r.end = 0;
  }
  return r;
}

// Lane 0 of the sender, one chunk: waits until the n-th load (stage n % kSendStages) landed, stores its `bytes` to
// `dst` and waits until the store completed, then reports `chunks_done` chunks in `progress`. One store in flight:
// chunk n's writes are performed before the next store starts (two in flight measured slower at 20 and 24 SMs,
// docs/intranode-kernels.md "Warp roles"), so its stage can be reloaded and its rows reported; the two loads ahead
// keep the next chunks ready meanwhile. The proxy fence orders the bulk copy's writes before the report (a
// generic-proxy write). Returns false after recording a timeout. The sender is latency-bound: every instruction in
// this loop costs time (a version with ~20 ns more per chunk measured 1-2% slower).
__device__ __forceinline__ bool store_chunk(const GroupView& g, char* s_stages, uint64_t* s_bars, int chunk, uint32_t n,
                                            char* dst, uint32_t bytes, int* progress, int chunks_done) {
  const int stage = static_cast<int>(n % kSendStages);
  const uint64_t start = ptx::global_timer_ns();
  for (uint32_t iter = 0; !ptx::mbarrier_try_wait_parity(s_bars + stage, (n / kSendStages) & 1u); ++iter) {
    if ((iter & 63u) == 63u && ptx::global_timer_ns() - start > g.timeout_ns) {
      // A local bulk load that never landed: nothing a peer did; report it and stop sending.
      record_timeout(g.status, WaitSite::kCombineFifoSpace, g.rank, g.rank, static_cast<int>(blockIdx.x));
      ptx::wait_bulk_group<0>();
      return false;
    }
  }
  ptx::bulk_copy_shared_to_global(dst, s_stages + stage * chunk, bytes);
  ptx::commit_bulk_group();
  ptx::wait_bulk_group<0>();
  ptx::fence_proxy_async_global();
  publish_progress(progress, chunks_done);
  return true;
}

// A peer's share of the rows: contiguous in x and in the peer's staging pool.
struct PeerStream {
  const char* src;
  char* dst;
  int64_t total;  // bytes
  int num_chunks;
  int next;  // the next chunk to load
  int rank;
};

__device__ __forceinline__ PeerStream peer_stream(const CombineKernelParams& p, const SourceRange& range, int dst,
                                                  int chunk) {
  const GroupView& g = p.group;
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * 2;
  PeerStream st;
  st.src = p.x + (range.x_row0 + range.begin) * row_bytes;
  st.dst = section<char>(g, dst, g.staging_x) + g.rank * g.staging_x_pool_bytes + range.begin * row_bytes;
  st.total = (range.end - range.begin) * row_bytes;
  st.num_chunks = static_cast<int>((st.total + chunk - 1) / chunk);
  st.next = 0;
  st.rank = dst;
  return st;
}

__device__ __forceinline__ uint32_t chunk_bytes(const PeerStream& st, int chunk, int i) {
  return static_cast<uint32_t>(min(static_cast<int64_t>(chunk), st.total - static_cast<int64_t>(i) * chunk));
}

__device__ __forceinline__ void load_chunk(const PeerStream& st, char* s_stages, uint64_t* s_bars, int chunk, int i,
                                           uint32_t& loads) {
  const int stage = static_cast<int>(loads % kSendStages);
  ++loads;
  ptx::mbarrier_arrive_expect_tx(s_bars + stage, chunk_bytes(st, chunk, i));
  ptx::bulk_copy_global_to_shared(s_stages + stage * chunk, st.src + static_cast<int64_t>(i) * chunk,
                                  chunk_bytes(st, chunk, i), s_bars + stage);
}

// Lane 0 of the sender with one peer (2 ranks): its chunks in order, two loads ahead; stops at a timeout (recorded).
__device__ void stream_one_peer(const CombineKernelParams& p, const PeerStream& st, char* s_stages, uint64_t* s_bars,
                                int* s_chunks_done) {
  const int chunk = send_chunk_bytes(p);
  uint32_t loads = 0;
  for (int i = 0; i < min(2, st.num_chunks); ++i) load_chunk(st, s_stages, s_bars, chunk, i, loads);
  for (int i = 0; i < st.num_chunks; ++i) {
    if (!store_chunk(p.group, s_stages, s_bars, chunk, static_cast<uint32_t>(i),
                     st.dst + static_cast<int64_t>(i) * chunk, chunk_bytes(st, chunk, i), &s_chunks_done[st.rank],
                     i + 1)) {
      return;
    }
    if (i + 2 < st.num_chunks) load_chunk(st, s_stages, s_bars, chunk, i + 2, loads);
  }
}

// Lane 0 of the sender with several peers: the peers take turns chunk by chunk, two loads ahead. A peer's reducers
// need the rows of every source of a token, so a peer served after the others would hold back every reduction (with
// one peer at a time, 4 ranks' reducers ended 60-80 us after the senders; docs/intranode-kernels.md).
__device__ void stream_peers_in_turn(const CombineKernelParams& p, char* s_stages, uint64_t* s_bars,
                                     int* s_chunks_done) {
  const GroupView& g = p.group;
  const int chunk = send_chunk_bytes(p);
  PeerStream streams[kMaxNvlPeers - 1];
  int num_streams = 0;
  for (int k = 1; k < g.num_ranks; ++k) {
    const int dst = (g.rank + k) % g.num_ranks;
    const SourceRange range = source_range(p, dst);
    if (range.end > range.begin) streams[num_streams++] = peer_stream(p, range, dst, chunk);
  }
  // Stage n % kSendStages holds the n-th chunk loaded: which stream's, and which of its chunks.
  int stage_stream[kSendStages], stage_chunk[kSendStages];
  uint32_t loads = 0;
  int turn = 0;
  auto load_next = [&] {
    for (int tried = 0; tried < num_streams; ++tried) {
      const int si = turn;
      turn = turn + 1 == num_streams ? 0 : turn + 1;
      PeerStream& st = streams[si];
      if (st.next == st.num_chunks) continue;
      stage_stream[loads % kSendStages] = si;
      stage_chunk[loads % kSendStages] = st.next;
      load_chunk(st, s_stages, s_bars, chunk, st.next++, loads);
      return;
    }
  };
  load_next();
  load_next();
  for (uint32_t n = 0; n < loads; ++n) {
    const PeerStream& st = streams[stage_stream[n % kSendStages]];
    const int i = stage_chunk[n % kSendStages];
    if (!store_chunk(g, s_stages, s_bars, chunk, n, st.dst + static_cast<int64_t>(i) * chunk, chunk_bytes(st, chunk, i),
                     &s_chunks_done[st.rank], i + 1)) {
      return;
    }
    load_next();
  }
}

// The sender: lane 0 of warp 0 streams the rows for the peers with bulk copies (TMA), which carry the link rate from
// one warp (docs/intranode-kernels.md, probes) and leave the SM's load/store units to the reducers. For peer dst
// the rows this rank received from dst in dst's channel c are contiguous in x (received order) and go to the same,
// contiguous slots of dst's staging pool for this rank: the ranges are copied in chunks of p.send_chunk_bytes
// through kSendStages shared-memory stages (one peer: stream_one_peer; more: stream_peers_in_turn).
// The top-k weights of every range go first, as plain stores by the whole warp, so that any tail covers them.
__device__ void send_rows(const CombineKernelParams& p, char* s_stages, uint64_t* s_bars, int* s_chunks_done) {
  const GroupView& g = p.group;
  const int num_ranks = g.num_ranks, me = g.rank;
  const int lane = threadIdx.x % 32;
  if (lane == 0) {
    for (int s = 0; s < kSendStages; ++s) ptx::mbarrier_init(s_bars + s, 1);
    ptx::fence_mbarrier_init();
  }
  for (int k = 1; k < num_ranks && p.num_topk > 0; ++k) {
    const int dst = (me + k) % num_ranks;
    const SourceRange range = source_range(p, dst);
    if (range.end <= range.begin) continue;
    float* staging_w = reinterpret_cast<float*>(section<char>(g, dst, g.staging_topk_weights) +
                                                me * g.staging_topk_weights_pool_bytes);
    const int64_t first = static_cast<int64_t>(range.begin) * p.num_topk;
    const int64_t count = static_cast<int64_t>(range.end - range.begin) * p.num_topk;
    const float* src_w = p.topk_weights + range.x_row0 * p.num_topk + first;
    for (int64_t i = lane; i < count; i += 32) staging_w[first + i] = __ldg(src_w + i);
  }
  __syncwarp();  // the weights are stored (and the barriers initialised) before lane 0 reports any row
  if (lane == 0) {
    if (num_ranks == 2) {
      const int dst = 1 - me;
      const SourceRange range = source_range(p, dst);
      if (range.end > range.begin) {
        stream_one_peer(p, peer_stream(p, range, dst, send_chunk_bytes(p)), s_stages, s_bars, s_chunks_done);
      }
    } else {
      stream_peers_in_turn(p, s_stages, s_bars, s_chunks_done);
    }
  }
  __syncwarp();
}

constexpr int kPublishBatch = 8;

// Lane d of the publisher warp turns the sender's progress towards rank d (chunks completed) into whole rows and
// publishes them as release stores of d's tail (absolute slot end), in batches of kPublishBatch rows: every release
// store costs a system-scope fence, which the sender thus never waits for.
__device__ void publish_rows(const CombineKernelParams& p, int* s_chunks_done) {
  const GroupView& g = p.group;
  const int lane = threadIdx.x % 32;
  const int channel = blockIdx.x;
  if (lane >= g.num_ranks || lane == g.rank) return;
  const SourceRange range = source_range(p, lane);
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * 2;
  int32_t* tail = section<int32_t>(g, lane, g.channel_tail) + g.rank * g.max_channels + channel;
  int published = range.begin;
  const uint64_t start = ptx::global_timer_ns();
  for (uint32_t iter = 0; published < range.end; ++iter) {
    const int64_t bytes = static_cast<int64_t>(read_progress(&s_chunks_done[lane])) * send_chunk_bytes(p);
    const int complete = min(range.end, range.begin + static_cast<int>(bytes / row_bytes));
    if (complete >= published + kPublishBatch || (complete == range.end && complete > published)) {
      ptx::st_release_sys_global(tail, complete);
      published = complete;
    } else if ((iter & 255u) == 255u && ptx::global_timer_ns() - start > g.timeout_ns) {
      // Reached only if the sender stopped (a local bulk copy that never landed, reported by the sender).
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

// Reducer warps build this rank's own tokens of channel c, one token per warp (tokens begin + w, begin + w + 16,
// ...): the warp waits until every peer's tail covers the token's slot, then adds the contributing rows (own rank's
// from x, peers' from the own staging pool) in rank order in float, two 16-byte positions per lane and source in
// flight, adds bias_0 then bias_1, rounds once to BF16 and stores. (A version that pulled the rows into shared
// memory with double-buffered bulk copies measured slower: 292 vs 282 us, docs/intranode-kernels.md.)
__device__ void reduce_tokens(const CombineKernelParams& p, int token_begin, int token_end) {
  const GroupView& g = p.group;
  const int num_ranks = g.num_ranks, me = g.rank;
  const int channel = blockIdx.x;
  const int rtid = threadIdx.x - kFirstReducerWarp * 32;
  const int warp = rtid / 32, lane = rtid % 32;
  const int row_bytes = p.hidden * 2;
  const int row_int4 = p.hidden / 8;
  const int my_recv_base = recv_base(p.rank_prefix_matrix, num_ranks, me, me);
  const int32_t* tails = section<int32_t>(g, me, g.channel_tail);
  const char* staging_x = section<char>(g, me, g.staging_x);
  const char* staging_w = section<char>(g, me, g.staging_topk_weights);
  __shared__ const int4* s_row[kReducerWarps][kMaxNvlPeers];
  __shared__ const float* s_w[kReducerWarps][kMaxNvlPeers];
  __shared__ bool s_peer[kReducerWarps][kMaxNvlPeers];
  __shared__ int s_failed;
  if (rtid == 0) s_failed = 0;
  named_barrier(kReducerBarrier, kReducerThreads);
  int cached_tail = 0;
  for (int t = token_begin + warp; t < token_end; t += kReducerWarps) {
    const int slot = lane < num_ranks ? p.send_slot[static_cast<int64_t>(t) * num_ranks + lane] : -1;
    bool failed = false;
    if (slot >= 0 && lane != me && cached_tail <= slot) {
      const int32_t* tail = tails + lane * g.max_channels + channel;
      failed = !bounded_wait(
          [&] {
            cached_tail = ptx::ld_acquire_sys_global(tail);
            return cached_tail > slot;
          },
          g.timeout_ns, g.status, WaitSite::kCombineFifoData, me, lane, channel, loss_words(g, lane));
      // Peer data, used only as "ready": a slot end past the pool is recorded (the rows are read at this rank's own
      // slots, which are always inside the pool).
      failed = failed || !check_peer_value(g.status, PeerDataField::kCombineTail, me, lane, channel, cached_tail, 0,
                                           g.max_tokens_per_rank);
    }
    if (__any_sync(0xffffffffu, failed)) {
      if (lane == 0) s_failed = 1;
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
  if (s_failed == 0 && rtid < num_ranks && rtid != me) {
    section<int32_t>(g, me, g.channel_tail)[rtid * g.max_channels + channel] = 0;
  }
}

__global__ void __launch_bounds__(kThreadsPerBlock, 1) combine_kernel(const __grid_constant__ CombineKernelParams p) {
  extern __shared__ __align__(128) char s_stages[];  // [kSendStages][send_chunk_bytes(p)], the sender's
  __shared__ __align__(8) uint64_t s_bars[kSendStages];
  __shared__ int s_chunks_done[kMaxNvlPeers];  // per destination: the sender's chunks whose stores completed
  const int channel = blockIdx.x;
  // After a worst-case dispatch that overflowed (it moved nothing), x holds fewer rows than the prefix matrix gives
  // this rank: combine nothing rather than read past x (the peers time out naming this rank).
  const int num_recv = p.rank_prefix_matrix[(p.group.num_ranks - 1) * p.group.num_ranks + p.group.rank];
  if (num_recv > p.x_rows) {
    if (channel == 0 && threadIdx.x == 0) {
      record_recv_capacity(p.group.status, CapacitySite::kCombine, p.group.rank, num_recv, p.x_rows);
    }
    return;
  }
  if (threadIdx.x < kMaxNvlPeers) s_chunks_done[threadIdx.x] = 0;
  if (threadIdx.x == 0) profile_mark(p.group.profile, 0);
  if (!block_barrier(p.group, channel)) return;
  if (threadIdx.x == 0) profile_mark(p.group.profile, 1);
  const int warp = threadIdx.x / 32;
  if (warp == kSenderWarp) {
    send_rows(p, s_stages, s_bars, s_chunks_done);
  } else if (warp == kPublisherWarp) {
    publish_rows(p, s_chunks_done);
  } else {
    reduce_tokens(p, channel_token_begin(p.num_tokens, p.num_channels, channel),
                  channel_token_begin(p.num_tokens, p.num_channels, channel + 1));
  }
  if (threadIdx.x % 32 == 0) profile_warp_end(p.group.profile, warp);
}

}  // namespace

cudaError_t PreloadCombine() { return preload_kernel(combine_kernel, kSendStages * kMaxCombineChunkBytes); }

cudaError_t LaunchCombine(const CombineKernelParams& params, cudaStream_t stream) {
  const size_t dynamic_smem = static_cast<size_t>(kSendStages) * send_chunk_bytes(params);
  return launch_kernel(
      combine_kernel, params,
      LaunchShape{.blocks = params.num_channels, .threads = kThreadsPerBlock, .dynamic_smem_bytes = dynamic_smem},
      stream);
}

cudaError_t PreloadDispatch();
cudaError_t PreloadNotify();
cudaError_t PreloadLayout();

cudaError_t PreloadKernels() {
  for (cudaError_t (*preload)() : {PreloadLayout, PreloadNotify, PreloadDispatch, PreloadCombine}) {
    if (const cudaError_t err = preload(); err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace epfabric::kernels::intranode
