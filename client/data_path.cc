// DataPath selection and the pieces both implementations share.
#include "data_path.h"

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/kernels/common.h"

namespace epfabric::client::internal {

absl::StatusOr<std::unique_ptr<DataPath>> DataPath::Create(v1::Backend backend, const DataPathConfig& config) {
  switch (backend) {
    case v1::BACKEND_CUDA:
      return NewCudaDataPath(config);
    case v1::BACKEND_HOST:
      return NewHostDataPath(config);
    default:
      return absl::InvalidArgumentError(absl::StrCat("lease backend = ", v1::Backend_Name(backend), ": not supported"));
  }
}

void InitLostIgnore(const uint64_t* lost_ranks_host, uint64_t* ignore) {
  for (int i = 0; i < kernels::kLostRankWords; ++i) {
    ignore[i] = lost_ranks_host != nullptr ? __atomic_load_n(lost_ranks_host + i, __ATOMIC_ACQUIRE) : 0;
  }
}

void RefreshLostIgnore(const uint64_t* lost_ranks_host, uint64_t* ignore) {
  if (lost_ranks_host == nullptr) return;
  for (int i = 0; i < kernels::kLostRankWords; ++i) ignore[i] &= __atomic_load_n(lost_ranks_host + i, __ATOMIC_ACQUIRE);
}

bool RankLost(const uint64_t* lost_ranks_host, const uint64_t* ignore, int rank) {
  if (lost_ranks_host == nullptr || rank < 0 || rank >= kernels::kMaxLostRanks) return false;
  const uint64_t word = __atomic_load_n(lost_ranks_host + rank / 64, __ATOMIC_ACQUIRE) & ~ignore[rank / 64];
  return ((word >> (rank % 64)) & 1u) != 0;
}

absl::Status RefuseCaptureAcrossHosts(v1::Backend backend, cudaStream_t stream, bool low_latency) {
  if (backend != v1::BACKEND_CUDA) return absl::OkStatus();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  EPF_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capture));
  if (capture == cudaStreamCaptureStatusNone) return absl::OkStatus();
  if (low_latency) {
    return absl::FailedPreconditionError(
        "this low-latency Buffer relays across hosts from the calling thread, which synchronises with the host "
        "between the steps of a call: to capture its calls into a CUDA graph, issue from the device "
        "(BufferConfig::low_latency_issue = kDevice, or EPF_LOW_LATENCY_ISSUE=device; the default on the verbs wire)");
  }
  return absl::FailedPreconditionError(
      "normal mode across hosts synchronises with the host between the steps of a call unless it runs in worst-case "
      "mode: to capture a dispatch and its combine into a CUDA graph, pass num_worst_tokens (a cached dispatch: of "
      "a handle from a worst-case dispatch)");
}

kernels::IntranodeGroup MakeIntranodeGroup(const DataPathConfig& c, kernels::KernelStatus* status) {
  kernels::IntranodeGroup group;
  group.config = {.num_ranks = c.num_ranks,
                  .max_tokens_per_rank = c.config.max_tokens_per_rank,
                  .max_hidden = c.config.hidden,
                  .max_topk = c.config.max_topk,
                  .num_experts = c.config.num_experts,
                  .max_channels = c.config.num_sms};
  group.rank = c.rank;
  for (int r = 0; r < c.num_ranks; ++r) group.peer_regions[r] = c.peer_regions[r];
  group.status = status;
  group.lost_ranks = c.lost_ranks;
  InitLostIgnore(c.lost_ranks_host, group.lost_ignore);
  group.timeout_ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(c.config.timeout));
  return group;
}

absl::StatusOr<kernels::LowLatencyContext> MakeLowLatencyContext(const DataPathConfig& c, kernels::KernelStatus* status,
                                                                 int32_t* rank_mask) {
  kernels::LowLatencyContext ll;
  EPF_ASSIGN_OR_RETURN(ll.layout, kernels::MakeLowLatencyLayout(c.config.max_tokens_per_rank, c.config.hidden,
                                                                c.num_ranks, c.config.num_experts));
  ll.rank = c.rank;
  ll.num_ranks = c.num_ranks;
  for (int r = 0; r < c.num_ranks; ++r) ll.peer_regions[r] = c.peer_regions[r];
  // Without enable_shrink the kernels mask nothing: a lost or silent peer fails the call (may_signal).
  ll.rank_mask = c.config.enable_shrink ? rank_mask : nullptr;
  ll.lost_ranks = c.lost_ranks;
  InitLostIgnore(c.lost_ranks_host, ll.lost_ignore);
  ll.status = status;
  ll.timeout_ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(c.config.timeout));
  ll.num_blocks = c.config.low_latency_sms;
  ll.remote_ranks = c.remote_ranks;
  ll.remote_inbox = c.remote_inbox;
  ll.remote_put = c.remote_put;
  ll.remote_put_arg = c.remote_put_arg;
  return ll;
}

}  // namespace epfabric::client::internal
