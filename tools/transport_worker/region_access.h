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
  RegionAccess(void* base, uint64_t bytes, bool device)
      : base_(static_cast<char*>(base)), bytes_(bytes), device_(device) {}
  uint64_t bytes() const { return bytes_; }
  bool device() const { return device_; }

  void Write(uint64_t offset, const void* data, uint64_t n) {
    if (device_) {
      cudaMemcpy(base_ + offset, data, n, cudaMemcpyHostToDevice);
    } else {
      std::memcpy(base_ + offset, data, n);
    }
  }
  std::vector<uint8_t> Read(uint64_t offset, uint64_t n) const {
    std::vector<uint8_t> out(n);
    if (device_) {
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
    cudaMemcpy(&value, base_ + offset, sizeof(value), cudaMemcpyDeviceToHost);
    return value;
  }

 private:
  char* base_;
  uint64_t bytes_;
  bool device_;
};

}  // namespace epfabric::tools
