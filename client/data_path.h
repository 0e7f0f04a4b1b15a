// Internal: the data path under a Buffer, one interface per backend (NCCL's transport table, as a class): the cuda
// path launches the kernels on the caller's stream, the host path runs the host backend on the calling thread; an
// internode path will be a third implementation. The Buffer picks one at Create and never asks for the backend again.
// A DataPath gets kernels params structs whose inputs the Buffer has checked against its tensors; the kernels'
// validation functions check them again (one set of rules, kernels/api) before anything runs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epfabric/client/buffer.h"
#include "epfabric/kernels/intranode.h"
#include "epfabric/kernels/low_latency.h"
#include "epfabric/kernels/low_latency_remote.h"

namespace epfabric::client::internal {

// What a data path is set up for; fixed for the Buffer's life.
struct DataPathConfig {
  BufferConfig config;
  int rank = 0;
  int num_ranks = 0;
  int experts_per_rank = 0;
  // Every rank's region as mapped in this process (normal mode: at most kMaxNvlPeers; low latency across hosts: an
  // outbox for a rank on another host, LowLatencyRemote::Configure).
  void* peer_regions[kernels::kMaxLowLatencyRanks] = {};
  // The daemon's lost-ranks words for these ranks (Lease::lost_ranks_words; null: not published, or the ranks are
  // not the group's ranks in order).
  const uint64_t* lost_ranks = nullptr;
  const uint64_t* lost_ranks_host = nullptr;  // the same words as this process reads them (set with lost_ranks)
  std::shared_ptr<Allocator> allocator;       // outputs (e.g. the host path's invalid top-k count)
  // The outer path of a group that spans hosts: only Layout and the expert-index checks are used (no regions).
  bool layout_only = false;
  // Low latency across hosts: see LowLatencyContext::remote_ranks.
  kernels::LowLatencyRankSet remote_ranks;
  void* remote_inbox = nullptr;
  kernels::LowLatencyRemotePut remote_put = nullptr;
  void* remote_put_arg = nullptr;
};

class DataPath {
 public:
  // The cuda or host implementation for `backend` (BACKEND_CUDA or BACKEND_HOST), with its status word, counters and
  // rank mask allocated and the group (normal mode) or low-latency context set up.
  static absl::StatusOr<std::unique_ptr<DataPath>> Create(v1::Backend backend, const DataPathConfig& config);

  virtual ~DataPath() = default;
  virtual v1::Backend backend() const = 0;

  // ---- input checks that depend on where the memory lives ----
  // Top-k expert indices outside [-1, num_experts): host memory is scanned now; device memory is checked by the
  // layout kernel instead (see CheckDispatchExpertIndices), so the cuda path returns OK.
  virtual absl::Status CheckExpertIndices(const TensorView& topk_idx) = 0;
  // Normal dispatch (not cached), after every other check passed: refuses the call when its layout counted invalid
  // top-k entries (cuda: waits, bounded, for the layout kernel's count, or scans a host copy of topk_idx when the
  // caller built the layout itself; not in worst-case mode, which must not wait).
  virtual absl::Status CheckDispatchExpertIndices(const DispatchArgs& args, cudaStream_t stream) = 0;

  // ---- normal mode ----
  // Computes the layout into `layout`'s tensors (given in `params`); sets layout->num_invalid_topk.
  virtual absl::Status Layout(kernels::DispatchLayoutParams params, DispatchLayout* layout, cudaStream_t stream) = 0;
  // Exchanges the counts (params' host counters are the path's own) and waits for what this rank receives: returns
  // the number of received tokens and sets the per-local-expert counts.
  virtual absl::StatusOr<int> Notify(kernels::IntranodeNotifyParams params, std::vector<int32_t>* per_expert,
                                     cudaStream_t stream) = 0;
  // Worst-case mode: exchanges the counts without waiting for them (the dispatch kernel reads the prefix matrix).
  virtual absl::Status NotifyNoWait(kernels::IntranodeNotifyParams params, cudaStream_t stream) = 0;
  virtual absl::Status Dispatch(const kernels::IntranodeDispatchParams& params, kernels::IntranodeHandle* handle,
                                cudaStream_t stream) = 0;
  virtual absl::Status Combine(const kernels::IntranodeCombineParams& params, const kernels::IntranodeHandle& handle,
                               cudaStream_t stream) = 0;

