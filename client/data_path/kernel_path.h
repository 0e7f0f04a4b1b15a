// Internal: the data path that runs the kernels library over mapped regions, the part the cuda path (cuda/) and the
// host path (host/) share. Normal mode's calls are one algorithm on both backends (notify, outputs sized by the
// received count, dispatch; combine), written here over the backend's launches; low latency is the kernels' calls.
// The internode path uses one as its NVLink stage (normal mode: this host's ranks) or as its low-latency stage (every
// rank; those on other hosts through outboxes, ReachAcrossHosts), through the stage methods below.
// The kernels' validation functions check every params struct again (one set of rules, kernels/api) before anything
// runs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "data_path/data_path.h"
#include "epfabric/kernels/intranode.h"
#include "epfabric/kernels/low_latency.h"
#include "epfabric/kernels/low_latency_remote.h"

namespace epfabric::client::internal {

// Notify's host-side wait outlasts the kernel's own timeout by this much, so that the kernel's record (naming the
// peer), not the host wait, explains a timeout.
inline constexpr uint64_t kNotifyGraceNs = 1000ull * 1000 * 1000;

// What a kernel path runs over; fixed for its life.
struct KernelPathConfig {
  BufferConfig config;  // the mode, sizes and timeout (across hosts, the NVLink stage's: InnerBufferConfig)
  int rank = 0;         // this rank's index among the path's ranks
  int num_ranks = 0;
  int experts_per_rank = 0;
  // The path's ranks' regions (the mode's part) as mapped in this process; null for a rank on another host.
  void* peer_regions[kernels::kMaxLowLatencyRanks] = {};
  // The daemon's lost-ranks words for these ranks, in this order (Lease::lost_ranks_words; null: not published).
  const uint64_t* lost_ranks = nullptr;
  const uint64_t* lost_ranks_host = nullptr;  // the same words as this process reads them (set with lost_ranks)
  std::shared_ptr<Allocator> allocator;       // outputs
};

// Low latency across hosts: completes a low-latency context with the ranks on other hosts (their outboxes as peer
// regions, the inbox, the put function: LowLatencyRemote::Reach).
using ReachAcrossHosts = std::function<void(kernels::LowLatencyContext*)>;

class KernelPath : public DataPath {
 public:
  // The cuda or host path, with its status word, counters and rank mask allocated and the group (normal mode) or
  // low-latency context set up.
  static absl::StatusOr<std::unique_ptr<KernelPath>> Create(Backend backend, const KernelPathConfig& config,
                                                            const ReachAcrossHosts& reach = nullptr);

  // ---- DataPath: over this path's ranks and experts ----
  absl::Status CheckExpertIndices(const TensorView& topk_idx) final {
    return CheckExpertIndicesOf(topk_idx, config_.config.num_experts);
  }
  absl::StatusOr<DispatchLayout> Layout(const TensorView& topk_idx, cudaStream_t stream) final {
    return LayoutOver(topk_idx, config_.num_ranks, config_.config.num_experts, stream);
  }
  absl::StatusOr<DispatchResult> Dispatch(const DispatchArgs& args, cudaStream_t stream) final;
  absl::StatusOr<CombineResult> Combine(const CombineArgs& args, cudaStream_t stream) final;

  // ---- stage methods (the internode path) ----
  // CheckExpertIndices against `num_experts` (across hosts: the group's, not this host's).
  virtual absl::Status CheckExpertIndicesOf(const TensorView& topk_idx, int num_experts) = 0;
  // The layout over `num_ranks` ranks and `num_experts` experts (across hosts: the whole group's).
  absl::StatusOr<DispatchLayout> LayoutOver(const TensorView& topk_idx, int num_ranks, int num_experts,
                                            cudaStream_t stream);
  // A dispatch that is not cached and not worst-case: refuses the call when its layout counted invalid top-k entries
  // against `num_experts` (cuda: a bounded wait for the layout kernel's count, or a scan of a host copy of topk_idx
  // when the caller built the layout itself).
  virtual absl::Status CheckLayoutIndices(const DispatchArgs& args, int num_experts, cudaStream_t stream) = 0;
  // Normal mode: this rank's call failed (the NVLink stage of a group across hosts whose call failed at any stage)
  // and it comes to no barrier until every rank reset: the other ranks' waits for it end now rather than at their
  // timeout (kernels::IntranodeAbandonCall, kernels::host_backend::IntranodeAbandonCall).
  virtual void AbandonCall() = 0;
  // The same in stream order, only if `failed` (device memory) records a failure then: the worst-case calls of a
  // group across hosts, whose RDMA stage fails on the device (cuda only).
  virtual absl::Status AbandonCallIfFailed(const kernels::KernelStatus* /*failed*/, cudaStream_t /*stream*/) {
    return absl::UnimplementedError("a conditional abandon needs the cuda backend");
  }
  // Low latency across hosts, device-issued (kernels/low_latency_remote.h): one step's issuer on this path's context
  // (its status word and rank mask). cuda only.
  virtual absl::Status LowLatencyRemoteIssue(const kernels::LowLatencyRemoteRings& /*rings*/,
                                             const kernels::LowLatencyRemoteArgs& /*args*/, cudaStream_t /*stream*/) {
    return absl::UnimplementedError("device-issued low latency needs the cuda backend");
  }

 protected:
  explicit KernelPath(const KernelPathConfig& config) : config_(config) {}

  // ---- the backend's launches (normal mode) ----
  // The layout kernel into `layout`'s tensors (given in `params`); sets layout->num_invalid_topk.
  virtual absl::Status LaunchLayout(kernels::DispatchLayoutParams params, DispatchLayout* layout,
                                    cudaStream_t stream) = 0;
  // Exchanges the counts (params' host counters are the path's own) and waits for what this rank receives: returns
  // the number of received tokens and sets the per-local-expert counts.
  virtual absl::StatusOr<int> Notify(kernels::IntranodeNotifyParams params, std::vector<int32_t>* per_expert,
                                     cudaStream_t stream) = 0;
  // Worst-case mode: exchanges the counts without waiting for them (the dispatch kernel reads the prefix matrix).
  virtual absl::Status NotifyNoWait(kernels::IntranodeNotifyParams params, cudaStream_t stream) = 0;
  virtual absl::Status LaunchDispatch(const kernels::IntranodeDispatchParams& params, kernels::IntranodeHandle* handle,
                                      cudaStream_t stream) = 0;
  virtual absl::Status LaunchCombine(const kernels::IntranodeCombineParams& params,
                                     const kernels::IntranodeHandle& handle, cudaStream_t stream) = 0;

  absl::StatusOr<Tensor> NewTensor(kernels::DType dtype, std::vector<int64_t> shape, cudaStream_t stream);

  const KernelPathConfig config_;
};

// The implementations (cuda/cuda_path.cc, host/host_path.cc).
absl::StatusOr<std::unique_ptr<KernelPath>> NewCudaPath(const KernelPathConfig& config, const ReachAcrossHosts& reach);
absl::StatusOr<std::unique_ptr<KernelPath>> NewHostPath(const KernelPathConfig& config, const ReachAcrossHosts& reach);

// Shared by the implementations: the kernels' view of the group, for a status word and rank mask of the path's own.
kernels::IntranodeGroup MakeIntranodeGroup(const KernelPathConfig& config, kernels::KernelStatus* status);
absl::StatusOr<kernels::LowLatencyContext> MakeLowLatencyContext(const KernelPathConfig& config,
                                                                 kernels::KernelStatus* status, int32_t* rank_mask,
                                                                 const ReachAcrossHosts& reach);

}  // namespace epfabric::client::internal
