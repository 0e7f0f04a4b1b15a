// Internal: the tensor helpers that the Buffer and every data path share: output allocation through the Buffer's
// Allocator, and the checks of TensorViews (dtype and shape; the rules on sizes are the kernels').
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epfabric/client/buffer.h"

namespace epfabric::client::internal {

// An output tensor from `allocator` (at least 256 bytes, so that pointers are never null).
absl::StatusOr<Tensor> NewTensor(const std::shared_ptr<Allocator>& allocator, kernels::DType dtype,
                                 std::vector<int64_t> shape, cudaStream_t stream);

// Tensors that callers never see as tensors of their own (a handle's) in one allocation, each at a 256-byte boundary:
// one allocator call instead of one per tensor (a framework's allocator is a callback into an interpreter). They
// share the block's lifetime.
struct TensorSpec {
  kernels::DType dtype;
  std::vector<int64_t> shape;
};
absl::StatusOr<std::vector<Tensor>> NewTensors(const std::shared_ptr<Allocator>& allocator,
                                               const std::vector<TensorSpec>& specs, cudaStream_t stream);

// Every message names the field and its value. `want` holds the expected sizes (-1: any), `meaning` names the
// dimensions for the message.
absl::Status ExpectDType(const TensorView& t, const char* name, kernels::DType want);
absl::Status ExpectShape(const TensorView& t, const char* name, const std::vector<int64_t>& want, const char* meaning);
absl::Status ExpectTensor(const TensorView& t, const char* name, kernels::DType dtype,
                          const std::vector<int64_t>& shape, const char* meaning);

// A pointer the kernels accept for a given tensor: never null (an empty but given tensor still says "given" to the
// peers). With no elements nothing is read or written through it, so a host address serves on cuda as well; it is
// aligned because the kernels' argument checks want 16-byte alignment. Null for a tensor that is not given.
const void* GivenData(const TensorView& t);
template <typename T>
const T* GivenPointer(const TensorView& t) {
  return static_cast<const T*>(GivenData(t));
}

}  // namespace epfabric::client::internal
