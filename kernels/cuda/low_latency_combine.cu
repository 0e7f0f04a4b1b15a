// Low-latency combine over NVLink, reducing at the expert rank: each expert rank sends, per token, ONE bf16 row (the
// weighted sum over its own experts of that token) instead of one row per (token, expert). With top-8 over 2 ranks
// that is up to 4x fewer bytes over NVLink than DeepEP's scheme, and the token's rank adds only num_ranks rows.
//
// Send phase:
//   1. block 0 stores this rank's top-k weights into each expert's rank (duplicate experts in a row have their
//      weights summed into the first position), then raises its weights flag (the call's tag) there. The last
//      block zeroes the other half's signals;
//   2. work items (source rank s, token t, slice of hidden) on the other blocks: read the token map row (dispatch's
//      handle: which packed slots hold this token's experts), take the weights (this rank's own tokens: straight
//      from the inputs; other ranks' tokens: wait, bounded, for s's weights flag carrying this call's tag), sum
//      fmaf(expert value, weight) over the experts in top-k order, round to bf16, store the slice into s's receive
//      area at row (t, this rank);
//   3. when every item is done, raise the combine flag (the call's tag) on every rank, except on a rank this call
//      gave up on, and on none after a failure unless the Buffer masks lost ranks (may_signal).
// Receive phase: every block waits for the combine flags (bounded), then each warp takes a (token, slice of hidden):
// it reads the token's top-k row once, and its lanes add the partial rows of the ranks that hold the token's experts,
// in rank order, and store bf16. Every operation
// mirrors host::LowLatencyCombineReference, so the result is bit-exact.
#include "low_latency_common.cuh"

namespace epfabric::kernels::low_latency {
namespace {

using CombineParams = CombineKernelParams;  // api/launch.h

// Block 0: publishes this rank's weights to the expert ranks, then raises the weights flags (the call's tag).
template <bool kWide>
__device__ __forceinline__ void publish_weights(const CombineParams& p, const MaskedRanks<kWide>& masked) {
  const GroupView& g = p.g;
  const LowLatencyLayout& l = g.layout;
  const int K = p.num_topk, L = l.num_local_experts, E = l.num_experts;
  // One thread per token: the whole row is loaded at once (independent loads), then handled in registers.
  for (int t = threadIdx.x; t < p.num_tokens; t += blockDim.x) {
    int64_t row[kLowLatencyMaxTopk];
    float w[kLowLatencyMaxTopk];
#pragma unroll
    for (int k = 0; k < kLowLatencyMaxTopk; ++k) {
      row[k] = k < K ? __ldg(p.topk_idx + static_cast<size_t>(t) * K + k) : -1;
      w[k] = k < K ? __ldg(p.topk_weights + static_cast<size_t>(t) * K + k) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kLowLatencyMaxTopk; ++k) {
      const int64_t e = row[k];
      if (k >= K || e < 0 || e >= E) continue;
      const int r = static_cast<int>(e / L);
      if (masked.has(r) || r == g.rank) continue;  // the own tokens' weights are read from the inputs
      bool first = true;
#pragma unroll
      for (int kk = 0; kk < k; ++kk) first = first && row[kk] != e;
      if (!first) continue;
      float sum = w[k];
#pragma unroll
      for (int kk = k + 1; kk < kLowLatencyMaxTopk; ++kk) {
        if (kk < K && row[kk] == e) sum = sum + w[kk];
      }
      dst_half<kWide>(g, r).weights(t)[k] = sum;
    }
  }
  // The barrier orders every weight of the block before the flags' releases.
  __syncthreads();
  if (threadIdx.x < g.num_ranks && !masked.has(threadIdx.x) && may_signal(g)) {
    ptx::st_release_sys_global(dst_half<kWide>(g, threadIdx.x).weights_flag(), static_cast<int32_t>(g.tag));
    mark_step(g, LowLatencyStep::kCombineWeightsSent);
  }
}

// Stores slice [lo, hi) (int4 positions) of the bf16 row sum_j x[row_j] * weight_j to dst: fmaf in top-k order, in
// float, one rounding. Lane k holds top-k position k's packed row (`slot`) and weight (`w`); bit k of `present` is
// set when that position is an expert here.
__device__ __forceinline__ void store_weighted_sum(const uint16_t* x, int H, int32_t slot, float w, uint32_t present,
                                                   int lo, int hi, int lane, int4* dst) {
  // The rows in top-k order, gathered into registers of every lane.
  int32_t rows[kLowLatencyMaxTopk];
  float row_weights[kLowLatencyMaxTopk];
  const int num_present = __popc(present);
#pragma unroll
  for (int j = 0; j < kLowLatencyMaxTopk; ++j) {
    const int k = present != 0 ? __ffs(present) - 1 : 0;
    present &= present - 1;
    rows[j] = __shfl_sync(0xffffffffu, slot, k);
    row_weights[j] = __shfl_sync(0xffffffffu, w, k);
  }
  // The rows' loads in groups of 8 (top-8: one group): 16 loads in flight per lane needed more than the 128
  // registers a thread has here and spilled (2 x H200: 20.5 -> 19.6 us of combine kernel time with groups).
  constexpr int kGroup = 8;
  static_assert(kLowLatencyMaxTopk % kGroup == 0);
  for (int i = lo + lane; i < hi; i += 32) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int g0 = 0; g0 < kLowLatencyMaxTopk; g0 += kGroup) {
      if (g0 >= num_present) break;
      int4 v[kGroup];
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        if (g0 + j < num_present)
          v[j] = ptx::ld_nc_global(reinterpret_cast<const int4*>(x + static_cast<size_t>(rows[g0 + j]) * H) + i);
      }
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        if (g0 + j < num_present) {
          const uint32_t words[4] = {static_cast<uint32_t>(v[j].x), static_cast<uint32_t>(v[j].y),
                                     static_cast<uint32_t>(v[j].z), static_cast<uint32_t>(v[j].w)};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            acc[2 * q] = __fmaf_rn(bf16_bits_to_float(words[q] & 0xFFFFu), row_weights[g0 + j], acc[2 * q]);
            acc[2 * q + 1] = __fmaf_rn(bf16_bits_to_float(words[q] >> 16), row_weights[g0 + j], acc[2 * q + 1]);
          }
        }
      }
    }
    int4 out;
    out.x = static_cast<int>(float_to_bf16_bits(acc[0]) | (float_to_bf16_bits(acc[1]) << 16));
    out.y = static_cast<int>(float_to_bf16_bits(acc[2]) | (float_to_bf16_bits(acc[3]) << 16));
    out.z = static_cast<int>(float_to_bf16_bits(acc[4]) | (float_to_bf16_bits(acc[5]) << 16));
    out.w = static_cast<int>(float_to_bf16_bits(acc[6]) | (float_to_bf16_bits(acc[7]) << 16));
    ptx::st_na_global(dst + i, out);
  }
}

