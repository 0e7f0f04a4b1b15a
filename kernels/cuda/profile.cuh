// Kernel timeline marks for benchmarks (see kProfileSlotsPerBlock in epfabric/kernels/status_word.h). Every mark is one
// predicated store when profiling is off (profile == nullptr).
#pragma once

#include <cstdint>

#include "epfabric/kernels/device/ptx.cuh"
#include "epfabric/kernels/status_word.h"

namespace epfabric::kernels {

__device__ __forceinline__ void profile_mark(uint64_t* profile, int slot) {
  if (profile != nullptr) profile[blockIdx.x * kProfileSlotsPerBlock + slot] = ptx::global_timer_ns();
}

// Warp `warp` of the block finished (call from one lane).
__device__ __forceinline__ void profile_warp_end(uint64_t* profile, int warp) { profile_mark(profile, 2 + warp); }

}  // namespace epfabric::kernels
