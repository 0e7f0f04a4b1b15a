// The internode path (internode_path.h): a DataPath composed of the NVLink stage (a kernel path) and the RDMA stage
// of its mode, and how each mode's stages are made.
#include "data_path/internode/internode_path.h"

#include <cstdlib>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "data_path/internode/low_latency_stage.h"
#include "data_path/internode/normal_stage.h"
#include "data_path/kernel_path.h"
#include "epfabric/client/client.h"
#include "epfabric/common/status_macros.h"

namespace epfabric::client::internal {
namespace {

class InternodePath final : public DataPath {
 public:
  // Normal mode: `nvlink` over this host's ranks, `normal` driving it. The layout and the index checks are over the
  // whole group (`num_ranks` ranks, `num_experts` experts).
  InternodePath(std::unique_ptr<KernelPath> nvlink, std::unique_ptr<NormalRdmaStage> normal, int num_ranks,
                int num_experts)
      : nvlink_(std::move(nvlink)), normal_(std::move(normal)), num_ranks_(num_ranks), num_experts_(num_experts) {}
  // Low latency: `nvlink` over every rank of the group, `low_latency` sending for the ranks on other hosts.
  InternodePath(std::unique_ptr<KernelPath> nvlink, std::unique_ptr<LowLatencyRdmaStage> low_latency, int num_ranks,
                int num_experts)
      : nvlink_(std::move(nvlink)),
        low_latency_(std::move(low_latency)),
        num_ranks_(num_ranks),
        num_experts_(num_experts) {}

  Backend backend() const override { return nvlink_->backend(); }

  absl::Status CheckExpertIndices(const TensorView& topk_idx) override {
    return nvlink_->CheckExpertIndicesOf(topk_idx, num_experts_);
  }

  absl::StatusOr<DispatchLayout> Layout(const TensorView& topk_idx, cudaStream_t stream) override {
    EPF_RETURN_IF_ERROR(RequireNormal("Layout"));
    return nvlink_->LayoutOver(topk_idx, num_ranks_, num_experts_, stream);
  }
  absl::StatusOr<DispatchResult> Dispatch(const DispatchArgs& args, cudaStream_t stream) override {
    EPF_RETURN_IF_ERROR(RequireNormal("Dispatch"));
    EPF_RETURN_IF_ERROR(nvlink_->CheckLayoutIndices(args, num_experts_, stream));
    return normal_->Dispatch(args, stream);
  }
  absl::StatusOr<CombineResult> Combine(const CombineArgs& args, cudaStream_t stream) override {
    EPF_RETURN_IF_ERROR(RequireNormal("Combine"));
    return normal_->Combine(args, stream);
  }

  absl::Status ValidateLowLatencyDispatch(const kernels::LowLatencyDispatchArgs& args) const override {
    return nvlink_->ValidateLowLatencyDispatch(args);
  }
  absl::Status ValidateLowLatencyCombine(const kernels::LowLatencyCombineArgs& args) const override {
    return nvlink_->ValidateLowLatencyCombine(args);
  }
  absl::Status LowLatencyDispatch(const kernels::LowLatencyDispatchArgs& args, cudaStream_t stream) override {
    EPF_RETURN_IF_ERROR(RequireLowLatency("LowLatencyDispatch"));
    return low_latency_->LowLatencyDispatch(args, stream);
  }
  absl::Status LowLatencyCombine(const kernels::LowLatencyCombineArgs& args, cudaStream_t stream) override {
    EPF_RETURN_IF_ERROR(RequireLowLatency("LowLatencyCombine"));
    return low_latency_->LowLatencyCombine(args, stream);
  }
  void* LowLatencyCombineInputBuffer() const override { return nvlink_->LowLatencyCombineInputBuffer(); }
  int32_t* LowLatencyRankMask() const override { return nvlink_->LowLatencyRankMask(); }

  absl::Status Check(cudaStream_t stream) override {
    return normal_ != nullptr ? normal_->Check(stream) : low_latency_->Check(stream);
  }
  absl::Status Reset(cudaStream_t stream) override {
    return normal_ != nullptr ? normal_->Reset(stream) : low_latency_->Reset(stream);
  }

 private:
  // The Buffer calls only its mode's methods (RequireMode); these keep a wrong call an error rather than a crash.
  absl::Status RequireNormal(const char* call) const {
    if (normal_ != nullptr) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(call, ": this internode path was made for low latency"));
  }
  absl::Status RequireLowLatency(const char* call) const {
    if (low_latency_ != nullptr) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(call, ": this internode path was made for normal mode"));
  }

  // Declared first, destroyed last: the RDMA stages use it.
  const std::unique_ptr<KernelPath> nvlink_;
  const std::unique_ptr<NormalRdmaStage> normal_;           // normal mode
  const std::unique_ptr<LowLatencyRdmaStage> low_latency_;  // low latency
  const int num_ranks_;
  const int num_experts_;
};

// BufferConfig::low_latency_issue resolved for this lease (decision 84).
absl::StatusOr<bool> IssuesFromTheDevice(const Lease& lease, const BufferConfig& config) {
  using Issue = BufferConfig::LowLatencyIssue;
  Issue issue = config.low_latency_issue;
  const bool cuda = lease.backend() == v1::BACKEND_CUDA;
  if (issue == Issue::kDevice && !cuda) {
    return absl::InvalidArgumentError(
        "low_latency_issue = device needs a cuda group (the host backend sends each write as it is made)");
  }
  if (issue == Issue::kAuto) {
    const char* env = std::getenv("EPF_LOW_LATENCY_ISSUE");
    const std::string choice = env != nullptr ? env : "";
    if (!choice.empty() && choice != "auto" && choice != "device" && choice != "relay") {
      return absl::InvalidArgumentError(
          absl::StrCat("EPF_LOW_LATENCY_ISSUE='", choice, "': expected device, relay or auto"));
    }
    // A valid choice applies to cuda groups: the host backend has none to make.
    if (cuda && choice == "device") issue = Issue::kDevice;
    if (cuda && choice == "relay") issue = Issue::kRelay;
  }
  if (issue == Issue::kAuto) return cuda && lease.transport() == v1::TRANSPORT_VERBS;
  return issue == Issue::kDevice;
}

}  // namespace