template <bool kWide>
__device__ __forceinline__ void send_phase(const CombineParams& p, MaskedRanks<kWide> masked, int lane, int warp_global,
                                           int total_warps) {
  const GroupView& g = p.g;
  const LowLatencyLayout& l = g.layout;
  const int H = l.hidden, M = l.max_tokens_per_rank, R = g.num_ranks, K = p.num_topk;
  const int row_int4 = H / 8;
  int32_t* done = reinterpret_cast<int32_t*>(own_half(g) + l.combine_done_offset);
  if (!weights_published(g)) {  // else a kCombineWeights launch did both (across hosts)
    // Block 0 publishes the weights that peers wait for; the cleaning goes to the last block.
    clean_other_half_signals<kWide>(g, done, nullptr, 0, static_cast<int>(gridDim.x) - 1);
    if (blockIdx.x == 0) publish_weights<kWide>(p, masked);
  }

  // Work items: (source rank, token) x slices of hidden (each slice a multiple of 32 int4 where possible).
  // The block that publishes the weights takes no item when others can: its items would start only after the
  // publication, and they were the last ones done (2 x H200: own tokens' rows 9.9 -> 8.3 us).
  const int first_item_warp = !weights_published(g) && gridDim.x > 1 ? kWarpsPerBlock : 0;
  const int item_warps = total_warps - first_item_warp;
  const int num_rows = R * M;
  const int slices = max(1, min((row_int4 + 31) / 32, item_warps / num_rows));
  const int slice_int4 = (row_int4 + slices - 1) / slices;
  const int num_items = num_rows * slices;
  // The source whose weights this warp saw arrive last (a warp's items are mostly of one source; one register, not
  // a rank set, for this register-bound loop).
  int weights_seen = -1;
  int items_done = 0;
  for (int item = warp_global - first_item_warp; item >= 0 && item < num_items; item += item_warps) {
    ++items_done;
    const int row = item / slices, slice = item % slices;
    const int s = row / M, t = row % M;
    if (masked.has(s)) continue;
    const int32_t* map = p.token_map + static_cast<size_t>(row) * kLowLatencyMaxTopk;
    const int32_t slot = lane < kLowLatencyMaxTopk ? __ldg(map + lane) : -1;
    // This rank's own tokens: their top-k row loads go out with the token map's (independent). Rows past the call's
    // tokens have no top-k row (their map entries are all -1; the loop skips them below).
    int64_t my_e = -1;
    float my_w = 0.0f;
    if (s == g.rank && t < p.num_tokens && lane < K) {
      my_e = __ldg(p.topk_idx + static_cast<size_t>(t) * K + lane);
      my_w = __ldg(p.topk_weights + static_cast<size_t>(t) * K + lane);
    }
    uint32_t present = __ballot_sync(0xffffffffu, slot >= 0);  // bit k: top-k position k is an expert here
    if (present == 0) continue;
    float w = 0.0f;
    if (s == g.rank) {
      // This rank's own tokens: the weights are the inputs, no need to wait for their publication. Summed exactly
      // as publish_weights does (the first position of an expert gets its weights in top-k order).
      float sum = my_w;
      for (int kk = 1; kk < K; ++kk) {
        const int64_t e_kk = __shfl_sync(0xffffffffu, my_e, kk);
        const float w_kk = __shfl_sync(0xffffffffu, my_w, kk);
        if (kk > lane && e_kk == my_e) sum = sum + w_kk;
      }
      w = slot >= 0 ? sum : 0.0f;
    } else {
      // What s published: in this rank's half, or in the inbox when s is on another host.
      const uint8_t* from = in_half<kWide>(g, s);
      if (weights_seen != s) {
        bool ok = true;
        if (lane == 0) {
          const int32_t* weights_flag = reinterpret_cast<const int32_t*>(from + l.weights_flag_offset) + s;
          ok = bounded_wait([&] { return static_cast<uint32_t>(ptx::ld_acquire_sys_global(weights_flag)) == g.tag; },
                            g.timeout_ns, g.status, WaitSite::kLowLatencyCombineFlag, g.rank, s, t, loss_words(g, s),
                            /*record_loss=*/g.rank_mask == nullptr);
          if (!ok) mask_rank(g, s);
          if (ok) mark_step(g, LowLatencyStep::kCombineWeightsArrived);
        }
        ok = __shfl_sync(0xffffffffu, ok, 0);
        if (!ok) {
          masked.add(s);
          continue;
        }
        weights_seen = s;
      }
      __syncwarp();  // lane 0's acquire of the flag orders every lane's weight loads
      w = slot >= 0 ? __int_as_float(
                          ptx::ld_volatile_global(reinterpret_cast<const int32_t*>(from + l.combine_weights_offset) +
                                                  static_cast<size_t>(row) * kLowLatencyMaxTopk + lane))
                    : 0.0f;
    }
    const int lo = slice * slice_int4, hi = min(row_int4, lo + slice_int4);
    int4* dst = reinterpret_cast<int4*>(dst_half<kWide>(g, s).recv_row(t));
    if (lane == 0) mark_step(g, LowLatencyStep::kCombineRowsGathered);
    store_weighted_sum(p.x, H, slot, w, present, lo, hi, lane, dst);
    if (lane == 0)
      mark_step(g, s == g.rank ? LowLatencyStep::kCombineOwnRowsSent : LowLatencyStep::kCombinePeerRowsSent);
  }
  __syncwarp();
  if (lane == 0 && items_done > 0) ptx::red_add_release_gpu_global(done, items_done);  // see dispatch

  // Every item was counted once; +1 for the cleaning. A rank skipped during this call (masked after a timeout) gets
  // no flag: its rows here were not written, and it must not read them as this call's.
  if (blockIdx.x == 0 && threadIdx.x < R && !masked.has(threadIdx.x)) {
    const int target = num_items + 1;
    if (wait_local_done(g, done, target, WaitSite::kLowLatencyCombineFlag, -1) > 0 && may_signal(g) &&
        !masked_now(g, threadIdx.x)) {
      mark_step(g, LowLatencyStep::kCombineItemsCounted);
      ptx::st_release_sys_global(dst_half<kWide>(g, threadIdx.x).combine_flag(), static_cast<int32_t>(g.tag));
      mark_step(g, LowLatencyStep::kCombineFlagsSent);
    }
  }
}

