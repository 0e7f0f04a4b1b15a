// The data pattern that the region memory tests write on one side of a shared region and check on the other;
// usable from host code and from CUDA kernels.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define EPF_PATTERN_HD __host__ __device__
#else
#define EPF_PATTERN_HD
#endif

namespace epfabric::testing {

// The value of element `index` of a pattern: distinct per seed, different between neighbours, rarely zero.
EPF_PATTERN_HD inline uint32_t PatternValue(uint64_t index, uint32_t seed) {
  uint32_t x = static_cast<uint32_t>(index) * 2654435761u + seed * 0x9E3779B9u + static_cast<uint32_t>(index >> 32);
  x ^= x >> 16;
  return x * 0x85EBCA6Bu + 1u;
}

}  // namespace epfabric::testing
