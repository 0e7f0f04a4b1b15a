// Helpers for GPU tests: skip cleanly (GTEST_SKIP) when the machine has fewer CUDA devices than a test needs.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

namespace epfabric::testing {

// Number of usable CUDA devices; 0 when there is no driver or no device.
inline int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

}  // namespace epfabric::testing

// Skips the current test unless at least `n` CUDA devices are visible.
#define EPF_REQUIRE_GPUS(n)                                                                         \
  do {                                                                                              \
    const int epf_have_ = ::epfabric::testing::CudaDeviceCount();                                   \
    if (epf_have_ < (n)) GTEST_SKIP() << "needs " << (n) << " CUDA device(s), found " << epf_have_; \
  } while (0)
