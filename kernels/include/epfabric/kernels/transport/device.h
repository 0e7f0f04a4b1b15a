// The transport from CUDA: what host code needs to drive device-side issuers (and, through signal.h, the receiving
// daemon's signal add).
// The internode kernels issue through kernels/cuda/transport.cuh directly; LaunchIssueCommands runs the same device
// code over a list of commands (conformance tests, benchmarks).
#pragma once

#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "epfabric/kernels/status_word.h"
#include "epfabric/kernels/transport/ring.h"
#include "epfabric/kernels/transport/signal.h"

namespace epfabric::kernels::transport {

// One ring as device code addresses it.
struct DeviceRing {
  void* ring = nullptr;                // device pointer of the ring's RingControl (cudaHostGetDevicePointer)
  unsigned long long* next = nullptr;  // device memory, zero at lease start: the next index to reserve
  uint32_t slots = kDefaultRingSlots;
  int channel = 0;
};

// One block per ring: lane 0 of block c issues commands[offsets[c] .. offsets[c + 1]) (device memory; offsets has
// rings.size() + 1 entries, device memory) on rings[c] in order, then quiets when `quiet` is set. Waits are bounded by
// `timeout_ns`; the first failure goes into `status` (device or mapped memory). `ring_failed` (device or mapped memory,
// one int per ring) is set to 1 for a ring whose daemon recorded an error: read that ring's RingControl for it.
absl::Status LaunchIssueCommands(const std::vector<DeviceRing>& rings, const Command* commands, const int* offsets,
                                 bool quiet, int self_rank, uint64_t timeout_ns, KernelStatus* status, int* ring_failed,
                                 cudaStream_t stream);

}  // namespace epfabric::kernels::transport
