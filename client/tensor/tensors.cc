// TensorView's sizes, the default allocators, output allocation and the checks of TensorViews.
#include "tensor/tensors.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "epfabric/common/status_macros.h"

namespace epfabric::client {
namespace {

using kernels::DType;

constexpr size_t kMinAllocationBytes = 256;  // never hand a kernel a null pointer for a given, empty tensor

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

class CudaAsyncAllocator final : public Allocator {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes, cudaStream_t stream) override {
    void* ptr = nullptr;
    EPF_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&ptr, bytes, stream));
    return ptr;
  }
  void Free(void* ptr, cudaStream_t stream) override { cudaFreeAsync(ptr, stream); }
};

class HostAllocator final : public Allocator {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes, cudaStream_t /*stream*/) override {
    const size_t rounded = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
    void* ptr = std::aligned_alloc(256, rounded);
    if (ptr == nullptr) return absl::ResourceExhaustedError(absl::StrFormat("host allocation of %d bytes", bytes));
    return ptr;
  }
  void Free(void* ptr, cudaStream_t /*stream*/) override { std::free(ptr); }
};

}  // namespace

// ---- TensorView, allocators (buffer.h) ----

absl::StatusOr<void*> Allocator::AllocateTensor(DType /*dtype*/, const std::vector<int64_t>& /*shape*/, size_t bytes,
                                                cudaStream_t stream) {
  return Allocate(std::max(bytes, kMinAllocationBytes), stream);
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t TensorView::bytes() const { return static_cast<size_t>(numel()) * kernels::DTypeSize(dtype); }

std::shared_ptr<Allocator> DefaultAllocator(Backend backend) {
  if (backend == Backend::kCuda) return std::make_shared<CudaAsyncAllocator>();
  return std::make_shared<HostAllocator>();
}

namespace internal {

absl::StatusOr<Tensor> NewTensor(const std::shared_ptr<Allocator>& allocator, DType dtype, std::vector<int64_t> shape,
                                 cudaStream_t stream) {
  Tensor t;
  t.view.dtype = dtype;
  t.view.shape = std::move(shape);
  EPF_ASSIGN_OR_RETURN(t.view.data, allocator->AllocateTensor(dtype, t.view.shape, t.view.bytes(), stream));
  if (t.view.data == nullptr) return absl::ResourceExhaustedError("the allocator returned a null pointer");
  std::shared_ptr<Allocator> owner = allocator;
  t.storage = std::shared_ptr<void>(t.view.data, [owner, stream](void* p) { owner->Free(p, stream); });
  return t;
}

absl::StatusOr<std::vector<Tensor>> NewTensors(const std::shared_ptr<Allocator>& allocator,
                                               const std::vector<TensorSpec>& specs, cudaStream_t stream) {
  std::vector<Tensor> tensors(specs.size());
  std::vector<size_t> offsets(specs.size());
  size_t total = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    tensors[i].view.dtype = specs[i].dtype;
    tensors[i].view.shape = specs[i].shape;
    offsets[i] = total;
    total += (std::max<size_t>(tensors[i].view.bytes(), 1) + kMinAllocationBytes - 1) / kMinAllocationBytes *
             kMinAllocationBytes;
  }
  // One int32 tensor of the block's size, so that a typed allocator (AllocateTensor) can serve it too.
  EPF_ASSIGN_OR_RETURN(Tensor block,
                       NewTensor(allocator, DType::kInt32, {static_cast<int64_t>(total / sizeof(int32_t))}, stream));
  for (size_t i = 0; i < specs.size(); ++i) {
    tensors[i].view.data = static_cast<char*>(block.view.data) + offsets[i];
    tensors[i].storage = std::shared_ptr<void>(block.storage, tensors[i].view.data);  // aliases the block
  }
  return tensors;
}

absl::Status ExpectDType(const TensorView& t, const char* name, DType want) {
  if (t.dtype != want) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s.dtype = %s: expected %s", name, kernels::DTypeName(t.dtype), kernels::DTypeName(want)));
  }
  return absl::OkStatus();
}

absl::Status ExpectShape(const TensorView& t, const char* name, const std::vector<int64_t>& want, const char* meaning) {
  bool ok = t.shape.size() == want.size();
  for (size_t i = 0; ok && i < want.size(); ++i) ok = t.shape[i] >= 0 && (want[i] < 0 || t.shape[i] == want[i]);
  if (!ok) {
    std::vector<std::string> dims;
    for (int64_t d : want) dims.push_back(d < 0 ? std::string("*") : absl::StrCat(d));
    return absl::InvalidArgumentError(absl::StrFormat("%s.shape = %s: expected [%s] (%s)", name, ShapeString(t.shape),
                                                      absl::StrJoin(dims, ", "), meaning));
  }
  if (t.numel() > 0 && t.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat("%s.data is null with shape %s", name, ShapeString(t.shape)));
  }
  return absl::OkStatus();
}

absl::Status ExpectTensor(const TensorView& t, const char* name, DType dtype, const std::vector<int64_t>& shape,
                          const char* meaning) {
  EPF_RETURN_IF_ERROR(ExpectDType(t, name, dtype));
  return ExpectShape(t, name, shape, meaning);
}

const void* GivenData(const TensorView& t) {
  alignas(256) static uint64_t dummy[32] = {};
  if (t.empty()) return nullptr;
  return t.data != nullptr ? t.data : static_cast<const void*>(dummy);
}

}  // namespace internal
}  // namespace epfabric::client
