// Shared host-side vocabulary of the kernels library: element types, errors, and the translation of the
// kernel status word (status_word.h) into absl::Status. Plain C++ (no CUDA compiler needed), so that the client
// library and tests can include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "epfabric/kernels/status_word.h"

namespace epfabric::kernels {

enum class DType : int32_t { kBF16 = 0, kFP8E4M3 = 1, kFloat32 = 2, kInt32 = 3, kInt64 = 4, kBool = 5 };

size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);

const char* WaitSiteName(WaitSite site);

// Kernel timelines for benchmarks (optional `profile_ns` of IntranodeGroup and LowLatencyContext): device memory of
// uint64 [blocks][kProfileSlotsPerBlock], %globaltimer nanoseconds. Per block: slot 0 = entry, slot 1 = end of the
// block's start-up (intranode: after the barrier and the slot scan; low latency: end of the send phase of the
// block's last warp, written by each warp that sends, so it is the latest), slot 2 + w = when warp w finished.
// Production leaves it null (the kernels then skip every mark).
inline constexpr int kProfileSlotsPerBlock = 34;

// Turns a status word read back from the device into an absl::Status naming the rank that was waited for.
absl::Status KernelStatusToStatus(const KernelStatus& status);

// Converts a CUDA runtime error into absl::Status with the failing expression, file and line.
absl::Status CudaErrorToStatus(cudaError_t err, const char* expr, const char* file, int line);

}  // namespace epfabric::kernels

// Evaluates a CUDA runtime call and returns an absl::Status from the enclosing function on failure.
#define EPF_CUDA_RETURN_IF_ERROR(expr)                                                         \
  do {                                                                                         \
    cudaError_t epf_cuda_err_ = (expr);                                                        \
    if (epf_cuda_err_ != cudaSuccess)                                                          \
      return ::epfabric::kernels::CudaErrorToStatus(epf_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)
