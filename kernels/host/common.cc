#include "epfabric/kernels/common.h"

#include "absl/strings/str_format.h"

namespace epfabric::kernels {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return 2;
    case DType::kFP8E4M3:
    case DType::kBool:
      return 1;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kFP8E4M3:
      return "fp8_e4m3";
    case DType::kFloat32:
      return "float32";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kBool:
      return "bool";
  }
  return "unknown";
}

const char* WaitSiteName(WaitSite site) {
  switch (site) {
    case WaitSite::kNone:
      return "none";
    case WaitSite::kBarrier:
      return "barrier";
    case WaitSite::kNotifyCounts:
      return "notify counts";
    case WaitSite::kDispatchFifoSpace:
      return "dispatch FIFO space";
    case WaitSite::kDispatchFifoData:
      return "dispatch FIFO data";
    case WaitSite::kCombineFifoSpace:
      return "combine FIFO space";
    case WaitSite::kCombineFifoData:
      return "combine FIFO data";
    case WaitSite::kLowLatencyRecvCount:
      return "low-latency receive count";
    case WaitSite::kLowLatencyCombineFlag:
      return "low-latency combine flag";
  }
  return "unknown";
}

absl::Status KernelStatusToStatus(const KernelStatus& status) {
  if (status.code == kKernelStatusOk) return absl::OkStatus();
  if (status.code == kKernelStatusTimeout) {
    return absl::DeadlineExceededError(
        absl::StrFormat("rank %d timed out waiting for %s from rank %d (channel %d)", status.waiting_rank,
                        WaitSiteName(static_cast<WaitSite>(status.site)), status.peer_rank, status.channel));
  }
  return absl::InternalError(absl::StrFormat("kernel status word holds unknown code %d", status.code));
}

absl::Status CudaErrorToStatus(cudaError_t err, const char* expr, const char* file, int line) {
  return absl::InternalError(
      absl::StrFormat("%s failed: %s (%s) at %s:%d", expr, cudaGetErrorName(err), cudaGetErrorString(err), file, line));
}

}  // namespace epfabric::kernels
