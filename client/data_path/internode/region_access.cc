// RegionAccess (normal_stage.h) for both backends: plain memory on the host, stream-ordered CUDA copies and the
// internode kernels on cuda.
#include <algorithm>
#include <atomic>
#include <cstring>

#include "data_path/internode/normal_stage.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/kernels/common.h"

namespace epfabric::client::internal {
namespace {

class HostRegionAccess final : public RegionAccess {
 public:
  absl::Status Copy(void* dst, const void* src, size_t bytes, cudaStream_t) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Zero(void* dst, size_t bytes, cudaStream_t) override {
    std::memset(dst, 0, bytes);
    return absl::OkStatus();
  }
  absl::Status Sync(cudaStream_t) override { return absl::OkStatus(); }
  // The peers' daemons write these words concurrently (the transport's signal adds): atomic accesses.
  absl::Status ReadWords(const void* src, uint64_t* out, int count) override {
    auto* words = static_cast<uint64_t*>(const_cast<void*>(src));
    for (int i = 0; i < count; ++i) out[i] = std::atomic_ref<uint64_t>(words[i]).load(std::memory_order_acquire);
    return absl::OkStatus();
  }
  absl::Status WriteWords(void* dst, const uint64_t* in, int count) override {
    auto* words = static_cast<uint64_t*>(dst);
    for (int i = 0; i < count; ++i) std::atomic_ref<uint64_t>(words[i]).store(in[i], std::memory_order_release);
    return absl::OkStatus();
  }
  absl::Status ToHost(void* dst, const void* src, size_t bytes, cudaStream_t) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status FromHost(void* dst, const void* src, size_t bytes, cudaStream_t) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Pack(const kernels::InternodePackParams& p, cudaStream_t) override {
    return kernels::host_backend::InternodePack(p);
  }
  absl::Status Reduce(const kernels::InternodeReduceParams& p, cudaStream_t) override {
    return kernels::host_backend::InternodeReduce(p);
  }
  absl::Status Plan(const kernels::InternodePlanParams& p, cudaStream_t) override {
    return kernels::host_backend::InternodePlan(p);
  }
  absl::Status Gather(const kernels::InternodeGatherParams& p, cudaStream_t) override {
    return kernels::host_backend::InternodeGather(p);
  }
  absl::Status Scatter(const kernels::InternodeScatterParams& p, cudaStream_t) override {
    return kernels::host_backend::InternodeScatter(p);
  }
};

class CudaRegionAccess final : public RegionAccess {
 public:
  ~CudaRegionAccess() override {
    if (poll_stream_ != nullptr) cudaStreamDestroy(poll_stream_);
    if (staging_ != nullptr) cudaFreeHost(staging_);
  }
  absl::Status Init() {
    EPF_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&poll_stream_, cudaStreamNonBlocking));
    EPF_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&staging_, kStagingWords * sizeof(uint64_t), cudaHostAllocDefault));
    return absl::OkStatus();
  }
  absl::Status Copy(void* dst, const void* src, size_t bytes, cudaStream_t stream) override {
    if (bytes > 0) EPF_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
    return absl::OkStatus();
  }
  absl::Status Zero(void* dst, size_t bytes, cudaStream_t stream) override {
    EPF_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst, 0, bytes, stream));
    return absl::OkStatus();
  }
  absl::Status Sync(cudaStream_t stream) override {
    EPF_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  }
  // On a stream of its own, so that polling never waits for (or is ordered behind) the caller's work.
  absl::Status ReadWords(const void* src, uint64_t* out, int count) override {
    if (count > kStagingWords) return absl::InternalError("too many words");
    EPF_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(staging_, src, count * sizeof(uint64_t), cudaMemcpyDeviceToHost, poll_stream_));
    EPF_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(poll_stream_));
    std::memcpy(out, staging_, count * sizeof(uint64_t));
    return absl::OkStatus();
  }
  absl::Status WriteWords(void* dst, const uint64_t* in, int count) override {
    if (count > kStagingWords) return absl::InternalError("too many words");
    std::memcpy(staging_, in, count * sizeof(uint64_t));
    EPF_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, staging_, count * sizeof(uint64_t), cudaMemcpyHostToDevice, poll_stream_));
    EPF_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(poll_stream_));
    return absl::OkStatus();
  }
  absl::Status ToHost(void* dst, const void* src, size_t bytes, cudaStream_t stream) override {
    if (bytes == 0) return absl::OkStatus();
    EPF_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
    EPF_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  }
  absl::Status FromHost(void* dst, const void* src, size_t bytes, cudaStream_t stream) override {
    if (bytes == 0) return absl::OkStatus();
    EPF_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
    EPF_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));  // `src` is the caller's pageable memory
    return absl::OkStatus();
  }
  absl::Status Pack(const kernels::InternodePackParams& p, cudaStream_t stream) override {
    return kernels::InternodePack(p, stream);
  }
  absl::Status Reduce(const kernels::InternodeReduceParams& p, cudaStream_t stream) override {
    return kernels::InternodeReduce(p, stream);
  }
  absl::Status Plan(const kernels::InternodePlanParams& p, cudaStream_t stream) override {
    return kernels::InternodePlan(p, stream);
  }
  absl::Status Gather(const kernels::InternodeGatherParams& p, cudaStream_t stream) override {
    return kernels::InternodeGather(p, stream);
  }
  absl::Status Scatter(const kernels::InternodeScatterParams& p, cudaStream_t stream) override {
    return kernels::InternodeScatter(p, stream);
  }

 private:
  static constexpr int kStagingWords = std::max(kRegionAccessMaxWords, kernels::kMaxInternodeHosts);
  cudaStream_t poll_stream_ = nullptr;
  void* staging_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<RegionAccess>> NewRegionAccess(Backend backend) {
  if (backend == Backend::kCuda) {
    auto access = std::make_unique<CudaRegionAccess>();
    EPF_RETURN_IF_ERROR(access->Init());
    return std::unique_ptr<RegionAccess>(std::move(access));
  }
  return std::unique_ptr<RegionAccess>(std::make_unique<HostRegionAccess>());
}

}  // namespace epfabric::client::internal