template <bool kWide>
__device__ __forceinline__ void recv_phase(const CombineParams& p, MaskedRanks<kWide> masked) {
  const GroupView& g = p.g;
  const LowLatencyLayout& l = g.layout;
  const int H = l.hidden, R = g.num_ranks, L = l.num_local_experts, E = l.num_experts, K = p.num_topk;
  // The ranks this block skips: one NVLink domain, a shared copy of the set; wide, the set is in shared memory.
  __shared__ unsigned int block_masked;
  if constexpr (!kWide) {
    if (threadIdx.x == 0) block_masked = masked.bits;
  }
  // Work items: (token, slice of hidden) per warp (below). The top-k row of the warp's first token is local input:
  // its load goes out before the wait for the flags.
  const int row_int4 = H / 8;
  const int warp_global = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int total_warps = gridDim.x * kWarpsPerBlock;
  const int slices = max(1, min((row_int4 + 31) / 32, total_warps / max(1, p.num_tokens)));
  const int slice_int4 = (row_int4 + slices - 1) / slices;
  int64_t first_e = -1;
  if (warp_global < p.num_tokens * slices && lane < K)
    first_e = __ldg(p.topk_idx + static_cast<size_t>(warp_global / slices) * K + lane);
  __syncthreads();
  if (threadIdx.x < R && !masked.has(threadIdx.x)) {
    const int32_t* flag =
        reinterpret_cast<const int32_t*>(in_half<kWide>(g, threadIdx.x) + l.combine_flag_offset) + threadIdx.x;
    const uint64_t wait_start = p.wait_recv_cost_ns != nullptr ? ptx::global_timer_ns() : 0;
    const bool ok = bounded_wait([&] { return static_cast<uint32_t>(ptx::ld_acquire_sys_global(flag)) == g.tag; },
                                 g.timeout_ns, g.status, WaitSite::kLowLatencyCombineFlag, g.rank,
                                 static_cast<int>(threadIdx.x), -1, loss_words(g, static_cast<int>(threadIdx.x)),
                                 /*record_loss=*/g.rank_mask == nullptr);
    // Every block waits for every flag; block 0's wait is the one counted.
    if (p.wait_recv_cost_ns != nullptr && blockIdx.x == 0) add_wait_cost(p.wait_recv_cost_ns + threadIdx.x, wait_start);
    if (!ok) {
      if constexpr (kWide) {
        masked.add(threadIdx.x);
      } else {
        atomicOr(&block_masked, 1u << threadIdx.x);
      }
      mask_rank(g, threadIdx.x);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) mark_step(g, LowLatencyStep::kCombineFlagsArrived);
  MaskedRanks<kWide> skip = masked;
  if constexpr (!kWide) skip.bits = block_masked;

  // Lanes < K read the token's top-k row once for the whole slice (which ranks hold its experts), then every lane
  // adds the partial rows of those ranks for its channels.
  for (int item = warp_global; item < p.num_tokens * slices; item += total_warps) {
    const int t = item / slices, slice = item % slices;
    const int64_t e =
        item == warp_global ? first_e : (lane < K ? __ldg(p.topk_idx + static_cast<size_t>(t) * K + lane) : -1);
    TokenRanks<kWide> ranks = token_ranks<kWide>((e >= 0 && e < E) ? static_cast<int>(e / L) : -1, skip);
    // Wide: the token's ranks in increasing order, taken here by the whole warp (next() is a warp collective, and the
    // lanes' loop over the slice below may diverge).
    int order[kLowLatencyMaxTopk];
    int num_parts = 0;
    if constexpr (kWide) {
#pragma unroll
      for (int j = 0; j < kLowLatencyMaxTopk; ++j) {
        order[j] = num_parts == j ? ranks.next() : -1;
        if (order[j] >= 0) ++num_parts;
      }
    }
    const int lo = slice * slice_int4, hi = min(row_int4, lo + slice_int4);
    for (int v = lo + lane; v < hi; v += 32) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      auto part = [&](int r) {
        return ptx::ld_volatile_global(reinterpret_cast<const int4*>(in_half<kWide>(g, r) + l.combine_recv_offset +
                                                                     (static_cast<size_t>(t) * R + r) * H * 2) +
                                       v);
      };
      auto add = [&](const int4& part) {
        const uint32_t words[4] = {static_cast<uint32_t>(part.x), static_cast<uint32_t>(part.y),
                                   static_cast<uint32_t>(part.z), static_cast<uint32_t>(part.w)};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          acc[2 * q] = __fadd_rn(acc[2 * q], bf16_bits_to_float(words[q] & 0xFFFFu));
          acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], bf16_bits_to_float(words[q] >> 16));
        }
      };
      // The partial rows in rank order, kMaxNvlPeers loads in flight at a time.
      int4 parts[kMaxNvlPeers];
      if constexpr (!kWide) {
        // One NVLink domain: a load per rank index.
#pragma unroll
        for (int r = 0; r < kMaxNvlPeers; ++r) {
          if ((ranks.bits >> r) & 1u) parts[r] = part(r);
        }
#pragma unroll
        for (int r = 0; r < kMaxNvlPeers; ++r) {
          if ((ranks.bits >> r) & 1u) add(parts[r]);
        }
      } else {
        // Any group: the token's ranks (at most kLowLatencyMaxTopk) in rank order, eight at a time.
        static_assert(kLowLatencyMaxTopk % kMaxNvlPeers == 0);
#pragma unroll
        for (int round = 0; round < kLowLatencyMaxTopk / kMaxNvlPeers; ++round) {
          if (round * kMaxNvlPeers >= num_parts) break;
#pragma unroll
          for (int j = 0; j < kMaxNvlPeers; ++j) {
            if (round * kMaxNvlPeers + j < num_parts) parts[j] = part(order[round * kMaxNvlPeers + j]);
          }
#pragma unroll
          for (int j = 0; j < kMaxNvlPeers; ++j) {
            if (round * kMaxNvlPeers + j < num_parts) add(parts[j]);
          }
        }
      }
      int4 out;
      out.x = static_cast<int>(float_to_bf16_bits(acc[0]) | (float_to_bf16_bits(acc[1]) << 16));
      out.y = static_cast<int>(float_to_bf16_bits(acc[2]) | (float_to_bf16_bits(acc[3]) << 16));
      out.z = static_cast<int>(float_to_bf16_bits(acc[4]) | (float_to_bf16_bits(acc[5]) << 16));
      out.w = static_cast<int>(float_to_bf16_bits(acc[6]) | (float_to_bf16_bits(acc[7]) << 16));
      reinterpret_cast<int4*>(p.combined_x + static_cast<size_t>(t) * H)[v] = out;
    }
  }
}

