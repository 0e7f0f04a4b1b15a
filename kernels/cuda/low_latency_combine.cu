// Low-latency combine over NVLink. Send phase: warps in groups per (local expert, source rank) read the expert
// outputs of the tokens that source rank sent (positions from the dispatch handle) and store each BF16 row straight
// into the source rank's receive area at slot (token, first top-k position of the expert): no staging copy, so
// every combine is zero-copy in DeepEP's sense. When all rows are stored, one flag per source rank is raised.
// Receive phase: every block waits for the flags (bounded), then each thread reduces 8 channels of one token over
// its top-k in a fixed order with fmaf into a float accumulator and stores BF16 (bit-exact with the host reference).
#include "absl/status/status.h"
#include "low_latency_common.cuh"

namespace epfabric::kernels {
namespace low_latency {
namespace {

struct CombineParams {
  GroupView g;
  const uint16_t* x;
  const int64_t* topk_idx;
  const float* topk_weights;
  int num_tokens;
  int num_topk;
  const int32_t* src_info;
  const int64_t* layout_range;
  const int32_t* topk_slot;
  uint16_t* combined_x;
};

__device__ __forceinline__ void send_phase(const CombineParams& p, uint32_t masked, int lane, int warp_global,
                                           int total_warps) {
  const GroupView& g = p.g;
  const LowLatencyLayout& l = g.layout;
  const int H = l.hidden, M = l.max_tokens_per_rank, R = g.num_ranks, L = l.num_local_experts;
  const size_t slots = static_cast<size_t>(R) * M;
  const int row_int4 = H * 2 / 16;
  int32_t* done = reinterpret_cast<int32_t*>(g.half_base(g.rank) + l.combine_done_offset);
  clean_other_half_signals(g, done);

  const int num_items = L * R;
  const int warps_per_item = max(1, min(kMaxWarpsPerItem, total_warps / num_items));
  const int groups = total_warps / warps_per_item;
  const int group = warp_global / warps_per_item, sub = warp_global % warps_per_item;
  if (group < groups) {
    for (int item = group; item < num_items; item += groups) {
      const int local = item / R, s = item % R;
      if (((masked >> s) & 1u) == 0) {
        const int64_t range = __ldg(p.layout_range + local * R + s);
        const int begin = static_cast<int>(range >> 32);
        const int count = static_cast<int>(range & 0xFFFFFFFF);
        uint8_t* recv = g.half_base(s) + l.combine_recv_offset;
        for (int j = sub; j < count; j += warps_per_item) {
          const size_t slot = static_cast<size_t>(local) * slots + begin + j;
          const int t = __ldg(p.src_info + slot);
          const int k0 = __ldg(p.topk_slot + slot);
          const int4* src = reinterpret_cast<const int4*>(p.x + slot * H);
          int4* dst = reinterpret_cast<int4*>(recv + (static_cast<size_t>(t) * kLowLatencyMaxTopk + k0) * H * 2);
          int i = lane;
          for (; i + 96 < row_int4; i += 128) {
            const int4 a = ptx::ld_nc_global(src + i), b = ptx::ld_nc_global(src + i + 32),
                       c = ptx::ld_nc_global(src + i + 64), d = ptx::ld_nc_global(src + i + 96);
            ptx::st_na_global(dst + i, a);
            ptx::st_na_global(dst + i + 32, b);
            ptx::st_na_global(dst + i + 64, c);
            ptx::st_na_global(dst + i + 96, d);
          }
          for (; i < row_int4; i += 32) ptx::st_na_global(dst + i, ptx::ld_nc_global(src + i));
        }
      }
      __syncwarp();
      if (lane == 0) {
        __threadfence_system();
        atomicAdd(done, 1);
      }
    }
  }

  // Every item is visited by exactly warps_per_item warps; +1 for the cleaning.
  if (blockIdx.x == 0 && threadIdx.x < R && ((masked >> threadIdx.x) & 1u) == 0) {
    const int target = num_items * warps_per_item + 1;
    bounded_wait([&] { return ptx::ld_acquire_gpu_global(done) >= target; }, g.timeout_ns, g.status,
                 WaitSite::kLowLatencyCombineFlag, g.rank, g.rank, -1);
    __threadfence_system();
    ptx::st_release_sys_global(
        reinterpret_cast<int32_t*>(g.half_base(threadIdx.x) + l.combine_flag_offset) + g.rank, 1);
  }
}

__device__ __forceinline__ void recv_phase(const CombineParams& p, uint32_t masked) {
  const GroupView& g = p.g;
  const LowLatencyLayout& l = g.layout;
  const int H = l.hidden, R = g.num_ranks, L = l.num_local_experts, E = l.num_experts, K = p.num_topk;
  const uint8_t* my_half = g.half_base(g.rank);
  __shared__ uint32_t block_masked;
  if (threadIdx.x == 0) block_masked = masked;
  __syncthreads();
  if (threadIdx.x < R && ((masked >> threadIdx.x) & 1u) == 0) {
    const int32_t* flag = reinterpret_cast<const int32_t*>(my_half + l.combine_flag_offset) + threadIdx.x;
    const bool ok = bounded_wait([&] { return ptx::ld_acquire_sys_global(flag) != 0; }, g.timeout_ns, g.status,
                                 WaitSite::kLowLatencyCombineFlag, g.rank, static_cast<int>(threadIdx.x), -1);
    if (!ok) {
      atomicOr(&block_masked, 1u << threadIdx.x);
      mask_rank(g, threadIdx.x);
    }
  }
  __syncthreads();
  const uint32_t skip = block_masked;

  const uint8_t* recv = my_half + l.combine_recv_offset;
  const int vecs_per_token = H / 8;
  const int total = p.num_tokens * vecs_per_token;
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += gridDim.x * blockDim.x) {
    const int t = idx / vecs_per_token, v = idx % vecs_per_token;
    const int64_t* row = p.topk_idx + static_cast<size_t>(t) * K;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < K; ++k) {
      const int64_t e = __ldg(row + k);
      if (e < 0 || e >= E) continue;
      if ((skip >> static_cast<int>(e / L)) & 1u) continue;
      int k0 = k;
      for (int kk = 0; kk < k; ++kk) {
        if (__ldg(row + kk) == e) {
          k0 = kk;
          break;
        }
      }
      const float w = __ldg(p.topk_weights + static_cast<size_t>(t) * K + k);
      const int4 x = ld_volatile_v4(
          reinterpret_cast<const int4*>(recv + ((static_cast<size_t>(t) * kLowLatencyMaxTopk + k0) * H + v * 8) * 2));
      const uint32_t words[4] = {static_cast<uint32_t>(x.x), static_cast<uint32_t>(x.y), static_cast<uint32_t>(x.z),
                                 static_cast<uint32_t>(x.w)};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc[2 * i] = __fmaf_rn(bf16_bits_to_float(words[i] & 0xFFFFu), w, acc[2 * i]);
        acc[2 * i + 1] = __fmaf_rn(bf16_bits_to_float(words[i] >> 16), w, acc[2 * i + 1]);
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

__global__ void __launch_bounds__(kThreadsPerBlock, 1) combine_kernel(const __grid_constant__ CombineParams p) {
  const int lane = threadIdx.x % 32;
  const int warp_global = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int total_warps = gridDim.x * kWarpsPerBlock;
  const uint32_t masked = read_masked_ranks(p.g);
  if (p.g.sends()) send_phase(p, masked, lane, warp_global, total_warps);
  if (p.g.receives()) recv_phase(p, masked);
}

}  // namespace
}  // namespace low_latency

absl::Status LowLatencyCombine(const LowLatencyContext& ctx, const LowLatencyCombineArgs& args, cudaStream_t stream) {
  if (absl::Status s = ValidateLowLatencyCombine(ctx, args); !s.ok()) return s;
  absl::StatusOr<low_latency::GroupView> g = low_latency::make_group_view(ctx, args.buffer_half, args.phases);
  if (!g.ok()) return g.status();
  absl::StatusOr<int> blocks = low_latency::blocks_for(ctx);
  if (!blocks.ok()) return blocks.status();
  low_latency::CombineParams p = {};
  p.g = *g;
  p.x = static_cast<const uint16_t*>(args.zero_copy ? LowLatencyCombineInputBuffer(ctx) : args.x);
  p.topk_idx = args.topk_idx;
  p.topk_weights = args.topk_weights;
  p.num_tokens = args.num_tokens;
  p.num_topk = args.num_topk;
  p.src_info = args.handle.packed_recv_src_info;
  p.layout_range = args.handle.packed_recv_layout_range;
  p.topk_slot = args.handle.packed_recv_topk_slot;
  p.combined_x = static_cast<uint16_t*>(args.combined_x);
  return low_latency::launch_cooperative(low_latency::combine_kernel, p, *blocks, stream);
}

}  // namespace epfabric::kernels
