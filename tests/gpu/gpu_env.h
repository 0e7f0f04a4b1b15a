// Helpers for GPU tests: skip cleanly (GTEST_SKIP) when the machine has fewer CUDA devices than a test needs.
// Tests whose ranks can share a GPU (gpu_placement.h: rank r on GPU r mod n) need one GPU; only a case that needs
// two physical GPUs for a stated reason (peer access between devices, a client that cannot see the owner's GPU)
// uses EPF_REQUIRE_DISTINCT_GPUS with that reason.
#pragma once

#include <gtest/gtest.h>

#include "support/gpu_placement.h"

// Skips the current test unless at least `n` CUDA devices are visible.
#define EPF_REQUIRE_GPUS(n)                                                                         \
  do {                                                                                              \
    const int epf_have_ = ::epfabric::testing::CudaDeviceCount();                                   \
    if (epf_have_ < (n)) GTEST_SKIP() << "needs " << (n) << " CUDA device(s), found " << epf_have_; \
  } while (0)

// Skips the current test unless at least `n` CUDA devices are visible, naming why ranks sharing a GPU cannot do.
#define EPF_REQUIRE_DISTINCT_GPUS(n, why)                                                                 \
  do {                                                                                                    \
    const int epf_have_ = ::epfabric::testing::CudaDeviceCount();                                         \
    if (epf_have_ < (n))                                                                                  \
      GTEST_SKIP() << "needs " << (n) << " physical CUDA devices (" << (why) << "), found " << epf_have_; \
  } while (0)
