// The worker's view of its own RDMA region: host memory (host backend) or device memory (cuda backend), read and
// written from the host for filling sources and checking what arrived.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include <cuda_runtime_api.h>

namespace epfabric::tools {

class RegionAccess {
 public:
  // `device`: whether the region is device memory; its copies then run on the calling thread's current CUDA device
  // at construction (threads other than the constructing one start on device 0, so every copy switches to it).
  RegionAccess(void* base, uint64_t bytes, bool device)
      : base_(static_cast<char*>(base)), bytes_(bytes), device_(device) {
    if (device_) cudaGetDevice(&cuda_device_);
  }
  uint64_t bytes() const { return bytes_; }
  bool device() const { return device_; }

  void Write(uint64_t offset, const void* data, uint64_t n) {
    if (device_) {
      cudaSetDevice(cuda_device_);
      cudaMemcpy(base_ + offset, data, n, cudaMemcpyHostToDevice);
    } else {
      std::memcpy(base_ + offset, data, n);
    }
  }
  std::vector<uint8_t> Read(uint64_t offset, uint64_t n) const {
    std::vector<uint8_t> out(n);
    if (device_) {
      cudaSetDevice(cuda_device_);
      cudaMemcpy(out.data(), base_ + offset, n, cudaMemcpyDeviceToHost);
    } else {
      std::memcpy(out.data(), base_ + offset, n);
    }
    return out;
  }
  // A signal word (acquire on the host backend; a fresh copy from the device on cuda).
  int64_t Load(uint64_t offset) const {
    if (!device_) {
      return std::atomic_ref<int64_t>(*reinterpret_cast<int64_t*>(base_ + offset)).load(std::memory_order_acquire);
    }
    int64_t value = 0;
    cudaSetDevice(cuda_device_);
    cudaMemcpy(&value, base_ + offset, sizeof(value), cudaMemcpyDeviceToHost);
    return value;
  }

 private:
  char* base_;
  uint64_t bytes_;
  bool device_;
  int cuda_device_ = 0;
};

}  // namespace epfabric::tools