template <bool kWide>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) combine_kernel(const __grid_constant__ CombineParams p) {
  const int lane = threadIdx.x % 32;
  const int warp_global = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int total_warps = gridDim.x * kWarpsPerBlock;
  if (threadIdx.x == 0) profile_mark(p.g.profile, 0);
  const MaskedRanks<kWide> masked = read_masked_ranks<kWide>(p.g);
  if (weights_only(p.g)) {  // across hosts: the first launch of the send phase
    int32_t* done = reinterpret_cast<int32_t*>(own_half(p.g) + p.g.layout.combine_done_offset);
    clean_other_half_signals<kWide>(p.g, done, nullptr, 0, static_cast<int>(gridDim.x) - 1);
    if (blockIdx.x == 0) publish_weights<kWide>(p, masked);
  }
  if (sends(p.g)) {
    send_phase<kWide>(p, masked, lane, warp_global, total_warps);
    if (lane == 0) profile_mark(p.g.profile, 1);
  }
  if (receives(p.g)) recv_phase<kWide>(p, masked);
  if (lane == 0) profile_warp_end(p.g.profile, threadIdx.x / 32);
}

}  // namespace

cudaError_t LaunchCombine(const CombineKernelParams& params, int num_blocks, cudaStream_t stream) {
  if (WideGroup(params.g)) return launch_kernel(combine_kernel<true>, params, cooperative_shape(num_blocks), stream);
  return launch_kernel(combine_kernel<false>, params, cooperative_shape(num_blocks), stream);
}

cudaError_t PreloadDispatch();

cudaError_t PreloadKernels() {
  if (const cudaError_t err = PreloadDispatch(); err != cudaSuccess) return err;
  if (const cudaError_t err = PreloadRemoteIssue(); err != cudaSuccess) return err;
  if (const cudaError_t err = preload_kernel(combine_kernel<true>); err != cudaSuccess) return err;
  return preload_kernel(combine_kernel<false>);
}

}  // namespace epfabric::kernels::low_latency
