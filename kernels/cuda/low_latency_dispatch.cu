// Low-latency dispatch over NVLink. One message per (token, destination rank) instead of DeepEP's one per
// (token, expert): the sender quantises a token once and stores it once into each destination rank's receive
// area (slot = source token index, so no atomics), plus a routing table per (expert, source rank) listing the
// tokens in increasing index. The receiver fans the messages out into the packed per-expert layout. With top-8
// over 2 ranks this moves up to 4x fewer bytes over NVLink than a message per (token, expert).
//
// Send phase, per warp (all warps of a cooperative grid):
//   1. block 0 zeroes the other half's signals (double buffering: no separate clean-up launch);
//   2. data items (token, 512-channel chunk): load 1 KB of BF16, compute per-128-channel FP8 scales, store the
//      chunk into every destination rank's message; count completion in a local counter;
//   3. routing items (one per global expert): list the tokens that chose the expert, store the list into the
//      expert's rank, wait until all local data items are done, then store the count signal (the call's tag and
//      count + 1, LowLatencyCountSignal) into the expert's rank; no signal after a failure (may_signal).
// Receive phase: warps in groups per (local expert, source rank): wait for the counts (bounded), compute the
// compact packed position begin = sum of counts of lower source ranks, copy each listed message's payload.
#include <cuda_fp8.h>

#include "low_latency_common.cuh"

