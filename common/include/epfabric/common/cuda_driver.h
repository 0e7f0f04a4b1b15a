// The few CUDA driver API entry points that epfabric needs (cuMem virtual memory management and shareable handles),
// resolved at run time through the CUDA runtime's cudaGetDriverEntryPointByVersion instead of linking libcuda:
// the daemon and the client library must load and start on machines without an NVIDIA driver (CI, the host
// backend). Also the conversion of CUDA errors to absl::Status used by the memory code on both sides.
#pragma once

#include <cuda.h>  // types only: nothing here links against libcuda
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace epfabric::cuda {

// The ABI version of every entry point below (the typedef suffixes): CUDA 12.0 semantics, served by any driver that
// the CUDA 13 runtime accepts.
inline constexpr unsigned int kDriverApiVersion = 12000;

struct DriverApi {
  PFN_cuGetErrorName_v6000 cuGetErrorName = nullptr;
  PFN_cuGetErrorString_v6000 cuGetErrorString = nullptr;
  PFN_cuCtxGetCurrent_v4000 cuCtxGetCurrent = nullptr;
  PFN_cuDeviceGet_v2000 cuDeviceGet = nullptr;
  PFN_cuDeviceGetAttribute_v2000 cuDeviceGetAttribute = nullptr;
  PFN_cuMemCreate_v10020 cuMemCreate = nullptr;
  PFN_cuMemRelease_v10020 cuMemRelease = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 cuMemGetAllocationGranularity = nullptr;
  PFN_cuMemAddressReserve_v10020 cuMemAddressReserve = nullptr;
  PFN_cuMemAddressFree_v10020 cuMemAddressFree = nullptr;
  PFN_cuMemMap_v10020 cuMemMap = nullptr;
  PFN_cuMemUnmap_v10020 cuMemUnmap = nullptr;
  PFN_cuMemSetAccess_v10020 cuMemSetAccess = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 cuMemExportToShareableHandle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 cuMemImportFromShareableHandle = nullptr;
  // DMA-BUF export of device memory for ibv_reg_dmabuf_mr (the verbs wire's GPUDirect RDMA without nvidia-peermem).
  PFN_cuMemGetHandleForAddressRange_v11070 cuMemGetHandleForAddressRange = nullptr;
};

// The entry points, resolved on first use (thread-safe) and cached for the life of the process.
// FailedPrecondition naming the symbol when there is no driver or the driver lacks one.
absl::StatusOr<const DriverApi*> Driver();

// OK for CUDA_SUCCESS; otherwise `what` + the driver's error name and text. Out-of-memory becomes ResourceExhausted,
// a missing device or driver FailedPrecondition, bad arguments InvalidArgument, the rest Internal.
absl::Status CuStatus(const DriverApi& driver, CUresult result, absl::string_view what);

// The same for the CUDA runtime. Also clears the runtime's last (non-sticky) error so that it does not surface in
// an unrelated later call.
absl::Status CudaStatus(cudaError_t error, absl::string_view what);

// Makes `device`'s primary context current on the calling thread (creating it if needed): the cuMem calls work on
// the current context, and gRPC handler threads start with none.
absl::Status UseDevice(int device);

}  // namespace epfabric::cuda
