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

// A step inside a kernel reached by one of the block's warps: slot `slot` keeps the latest time over the block's
// warps (atomicMax; the timer only grows, so a buffer reused by the next launch ends up holding that launch's times).
// For kernels whose warps do not fill every slot (low latency: 16 warps, slots 18 and up).
__device__ __forceinline__ void profile_latest(uint64_t* profile, int slot) {
  if (profile != nullptr) {
    atomicMax(reinterpret_cast<unsigned long long*>(profile + blockIdx.x * kProfileSlotsPerBlock + slot),
              static_cast<unsigned long long>(ptx::global_timer_ns()));
  }
}

}  // namespace epfabric::kernels
