// The launch functions of kernels/cuda in a build without nvcc (EPF_CUDA=OFF): every one fails with
// cudaErrorNotSupported (the transport's with FAILED_PRECONDITION), so the cuda backend reports "not supported" where
// a build with CUDA would launch; the host backend and everything else are unchanged. Keep in step with api/launch.h,
// api/internode_launch.h and epfabric/kernels/transport/device.h: a missing definition fails the EPF_CUDA=OFF link.
#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "api/internode_launch.h"
#include "api/launch.h"
#include "epfabric/kernels/transport/device.h"

namespace epfabric::kernels {
namespace {

constexpr cudaError_t kNoKernels = cudaErrorNotSupported;

absl::Status NoKernels(const char* what) {
  return absl::FailedPreconditionError(std::string(what) + ": this build has no CUDA kernels (EPF_CUDA=OFF)");
}

}  // namespace

namespace intranode {
cudaError_t LaunchDispatchLayout(const LayoutKernelParams&, cudaStream_t) { return kNoKernels; }
cudaError_t LaunchNotify(const NotifyKernelParams&, cudaStream_t) { return kNoKernels; }
cudaError_t LaunchDispatch(const DispatchKernelParams&, cudaStream_t) { return kNoKernels; }
cudaError_t LaunchCombine(const CombineKernelParams&, cudaStream_t) { return kNoKernels; }
cudaError_t LaunchAbandonCall(const GroupView&, cudaStream_t, const KernelStatus*) { return kNoKernels; }
cudaError_t PreloadKernels() { return kNoKernels; }
}  // namespace intranode

namespace low_latency {
cudaError_t LaunchDispatch(const DispatchKernelParams&, int, cudaStream_t) { return kNoKernels; }
cudaError_t LaunchCombine(const CombineKernelParams&, int, cudaStream_t) { return kNoKernels; }
cudaError_t LaunchRemoteIssue(const RemoteIssueKernelParams&, cudaStream_t) { return kNoKernels; }
cudaError_t PreloadKernels() { return kNoKernels; }
cudaError_t PreloadRemoteIssue() { return kNoKernels; }
}  // namespace low_latency

namespace internode {
cudaError_t LaunchPack(const InternodePackParams&, cudaStream_t) { return kNoKernels; }
cudaError_t LaunchReduce(const InternodeReduceParams&, cudaStream_t) { return kNoKernels; }
cudaError_t LaunchPlan(const InternodePlanParams&, cudaStream_t) { return kNoKernels; }
cudaError_t LaunchGather(const InternodeGatherParams&, cudaStream_t) { return kNoKernels; }
cudaError_t LaunchScatter(const InternodeScatterParams&, cudaStream_t) { return kNoKernels; }
cudaError_t LaunchIssue(const InternodeIssueParams&, cudaStream_t) { return kNoKernels; }
cudaError_t LaunchWait(const InternodeWaitParams&, cudaStream_t) { return kNoKernels; }
}  // namespace internode

namespace transport {
absl::Status LaunchIssueCommands(const std::vector<DeviceRing>&, const Command*, const int*, bool, int, uint64_t,
                                 KernelStatus*, int*, cudaStream_t) {
  return NoKernels("transport issue_commands");
}
}  // namespace transport

}  // namespace epfabric::kernels
