// The cuda data path: the kernels on the caller's stream, a device status word that names the peer of a timeout,
// mapped host counters for notify, and mapped host words for the layout kernel's count of invalid top-k entries.
#include <algorithm>
#include <mutex>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "data_path/kernel_path.h"
#include "data_path/lost_ranks.h"
#include "epfabric/common/status_macros.h"
#include "tensor/tensors.h"

namespace epfabric::client::internal {
namespace {

constexpr int kNumInvalidTopkSlots = 64;  // mapped host words for the layout kernel's invalid-entry count

// Mapped host words for the layout kernel's count of invalid top-k entries, handed out one per DispatchLayout and
// returned when the layout's last copy goes (so a slot is never shared by two live layouts).
class MappedWordPool {
 public:
  static absl::StatusOr<std::shared_ptr<MappedWordPool>> Create() {
    auto pool = std::shared_ptr<MappedWordPool>(new MappedWordPool);
    void* host = nullptr;
    EPF_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&host, kNumInvalidTopkSlots * sizeof(int32_t), cudaHostAllocMapped));
    pool->host_ = static_cast<int32_t*>(host);
    void* device = nullptr;
    EPF_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&device, host, 0));
    pool->device_ = static_cast<int32_t*>(device);
    for (int i = 0; i < kNumInvalidTopkSlots; ++i) pool->free_.push_back(i);
    return pool;
  }
  ~MappedWordPool() {
    if (host_ != nullptr) cudaFreeHost(host_);
  }
  // A slot or -1 when all are taken (the caller then does without). A slot given back while its layout kernel may
  // still be queued (value still -1) is only reused once the kernel has written it, so a late write can never land
  // in the next layout's count.
  int Take() {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < returned_.size();) {
      if (static_cast<volatile int32_t*>(host_)[returned_[i]] >= 0) {
        free_.push_back(returned_[i]);
        returned_[i] = returned_.back();
        returned_.pop_back();
      } else {
        ++i;
      }
    }
    if (free_.empty()) return -1;
    const int slot = free_.back();
    free_.pop_back();
    return slot;
  }
  void Give(int slot) {
    std::lock_guard<std::mutex> lock(mu_);
    returned_.push_back(slot);
  }
  volatile int32_t* host(int slot) { return host_ + slot; }
  int32_t* device(int slot) { return device_ + slot; }

 private:
  MappedWordPool() = default;
  std::mutex mu_;
  std::vector<int> free_;
  std::vector<int> returned_;  // given back, reusable once the kernel wrote them
  int32_t* host_ = nullptr;
  int32_t* device_ = nullptr;
};

class CudaDataPath final : public KernelPath {
 public:
  explicit CudaDataPath(const KernelPathConfig& config) : KernelPath(config) {}

  ~CudaDataPath() override {
    if (status_ != nullptr) cudaFree(status_);
    if (rank_mask_ != nullptr) cudaFree(rank_mask_);
    if (host_counters_ != nullptr) cudaFreeHost(host_counters_);
  }

