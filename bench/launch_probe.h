// See launch_probe.cu.
#pragma once

#include <cuda_runtime_api.h>

namespace epfabric::bench {

// Enqueues an empty kernel as one cooperative grid of `blocks` x `threads`.
cudaError_t LaunchEmptyCooperative(int blocks, int threads, cudaStream_t stream);

}  // namespace epfabric::bench
