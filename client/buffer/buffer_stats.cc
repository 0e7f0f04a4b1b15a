#include "buffer/buffer_stats.h"

#include <algorithm>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "epfabric/common/status_macros.h"

namespace epfabric::client::internal {
namespace {

absl::Status CudaError(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("data-path counters: ", what, ": ", cudaGetErrorString(error)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataPathRecorder>> DataPathRecorder::Create(kernels::DataPathStats* page,
                                                                           v1::Backend backend, int num_local_experts,
                                                                           bool low_latency) {
  auto recorder = std::unique_ptr<DataPathRecorder>(new DataPathRecorder());
  recorder->page_ = page;
  recorder->backend_ = backend;
  recorder->counted_experts_ = std::clamp(num_local_experts, 0, kernels::kDataPathStatsMaxExperts);
  if (page == nullptr) return recorder;
  kernels::StatsStore(&page->num_local_experts, static_cast<uint64_t>(recorder->counted_experts_));
  kernels::StatsStore(&page->magic, kernels::kDataPathStatsMagic);
  const int n = recorder->counted_experts_;
  if (n == 0 || !low_latency) return recorder;
  // The totals start from the page's values, so that a later Buffer on the same lease keeps counting up.
  if (backend == v1::BACKEND_CUDA) {
    void* device = nullptr;
    if (cudaError_t e = cudaMalloc(&device, sizeof(uint64_t) * n); e != cudaSuccess) return CudaError(e, "cudaMalloc");
    recorder->expert_load_ = static_cast<uint64_t*>(device);
    // A private non-blocking stream: nothing here may wait for other streams (decision 57).
    cudaStream_t stream = nullptr;
    if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
      return CudaError(e, "cudaStreamCreateWithFlags");
    }
    absl::Cleanup destroy = [stream] { cudaStreamDestroy(stream); };
    std::vector<uint64_t> start(n);
    for (int e = 0; e < n; ++e) start[e] = kernels::StatsLoad(&page->ll_expert_tokens[e]);
    if (cudaError_t e = cudaMemcpyAsync(device, start.data(), sizeof(uint64_t) * n, cudaMemcpyHostToDevice, stream);
        e != cudaSuccess) {
      return CudaError(e, "cudaMemcpyAsync");
    }
    if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) return CudaError(e, "cudaStreamSynchronize");
  } else {
    recorder->host_totals_.resize(n);
    for (int e = 0; e < n; ++e) recorder->host_totals_[e] = kernels::StatsLoad(&page->ll_expert_tokens[e]);
    recorder->expert_load_ = recorder->host_totals_.data();
  }
  return recorder;
}

DataPathRecorder::~DataPathRecorder() {
  if (backend_ == v1::BACKEND_CUDA && expert_load_ != nullptr) cudaFree(expert_load_);
}

void DataPathRecorder::SetRankMask(const int32_t* mask, int num_ranks) {
  rank_mask_ = mask;
  mask_ranks_ = std::clamp(num_ranks, 0, kernels::kDataPathStatsMaxRanks);
  if (page_ != nullptr) kernels::StatsStore(&page_->num_ranks, static_cast<uint64_t>(mask_ranks_));
}

void DataPathRecorder::Call(kernels::DataPathOp op, const absl::Status& status) {
  if (page_ == nullptr) return;
  kernels::StatsAdd(&page_->calls[op], 1);
  if (!status.ok()) Failure(status);
}

void DataPathRecorder::Failure(const absl::Status& status) {
  if (page_ == nullptr || status.ok()) return;
  kernels::StatsAdd(absl::IsDeadlineExceeded(status) ? &page_->timeouts : &page_->errors, 1);
}

void DataPathRecorder::Sent(int64_t tokens, int64_t bytes) {
  if (page_ == nullptr) return;
  kernels::StatsAdd(&page_->tokens_sent, static_cast<uint64_t>(std::max<int64_t>(tokens, 0)));
  kernels::StatsAdd(&page_->bytes_sent, static_cast<uint64_t>(std::max<int64_t>(bytes, 0)));
}

void DataPathRecorder::Received(int64_t tokens, int64_t bytes) {
  if (page_ == nullptr) return;
  kernels::StatsAdd(&page_->tokens_received, static_cast<uint64_t>(std::max<int64_t>(tokens, 0)));
  kernels::StatsAdd(&page_->bytes_received, static_cast<uint64_t>(std::max<int64_t>(bytes, 0)));
}

void DataPathRecorder::AddExpertCounts(const std::vector<int32_t>& per_local_expert) {
  if (page_ == nullptr) return;
  const int n = std::min<int>(counted_experts_, static_cast<int>(per_local_expert.size()));
  for (int e = 0; e < n; ++e) {
    kernels::StatsAdd(&page_->expert_tokens[e], static_cast<uint64_t>(std::max(per_local_expert[e], 0)));
  }
}

absl::Status DataPathRecorder::AfterLowLatencyDispatch(cudaStream_t stream) {
  if (page_ == nullptr) return absl::OkStatus();
  if (++low_latency_calls_ % kernels::kLowLatencyStatsPeriod != 0) return absl::OkStatus();
  return Publish(stream);
}

absl::Status DataPathRecorder::Publish(cudaStream_t stream) {
  if (page_ == nullptr) return absl::OkStatus();
  if (backend_ == v1::BACKEND_CUDA) {
    // The page is registered with CUDA (Lease), so these copies are asynchronous; the daemon reads whole words.
    if (expert_load_ != nullptr) {
      EPF_RETURN_IF_ERROR(
          CudaError(cudaMemcpyAsync(page_->ll_expert_tokens, expert_load_, sizeof(uint64_t) * counted_experts_,
                                    cudaMemcpyDeviceToHost, stream),
                    "cudaMemcpyAsync"));
    }
    if (rank_mask_ != nullptr && mask_ranks_ > 0) {
      EPF_RETURN_IF_ERROR(CudaError(
          cudaMemcpyAsync(page_->rank_mask, rank_mask_, sizeof(int32_t) * mask_ranks_, cudaMemcpyDeviceToHost, stream),
          "cudaMemcpyAsync"));
    }
    return absl::OkStatus();
  }
  if (expert_load_ != nullptr) {
    for (int e = 0; e < counted_experts_; ++e) kernels::StatsStore(&page_->ll_expert_tokens[e], host_totals_[e]);
  }
  for (int r = 0; rank_mask_ != nullptr && r < mask_ranks_; ++r) {
    __atomic_store_n(&page_->rank_mask[r], rank_mask_[r], __ATOMIC_RELAXED);
  }
  return absl::OkStatus();
}

}  // namespace epfabric::client::internal
