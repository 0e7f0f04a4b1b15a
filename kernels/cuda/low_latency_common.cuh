// Device-side pieces shared by the low-latency dispatch and combine kernels: region addressing, rank masks, the
// launch (cooperative: every block must be resident because blocks wait for work done by other blocks).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "bounded_wait.cuh"
#include "epfabric/kernels/common.h"
#include "epfabric/kernels/low_latency.h"
#include "profile.cuh"
#include "ptx.cuh"

namespace epfabric::kernels::low_latency {

inline constexpr int kThreadsPerBlock = 512;
inline constexpr int kWarpsPerBlock = kThreadsPerBlock / 32;
// Receive/combine-send work items are (local expert, source rank) pairs; up to this many warps share one.
inline constexpr int kMaxWarpsPerItem = 8;

// What both kernels get: where the regions are and how to fail.
struct GroupView {
  LowLatencyLayout layout;
  uint8_t* regions[kMaxNvlPeers];
  int rank;
  int num_ranks;
  int half;
  int phases;
  int32_t* rank_mask;
  KernelStatus* status;
  uint64_t timeout_ns;
  uint64_t* profile;  // null unless a benchmark asks for a timeline

  __device__ __forceinline__ uint8_t* half_base(int r) const { return regions[r] + layout.half_bytes * half; }
  __device__ __forceinline__ uint8_t* other_half_base(int r) const {
    return regions[r] + layout.half_bytes * (half ^ 1);
  }
  __device__ __forceinline__ bool sends() const { return (phases & 1) != 0; }
  __device__ __forceinline__ bool receives() const { return (phases & 2) != 0; }
};

// Bit r set = rank r is masked. Read once per thread at kernel start.
__device__ __forceinline__ uint32_t read_masked_ranks(const GroupView& g) {
  uint32_t bits = 0;
  if (g.rank_mask != nullptr) {
    int32_t values[kMaxNvlPeers];
#pragma unroll
    for (int r = 0; r < kMaxNvlPeers; ++r) values[r] = r < g.num_ranks ? g.rank_mask[r] : 0;  // all in flight
#pragma unroll
    for (int r = 0; r < kMaxNvlPeers; ++r) bits |= values[r] != 0 ? 1u << r : 0u;
  }
  return bits;
}

// After a timeout waiting for `peer`, later calls skip it (Mooncake EP's rank masking).
__device__ __forceinline__ void mask_rank(const GroupView& g, int peer) {
  if (g.rank_mask != nullptr) atomicExch(g.rank_mask + peer, 1);
}

// Zeroes the signals of the half the previous call used (and the next call will use). Called by block 0 at the
// start of a send phase; its completion is counted into `done_counter` so that no signal leaves this rank before
// the cleaning is visible (peers may write into the cleaned half as soon as they see this call's signals).
// `fill`/`fill_count` (optional) is another local array that must be set to -1 before this call's receive phase.
__device__ __forceinline__ void clean_other_half_signals(const GroupView& g, int32_t* done_counter,
                                                         int32_t* fill = nullptr, int fill_count = 0) {
  if (blockIdx.x != 0) return;
  int32_t* signals = reinterpret_cast<int32_t*>(g.other_half_base(g.rank));
  const int num_ints = static_cast<int>(g.layout.signal_bytes / sizeof(int32_t));
  for (int i = threadIdx.x; i < num_ints; i += blockDim.x) signals[i] = 0;
  for (int i = threadIdx.x; i < fill_count; i += blockDim.x) fill[i] = -1;
  __syncthreads();
  if (threadIdx.x == 0) ptx::red_add_release_sys_global(done_counter, 1);
}

// Copies `num_int4` 16-byte words from local memory that peers wrote (volatile: never a stale L1 line), with
// kBatch loads in flight per lane.
template <int kBatch = 16>
__device__ __forceinline__ void warp_copy_volatile(int4* dst, const int4* src, int num_int4, int lane) {
  for (int base = 0; base < num_int4; base += 32 * kBatch) {
    int4 v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * 32 + lane;
      if (i < num_int4) v[u] = ptx::ld_volatile_global(src + i);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * 32 + lane;
      if (i < num_int4) ptx::st_na_global(dst + i, v[u]);
    }
  }
}

__device__ __forceinline__ float bf16_bits_to_float(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

// Round-to-nearest-even float -> bf16 bits (same as host::FloatToBf16 for finite values and NaN).
__device__ __forceinline__ uint32_t float_to_bf16_bits(float v) {
  const uint32_t bits = __float_as_uint(v);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (bits >> 16) | 0x40u;
  return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
}

// Launches `kernel` with `params` as one cooperative grid of `num_blocks` x kThreadsPerBlock.
template <typename Kernel, typename Params>
absl::Status launch_cooperative(Kernel kernel, const Params& params, int num_blocks, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(num_blocks);
  config.blockDim = dim3(kThreadsPerBlock);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  EPF_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&config, kernel, params));
  return absl::OkStatus();
}

// Fills the GroupView from the host context.
absl::StatusOr<GroupView> make_group_view(const LowLatencyContext& ctx, int half, LowLatencyPhases phases);

// Blocks per launch: ctx.num_blocks or the device's SM count.
absl::StatusOr<int> blocks_for(const LowLatencyContext& ctx);

}  // namespace epfabric::kernels::low_latency