namespace epfabric::kernels::low_latency {
namespace {

constexpr float kFp8Max = 448.0f;
constexpr float kFp8MaxInv = 1.0f / 448.0f;  // the same float as host::kFp8E4M3MaxInv
constexpr float kMinAmax = 1e-4f;
constexpr int kChannelsPerChunk = 512;  // one warp item: 32 lanes x 16 channels
// Top-k entries a routing block keeps in shared memory (int32, -1 for entries outside [0, E)); larger calls scan global
// memory.
constexpr int kRoutingSmemEntries = 8192;

using DispatchParams = DispatchKernelParams;  // api/launch.h

// Mirrors host::ComputeFp8GroupScale operation for operation.
__device__ __forceinline__ void fp8_group_scale(float amax, bool round_scale, float& stored, float& multiplier) {
  amax = fmaxf(amax, kMinAmax);
  if (round_scale) {
    const float ratio = __fmul_rn(amax, kFp8MaxInv);
    const uint32_t bits = __float_as_uint(ratio);
    int exponent = static_cast<int>((bits >> 23) & 0xFF) - 127;
    if ((bits & 0x7FFFFF) != 0) ++exponent;
    stored = __uint_as_float(static_cast<uint32_t>(exponent + 127) << 23);
    multiplier = __uint_as_float(static_cast<uint32_t>(127 - exponent) << 23);
  } else {
    stored = __fmul_rn(amax, kFp8MaxInv);
    multiplier = __fdiv_rn(kFp8Max, amax);
  }
}

__device__ __forceinline__ uint32_t fp8x4(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return (lo & 0xFFFFu) | (hi << 16);
}

template <bool kUseFP8, bool kWide>
__device__ __forceinline__ void send_phase(const DispatchParams& p, MaskedRanks<kWide> masked, int lane,
                                           int warp_global, int total_warps) {
  const GroupView& g = p.g;
  const LowLatencyLayout& l = g.layout;
  const int H = l.hidden, M = l.max_tokens_per_rank, R = g.num_ranks, L = l.num_local_experts;
  const int E = l.num_experts, K = p.num_topk;
  int32_t* done = reinterpret_cast<int32_t*>(own_half(g) + l.dispatch_done_offset);
  // The token map (an output) is reset here, before this call's receive phase fills it.
  // The cleaning goes to the first block past the data items (idle in this phase when the grid has room).
  const int chunks = (H + kChannelsPerChunk - 1) / kChannelsPerChunk;
  const int num_items = p.num_tokens * chunks;
  clean_other_half_signals<kWide>(
      g, done, p.packed_recv_token_map, R * M * kLowLatencyMaxTopk,
      min(static_cast<int>(gridDim.x) - 1, (num_items + kWarpsPerBlock - 1) / kWarpsPerBlock));

  // Blocks that hold routing warps (see below) first copy topk_idx into shared memory, so that each routing warp
  // scans it at shared-memory latency instead of through dependent rounds of global loads.
  __shared__ int32_t s_topk[kRoutingSmemEntries];
  const int first_routing_warp = max(0, total_warps - E);
  const bool topk_in_smem = p.num_tokens * K <= kRoutingSmemEntries &&
                            static_cast<int>((blockIdx.x + 1) * kWarpsPerBlock) > first_routing_warp;
  if (topk_in_smem) {
    for (int i = threadIdx.x; i < p.num_tokens * K; i += blockDim.x) {
      const int64_t v = __ldg(p.topk_idx + i);
      s_topk[i] = v >= 0 && v < E ? static_cast<int32_t>(v) : -1;  // out of range = no expert, as elsewhere
    }
    __syncthreads();
  }

  // Data items.
  int items_done = 0;
  for (int item = warp_global; item < num_items; item += total_warps) {
    const int t = item / chunks, chunk = item % chunks;
    const int c0 = chunk * kChannelsPerChunk + lane * 16;
    const bool active = c0 < H;  // H % 128 == 0: whole 8-lane groups are active or not
    int4 v0 = make_int4(0, 0, 0, 0), v1 = v0;
    if (active) {  // issued before the routing load so that both are in flight together
      const int4* src = reinterpret_cast<const int4*>(p.x + static_cast<size_t>(t) * H + c0);
      v0 = ptx::ld_nc_global(src);
      v1 = ptx::ld_nc_global(src + 1);
    }
    const int64_t e = lane < K ? __ldg(p.topk_idx + static_cast<size_t>(t) * K + lane) : -1;
    const int e_rank = (e >= 0 && e < E) ? static_cast<int>(e / L) : -1;
    TokenRanks<kWide> dst_ranks = token_ranks<kWide>(e_rank, masked);
    // message_per_expert (measurement only): one copy per distinct expert of the token on the rank.
    bool first_of_expert = false;
    if (p.message_per_expert) {
      first_of_expert = e_rank >= 0;
      for (int k = 0; k < K; ++k) {  // an expert listed twice counts once
        const int64_t other = __shfl_sync(0xffffffffu, e, k);
        if (k < lane && other == e) first_of_expert = false;
      }
    }
    auto copies_for = [&](int r) {
      return p.message_per_expert ? max(1, __popc(__ballot_sync(0xffffffffu, first_of_expert && e_rank == r))) : 1;
    };
    // The token's message in rank r's half (its slot [this rank][t]), or in this rank's outbox for r.
    const size_t msg_offset = g.own.msgs + static_cast<size_t>(t) * l.dispatch_msg_bytes;
    auto msg_of = [&](int r) {
      return kWide ? dst_half<kWide>(g, r).msg(t, l.dispatch_msg_bytes) : half_base<kWide>(g, r) + msg_offset;
    };
    if constexpr (kUseFP8) {
      const uint32_t w[8] = {static_cast<uint32_t>(v0.x), static_cast<uint32_t>(v0.y), static_cast<uint32_t>(v0.z),
                             static_cast<uint32_t>(v0.w), static_cast<uint32_t>(v1.x), static_cast<uint32_t>(v1.y),
                             static_cast<uint32_t>(v1.z), static_cast<uint32_t>(v1.w)};
      float f[16];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        f[2 * i] = bf16_bits_to_float(w[i] & 0xFFFFu);
        f[2 * i + 1] = bf16_bits_to_float(w[i] >> 16);
      }
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(f[i]));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
      float stored, multiplier;
      fp8_group_scale(amax, p.round_scale, stored, multiplier);
#pragma unroll
      for (int i = 0; i < 16; ++i) f[i] = __fmul_rn(f[i], multiplier);
      const int4 q = make_int4(
          static_cast<int>(fp8x4(f[0], f[1], f[2], f[3])), static_cast<int>(fp8x4(f[4], f[5], f[6], f[7])),
          static_cast<int>(fp8x4(f[8], f[9], f[10], f[11])), static_cast<int>(fp8x4(f[12], f[13], f[14], f[15])));
      for (int r = dst_ranks.next(); r >= 0; r = dst_ranks.next()) {
        uint8_t* msg = msg_of(r);
        const int copies = copies_for(r);
        for (int copy = 0; copy < copies && active; ++copy) {
          ptx::st_na_global(reinterpret_cast<int4*>(msg + kLowLatencyMessageHeaderBytes + c0), q);
          if ((lane & 7) == 0) {
            reinterpret_cast<float*>(msg + kLowLatencyMessageHeaderBytes + H)[c0 / kFp8GroupSize] = stored;
          }
        }
        if (chunk == 0 && lane == 0) *reinterpret_cast<int4*>(msg) = make_int4(t, 0, 0, 0);
      }
    } else {
      for (int r = dst_ranks.next(); r >= 0; r = dst_ranks.next()) {
        uint8_t* msg = msg_of(r);
        const int copies = copies_for(r);
        for (int copy = 0; copy < copies && active; ++copy) {
          int4* dst = reinterpret_cast<int4*>(msg + kLowLatencyMessageHeaderBytes + static_cast<size_t>(c0) * 2);
          ptx::st_na_global(dst, v0);
          ptx::st_na_global(dst + 1, v1);
        }
        if (chunk == 0 && lane == 0) *reinterpret_cast<int4*>(msg) = make_int4(t, 0, 0, 0);
      }
    }
    ++items_done;
  }
  // One GPU-scope release per warp: its stores (all lanes, ordered by the warp barrier) happen before the count that
  // lets the signals go; the warp that sends them acquires the count and publishes behind a system-scope fence or
  // release, which carries these stores to the peers (causality is transitive). A system-scope fence per data warp
  // here was measurably slower.
  __syncwarp();
  if (lane == 0 && items_done > 0) {
    ptx::red_add_release_gpu_global(done, items_done);
    mark_step(g, LowLatencyStep::kDispatchDataStored);
  }