  absl::Status Init(const ReachAcrossHosts& reach) {
    // Nothing here may synchronise the device or the legacy default stream: another rank of this process (ranks
    // sharing a GPU as threads, as tests and single-process launchers do) may have a kernel running that waits for
    // this rank, and a device-wide wait would then deadlock until that kernel times out. The zeroing runs on a
    // private non-blocking stream instead.
    // The kernels are loaded now, not at the first call (kernels/intranode.h, IntranodePreloadKernels): a first call
    // that must load code waits for whatever runs on the device. Once per process and device, in fact: later Buffers
    // find them loaded.
    EPF_RETURN_IF_ERROR(config_.config.low_latency ? kernels::LowLatencyPreloadKernels()
                                                   : kernels::IntranodePreloadKernels());
    cudaStream_t init_stream = nullptr;
    EPF_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&init_stream, cudaStreamNonBlocking));
    absl::Cleanup destroy_stream = [init_stream] { cudaStreamDestroy(init_stream); };
    void* status = nullptr;
    EPF_CUDA_RETURN_IF_ERROR(cudaMalloc(&status, sizeof(kernels::KernelStatus)));
    status_ = static_cast<kernels::KernelStatus*>(status);
    EPF_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(status, 0, sizeof(kernels::KernelStatus), init_stream));
    const int world = config_.num_ranks;
    if (config_.config.low_latency) {
      void* mask = nullptr;
      EPF_CUDA_RETURN_IF_ERROR(cudaMalloc(&mask, sizeof(int32_t) * world));
      rank_mask_ = static_cast<int32_t*>(mask);
      EPF_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(mask, 0, sizeof(int32_t) * world, init_stream));
    } else {
      void* counters = nullptr;
      EPF_CUDA_RETURN_IF_ERROR(
          cudaHostAlloc(&counters, sizeof(int32_t) * (1 + config_.experts_per_rank), cudaHostAllocMapped));
      host_counters_ = static_cast<int32_t*>(counters);
      void* device = nullptr;
      EPF_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&device, counters, 0));
      device_counters_ = static_cast<int32_t*>(device);
      EPF_ASSIGN_OR_RETURN(invalid_topk_words_, MappedWordPool::Create());
    }
    EPF_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(init_stream));
    // The regions were zeroed by the daemon when the lease started, so no reset is needed here.
    if (config_.config.low_latency) {
      EPF_ASSIGN_OR_RETURN(ll_, MakeLowLatencyContext(config_, status_, rank_mask_, reach));
      if (kernels::LowLatencyWideGroup(ll_)) {  // the kernels read the regions from device memory
        EPF_ASSIGN_OR_RETURN(region_table_, kernels::LowLatencyRegionTable::Create(ll_, init_stream));
        ll_.peer_region_table = region_table_.get();
      }
    } else {
      group_ = MakeIntranodeGroup(config_, status_);
    }
    return absl::OkStatus();
  }

  Backend backend() const override { return Backend::kCuda; }

  absl::Status CheckExpertIndicesOf(const TensorView& /*topk_idx*/, int /*num_experts*/) override {
    return absl::OkStatus();
  }

  // The number of invalid top-k entries, from the layout's mapped word (bounded wait) or, for a layout the caller
  // built, from a host copy of topk_idx.
  absl::Status CheckLayoutIndices(const DispatchArgs& args, int num_experts, cudaStream_t stream) override {
    // Worst-case mode must not wait (it may be captured in a CUDA graph, where the layout kernel has not run): the
    // kernels treat entries outside [-1, num_experts) as -1, as the layout counted them.
    if (args.cached != nullptr || args.num_worst_tokens > 0) return absl::OkStatus();
    if (args.layout != nullptr && !args.layout->num_invalid_topk.view.empty() &&
        args.layout->num_invalid_topk.view.data != nullptr) {
      auto invalid = kernels::IntranodeWaitRecvCounts(
          static_cast<const volatile int32_t*>(args.layout->num_invalid_topk.view.data), group_.timeout_ns);
      if (!invalid.ok()) {
        return absl::DeadlineExceededError(absl::StrCat(
            "the dispatch layout kernel did not report its invalid top-k count: ", invalid.status().message()));
      }
      if (*invalid > 0) {
        return absl::InvalidArgumentError(absl::StrFormat("topk_idx has %d entries outside [-1, %d) (num_experts = %d)",
                                                          *invalid, num_experts, num_experts));
      }
      return absl::OkStatus();
    }
    if (args.topk_idx.empty() || args.topk_idx.numel() == 0) return absl::OkStatus();
    std::vector<int64_t> host(args.topk_idx.numel());
    EPF_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(host.data(), args.topk_idx.data, args.topk_idx.bytes(), cudaMemcpyDeviceToHost, stream));
    EPF_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return kernels::CheckExpertIndices("topk_idx", host.data(), args.topk_idx.shape[0], args.topk_idx.shape[1],
                                       num_experts);
  }

  absl::Status LaunchLayout(kernels::DispatchLayoutParams p, DispatchLayout* layout, cudaStream_t stream) override {
    // The count of invalid entries goes to a mapped host word that Dispatch reads before notify.
    const int slot = invalid_topk_words_->Take();
    if (slot >= 0) {
      std::shared_ptr<MappedWordPool> pool = invalid_topk_words_;
      *pool->host(slot) = -1;
      layout->num_invalid_topk.view = {const_cast<int32_t*>(pool->host(slot)), kernels::DType::kInt32, {1}};
      layout->num_invalid_topk.storage =
          std::shared_ptr<void>(pool->device(slot), [pool, slot](void*) { pool->Give(slot); });
      p.num_invalid_topk = pool->device(slot);
    }
    absl::Status launched = kernels::GetDispatchLayout(p, stream);
    if (!launched.ok() && p.num_invalid_topk != nullptr) {
      *static_cast<int32_t*>(layout->num_invalid_topk.view.data) = 0;  // nothing will write it
    }
    return launched;
  }

  absl::StatusOr<int> Notify(kernels::IntranodeNotifyParams p, std::vector<int32_t>* per_expert,
                             cudaStream_t stream) override {
    std::fill(host_counters_, host_counters_ + 1 + config_.experts_per_rank, -1);
    p.host_num_recv_tokens = device_counters_;
    p.host_num_recv_tokens_per_expert = device_counters_ + 1;
    EPF_RETURN_IF_ERROR(kernels::IntranodeNotify(Fresh(group_), p, stream));
    // The kernel gives up after timeout_ns and records whom it waited for; wait a little longer than that so the
    // record, not this wait, names the peer.
    auto num_recv = kernels::IntranodeWaitRecvCounts(host_counters_, group_.timeout_ns + kNotifyGraceNs);
    if (!num_recv.ok()) return KernelStatusOr(num_recv.status(), stream);
    per_expert->assign(host_counters_ + 1, host_counters_ + 1 + config_.experts_per_rank);
    return *num_recv;
  }

  absl::Status NotifyNoWait(kernels::IntranodeNotifyParams p, cudaStream_t stream) override {
    p.host_num_recv_tokens = nullptr;
    p.host_num_recv_tokens_per_expert = nullptr;
    return kernels::IntranodeNotify(Fresh(group_), p, stream);
  }

  absl::Status LaunchDispatch(const kernels::IntranodeDispatchParams& p, kernels::IntranodeHandle* handle,
                              cudaStream_t stream) override {
    return kernels::IntranodeDispatch(Fresh(group_), p, handle, stream);
  }

  absl::Status LaunchCombine(const kernels::IntranodeCombineParams& p, const kernels::IntranodeHandle& handle,
                             cudaStream_t stream) override {
    return kernels::IntranodeCombine(Fresh(group_), p, handle, stream);
  }

  absl::Status LowLatencyDispatch(const kernels::LowLatencyDispatchArgs& args, cudaStream_t stream) override {
    return kernels::LowLatencyDispatch(Fresh(ll_), args, stream);
  }
  absl::Status LowLatencyCombine(const kernels::LowLatencyCombineArgs& args, cudaStream_t stream) override {
    return kernels::LowLatencyCombine(Fresh(ll_), args, stream);
  }
  absl::Status ValidateLowLatencyDispatch(const kernels::LowLatencyDispatchArgs& args) const override {
    return kernels::ValidateLowLatencyDispatch(ll_, args);
  }
  absl::Status ValidateLowLatencyCombine(const kernels::LowLatencyCombineArgs& args) const override {
    return kernels::ValidateLowLatencyCombine(ll_, args);
  }
  void* LowLatencyCombineInputBuffer() const override { return kernels::LowLatencyCombineInputBuffer(ll_); }
  int32_t* LowLatencyRankMask() const override { return rank_mask_; }
  absl::Status LowLatencyRemoteIssue(const kernels::LowLatencyRemoteRings& rings,
                                     const kernels::LowLatencyRemoteArgs& args, cudaStream_t stream) override {
    return kernels::LowLatencyRemoteIssue(Fresh(ll_), rings, args, stream);
  }

  absl::Status Check(cudaStream_t stream) override {
    absl::Status kernel = kernels::ReadKernelStatus(status_, stream);
    if (!kernel.ok() &&
        (absl::IsDeadlineExceeded(kernel) || absl::IsDataLoss(kernel) || absl::IsResourceExhausted(kernel))) {
      EPF_RETURN_IF_ERROR(kernels::ClearKernelStatus(status_, stream));
      EPF_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    }
    return kernel;
  }

  void AbandonCall() override {                                                    // see DataPath::AbandonCall
    if (!config_.config.low_latency) (void)kernels::IntranodeAbandonCall(group_);  // best effort: the call fails anyway
  }

  absl::Status AbandonCallIfFailed(const kernels::KernelStatus* failed, cudaStream_t stream) override {
    return kernels::IntranodeAbandonCallIfFailed(group_, failed, stream);
  }

  absl::Status Reset(cudaStream_t stream) override {
    if (config_.config.low_latency) {
      // Both halves' signals (the only part of a half that is ever cleaned) and the rank mask.
      char* own = static_cast<char*>(ll_.peer_regions[config_.rank]);
      EPF_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(own, 0, ll_.layout.signal_bytes, stream));
      EPF_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(own + ll_.layout.half_bytes, 0, ll_.layout.signal_bytes, stream));
      EPF_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(rank_mask_, 0, sizeof(int32_t) * config_.num_ranks, stream));
    } else {
      EPF_RETURN_IF_ERROR(kernels::IntranodeResetRegion(group_, stream));
    }
    EPF_RETURN_IF_ERROR(kernels::ClearKernelStatus(status_, stream));
    EPF_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  }

 private:
  // After a failed or timed-out call: the kernel's record (naming the peer) explains it better than the host-side
  // error.
  absl::Status KernelStatusOr(absl::Status fallback, cudaStream_t stream) {
    absl::Status kernel = kernels::ReadKernelStatus(status_, stream);
    if (!kernel.ok()) {
      kernels::ClearKernelStatus(status_, stream).IgnoreError();
      return kernel;
    }
    return fallback;
  }

  // The view for a call, its ignored lost ranks refreshed (RefreshLostIgnore).
  template <typename View>
  View& Fresh(View& view) {
    RefreshLostIgnore(config_.lost_ranks_host, view.lost_ignore);
    return view;
  }

  kernels::KernelStatus* status_ = nullptr;  // device memory
  int32_t* host_counters_ = nullptr;         // notify's, mapped: [0] = received tokens, [1..] per local expert
  int32_t* device_counters_ = nullptr;       // the device view of host_counters_
  int32_t* rank_mask_ = nullptr;             // low latency, device memory
  std::shared_ptr<MappedWordPool> invalid_topk_words_;
  kernels::IntranodeGroup group_;                // normal mode
  kernels::LowLatencyContext ll_;                // low-latency mode
  kernels::LowLatencyRegionTable region_table_;  // ll_.peer_region_table of a wide group
};

}  // namespace

absl::StatusOr<std::unique_ptr<KernelPath>> NewCudaPath(const KernelPathConfig& config, const ReachAcrossHosts& reach) {
  auto path = std::make_unique<CudaDataPath>(config);
  EPF_RETURN_IF_ERROR(path->Init(reach));
  return std::unique_ptr<KernelPath>(std::move(path));
}

}  // namespace epfabric::client::internal
