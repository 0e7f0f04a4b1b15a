// The one kernel the daemon launches: the receiving side of the socket wire adds a signal to a word of a region in
// GPU memory after the puts it received before it. Its own library (epfabric_kernels_signal), so that the daemon links
// this and the kernels' ABI (kernels_abi: ring format, counters page, status words) and nothing else of the data path.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace epfabric::kernels::transport {

// Adds `value` to the 8-byte word at `word` (device memory) with a system-scope atomic, after everything queued earlier
// on `stream` (the puts it received before the signal).
absl::Status LaunchSignalAdd(void* word, int64_t value, cudaStream_t stream);

}  // namespace epfabric::kernels::transport
