// Internal: the data path under a Buffer, one interface for every group shape (NCCL's transport table, as a class).
// Three implementations, chosen once by NewDataPath:
//   cuda/       the kernels on the caller's stream, over the mapped regions of this host's ranks;
//   host/       the kernels library's host backend on the calling thread, over the same regions in shared memory;
//   internode/  a group that spans hosts: the NVLink stage (a cuda or host path over this host's ranks; in low latency
//               over every rank, those on other hosts through outboxes) composed with the RDMA stage (the transport
//               rings the daemon serves).
// The Buffer checks every tensor against the group and the group's generation before it calls a path, and never asks
// which path it holds. A path is made for one mode (BufferConfig::low_latency); the Buffer calls only that mode's
// methods (Buffer::State::RequireMode).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "epfabric/client/buffer.h"
#include "epfabric/kernels/low_latency.h"

namespace epfabric::client::internal {

class DataPath {
 public:
  virtual ~DataPath() = default;
  virtual Backend backend() const = 0;

  // Top-k expert indices outside [-1, num_experts) of the group: host memory is scanned now; device memory is checked
  // by the layout kernel instead (Dispatch waits for its count), so the cuda paths return OK.
  virtual absl::Status CheckExpertIndices(const TensorView& topk_idx) = 0;

  // ---- normal mode ----
  // The layout of `topk_idx` over the group's ranks and experts (the Buffer checked its shape). Sets
  // num_invalid_topk.
  virtual absl::StatusOr<DispatchLayout> Layout(const TensorView& topk_idx, cudaStream_t stream) = 0;
  // The Buffer checked `args` against the group (dtypes, shapes, the layout's tensors, a cached handle's token count).
  // A dispatch that is not cached first refuses top-k entries its layout counted as invalid (cuda: a bounded wait for
  // the layout kernel's count; not in worst-case mode, which must not wait).
  virtual absl::StatusOr<DispatchResult> Dispatch(const DispatchArgs& args, cudaStream_t stream) = 0;
  virtual absl::StatusOr<CombineResult> Combine(const CombineArgs& args, cudaStream_t stream) = 0;

  // ---- low-latency mode ----
  // The kernels' validation, for args built before anything runs (so that a refused call moves no cursor).
  virtual absl::Status ValidateLowLatencyDispatch(const kernels::LowLatencyDispatchArgs& args) const = 0;
  virtual absl::Status ValidateLowLatencyCombine(const kernels::LowLatencyCombineArgs& args) const = 0;
  virtual absl::Status LowLatencyDispatch(const kernels::LowLatencyDispatchArgs& args, cudaStream_t stream) = 0;
  virtual absl::Status LowLatencyCombine(const kernels::LowLatencyCombineArgs& args, cudaStream_t stream) = 0;
  // Where a zero-copy combine's inputs go, inside this rank's region.
  virtual void* LowLatencyCombineInputBuffer() const = 0;
  // int32 [num_ranks], nonzero = that rank is masked (set by the kernels when a wait on it times out, or by the
  // caller); device memory on cuda. nullptr in normal mode.
  virtual int32_t* LowLatencyRankMask() const = 0;

  // Buffer::Rejoin of a rank that joins running peers (a replacement): waits (bounded) until every other rank's count
  // signal for this rank's first local expert carries `tag` in `half` of this rank's region, i.e. until every peer
  // began its first dispatch of the new generation. Only then may this rank write into the peers' regions: a peer
  // still in its last call of the previous generation cleans the half this rank's first dispatch writes into.
  // DEADLINE_EXCEEDED naming the ranks that did not begin. Unimplemented where a path cannot read its signals from
  // the host yet (cuda, across hosts).
  virtual absl::Status AwaitFirstDispatchOfPeers(uint32_t /*tag*/, int /*half*/, absl::Duration /*timeout*/) {
    return absl::UnimplementedError(
        "Rejoin of a replacement (a Buffer that made no call yet) is implemented on the host backend within one host "
        "only");
  }

  // ---- failures ----
  // Buffer::Check: a timeout or failure the asynchronous calls recorded, naming the rank (then cleared).
  virtual absl::Status Check(cudaStream_t stream) = 0;
  // Buffer::Reset: the region's signals, the status word, the rank mask, and across hosts the transport's words.
  virtual absl::Status Reset(cudaStream_t stream) = 0;
};

// The path for `lease`'s group in `config`'s mode: checks that the regions (the mode's part of them, in a group that
// serves both modes) are large enough and that the group's shape suits the mode, then makes the cuda or host path (one
// host) or the internode path (across hosts, or BufferConfig::force_internode). `allocator` gives the outputs.
absl::StatusOr<std::unique_ptr<DataPath>> NewDataPath(Lease* lease, const BufferConfig& config,
                                                      std::shared_ptr<Allocator> allocator);

// The lease's backend as the Buffer's API names it (InvalidArgument for a backend without a data path).
absl::StatusOr<Backend> BackendOf(const Lease& lease);

}  // namespace epfabric::client::internal