  // Writes expert e's token list (ascending) into its rank's table; returns the count.
  auto write_table = [&](int e, int32_t* table) {
    int count = 0;
    for (int t0 = 0; t0 < p.num_tokens; t0 += 32) {
      const int t = t0 + lane;
      int k0 = -1;
      if (t < p.num_tokens) {
        if (topk_in_smem) {
          for (int k = K - 1; k >= 0; --k) {
            if (s_topk[t * K + k] == e) k0 = k;
          }
        } else {
          // No early exit: the loads of the row are independent and can all be in flight.
#pragma unroll
          for (int k = kLowLatencyMaxTopk - 1; k >= 0; --k) {
            if (k < K && __ldg(p.topk_idx + static_cast<size_t>(t) * K + k) == e) k0 = k;
          }
        }
      }
      const uint32_t found = __ballot_sync(0xffffffffu, k0 >= 0);
      if (k0 >= 0) table[count + __popc(found & ((1u << lane) - 1u))] = t | (k0 << 16);
      count += __popc(found);
    }
    __syncwarp();
    return count;
  };

  if (E <= total_warps) {
    // One expert per routing warp (the last E warps of the grid). The routing warps of a block leave their counts in
    // shared memory, and the block's last warp publishes them all behind one system-scope fence: each system-scope
    // fence or release costs about 2 us, and those of one SM's warps do not overlap (a release per routing warp, 16
    // per SM, took 3.4 us from the last data item to the last count on an H100). The barrier orders the
    // other warps' table stores before that fence. Each lane acquires the work counter itself, so its own fence
    // covers the data warps' stores.
    __shared__ int64_t s_count[kWarpsPerBlock];
    __shared__ int64_t* s_count_dst[kWarpsPerBlock];
    const int first_routing_warp = total_warps - E;
    const int block_routing_warps =
        min(kWarpsPerBlock, max(0, static_cast<int>(blockIdx.x + 1) * kWarpsPerBlock - first_routing_warp));
    const int w = threadIdx.x / 32;
    if (w < kWarpsPerBlock - block_routing_warps) return;
    const int e = total_warps - 1 - warp_global;
    const int r = e / L, local = e % L;
    int64_t* count_dst = nullptr;
    int count = 0;
    if (!masked.has(r)) {
      const DstHalf dst = dst_half<kWide>(g, r);
      count = write_table(e, dst.table(local));
      count_dst = dst.count(local);
    }
    if (lane == 0) {
      s_count[w] = static_cast<int64_t>(LowLatencyCountSignal(g.tag, count));
      s_count_dst[w] = count_dst;
      mark_step(g, LowLatencyStep::kDispatchTableWritten);
    }
    ptx::named_barrier(1, block_routing_warps * 32);
    if (w != kWarpsPerBlock - 1) return;
    int reached = 0;
    if (lane == 0) reached = wait_local_done(g, done, num_items + 1, WaitSite::kLowLatencyRecvCount, e);
    __syncwarp();
    reached = __shfl_sync(0xffffffffu, reached, 0);
    if (reached <= 0 || !may_signal(g)) return;
    if (lane == 0) mark_step(g, LowLatencyStep::kDispatchItemsCounted);
    (void)ptx::ld_acquire_gpu_global(done);
    ptx::fence_acq_rel_sys();
    if (lane < block_routing_warps) {
      const int from = kWarpsPerBlock - 1 - lane;
      if (s_count_dst[from] != nullptr) ptx::st_relaxed_sys_global(s_count_dst[from], s_count[from]);
    }
    __syncwarp();
    if (lane == 0) mark_step(g, LowLatencyStep::kDispatchCountSent);
    return;
  }
  // Routing items, handed out from the last warp down so that they land on warps without data items.
  for (int e = total_warps - 1 - warp_global; e < E; e += total_warps) {
    const int r = e / L, local = e % L;
    if (masked.has(r)) continue;
    const DstHalf dst = dst_half<kWide>(g, r);
    const int count = write_table(e, dst.table(local));
    if (lane == 0) {
      mark_step(g, LowLatencyStep::kDispatchTableWritten);
      // The count may only travel once every message it covers has been stored (and the cleaning is visible).
      const int target = num_items + 1;
      if (wait_local_done(g, done, target, WaitSite::kLowLatencyRecvCount, e) > 0 && may_signal(g)) {
        mark_step(g, LowLatencyStep::kDispatchItemsCounted);
        ptx::st_release_sys_global(dst.count(local), static_cast<int64_t>(LowLatencyCountSignal(g.tag, count)));
        mark_step(g, LowLatencyStep::kDispatchCountSent);
      }
    }
  }
}

