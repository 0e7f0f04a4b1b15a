// The host data path: the host backend of the kernels library run on the calling thread over the group's shared
// memory; streams are ignored and every pointer is host memory.
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "data_path/kernel_path.h"
#include "data_path/lost_ranks.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/kernels/host_backend.h"
#include "tensor/tensors.h"

namespace epfabric::client::internal {
namespace {

namespace hb = kernels::host_backend;

class HostDataPath final : public KernelPath {
 public:
  explicit HostDataPath(const KernelPathConfig& config) : KernelPath(config) {}

  absl::Status Init(const ReachAcrossHosts& reach) {
    counters_.assign(1 + config_.experts_per_rank, -1);
    rank_mask_.assign(config_.num_ranks, 0);
    if (config_.config.low_latency) {
      EPF_ASSIGN_OR_RETURN(ll_, MakeLowLatencyContext(config_, &status_, rank_mask_.data(), reach));
    } else {
      group_ = MakeIntranodeGroup(config_, &status_);
    }
    return absl::OkStatus();
  }

  Backend backend() const override { return Backend::kHost; }

  absl::Status CheckExpertIndicesOf(const TensorView& topk_idx, int num_experts) override {
    if (topk_idx.empty()) return absl::OkStatus();
    return kernels::CheckExpertIndices("topk_idx", static_cast<const int64_t*>(topk_idx.data), topk_idx.shape[0],
                                       topk_idx.shape[1], num_experts);
  }

  absl::Status CheckLayoutIndices(const DispatchArgs& args, int num_experts, cudaStream_t /*stream*/) override {
    EPF_RETURN_IF_ERROR(CheckExpertIndicesOf(args.topk_idx, num_experts));
    if (args.cached != nullptr || args.layout == nullptr) return absl::OkStatus();
    const TensorView& invalid = args.layout->num_invalid_topk.view;
    if (!invalid.empty() && invalid.data != nullptr && *static_cast<const int32_t*>(invalid.data) != 0) {
      return kernels::InvalidValue("layout.num_invalid_topk", *static_cast<const int32_t*>(invalid.data),
                                   "the layout was computed from top-k entries outside [-1, num_experts)");
    }
    return absl::OkStatus();
  }

  absl::Status LaunchLayout(kernels::DispatchLayoutParams p, DispatchLayout* layout, cudaStream_t stream) override {
    EPF_ASSIGN_OR_RETURN(layout->num_invalid_topk, NewTensor(kernels::DType::kInt32, {1}, stream));
    p.num_invalid_topk = static_cast<int32_t*>(layout->num_invalid_topk.view.data);
    return hb::GetDispatchLayout(p);
  }

  absl::StatusOr<int> Notify(kernels::IntranodeNotifyParams p, std::vector<int32_t>* per_expert,
                             cudaStream_t /*stream*/) override {
    std::fill(counters_.begin(), counters_.end(), -1);
    p.host_num_recv_tokens = counters_.data();
    p.host_num_recv_tokens_per_expert = counters_.data() + 1;
    EPF_RETURN_IF_ERROR(hb::IntranodeNotify(Fresh(group_), p));
    // The host backend has written the counts before returning; this does not wait.
    EPF_ASSIGN_OR_RETURN(const int32_t num_recv,
                         kernels::IntranodeWaitRecvCounts(counters_.data(), group_.timeout_ns + kNotifyGraceNs));
    per_expert->assign(counters_.begin() + 1, counters_.end());
    return num_recv;
  }

  absl::Status NotifyNoWait(kernels::IntranodeNotifyParams p, cudaStream_t /*stream*/) override {
    p.host_num_recv_tokens = nullptr;
    p.host_num_recv_tokens_per_expert = nullptr;
    return hb::IntranodeNotify(Fresh(group_), p);
  }

  absl::Status LaunchDispatch(const kernels::IntranodeDispatchParams& p, kernels::IntranodeHandle* handle,
                              cudaStream_t /*stream*/) override {
    return hb::IntranodeDispatch(Fresh(group_), p, handle);
  }

  absl::Status LaunchCombine(const kernels::IntranodeCombineParams& p, const kernels::IntranodeHandle& handle,
                             cudaStream_t /*stream*/) override {
    return hb::IntranodeCombine(Fresh(group_), p, handle);
  }

