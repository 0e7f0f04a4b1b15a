// The daemon's one kernel (transport/signal.h) in a build without nvcc (EPF_CUDA=OFF): it fails with
// FAILED_PRECONDITION, so a cuda region's signal reports "not supported"; host regions never launch it.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "epfabric/kernels/transport/signal.h"

namespace epfabric::kernels::transport {

absl::Status LaunchSignalAdd(void*, int64_t, cudaStream_t) {
  return absl::FailedPreconditionError("transport signal_add: this build has no CUDA kernels (EPF_CUDA=OFF)");
}

}  // namespace epfabric::kernels::transport