  // ---- low-latency mode ----
  virtual absl::Status LowLatencyDispatch(const kernels::LowLatencyDispatchArgs& args, cudaStream_t stream) = 0;
  virtual absl::Status LowLatencyCombine(const kernels::LowLatencyCombineArgs& args, cudaStream_t stream) = 0;
  // The validation of the kernels, for args built before anything runs.
  virtual absl::Status ValidateLowLatencyDispatch(const kernels::LowLatencyDispatchArgs& args) const = 0;
  virtual absl::Status ValidateLowLatencyCombine(const kernels::LowLatencyCombineArgs& args) const = 0;
  virtual void* LowLatencyCombineInputBuffer() const = 0;
  // Low latency: int32 [num_ranks], nonzero = that rank is masked (set by the kernels when a wait on it times out,
  // or by the caller); device memory on cuda. nullptr in normal mode.
  virtual int32_t* LowLatencyRankMask() const = 0;
  // Low latency across hosts, device-issued (kernels/low_latency_remote.h): one step's issuer on this path's context
  // (its status word and rank mask). cuda only.
  virtual absl::Status LowLatencyRemoteIssue(const kernels::LowLatencyRemoteRings& /*rings*/,
                                             const kernels::LowLatencyRemoteArgs& /*args*/, cudaStream_t /*stream*/) {
    return absl::UnimplementedError("device-issued low latency needs the cuda backend");
  }

  // ---- failures ----
  // Buffer::Check and Buffer::Reset (the region's signals, the status word, the rank mask).
  virtual absl::Status Check(cudaStream_t stream) = 0;
  virtual absl::Status Reset(cudaStream_t stream) = 0;
  // Normal mode: this rank's call failed (the inner path of a group across hosts whose call failed at any stage) and
  // it comes to no barrier until every rank reset: the other ranks' waits for it end now rather than at their
  // timeout (kernels::IntranodeAbandonCall, kernels::host_backend::IntranodeAbandonCall).
  virtual void AbandonCall() = 0;
  // The same in stream order, only if `failed` (device memory) records a failure then: the worst-case calls of a group
  // across hosts, whose RDMA stage fails on the device (cuda only).
  virtual absl::Status AbandonCallIfFailed(const kernels::KernelStatus* /*failed*/, cudaStream_t /*stream*/) {
    return absl::UnimplementedError("a conditional abandon needs the cuda backend");
  }
};

// The implementations (data_path_cuda.cc, data_path_host.cc).
absl::StatusOr<std::unique_ptr<DataPath>> NewCudaDataPath(const DataPathConfig& config);
absl::StatusOr<std::unique_ptr<DataPath>> NewHostDataPath(const DataPathConfig& config);

// When a path is made: the lost-ranks bits set now (ranks lost before it was made), which its waits ignore until they
// clear; all zero without words.
void InitLostIgnore(const uint64_t* lost_ranks_host, uint64_t* ignore);
// Before each call: a rank ignored since the path was made (lost already then: awaited, not reported) stops being
// ignored once its bit has cleared (it came back), so that a later loss is reported.
void RefreshLostIgnore(const uint64_t* lost_ranks_host, uint64_t* ignore);
// A host-side wait's check: the daemon published `rank` as lost and `ignore` does not hide it.
bool RankLost(const uint64_t* lost_ranks_host, const uint64_t* ignore, int rank);
// FailedPrecondition while `stream` is being captured (cuda backend): calls of a group that spans hosts that
// synchronise with the host between their stages (normal mode; low latency relayed) cannot be captured into a CUDA
// graph. The message says what to use instead.
absl::Status RefuseCaptureAcrossHosts(v1::Backend backend, cudaStream_t stream, bool low_latency = false);

// Shared by the implementations: the kernels' view of the group, for a status word and rank mask of the path's own.
kernels::IntranodeGroup MakeIntranodeGroup(const DataPathConfig& config, kernels::KernelStatus* status);
absl::StatusOr<kernels::LowLatencyContext> MakeLowLatencyContext(const DataPathConfig& config,
                                                                 kernels::KernelStatus* status, int32_t* rank_mask);

}  // namespace epfabric::client::internal
