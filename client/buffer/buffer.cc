// The Buffer API over a Lease: creation (the data path for the group's shape, data_path/data_path.h) and the calls
// that are not one mode's (Check, Reset, the low-latency buffers). The modes are in buffer_normal.cc and
// buffer_low_latency.cc, the generations in buffer_generation.cc. docs/data-layout.md describes every output.
#include "epfabric/client/buffer.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "buffer/buffer_state.h"
#include "epfabric/client/client.h"
#include "epfabric/common/status_macros.h"

namespace epfabric::client {
namespace {

using kernels::DType;

const char* BoolName(bool value) { return value ? "true" : "false"; }

absl::Status GroupUsable(const Lease& lease) {
  if (absl::Status healthy = lease.Healthy(); !healthy.ok()) {
    return absl::UnavailableError(absl::StrCat("the group is not usable: ", healthy.message()));
  }
  return absl::OkStatus();
}

}  // namespace

// ---- Buffer ----

absl::Status Buffer::State::Usable() const { return GroupUsable(*lease); }

absl::Status Buffer::State::RequireMode(bool low_latency, const char* call) const {
  if (config.low_latency != low_latency) {
    return absl::FailedPreconditionError(absl::StrFormat("%s needs a %s buffer; this one has config.low_latency = %s",
                                                         call, low_latency ? "low-latency" : "normal-mode",
                                                         BoolName(config.low_latency)));
  }
  if (low_latency && recv_hook_pending) {
    return absl::FailedPreconditionError(
        absl::StrFormat("%s: the previous low-latency call's recv_hook has not run (its receive phase must run "
                        "before the next call's send phase)",
                        call));
  }
  return absl::OkStatus();
}

Buffer::Buffer(std::unique_ptr<State> state) : state_(std::move(state)) {}
Buffer::~Buffer() = default;

int Buffer::rank() const { return state_->rank; }
int Buffer::num_ranks() const { return state_->num_ranks; }
Backend Buffer::backend() const { return state_->path->backend(); }
const BufferConfig& Buffer::config() const { return state_->config; }

absl::StatusOr<std::unique_ptr<Buffer>> Buffer::Create(Lease* lease, BufferConfig config,
                                                       std::shared_ptr<Allocator> allocator) {
  if (lease == nullptr) return absl::InvalidArgumentError("lease is null");
  EPF_RETURN_IF_ERROR(GroupUsable(*lease));
  EPF_ASSIGN_OR_RETURN(const Backend backend, internal::BackendOf(*lease));
  allocator = allocator != nullptr ? std::move(allocator) : DefaultAllocator(backend);
  auto state = std::make_unique<State>();
  state->lease = lease;
  state->config = config;
  state->allocator = allocator;
  state->rank = lease->rank();
  state->num_ranks = lease->world_size();
  state->experts_per_rank = config.num_experts / std::max(state->num_ranks, 1);
  EPF_ASSIGN_OR_RETURN(state->path, internal::NewDataPath(lease, config, std::move(allocator)));
  auto buffer = std::unique_ptr<Buffer>(new Buffer(std::move(state)));
  EPF_RETURN_IF_ERROR(buffer->CountInto(lease));
  return buffer;
}

absl::Status Buffer::CountInto(Lease* lease) {
  EPF_ASSIGN_OR_RETURN(state_->stats,
                       internal::DataPathRecorder::Create(lease->datapath_stats(), lease->backend(),
                                                          state_->experts_per_rank, state_->config.low_latency));
  if (state_->config.low_latency) state_->stats->SetRankMask(state_->path->LowLatencyRankMask(), state_->num_ranks);
  return absl::OkStatus();
}

TensorView Buffer::NextLowLatencyCombineBuffer() const {
  const State& s = *state_;
  if (!s.config.low_latency) return {};
  return TensorView{
      s.path->LowLatencyCombineInputBuffer(),
      DType::kBF16,
      {s.experts_per_rank, static_cast<int64_t>(s.num_ranks) * s.config.max_tokens_per_rank, s.config.hidden}};
}

TensorView Buffer::LowLatencyRankMask() const {
  const State& s = *state_;
  int32_t* mask = s.config.low_latency ? s.path->LowLatencyRankMask() : nullptr;
  if (mask == nullptr) return {};
  return TensorView{mask, DType::kInt32, {s.num_ranks}};
}

absl::Status Buffer::Check(cudaStream_t stream) {
  State& s = *state_;
  if (s.stats != nullptr) (void)s.stats->Publish(stream);  // counters only: never fails the check
  absl::Status status = s.path->Check(stream);
  if (s.stats != nullptr) s.stats->Failure(status);
  return s.config.low_latency ? s.ExplainFirstCall(std::move(status)) : s.NameGoneRanks(std::move(status));
}

absl::Status Buffer::Reset(cudaStream_t stream) {
  State& s = *state_;
  s.recv_hook_pending = false;
  s.cursor = kernels::LowLatencyBufferCursor();
  s.generation_pending = true;
  return s.path->Reset(stream);
}

}  // namespace epfabric::client
