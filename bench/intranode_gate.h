// Start gate of the intranode benchmark (see intranode_gate.cu).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace epfabric::bench {

// Enqueues a kernel that returns once `*flag` (mapped host memory, device pointer) is non-zero, or after
// `timeout_ns`.
cudaError_t LaunchGate(const int32_t* flag, uint64_t timeout_ns, cudaStream_t stream);

}  // namespace epfabric::bench
