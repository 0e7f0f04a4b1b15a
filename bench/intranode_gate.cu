// Helper kernels of the intranode benchmark. A start gate: one tiny kernel per GPU spins on a flag in mapped host
// memory, so that the work queued behind it starts on every GPU at (nearly) the same moment, independent of host launch
// skew.
#include "intranode_gate.h"

#include "epfabric/kernels/device/ptx.cuh"

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

// Bulk-copy (TMA) link probe: lane 0 of every warp runs its own pipeline of `stages` shared-memory buffers of
// `chunk` bytes: bulk load from `src` into a buffer, bulk store from the buffer into `dst`; a buffer is refilled as
// soon as its store has read it. Pipeline p of P takes chunks p, p + P, ...
__global__ void bulk_probe_kernel(const char* __restrict__ src, char* __restrict__ dst, int64_t bytes, int chunk,
                                  int stages) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t bars[32][8];
  namespace ptx = kernels::ptx;
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (threadIdx.x % 32 != 0) return;
  char* buf = smem + static_cast<int64_t>(warp) * stages * chunk;
  uint64_t* bar = bars[warp];
  for (int s = 0; s < stages; ++s) ptx::mbarrier_init(bar + s, 1);
  ptx::fence_mbarrier_init();
  const int64_t pipelines = static_cast<int64_t>(gridDim.x) * warps;
  const int64_t me = static_cast<int64_t>(blockIdx.x) * warps + warp;
  const int64_t num_chunks = (bytes + chunk - 1) / chunk;
  const int64_t mine = num_chunks > me ? (num_chunks - me + pipelines - 1) / pipelines : 0;
  auto offset = [&](int64_t i) { return (me + i * pipelines) * chunk; };
  auto size = [&](int64_t i) { return static_cast<uint32_t>(min(static_cast<int64_t>(chunk), bytes - offset(i))); };
  auto load = [&](int64_t i) {
    const int s = static_cast<int>(i % stages);
    ptx::mbarrier_arrive_expect_tx(bar + s, size(i));
    ptx::bulk_copy_global_to_shared(buf + static_cast<int64_t>(s) * chunk, src + offset(i), size(i), bar + s);
  };
  for (int64_t i = 0; i < mine && i < stages; ++i) load(i);
  for (int64_t i = 0; i < mine; ++i) {
    const int s = static_cast<int>(i % stages);
    // Bounded like every wait in this project: a load that has not landed in 2 s ends the probe (its time then
    // shows it).
    const uint64_t start = ptx::global_timer_ns();
    while (!ptx::mbarrier_try_wait_parity(bar + s, static_cast<uint32_t>((i / stages) & 1))) {
      if (ptx::global_timer_ns() - start > 2'000'000'000ull) {
        ptx::wait_bulk_group<0>();
        return;
      }
    }
    ptx::bulk_copy_shared_to_global(dst + offset(i), buf + static_cast<int64_t>(s) * chunk, size(i));
    ptx::commit_bulk_group();
    if (i + stages < mine) {
      ptx::wait_bulk_group_read<0>();
      load(i + stages);
    }
  }
  ptx::wait_bulk_group<0>();
}

}  // namespace

cudaError_t LaunchCopyProbe(const void* src, void* dst, size_t bytes, int blocks, int threads, cudaStream_t stream) {
  copy_probe_kernel<<<blocks, threads, 0, stream>>>(static_cast<const int4*>(src), static_cast<int4*>(dst),
                                                    static_cast<int64_t>(bytes / 16));
  return cudaGetLastError();
}

cudaError_t LaunchBulkCopyProbe(const void* src, void* dst, size_t bytes, int blocks, int pipelines, int stages,
                                int chunk, cudaStream_t stream) {
  const int smem = pipelines * stages * chunk;
  cudaError_t err = cudaFuncSetAttribute(bulk_probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  bulk_probe_kernel<<<blocks, pipelines * 32, smem, stream>>>(static_cast<const char*>(src), static_cast<char*>(dst),
                                                              static_cast<int64_t>(bytes), chunk, stages);
  return cudaGetLastError();
}

cudaError_t LaunchGate(const int32_t* flag, uint64_t timeout_ns, cudaStream_t stream) {
  gate_kernel<<<1, 1, 0, stream>>>(flag, timeout_ns);
  return cudaGetLastError();
}

}  // namespace epfabric::bench
