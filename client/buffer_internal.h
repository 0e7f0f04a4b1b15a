// Internal to the Buffer's files (buffer.cc, buffer_normal.cc, buffer_low_latency.cc, data_path_*.cc): the Buffer's
// state, output allocation, and the checks of TensorViews (dtype and shape; the rules on sizes are the kernels').
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "buffer_stats.h"
#include "data_path.h"
#include "epfabric/client/buffer.h"
#include "internode_path.h"

namespace epfabric::client {
namespace internal {

// Notify's host-side wait outlasts the kernel's own timeout by this much, so that the kernel's record (naming the
// peer), not the host wait, explains a timeout.
inline constexpr uint64_t kNotifyGraceNs = 1000ull * 1000 * 1000;

// An output tensor from `allocator` (at least 256 bytes, so that pointers are never null).
absl::StatusOr<Tensor> NewTensor(const std::shared_ptr<Allocator>& allocator, kernels::DType dtype,
                                 std::vector<int64_t> shape, cudaStream_t stream);

// Tensors that callers never see as tensors of their own (a handle's) in one allocation, each at a 256-byte boundary:
// one allocator call instead of one per tensor (a framework's allocator is a callback into an interpreter). They
// share the block's lifetime.
struct TensorSpec {
  kernels::DType dtype;
  std::vector<int64_t> shape;
};
absl::StatusOr<std::vector<Tensor>> NewTensors(const std::shared_ptr<Allocator>& allocator,
                                               const std::vector<TensorSpec>& specs, cudaStream_t stream);

// Every message names the field and its value. `want` holds the expected sizes (-1: any), `meaning` names the
// dimensions for the message.
absl::Status ExpectDType(const TensorView& t, const char* name, kernels::DType want);
absl::Status ExpectShape(const TensorView& t, const char* name, const std::vector<int64_t>& want, const char* meaning);
absl::Status ExpectTensor(const TensorView& t, const char* name, kernels::DType dtype,
                          const std::vector<int64_t>& shape, const char* meaning);

// A pointer the kernels accept for a given tensor: never null (an empty but given tensor still says "given" to the
// peers). With no elements nothing is read or written through it, so a host address serves on cuda as well; it is
// aligned because the kernels' argument checks want 16-byte alignment. Null for a tensor that is not given.
const void* GivenData(const TensorView& t);
template <typename T>
const T* GivenPointer(const TensorView& t) {
  return static_cast<const T*>(GivenData(t));
}

}  // namespace internal

struct Buffer::State {
  Lease* lease = nullptr;
  BufferConfig config;
  std::shared_ptr<Allocator> allocator;
  int rank = 0;
  int num_ranks = 0;
  int experts_per_rank = 0;
  // Groups within one host: the data path. Groups that span hosts: only its layout and index checks (over the whole
  // group); `internode` runs the calls.
  std::unique_ptr<internal::DataPath> path;
  std::unique_ptr<internal::InternodePath> internode;

  // The lease's data-path counters (null for inner Buffers and leases without a page).
  std::unique_ptr<internal::DataPathRecorder> stats;

  kernels::LowLatencyBufferCursor cursor;
  // Low latency: the group's generation this Buffer's calls belong to (a digest of every rank's lease serial, taken
  // when it was made or reset; docs/data-layout.md, "Generations"), the serials it was taken from, and the calls made
  // since (the other input of each call's tag). No serials: a lease without a counters page (generation 0).
  uint64_t generation = 0;
  std::vector<uint64_t> serials;
  uint64_t call_index = 0;
  bool generation_pending = true;  // made or reset: the next call takes the generation (TakeGeneration)
  uint32_t NextCallTag() { return kernels::LowLatencyCallTag(generation, call_index++); }
  bool recv_hook_pending = false;  // a low-latency send phase whose receive hook has not run yet

  // Unavailable when the lease's group is degraded.
  absl::Status Usable() const;
  // Low latency: as Usable, except that a DEGRADED group whose lost ranks are known and do not include this one is
  // usable, with those ranks masked in stream order (elastic EP: the survivors go on without them).
  absl::Status UsableForLowLatency(cudaStream_t stream);
  // Normal mode: CheckGeneration (never masking), then Usable.
  absl::Status UsableForNormal();
  // The first call after the Buffer was made or reset: waits (up to config.timeout) until every rank of the group has
  // a client, then takes the generation from their lease serials and starts the call count afresh. UNAVAILABLE
  // naming the ranks without a client.
  absl::Status TakeGeneration();
  // Takes the generation if due; then a rank whose client left or changed since is masked (`may_mask`, low latency
  // with enable_shrink) or fails the call with UNAVAILABLE naming it.
  absl::Status CheckGeneration(bool may_mask, cudaStream_t stream);
  // Low latency: a timeout in the first calls of a generation, with what may explain it (a peer still serving the
  // previous generation) and what to do.
  absl::Status ExplainFirstCall(absl::Status status) const;
  // Low latency with enable_shrink: masks rank r in stream order.
  absl::Status MaskRank(int r, cudaStream_t stream);
  // FailedPrecondition when the Buffer is in the other mode, or (low latency) a receive hook is pending.
  absl::Status RequireMode(bool low_latency, const char* call) const;
  absl::StatusOr<Tensor> NewTensor(kernels::DType dtype, std::vector<int64_t> shape, cudaStream_t stream) {
    return internal::NewTensor(allocator, dtype, std::move(shape), stream);
  }
  absl::StatusOr<std::vector<Tensor>> NewTensors(const std::vector<internal::TensorSpec>& specs, cudaStream_t stream) {
    return internal::NewTensors(allocator, specs, stream);
  }
};

}  // namespace epfabric::client
