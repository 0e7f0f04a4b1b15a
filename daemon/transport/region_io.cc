#include "transport/region_io.h"

#include <atomic>
#include <cstring>

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "epfabric/kernels/transport/signal.h"

namespace epfabric::daemon::transport {
namespace {

constexpr uint64_t kHostChunk = 64ull << 20;  // bounds one recv/send call, not a copy
constexpr uint64_t kCudaStaging = 4ull << 20;

class HostRegionIo final : public RegionIo {
 public:
  explicit HostRegionIo(memory::Region* region) : base_(static_cast<char*>(region->base())) {}
  uint64_t chunk_bytes() const override { return kHostChunk; }
  absl::StatusOr<const void*> Source(uint64_t offset, uint64_t) override { return base_ + offset; }
  absl::StatusOr<void*> Stage(uint64_t offset, uint64_t) override { return base_ + offset; }
  absl::Status Land(uint64_t, uint64_t) override { return absl::OkStatus(); }
  absl::Status SignalAdd(uint64_t offset, int64_t value) override {
    // Release: the bytes received before (plain stores) are visible to whoever acquires the new value.
    std::atomic_ref<int64_t>(*reinterpret_cast<int64_t*>(base_ + offset)).fetch_add(value, std::memory_order_acq_rel);
    return absl::OkStatus();
  }
  absl::Status CopyWithin(uint64_t dst_offset, uint64_t src_offset, uint64_t bytes) override {
    std::memmove(base_ + dst_offset, base_ + src_offset, bytes);
    return absl::OkStatus();
  }

 private:
  char* const base_;
};

absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("transport: ", what, ": ", cudaGetErrorString(err)));
}

class CudaRegionIo final : public RegionIo {
 public:
  CudaRegionIo(memory::Region* region, int device) : base_(static_cast<char*>(region->base())), device_(device) {}
  ~CudaRegionIo() override {
    if (staging_ != nullptr) cudaFreeHost(staging_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Init() {
    if (absl::Status set = CudaStatus(cudaSetDevice(device_), "cudaSetDevice"); !set.ok()) return set;
    if (absl::Status made = CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
        !made.ok()) {
      return made;
    }
    return CudaStatus(cudaMallocHost(&staging_, kCudaStaging), "pinned staging buffer");
  }

  uint64_t chunk_bytes() const override { return kCudaStaging; }

  absl::StatusOr<const void*> Source(uint64_t offset, uint64_t bytes) override {
    if (absl::Status s = Current(); !s.ok()) return s;
    if (absl::Status s = CudaStatus(cudaMemcpyAsync(staging_, base_ + offset, bytes, cudaMemcpyDeviceToHost, stream_),
                                    "copy from the region");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = CudaStatus(cudaStreamSynchronize(stream_), "copy from the region"); !s.ok()) return s;
    return static_cast<const void*>(staging_);
  }

  absl::StatusOr<void*> Stage(uint64_t, uint64_t) override { return staging_; }

  absl::Status Land(uint64_t offset, uint64_t bytes) override {
    if (absl::Status s = Current(); !s.ok()) return s;
    if (absl::Status s = CudaStatus(cudaMemcpyAsync(base_ + offset, staging_, bytes, cudaMemcpyHostToDevice, stream_),
                                    "copy into the region");
        !s.ok()) {
      return s;
    }
    return CudaStatus(cudaStreamSynchronize(stream_), "copy into the region");
  }

  absl::Status SignalAdd(uint64_t offset, int64_t value) override {
    if (absl::Status s = Current(); !s.ok()) return s;
    if (absl::Status s = kernels::transport::LaunchSignalAdd(base_ + offset, value, stream_); !s.ok()) return s;
    return CudaStatus(cudaStreamSynchronize(stream_), "signal add");
  }

  absl::Status CopyWithin(uint64_t dst_offset, uint64_t src_offset, uint64_t bytes) override {
    if (absl::Status s = Current(); !s.ok()) return s;
    if (absl::Status s = CudaStatus(
            cudaMemcpyAsync(base_ + dst_offset, base_ + src_offset, bytes, cudaMemcpyDeviceToDevice, stream_),
            "copy within the region");
        !s.ok()) {
      return s;
    }
    return CudaStatus(cudaStreamSynchronize(stream_), "copy within the region");
  }

 private:
  // Wire threads start without a current device.
  absl::Status Current() { return CudaStatus(cudaSetDevice(device_), "cudaSetDevice"); }

  char* const base_;
  const int device_;
  cudaStream_t stream_ = nullptr;
  void* staging_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<RegionIo>> MakeRegionIo(memory::Region* region) {
  if (region == nullptr) return absl::InvalidArgumentError("transport: no RDMA region");
  const int device = region->descriptor().device();
  if (device < 0) return std::make_unique<HostRegionIo>(region);
  auto io = std::make_unique<CudaRegionIo>(region, device);
  if (absl::Status init = io->Init(); !init.ok()) return init;
  return io;
}

}  // namespace epfabric::daemon::transport
