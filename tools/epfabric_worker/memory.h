// epfabric_worker: tensors in the memory of the Buffer's backend (device memory on cuda, host memory on host).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker.h"

namespace epfabric::worker {

class Memory {
 public:
  explicit Memory(bool device) : device_(device) {}

  absl::StatusOr<TensorView> Upload(const void* src, size_t bytes, DType dtype, std::vector<int64_t> shape) {
    auto ptr = Allocate(bytes);
    if (!ptr.ok()) return ptr.status();
    if (device_) {
      if (bytes > 0 && cudaMemcpy(*ptr, src, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
        return absl::InternalError("cudaMemcpy to the device");
      }
    } else if (bytes > 0) {
      std::memcpy(*ptr, src, bytes);
    }
    return TensorView{.data = *ptr, .dtype = dtype, .shape = std::move(shape)};
  }

  // `bytes` bytes all equal to `byte`, set where the memory lives (cudaMemset on the device): inputs for
  // --restart_probe that cost no host loop and no host-to-device copy.
  absl::StatusOr<TensorView> Filled(size_t bytes, uint8_t byte, DType dtype, std::vector<int64_t> shape) {
    auto ptr = Allocate(bytes);
    if (!ptr.ok()) return ptr.status();
    if (device_) {
      if (bytes > 0 && cudaMemset(*ptr, byte, bytes) != cudaSuccess) return absl::InternalError("cudaMemset");
    } else if (bytes > 0) {
      std::memset(*ptr, byte, bytes);
    }
    return TensorView{.data = *ptr, .dtype = dtype, .shape = std::move(shape)};
  }

  template <typename T>
  absl::StatusOr<TensorView> Upload(const std::vector<T>& v, DType dtype, std::vector<int64_t> shape) {
    return Upload(v.data(), v.size() * sizeof(T), dtype, std::move(shape));
  }

  // The first `count` elements of `view` (fewer when the view is smaller).
  template <typename T>
  std::vector<T> Download(const TensorView& view, size_t count) const {
    std::vector<T> out;
    if (view.empty()) return out;
    count = std::min(count, view.bytes() / sizeof(T));
    out.resize(count);
    if (count == 0) return out;
    if (device_) {
      if (cudaMemcpy(out.data(), view.data, count * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess) out.clear();
    } else {
      std::memcpy(out.data(), view.data, count * sizeof(T));
    }
    return out;
  }

  void Clear() { owned_.clear(); }

 private:
  // Never null, even for zero rows: an empty view means "not given". Owned until Clear().
  absl::StatusOr<void*> Allocate(size_t bytes) {
    const size_t alloc = std::max<size_t>(256, (bytes + 255) / 256 * 256);
    void* ptr = nullptr;
    if (device_) {
      if (cudaMalloc(&ptr, alloc) != cudaSuccess) return absl::ResourceExhaustedError("cudaMalloc");
      owned_.push_back(std::shared_ptr<void>(ptr, [](void* p) { cudaFree(p); }));
    } else {
      ptr = std::aligned_alloc(256, alloc);
      if (ptr == nullptr) return absl::ResourceExhaustedError("aligned_alloc");
      owned_.push_back(std::shared_ptr<void>(ptr, [](void* p) { std::free(p); }));
    }
    return ptr;
  }

  bool device_;
  std::vector<std::shared_ptr<void>> owned_;
};

}  // namespace epfabric::worker
