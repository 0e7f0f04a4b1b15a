// Kernels of the transport: a list issuer (tests, benchmarks). The receiving daemon's signal add is signal_add.cu.
#include <vector>

#include "api/launch_error.h"
#include "epfabric/kernels/transport/device.h"
#include "transport.cuh"

namespace epfabric::kernels::transport {
namespace {

constexpr int kMaxLaunchRings = kMaxChannels;

struct IssueParams {
  transport_device::Ring rings[kMaxLaunchRings];
  const Command* commands;
  const int* offsets;
  bool quiet;
  int self_rank;
  uint64_t timeout_ns;
  KernelStatus* status;
  int* ring_failed;
};

__global__ void issue_commands(const IssueParams params) {
  if (threadIdx.x != 0) return;
  const int c = blockIdx.x;
  const transport_device::Ring& ring = params.rings[c];
  bool ok = true;
  for (int i = params.offsets[c]; ok && i < params.offsets[c + 1]; ++i) {
    const Command& command = params.commands[i];
    ok = transport_device::issue(ring, static_cast<Opcode>(command.opcode), command.dst_rank, command.dst_offset,
                                 command.src_offset, command.arg, params.timeout_ns, params.status, params.self_rank);
  }
  if (ok && params.quiet) ok = transport_device::quiet(ring, params.timeout_ns, params.status, params.self_rank);
  if (!ok && transport_device::ring_failed(ring)) params.ring_failed[c] = 1;
}

}  // namespace

absl::Status LaunchIssueCommands(const std::vector<DeviceRing>& rings, const Command* commands, const int* offsets,
                                 bool quiet, int self_rank, uint64_t timeout_ns, KernelStatus* status, int* ring_failed,
                                 cudaStream_t stream) {
  if (rings.empty() || rings.size() > static_cast<size_t>(kMaxLaunchRings)) {
    return absl::InvalidArgumentError("transport: 1 to 32 rings per launch");
  }
  IssueParams params = {};
  for (size_t c = 0; c < rings.size(); ++c) {
    const DeviceRing& ring = rings[c];
    if (ring.ring == nullptr || ring.next == nullptr || !ValidRingSlots(ring.slots)) {
      return absl::InvalidArgumentError("transport: a ring without memory, counter or a valid slot count");
    }
    auto* control = static_cast<RingControl*>(ring.ring);
    params.rings[c] = {control, reinterpret_cast<Command*>(control + 1), ring.next, ring.slots, ring.channel};
  }
  params.commands = commands;
  params.offsets = offsets;
  params.quiet = quiet;
  params.self_rank = self_rank;
  params.timeout_ns = timeout_ns;
  params.status = status;
  params.ring_failed = ring_failed;
  issue_commands<<<static_cast<int>(rings.size()), 32, 0, stream>>>(params);
  return LaunchError(cudaGetLastError(), "transport issue_commands");
}

}  // namespace epfabric::kernels::transport