template <bool kUseFP8, bool kWide>
__device__ __forceinline__ void recv_phase(const DispatchParams& p, MaskedRanks<kWide> masked, int lane,
                                           int warp_global, int total_warps) {
  const GroupView& g = p.g;
  const LowLatencyLayout& l = g.layout;
  const int H = l.hidden, M = l.max_tokens_per_rank, R = g.num_ranks, L = l.num_local_experts;
  const int G = H / kFp8GroupSize;
  const size_t slots = static_cast<size_t>(R) * M;
  const uint8_t* my_half = own_half(g);
  const int num_items = L * R;
  const int warps_per_item = max(1, min(kMaxWarpsPerItem, total_warps / num_items));
  const int groups = total_warps / warps_per_item;
  const int group = warp_global / warps_per_item, sub = warp_global % warps_per_item;
  if (group >= groups) return;
  const size_t row_bytes = kUseFP8 ? static_cast<size_t>(H) : static_cast<size_t>(H) * 2;
  // The token map was reset by this call's send phase (the cleaning block) and must be before this phase fills it.
  // Every item acquires this rank's own count for its expert, published only after the cleaning was counted, so
  // only a rank that masked itself (its own counts are then not read) waits for the cleaning here.
  if (masked.has(g.rank)) {
    const int32_t* done = reinterpret_cast<const int32_t*>(my_half + l.dispatch_done_offset);
    const int target = p.num_tokens * ((H + kChannelsPerChunk - 1) / kChannelsPerChunk) + 1;
    if (lane == 0) wait_local_done(g, done, target, WaitSite::kLowLatencyRecvCount, -1);
    __syncwarp();
  }

  for (int item = group; item < num_items; item += groups) {
    const int local = item / R, s = item % R;
    // Source `src`'s count for this expert (0 when masked, lost or silent), read by one lane.
    auto read_count = [&](int src) {
      if (src >= R || masked.has(src)) return 0;
      const int64_t* signal =
          reinterpret_cast<const int64_t*>(in_half<kWide>(g, src) + l.dispatch_count_offset) + local * R + src;
      int64_t count = -1;
      const uint64_t wait_start = p.wait_recv_cost_ns != nullptr ? ptx::global_timer_ns() : 0;
      // Only this call's signal ends the wait: a value with another tag is an earlier call's or client's.
      const bool ok = bounded_wait(
          [&] {
            count = LowLatencyCountOf(static_cast<uint64_t>(ptx::ld_acquire_sys_global(signal)), g.tag);
            return count >= 0;
          },
          g.timeout_ns, g.status, WaitSite::kLowLatencyRecvCount, g.rank, src, local, loss_words(g, src),
          /*record_loss=*/g.rank_mask == nullptr);
      // Every warp of the item waits on every source (for `begin`); the item's own (local, s) wait is counted once.
      if (p.wait_recv_cost_ns != nullptr && sub == 0 && src == s) add_wait_cost(p.wait_recv_cost_ns + s, wait_start);
      if (!ok) {
        mask_rank(g, src);
        return 0;
      }
      // Peer data: at most M tokens per (expert, source), so the compact rows of all sources fit R * M slots. A bad
      // count is recorded and counts as 0.
      return check_peer_value(g.status, PeerDataField::kLowLatencyRecvCount, g.rank, src, local, count, 0, M)
                 ? static_cast<int>(count)
                 : 0;
    };
    // Every source's count, a source per lane (32 at a time in a wide group): begin = the counts of lower sources.
    int begin = 0, total = 0, count = 0;
    if constexpr (kWide) {
      for (int first = 0; first < R; first += 32) {
        const int mine = read_count(first + lane);
        begin += __reduce_add_sync(0xffffffffu, first + lane < s ? mine : 0);
        total += __reduce_add_sync(0xffffffffu, mine);
        if (s >= first && s < first + 32) count = __shfl_sync(0xffffffffu, mine, s - first);
      }
    } else {
      const int mine = read_count(lane);
      begin = __reduce_add_sync(0xffffffffu, lane < s ? mine : 0);
      total = __reduce_add_sync(0xffffffffu, mine);
      count = __shfl_sync(0xffffffffu, mine, s);
    }
    __syncwarp();  // orders the acquiring lanes' loads before every lane's reads of the payload
    if (lane == 0) mark_step(g, LowLatencyStep::kDispatchCountsArrived);
    if (sub == 0 && lane == 0) {
      p.packed_recv_layout_range[local * R + s] = (static_cast<int64_t>(begin) << 32) | static_cast<uint32_t>(count);
      if (s == 0) p.packed_recv_count[local] = total;
      if (p.cumulative_stats != nullptr && count > 0) atomicAdd(p.cumulative_stats + local, count);
      if (p.expert_load != nullptr && count > 0) {
        atomicAdd(reinterpret_cast<unsigned long long*>(p.expert_load) + local, static_cast<unsigned long long>(count));
      }
    }
    const uint8_t* from = in_half<kWide>(g, s);  // this rank's half, or the inbox for a rank on another host
    const int32_t* table =
        reinterpret_cast<const int32_t*>(from + l.dispatch_table_offset) + (static_cast<size_t>(local) * R + s) * M;
    const uint8_t* msgs = from + l.dispatch_msgs_offset + static_cast<size_t>(s) * M * l.dispatch_msg_bytes;
    for (int j = sub; j < count; j += warps_per_item) {
      const int32_t entry = ptx::ld_volatile_global(table + j);
      const int t = entry & 0xFFFF, k0 = entry >> 16;
      // Peer data: the token needs a message slot (t < M) and k0 a top-k position; a bad entry is recorded and its
      // row skipped (the whole warp sees the same entry).
      if (t >= M || k0 < 0 || k0 >= kLowLatencyMaxTopk) {
        if (lane == 0) {
          if (t >= M) {
            record_bad_peer_data(g.status, PeerDataField::kLowLatencyRoutingToken, g.rank, s, local, t, 0, M - 1);
          } else {
            record_bad_peer_data(g.status, PeerDataField::kLowLatencyRoutingTopk, g.rank, s, local, k0, 0,
                                 kLowLatencyMaxTopk - 1);
          }
        }
        continue;
      }
      const size_t slot = static_cast<size_t>(local) * slots + begin + j;
      const uint8_t* payload = msgs + static_cast<size_t>(t) * l.dispatch_msg_bytes + kLowLatencyMessageHeaderBytes;
      // Scales first, so that their loads overlap the payload's.
      int32_t scale_bits[2] = {0, 0};
      if constexpr (kUseFP8) {
        const int32_t* scales = reinterpret_cast<const int32_t*>(payload + H);
        if (lane < G) scale_bits[0] = ptx::ld_volatile_global(scales + lane);
        if (lane + 32 < G) scale_bits[1] = ptx::ld_volatile_global(scales + lane + 32);
      }
      warp_copy_volatile(reinterpret_cast<int4*>(p.packed_recv_x + slot * row_bytes),
                         reinterpret_cast<const int4*>(payload), static_cast<int>(row_bytes / 16), lane);
      if constexpr (kUseFP8) {
        auto write_scale = [&](int gi, int32_t bits) {
          if (p.use_ue8m0) {
            uint8_t* out = static_cast<uint8_t*>(p.packed_recv_x_scales);
            const size_t pack = gi / kUe8m0ScalesPerInt32;
            out[((static_cast<size_t>(local) * (G / kUe8m0ScalesPerInt32) + pack) * slots + begin + j) * 4 +
                gi % kUe8m0ScalesPerInt32] = static_cast<uint8_t>((bits >> 23) & 0xFF);
          } else {
            static_cast<int32_t*>(p.packed_recv_x_scales)[(static_cast<size_t>(local) * G + gi) * slots + begin + j] =
                bits;
          }
        };
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          if (lane + 32 * u < G) write_scale(lane + 32 * u, scale_bits[u]);
        }
        const int32_t* scales = reinterpret_cast<const int32_t*>(payload + H);
        for (int gi = lane + 64; gi < G; gi += 32) write_scale(gi, ptx::ld_volatile_global(scales + gi));
      }
      if (lane == 0) {
        p.packed_recv_src_info[slot] = t;
        p.packed_recv_topk_slot[slot] = k0;
        p.packed_recv_token_map[(static_cast<size_t>(s) * M + t) * kLowLatencyMaxTopk + k0] =
            static_cast<int32_t>(slot);
      }
    }
  }
}

