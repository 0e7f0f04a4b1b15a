// Low latency across hosts with the puts issued from the device (docs/internode-dispatch.md, "Capture across hosts"):
// after each step of a call the staged bytes for the ranks on other hosts are put into their inboxes by a small
// kernel on the caller's stream, and the receiving kernels wait for them on the device. Nothing waits on the host, so
// a call can be captured into a CUDA graph. The relay (client/internode_low_latency_relay.cc) sends the same ranges
// in the same order from the calling thread; this is its device twin.
//
// A call is, on the caller's stream:
//   dispatch: kQuiet -> dispatch kernel (kSend) -> kDispatch -> dispatch kernel (kRecv)
//   combine:  kQuiet -> combine kernel (kCombineWeights) -> kCombineWeights -> combine kernel (kSendWeightsPublished)
//             -> kCombineRows -> combine kernel (kRecv)
// kQuiet waits until the puts of earlier calls are complete: the call about to start cleans and rewrites outboxes
// those puts may still be reading.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "epfabric/kernels/low_latency.h"
#include "epfabric/kernels/transport/device.h"

namespace epfabric::kernels {

// The rings a rank's device-side issuer uses: rank r's sends go on rings[r % num_rings], so that each destination
// sees them in order (a signal after the data it publishes). Each ring's `next` counter is used by this issuer only:
// no host issuer may use these rings meanwhile (their indices would collide).
struct LowLatencyRemoteRings {
  transport::DeviceRing rings[kMaxNvlPeers];
  int num_rings = 0;
  // Where the low-latency part starts in the RDMA region (after a normal-mode part; LowLatencyRemote): the rings'
  // offsets are the region's. The inbox (two layout halves) is at this offset, this rank's outbox for rank r (two
  // outbox halves) after it, at 2 * half_bytes + r * 2 * outbox_half_bytes.
  uint64_t rdma_offset = 0;
};

enum class LowLatencyRemoteStep : int32_t {
  kQuiet = 0,           // wait for the completion of every put issued so far (bounded)
  kDispatch = 1,        // this rank's messages, routing lists, then counts
  kCombineWeights = 2,  // this rank's top-k weights, then the weights flag
  kCombineRows = 3,     // the partial sums of the tokens this rank holds experts of, then the combine flag
};

struct LowLatencyRemoteArgs {
  LowLatencyRemoteStep step = LowLatencyRemoteStep::kQuiet;
  int buffer_half = 0;
  int num_tokens = 0;                  // kDispatch, kCombineWeights: tokens this rank dispatched in the call
  const int32_t* token_map = nullptr;  // kCombineRows: the dispatch's packed_recv_token_map [R][M][kLowLatencyMaxTopk]
};

// Launches one step's issuer on `stream` (one warp per rank on another host that is not masked). No host
// synchronisation: capturable. A wait that times out (ring space, completion) is recorded in ctx.status; a ring whose
// daemon recorded a failure (peer lost, refused command) gets no further commands from the step, and the caller reads
// the ring's RingControl for why (transport::RingErrorStatus).
absl::Status LowLatencyRemoteIssue(const LowLatencyContext& ctx, const LowLatencyRemoteRings& rings,
                                   const LowLatencyRemoteArgs& args, cudaStream_t stream);

}  // namespace epfabric::kernels
