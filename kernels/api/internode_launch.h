// Internal: the launch side of the internode kernels (kernels/cuda/internode.cu), called by internode_api.cc after
// validation. Plain C++ structs from internode_layout.h, no absl.
#pragma once

#include <cuda_runtime_api.h>

#include "epfabric/kernels/internode_layout.h"

namespace epfabric::kernels::internode {

cudaError_t LaunchPack(const InternodePackParams& params, cudaStream_t stream);
cudaError_t LaunchReduce(const InternodeReduceParams& params, cudaStream_t stream);
// The worst-case mode's steps (kernels/cuda/internode_worst.cu).
cudaError_t LaunchPlan(const InternodePlanParams& params, cudaStream_t stream);
cudaError_t LaunchGather(const InternodeGatherParams& params, cudaStream_t stream);
cudaError_t LaunchScatter(const InternodeScatterParams& params, cudaStream_t stream);
cudaError_t LaunchIssue(const InternodeIssueParams& params, cudaStream_t stream);
cudaError_t LaunchWait(const InternodeWaitParams& params, cudaStream_t stream);

}  // namespace epfabric::kernels::internode
