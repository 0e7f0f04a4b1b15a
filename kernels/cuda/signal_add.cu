// The receiving daemon's signal add (epfabric/kernels/transport/signal.h): one thread, one system-scope atomic.
#include <cstdint>

#include "absl/strings/str_format.h"
#include "epfabric/kernels/transport/signal.h"

namespace epfabric::kernels::transport {
namespace {

__global__ void signal_add(unsigned long long* word, long long value) {
  atomicAdd_system(word, static_cast<unsigned long long>(value));
  __threadfence_system();
}

}  // namespace

absl::Status LaunchSignalAdd(void* word, int64_t value, cudaStream_t stream) {
  if (word == nullptr || reinterpret_cast<uintptr_t>(word) % 8 != 0) {
    return absl::InvalidArgumentError("transport: signal word null or not 8-byte aligned");
  }
  signal_add<<<1, 1, 0, stream>>>(static_cast<unsigned long long*>(word), static_cast<long long>(value));
  // As the kernels library's launch functions report a launch error (kernels::CudaErrorToStatus).
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return absl::InternalError(absl::StrFormat("%s failed: %s (%s) at %s:%d", "transport signal_add",
                                               cudaGetErrorName(err), cudaGetErrorString(err), __FILE__, __LINE__));
  }
  return absl::OkStatus();
}

}  // namespace epfabric::kernels::transport
