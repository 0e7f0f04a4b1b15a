// Kernels for cuda_region_test: write and check the test pattern through a (possibly imported) device pointer, so
// that the other process's memory is touched by loads and stores from SMs, as the data path does.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace epfabric::testing {

cudaError_t LaunchFillPattern(uint32_t* data, uint64_t count, uint32_t seed, cudaStream_t stream);

// Adds the number of elements that differ from the pattern to `*mismatches` (device memory).
cudaError_t LaunchCountMismatches(const uint32_t* data, uint64_t count, uint32_t seed, unsigned long long* mismatches,
                                  cudaStream_t stream);

}  // namespace epfabric::testing
