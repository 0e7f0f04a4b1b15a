#include "gpu/cuda_region_test_kernels.h"
#include "memory_pattern.h"

namespace epfabric::testing {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocks = 264;  // 2 per SM on H100/H200: enough to saturate a peer link with 4-byte stores

__global__ void FillPattern(uint32_t* data, uint64_t count, uint32_t seed) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    data[i] = PatternValue(i, seed);
  }
}

__global__ void CountMismatches(const uint32_t* data, uint64_t count, uint32_t seed, unsigned long long* mismatches) {
  unsigned long long local = 0;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    local += data[i] != PatternValue(i, seed) ? 1 : 0;
  }
  if (local != 0) atomicAdd(mismatches, local);
}

}  // namespace

cudaError_t LaunchFillPattern(uint32_t* data, uint64_t count, uint32_t seed, cudaStream_t stream) {
  FillPattern<<<kBlocks, kThreads, 0, stream>>>(data, count, seed);
  return cudaGetLastError();
}

cudaError_t LaunchCountMismatches(const uint32_t* data, uint64_t count, uint32_t seed, unsigned long long* mismatches,
                                  cudaStream_t stream) {
  CountMismatches<<<kBlocks, kThreads, 0, stream>>>(data, count, seed, mismatches);
  return cudaGetLastError();
}

}  // namespace epfabric::testing