template <bool kUseFP8, bool kWide>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) dispatch_kernel(const __grid_constant__ DispatchParams p) {
  const int lane = threadIdx.x % 32;
  const int warp_global = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int total_warps = gridDim.x * kWarpsPerBlock;
  if (threadIdx.x == 0) profile_mark(p.g.profile, 0);
  const MaskedRanks<kWide> masked = read_masked_ranks<kWide>(p.g);
  if (sends(p.g)) {
    send_phase<kUseFP8, kWide>(p, masked, lane, warp_global, total_warps);
    if (lane == 0) profile_mark(p.g.profile, 1);
  }
  if (receives(p.g)) recv_phase<kUseFP8, kWide>(p, masked, lane, warp_global, total_warps);
  if (lane == 0) profile_warp_end(p.g.profile, threadIdx.x / 32);
}

}  // namespace

cudaError_t PreloadDispatch() {
  for (cudaError_t err : {preload_kernel(dispatch_kernel<true, false>), preload_kernel(dispatch_kernel<false, false>),
                          preload_kernel(dispatch_kernel<true, true>), preload_kernel(dispatch_kernel<false, true>)}) {
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t LaunchDispatch(const DispatchKernelParams& params, int num_blocks, cudaStream_t stream) {
  const LaunchShape shape = cooperative_shape(num_blocks);
  if (WideGroup(params.g)) {
    return params.use_fp8 ? launch_kernel(dispatch_kernel<true, true>, params, shape, stream)
                          : launch_kernel(dispatch_kernel<false, true>, params, shape, stream);
  }
  return params.use_fp8 ? launch_kernel(dispatch_kernel<true, false>, params, shape, stream)
                        : launch_kernel(dispatch_kernel<false, false>, params, shape, stream);
}

}  // namespace epfabric::kernels::low_latency
