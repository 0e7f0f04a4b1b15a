// Internal to the Buffer's files (buffer.cc, buffer_normal.cc, buffer_low_latency.cc, buffer_generation.cc): the
// Buffer's state, which holds its one data path (data_path/data_path.h) whatever the group's shape.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "buffer/buffer_stats.h"
#include "data_path/data_path.h"
#include "epfabric/client/buffer.h"
#include "tensor/tensors.h"

namespace epfabric::client {

struct Buffer::State {
  Lease* lease = nullptr;
  BufferConfig config;
  std::shared_ptr<Allocator> allocator;
  int rank = 0;
  int num_ranks = 0;
  int experts_per_rank = 0;
  // The data path for the group's shape (cuda, host, or internode); the Buffer never asks which.
  std::unique_ptr<internal::DataPath> path;

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
  // A wait that ended because a peer left the call (UNAVAILABLE "... left the call"): adds the ranks whose client left
  // or changed since the generation was taken, which is usually why the peer left.
  absl::Status NameGoneRanks(absl::Status status) const;
  // Low latency with enable_shrink: masks rank r in stream order.
  absl::Status MaskRank(int r, cudaStream_t stream);
  // Low latency: sets (masked) or clears rank r's mask entry in stream order (Buffer::Rejoin clears them).
  absl::Status SetRankMask(int r, bool masked, cudaStream_t stream);
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