  absl::Status LowLatencyDispatch(const kernels::LowLatencyDispatchArgs& args, cudaStream_t /*stream*/) override {
    return hb::LowLatencyDispatch(Fresh(ll_), args);
  }
  absl::Status LowLatencyCombine(const kernels::LowLatencyCombineArgs& args, cudaStream_t /*stream*/) override {
    return hb::LowLatencyCombine(Fresh(ll_), args);
  }
  absl::Status ValidateLowLatencyDispatch(const kernels::LowLatencyDispatchArgs& args) const override {
    return kernels::ValidateLowLatencyDispatch(ll_, args);
  }
  absl::Status ValidateLowLatencyCombine(const kernels::LowLatencyCombineArgs& args) const override {
    return kernels::ValidateLowLatencyCombine(ll_, args);
  }
  void* LowLatencyCombineInputBuffer() const override { return kernels::LowLatencyCombineInputBuffer(ll_); }
  int32_t* LowLatencyRankMask() const override {
    return config_.config.low_latency ? const_cast<int32_t*>(rank_mask_.data()) : nullptr;
  }

  absl::Status AwaitFirstDispatchOfPeers(uint32_t tag, int half, absl::Duration timeout) override {
    if (!config_.config.low_latency || !ll_.remote_ranks.empty())
      return DataPath::AwaitFirstDispatchOfPeers(tag, half, timeout);
    const kernels::LowLatencyLayout& l = ll_.layout;
    // Local expert 0's count from source s: [local][source] words at dispatch_count_offset of this rank's half.
    const auto* counts = reinterpret_cast<const uint64_t*>(static_cast<const uint8_t*>(ll_.peer_regions[ll_.rank]) +
                                                           l.half_bytes * half + l.dispatch_count_offset);
    const absl::Time deadline = absl::Now() + timeout;
    for (;;) {
      std::vector<int> missing;
      for (int s = 0; s < ll_.num_ranks; ++s) {
        if (s != ll_.rank && kernels::LowLatencyCountOf(__atomic_load_n(counts + s, __ATOMIC_ACQUIRE), tag) < 0) {
          missing.push_back(s);
        }
      }
      if (missing.empty()) return absl::OkStatus();
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "Rejoin: rank(s) ", absl::StrJoin(missing, ", "),
            " did not begin the new generation's first "
            "dispatch within ",
            absl::FormatDuration(timeout), " (every rank of the group calls Rejoin at the same call boundary)"));
      }
      absl::SleepFor(absl::Microseconds(50));
    }
  }

  absl::Status Check(cudaStream_t /*stream*/) override { return absl::OkStatus(); }

  void AbandonCall() override {
    if (!config_.config.low_latency) (void)hb::IntranodeAbandonCall(group_);  // best effort: the call fails anyway
  }

  absl::Status Reset(cudaStream_t /*stream*/) override {
    status_ = {};
    std::fill(rank_mask_.begin(), rank_mask_.end(), 0);
    return config_.config.low_latency ? hb::LowLatencyResetRegion(ll_) : hb::IntranodeResetRegion(group_);
  }

 private:
  // The view for a call, its ignored lost ranks refreshed (RefreshLostIgnore).
  template <typename View>
  View& Fresh(View& view) {
    RefreshLostIgnore(config_.lost_ranks_host, view.lost_ignore);
    return view;
  }

  kernels::KernelStatus status_{};
  std::vector<int32_t> counters_;   // notify's: [0] = received tokens, [1..] per local expert
  std::vector<int32_t> rank_mask_;  // low latency
  kernels::IntranodeGroup group_;   // normal mode
  kernels::LowLatencyContext ll_;   // low-latency mode
};

}  // namespace

absl::StatusOr<std::unique_ptr<KernelPath>> NewHostPath(const KernelPathConfig& config, const ReachAcrossHosts& reach) {
  auto path = std::make_unique<HostDataPath>(config);
  EPF_RETURN_IF_ERROR(path->Init(reach));
  return std::unique_ptr<KernelPath>(std::move(path));
}

}  // namespace epfabric::client::internal
