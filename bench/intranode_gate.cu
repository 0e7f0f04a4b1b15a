// Helper kernels of the intranode benchmark. A start gate: one tiny kernel per GPU spins on a flag in mapped host
// memory, so that the work queued behind it starts on every GPU at (nearly) the same moment, independent of host launch
// skew.
#include "intranode_gate.h"

#include "ptx.cuh"

namespace epfabric::bench {
namespace {

__global__ void gate_kernel(const volatile int32_t* flag, uint64_t timeout_ns) {
  const uint64_t start = kernels::ptx::global_timer_ns();
  while (*flag == 0 && kernels::ptx::global_timer_ns() - start < timeout_ns) {
  }
}

// Link probe: copies `num_int4` 16-byte words with every thread of the grid, four loads in flight per thread.
__global__ void copy_probe_kernel(const int4* __restrict__ src, int4* __restrict__ dst, int64_t num_int4) {
  constexpr int kUnroll = 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t base = blockIdx.x * blockDim.x + threadIdx.x; base < num_int4; base += stride * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * stride < num_int4) v[u] = kernels::ptx::ld_cg_global(src + base + u * stride);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * stride < num_int4) kernels::ptx::st_na_global(dst + base + u * stride, v[u]);
    }
  }
}

}  // namespace

cudaError_t LaunchCopyProbe(const void* src, void* dst, size_t bytes, int blocks, int threads, cudaStream_t stream) {
  copy_probe_kernel<<<blocks, threads, 0, stream>>>(static_cast<const int4*>(src), static_cast<int4*>(dst),
                                                    static_cast<int64_t>(bytes / 16));
  return cudaGetLastError();
}

cudaError_t LaunchGate(const int32_t* flag, uint64_t timeout_ns, cudaStream_t stream) {
  gate_kernel<<<1, 1, 0, stream>>>(flag, timeout_ns);
  return cudaGetLastError();
}

}  // namespace epfabric::bench