absl::Status RefuseCaptureAcrossHosts(Backend backend, cudaStream_t stream, bool low_latency) {
  if (backend != Backend::kCuda) return absl::OkStatus();
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

absl::StatusOr<std::unique_ptr<DataPath>> NewNormalInternodePath(Lease* lease, const BufferConfig& config,
                                                                 const InternodeGroupShape& shape,
                                                                 std::shared_ptr<Allocator> allocator,
                                                                 uint64_t rdma_limit) {
  EPF_ASSIGN_OR_RETURN(const Backend backend, BackendOf(*lease));
  // The NVLink stage: this host's ranks, by their index on the host (the lost-ranks words in that order).
  const std::vector<int>& ranks = lease->nvl_ranks();
  KernelPathConfig nvlink{.config = InnerBufferConfig(config, shape),
                          .rank = shape.local_rank,
                          .num_ranks = shape.ranks_per_host,
                          .experts_per_rank = config.num_experts / lease->world_size(),
                          .allocator = allocator};
  bool group_order = true;  // host 0: its ranks' indices are their group ranks
  for (int i = 0; i < shape.ranks_per_host; ++i) {
    nvlink.peer_regions[i] = lease->region(ranks[i]);
    group_order = group_order && ranks[i] == i;
  }
  nvlink.lost_ranks = lease->lost_ranks_words(backend == Backend::kCuda, /*same_host_order=*/!group_order);
  nvlink.lost_ranks_host = lease->lost_ranks_words(/*device=*/false, /*same_host_order=*/!group_order);
  EPF_ASSIGN_OR_RETURN(std::unique_ptr<KernelPath> nvlink_path, KernelPath::Create(backend, nvlink));
  EPF_ASSIGN_OR_RETURN(
      std::unique_ptr<NormalRdmaStage> rdma,
      NormalRdmaStage::Create(lease, config, shape, nvlink_path.get(), std::move(allocator), rdma_limit));
  return std::unique_ptr<DataPath>(std::make_unique<InternodePath>(std::move(nvlink_path), std::move(rdma),
                                                                   lease->world_size(), config.num_experts));
}

absl::StatusOr<std::unique_ptr<DataPath>> NewLowLatencyInternodePath(Lease* lease, const BufferConfig& config,
                                                                     std::shared_ptr<Allocator> allocator,
                                                                     uint64_t nvl_offset, uint64_t rdma_offset) {
  EPF_ASSIGN_OR_RETURN(const Backend backend, BackendOf(*lease));
  const int world = lease->world_size();
  EPF_ASSIGN_OR_RETURN(
      const kernels::LowLatencyLayout layout,
      kernels::MakeLowLatencyLayout(config.max_tokens_per_rank, config.hidden, world, config.num_experts));
  EPF_ASSIGN_OR_RETURN(std::unique_ptr<LowLatencyRemote> remote,
                       LowLatencyRemote::Create(lease, layout, config.timeout, rdma_offset));
  // The kernel path over every rank: this host's through their regions, the others' through outboxes (Reach).
  KernelPathConfig all{.config = config,
                       .rank = lease->rank(),
                       .num_ranks = world,
                       .experts_per_rank = config.num_experts / world,
                       .allocator = std::move(allocator)};
  for (int r = 0; r < world; ++r) {
    if (lease->region(r) != nullptr) all.peer_regions[r] = static_cast<char*>(lease->region(r)) + nvl_offset;
  }
  const bool cuda = backend == Backend::kCuda;
  all.lost_ranks = lease->lost_ranks_words(/*device=*/cuda);
  all.lost_ranks_host = lease->lost_ranks_words(/*device=*/false);
  EPF_ASSIGN_OR_RETURN(const bool device_issue, IssuesFromTheDevice(*lease, config));
  // The cuda kernels cannot send over the transport themselves: the calling thread relays between the steps, or an
  // issue kernel after each; the host backend sends each write as it is made unless told to relay (for tests).
  const bool relay = (cuda && !device_issue) || config.low_latency_relay;
  const bool put_as_written = !relay && !device_issue;
  const LowLatencyRemote* reach = remote.get();
  EPF_ASSIGN_OR_RETURN(std::unique_ptr<KernelPath> path,
                       KernelPath::Create(backend, all, [reach, put_as_written](kernels::LowLatencyContext* context) {
                         reach->Reach(context, put_as_written);
                       }));
  std::unique_ptr<LowLatencyRdmaStage> stage;
  if (device_issue) {
    EPF_ASSIGN_OR_RETURN(stage, NewLowLatencyDeviceStage(path.get(), std::move(remote), lease, config.timeout));
  } else if (relay) {
    EPF_ASSIGN_OR_RETURN(stage, NewLowLatencyRelayStage(path.get(), std::move(remote), layout, lease->rank(),
                                                        all.peer_regions[lease->rank()], all.lost_ranks_host,
                                                        config.enable_shrink, config.timeout));
  } else {
    stage = NewLowLatencyAsWrittenStage(path.get(), std::move(remote));
  }
  return std::unique_ptr<DataPath>(
      std::make_unique<InternodePath>(std::move(path), std::move(stage), world, config.num_experts));
}

}  // namespace epfabric::client::internal
