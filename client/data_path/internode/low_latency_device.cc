// Low-latency mode across hosts on the cuda backend with the puts issued from the device (low_latency_stage.h,
// kernels/low_latency_remote.h): every step is a launch on the caller's stream and every wait is a kernel's bounded
// wait, so a call can be captured into a CUDA graph. The relay (low_latency_relay.cc) sends the same ranges
// from the calling thread instead.
#include <algorithm>
#include <atomic>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "data_path/internode/low_latency_stage.h"
#include "data_path/internode/normal_stage.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/kernels/transport/issuer.h"

namespace epfabric::client::internal {
namespace {

namespace transport = kernels::transport;
using kernels::LowLatencyPhases;
using kernels::LowLatencyRemoteStep;

// Copies on a private non-blocking stream: a plain cudaMemcpy waits for the legacy default stream, and so for the
// kernels of another rank of this process (ranks sharing a GPU as threads) that may be waiting for this one.
absl::Status CopyPrivately(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  cudaStream_t stream = nullptr;
  EPF_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaError_t err = cudaMemcpyAsync(dst, src, bytes, kind, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  EPF_CUDA_RETURN_IF_ERROR(err);
  return absl::OkStatus();
}

// The command regions whose low-latency rings a device-side issuer of this process holds: its ring index lives in
// device memory, so a second issuer on the same rings (a Buffer made before the previous one went, e.g. one a garbage
// collector has not destroyed yet) would reuse indices the daemon has already consumed and never be served.
std::mutex rings_held_mu;
std::set<const void*>& RingsHeld() {
  static auto* held = new std::set<const void*>();
  return *held;
}

class LowLatencyDeviceStage final : public LowLatencyRdmaStage {
 public:
  LowLatencyDeviceStage(KernelPath* inner, std::unique_ptr<LowLatencyRemote> remote,
                        kernels::LowLatencyRemoteRings rings, std::vector<transport::RingControl*> controls,
                        unsigned long long* next, absl::Duration timeout)
      : LowLatencyRdmaStage(inner),
        remote_(std::move(remote)),
        rings_(rings),
        controls_(std::move(controls)),
        next_(next),
        timeout_(timeout) {}

  // The last puts must reach their destinations before the lease can end (it drops what its rings hold), and the
  // rings' next index goes back to the host side so that a later issuer on this lease carries on from it.
  ~LowLatencyDeviceStage() override {
    QuietOnHost().IgnoreError();
    cudaFree(next_);
    std::lock_guard<std::mutex> lock(rings_held_mu);
    RingsHeld().erase(controls_.front());
  }

  absl::Status LowLatencyDispatch(const kernels::LowLatencyDispatchArgs& args, cudaStream_t stream) override {
    kernels::LowLatencyDispatchArgs step = args;
    if (kernels::LowLatencySends(args.phases)) {
      EPF_RETURN_IF_ERROR(Issue({.step = LowLatencyRemoteStep::kQuiet, .buffer_half = args.buffer_half}, stream));
      step.phases = LowLatencyPhases::kSend;
      EPF_RETURN_IF_ERROR(inner_->LowLatencyDispatch(step, stream));
      EPF_RETURN_IF_ERROR(Issue(
          {.step = LowLatencyRemoteStep::kDispatch, .buffer_half = args.buffer_half, .num_tokens = args.num_tokens},
          stream));
    }
    if (kernels::LowLatencyReceives(args.phases)) {
      step.phases = LowLatencyPhases::kRecv;
      EPF_RETURN_IF_ERROR(inner_->LowLatencyDispatch(step, stream));
    }
    return absl::OkStatus();
  }

  absl::Status LowLatencyCombine(const kernels::LowLatencyCombineArgs& args, cudaStream_t stream) override {
    kernels::LowLatencyCombineArgs step = args;
    if (kernels::LowLatencySends(args.phases)) {
      EPF_RETURN_IF_ERROR(Issue({.step = LowLatencyRemoteStep::kQuiet, .buffer_half = args.buffer_half}, stream));
      step.phases = LowLatencyPhases::kCombineWeights;
      EPF_RETURN_IF_ERROR(inner_->LowLatencyCombine(step, stream));
      EPF_RETURN_IF_ERROR(Issue({.step = LowLatencyRemoteStep::kCombineWeights,
                                 .buffer_half = args.buffer_half,
                                 .num_tokens = args.num_tokens},
                                stream));
      step.phases = LowLatencyPhases::kSendWeightsPublished;
      EPF_RETURN_IF_ERROR(inner_->LowLatencyCombine(step, stream));
      EPF_RETURN_IF_ERROR(Issue({.step = LowLatencyRemoteStep::kCombineRows,
                                 .buffer_half = args.buffer_half,
                                 .token_map = args.handle.packed_recv_token_map},
                                stream));
    }
    if (kernels::LowLatencyReceives(args.phases)) {
      step.phases = LowLatencyPhases::kRecv;
      EPF_RETURN_IF_ERROR(inner_->LowLatencyCombine(step, stream));
    }
    return absl::OkStatus();
  }

  // The kernels' record first (it names the rank a wait was for), then a ring the daemon stopped (peer lost, a
  // refused command): its puts after the failure were dropped.
  absl::Status Check(cudaStream_t stream) override {
    EPF_RETURN_IF_ERROR(inner_->Check(stream));
    return RingErrors();
  }

  absl::Status Reset(cudaStream_t stream) override {
    // Puts still queued read the outboxes' signals that are about to be zeroed.
    EPF_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    QuietOnHost().IgnoreError();
    for (const LowLatencyRemote::SignalRange& range : remote_->SignalRanges()) {
      EPF_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(range.at, 0, range.bytes, stream));
    }
    return inner_->Reset(stream);
  }

 private:
  absl::Status Issue(const kernels::LowLatencyRemoteArgs& args, cudaStream_t stream) {
    return inner_->LowLatencyRemoteIssue(rings_, args, stream);
  }

  absl::Status RingErrors() const {
    for (int c = 0; c < rings_.num_rings; ++c) {
      EPF_RETURN_IF_ERROR(transport::RingErrorStatus(rings_.rings[c].channel, *controls_[c]));
    }
    return absl::OkStatus();
  }

  // Publishes the device-side next index of each ring as the ring's `reserved` (where a host issuer carries on
  // from), then waits (bounded) until every put issued so far is complete, as a host issuer's quiet does. The caller
  // has synchronised the streams that issue.
  absl::Status QuietOnHost() {
    std::vector<unsigned long long> next(rings_.num_rings);
    EPF_RETURN_IF_ERROR(
        CopyPrivately(next.data(), next_, sizeof(unsigned long long) * next.size(), cudaMemcpyDeviceToHost));
    absl::Status quiet;
    for (int c = 0; c < rings_.num_rings; ++c) {
      std::atomic_ref<uint64_t>(controls_[c]->reserved).store(next[c], std::memory_order_release);
      auto ring = transport::RingIssuer::Create(controls_[c], rings_.rings[c].channel, rings_.rings[c].slots);
      if (ring.ok()) quiet.Update(ring->Quiet(timeout_));
    }
    return quiet;
  }

  std::unique_ptr<LowLatencyRemote> remote_;
  const kernels::LowLatencyRemoteRings rings_;
  const std::vector<transport::RingControl*> controls_;  // the rings' control blocks as this process maps them
  unsigned long long* const next_;                       // device memory, one counter per ring
  const absl::Duration timeout_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<LowLatencyRdmaStage>> NewLowLatencyDeviceStage(KernelPath* inner,
                                                                              std::unique_ptr<LowLatencyRemote> remote,
                                                                              Lease* lease, absl::Duration timeout) {
  const uint32_t slots = lease->group().ring_slots();
  const ChannelRange channels = LowLatencyChannels(*lease);
  if (lease->group().num_normal_bytes() > 0 && channels.first == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", lease->group_name(),
                     "' serves both modes with one transport channel: device-issued low latency "
                     "needs a channel of its own (CreateGroup's transport_channels >= 2)"));
  }
  void* device_base = lease->commands_region_device();
  void* host_base = lease->commands_region();
  if (device_base == nullptr || host_base == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", lease->group_name(), "': the transport command rings are not mapped for CUDA"));
  }
  const int first = channels.first;
  const void* held = transport::RingAt(host_base, first, slots);
  {
    std::lock_guard<std::mutex> lock(rings_held_mu);
    if (!RingsHeld().insert(held).second) {
      return absl::FailedPreconditionError(
          absl::StrCat("group '", lease->group_name(),
                       "': another low-latency Buffer of this lease issues from the device; "
                       "destroy it before making a new one (the rings' next index is in its device memory)"));
    }
  }
  auto release = absl::MakeCleanup([held] {
    std::lock_guard<std::mutex> lock(rings_held_mu);
    RingsHeld().erase(held);
  });
  kernels::LowLatencyRemoteRings rings;
  rings.num_rings = std::min(channels.count, kernels::kMaxNvlPeers);
  rings.rdma_offset = remote->rdma_offset();
  std::vector<transport::RingControl*> controls;
  std::vector<unsigned long long> start;
  for (int c = 0; c < rings.num_rings; ++c) {
    auto* control = static_cast<transport::RingControl*>(transport::RingAt(host_base, first + c, slots));
    if (control->magic != transport::kRingMagic) {
      return absl::FailedPreconditionError(absl::StrCat("transport ring ", first + c, " is not initialised"));
    }
    controls.push_back(control);
    // Host issuers may have used the ring before (a relay Buffer on this lease): carry on from their next index.
    start.push_back(std::atomic_ref<uint64_t>(control->reserved).load(std::memory_order_acquire));
    rings.rings[c] = {.ring = transport::RingAt(device_base, first + c, slots),
                      .next = nullptr,
                      .slots = slots,
                      .channel = first + c};
  }
  void* next = nullptr;
  EPF_CUDA_RETURN_IF_ERROR(cudaMalloc(&next, sizeof(unsigned long long) * rings.num_rings));
  auto* counters = static_cast<unsigned long long*>(next);
  if (absl::Status copied =
          CopyPrivately(counters, start.data(), sizeof(unsigned long long) * start.size(), cudaMemcpyHostToDevice);
      !copied.ok()) {
    cudaFree(next);
    return copied;
  }
  for (int c = 0; c < rings.num_rings; ++c) rings.rings[c].next = counters + c;
  std::move(release).Cancel();  // the path releases the rings when it goes
  return std::unique_ptr<LowLatencyRdmaStage>(
      std::make_unique<LowLatencyDeviceStage>(inner, std::move(remote), rings, std::move(controls), counters, timeout));
}

}  // namespace epfabric::client::internal
