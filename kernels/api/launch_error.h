// Internal: a launch function's cudaError_t as an absl::Status (for kernels/api only; kernels/cuda stays absl-free).
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "epfabric/kernels/common.h"

namespace epfabric::kernels {

inline absl::Status LaunchError(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return CudaErrorToStatus(err, what, __FILE__, __LINE__);
}

}  // namespace epfabric::kernels
