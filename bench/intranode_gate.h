// Helper kernels of the intranode benchmark (see intranode_gate.cu): a start gate and a link probe.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace epfabric::bench {

// Enqueues a kernel that returns once `*flag` (mapped host memory, device pointer) is non-zero, or after
// `timeout_ns`.
cudaError_t LaunchGate(const int32_t* flag, uint64_t timeout_ns, cudaStream_t stream);

// Copies `bytes` (a multiple of 16) from `src` to `dst` with `blocks` x `threads` threads (16-byte loads, then
// stores): with a peer's memory at one end, this measures what SM loads or stores get through NVLink.
cudaError_t LaunchCopyProbe(const void* src, void* dst, size_t bytes, int blocks, int threads, cudaStream_t stream);

// The same copy with bulk copies (TMA) through shared memory: `pipelines` warps per block, each a ring of `stages`
// buffers of `chunk` bytes (a multiple of 16; pipelines * stages * chunk bytes of shared memory per block, at most 8
// stages).
cudaError_t LaunchBulkCopyProbe(const void* src, void* dst, size_t bytes, int blocks, int pipelines, int stages,
                                int chunk, cudaStream_t stream);

}  // namespace epfabric::bench
