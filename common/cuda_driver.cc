#include "epfabric/common/cuda_driver.h"

#include <mutex>

#include "absl/strings/str_cat.h"

namespace epfabric::cuda {
namespace {

absl::Status Resolve(const char* symbol, void** function) {
  cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t error =
      cudaGetDriverEntryPointByVersion(symbol, function, kDriverApiVersion, cudaEnableDefault, &query);
  if (error != cudaSuccess || query != cudaDriverEntryPointSuccess || *function == nullptr) {
    (void)cudaGetLastError();
    *function = nullptr;
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA driver entry point ", symbol, " (version ", kDriverApiVersion, ") is not available: ",
                     error != cudaSuccess ? absl::StrCat(cudaGetErrorName(error), ": ", cudaGetErrorString(error))
                                          : absl::StrCat("query result ", static_cast<int>(query))));
  }
  return absl::OkStatus();
}

template <typename Function>
absl::Status ResolveInto(const char* symbol, Function& function) {
  void* raw = nullptr;
  absl::Status status = Resolve(symbol, &raw);
  function = reinterpret_cast<Function>(raw);
  return status;
}

absl::StatusOr<DriverApi> Load() {
  DriverApi api;
  for (absl::Status status : {
           ResolveInto("cuGetErrorName", api.cuGetErrorName),
           ResolveInto("cuGetErrorString", api.cuGetErrorString),
           ResolveInto("cuCtxGetCurrent", api.cuCtxGetCurrent),
           ResolveInto("cuDeviceGet", api.cuDeviceGet),
           ResolveInto("cuDeviceGetAttribute", api.cuDeviceGetAttribute),
           ResolveInto("cuMemCreate", api.cuMemCreate),
           ResolveInto("cuMemRelease", api.cuMemRelease),
           ResolveInto("cuMemGetAllocationGranularity", api.cuMemGetAllocationGranularity),
           ResolveInto("cuMemAddressReserve", api.cuMemAddressReserve),
           ResolveInto("cuMemAddressFree", api.cuMemAddressFree),
           ResolveInto("cuMemMap", api.cuMemMap),
           ResolveInto("cuMemUnmap", api.cuMemUnmap),
           ResolveInto("cuMemSetAccess", api.cuMemSetAccess),
           ResolveInto("cuMemExportToShareableHandle", api.cuMemExportToShareableHandle),
           ResolveInto("cuMemImportFromShareableHandle", api.cuMemImportFromShareableHandle),
           ResolveInto("cuMemGetHandleForAddressRange", api.cuMemGetHandleForAddressRange),
       }) {
    if (!status.ok()) return status;
  }
  return api;
}

absl::StatusCode CodeFor(CUresult result) {
  switch (result) {
    case CUDA_ERROR_OUT_OF_MEMORY:
      return absl::StatusCode::kResourceExhausted;
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_INVALID_DEVICE:
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_NOT_SUPPORTED:
    case CUDA_ERROR_PEER_ACCESS_UNSUPPORTED:
      return absl::StatusCode::kFailedPrecondition;
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE:
      return absl::StatusCode::kInvalidArgument;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::StatusCode CodeFor(cudaError_t error) {
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::StatusCode::kResourceExhausted;
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorNotSupported:
    case cudaErrorPeerAccessUnsupported:
      return absl::StatusCode::kFailedPrecondition;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidResourceHandle:
      return absl::StatusCode::kInvalidArgument;
    default:
      return absl::StatusCode::kInternal;
  }
}

}  // namespace

absl::StatusOr<const DriverApi*> Driver() {
  static std::once_flag once;
  static absl::StatusOr<DriverApi>* loaded = nullptr;  // never destroyed: used until process exit
  std::call_once(once, [] { loaded = new absl::StatusOr<DriverApi>(Load()); });
  if (!loaded->ok()) return loaded->status();
  return &**loaded;
}

absl::Status CuStatus(const DriverApi& driver, CUresult result, absl::string_view what) {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  const char* name = nullptr;
  const char* text = nullptr;
  if (driver.cuGetErrorName == nullptr || driver.cuGetErrorName(result, &name) != CUDA_SUCCESS) name = nullptr;
  if (driver.cuGetErrorString == nullptr || driver.cuGetErrorString(result, &text) != CUDA_SUCCESS) text = nullptr;
  return absl::Status(CodeFor(result),
                      absl::StrCat(what, ": ", name != nullptr ? name : "CUresult", " (", static_cast<int>(result), ")",
                                   text != nullptr ? absl::StrCat(": ", text) : ""));
}

absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();
  return absl::Status(CodeFor(error),
                      absl::StrCat(what, ": ", cudaGetErrorName(error), ": ", cudaGetErrorString(error)));
}

absl::Status UseDevice(int device) {
  // cudaSetDevice initialises the device's primary context and makes it current (CUDA 12 and later).
  return CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
}

}  // namespace epfabric::cuda
