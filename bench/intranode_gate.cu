// A start gate for the intranode benchmark: one tiny kernel per GPU spins on a flag in mapped host memory, so that
// the work queued behind it starts on every GPU at (nearly) the same moment, independent of host launch skew.
#include "intranode_gate.h"

#include "ptx.cuh"

namespace epfabric::bench {
namespace {

__global__ void gate_kernel(const volatile int32_t* flag, uint64_t timeout_ns) {
  const uint64_t start = kernels::ptx::global_timer_ns();
  while (*flag == 0 && kernels::ptx::global_timer_ns() - start < timeout_ns) {
  }
}

}  // namespace

cudaError_t LaunchGate(const int32_t* flag, uint64_t timeout_ns, cudaStream_t stream) {
  gate_kernel<<<1, 1, 0, stream>>>(flag, timeout_ns);
  return cudaGetLastError();
}

}  // namespace epfabric::bench
