// Shared host-side vocabulary of the kernels library: element types, errors, and the translation of the
// kernel status word (status_word.h) into absl::Status. Plain C++ (no CUDA compiler needed), so that the client
// library and tests can include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "epfabric/kernels/status_word.h"

namespace epfabric::kernels {

enum class DType : int32_t { kBF16 = 0, kFP8E4M3 = 1, kFloat32 = 2, kInt32 = 3, kInt64 = 4, kBool = 5 };

size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);

const char* WaitSiteName(WaitSite site);
const char* PeerDataFieldName(PeerDataField field);

// Turns a status word read back from the device into an absl::Status naming the peer: DeadlineExceededError for a
// timeout ("rank 0 timed out waiting for barrier from rank 1 (channel 0)"), DataLossError for bad peer data
// ("rank 0 read notify token count = 2147483000 from rank 1 (destination rank 0; valid [0, 4096]): stale or corrupt
// peer data"), ResourceExhaustedError for too little room in worst-case mode (kKernelStatusRecvCapacity).
absl::Status KernelStatusToStatus(const KernelStatus& status);

// The record a kernel writes for a bad value read from peer-writable memory (values saturated to int32); the host
// backend reports through it too, so that both backends word the error the same way.
KernelStatus BadPeerDataRecord(PeerDataField field, int reading_rank, int peer_rank, int index, int64_t value,
                               int64_t min_value, int64_t max_value);
// The record of a rank that receives `num_recv` rows with room for `capacity` (kKernelStatusRecvCapacity); written by
// the kernels and the host backend alike.
KernelStatus RecvCapacityRecord(CapacitySite site, int rank, int64_t num_recv, int64_t capacity);

// InvalidArgumentError "<field> = <value>: <requirement>": the one form of the data path's out-of-range input errors
// (kernels and client alike), so that every message names the field and its value.
absl::Status InvalidValue(std::string_view field, int64_t value, std::string_view requirement);
// InvalidArgumentError "<field> is null: required <when>".
absl::Status MissingPointer(std::string_view field, std::string_view when);

// The data path's rules on sizes, written once: the launch functions of both backends check their params with them,
// and callers that check their own tensors before anything is launched (the client's Buffer) use the same functions.
// `field` names the value in the message as the caller knows it ("num_tokens", "x.shape[0] (num_tokens)").
absl::Status CheckNumTokens(std::string_view field, int64_t num_tokens, int64_t max_tokens_per_rank);
absl::Status CheckNumTopk(std::string_view field, int64_t num_topk, int64_t max_topk);
// Dispatch rows: bf16 or fp8_e4m3; hidden in [1, max_hidden], a multiple of 128 (fp8) or 8 (bf16).
absl::Status CheckDispatchDType(std::string_view field, DType dtype);
absl::Status CheckDispatchHidden(std::string_view field, int64_t hidden, DType dtype, int64_t max_hidden);
// Combine rows (bf16): hidden a multiple of 8 in [8, max_hidden].
absl::Status CheckCombineHidden(std::string_view field, int64_t hidden, int64_t max_hidden);
// Host memory only: the first top-k entry outside [-1, num_experts) of `topk_idx` [num_tokens, num_topk], as
// InvalidArgument "<name>[t][k] = e: expert indices must be in [-1, num_experts)".
absl::Status CheckExpertIndices(std::string_view name, const int64_t* topk_idx, int64_t num_tokens, int64_t num_topk,
                                int num_experts);

// Converts a CUDA runtime error into absl::Status with the failing expression, file and line.
absl::Status CudaErrorToStatus(cudaError_t err, const char* expr, const char* file, int line);

}  // namespace epfabric::kernels

// Evaluates a CUDA runtime call and returns an absl::Status from the enclosing function on failure.
#define EPF_CUDA_RETURN_IF_ERROR(expr)                                                         \
  do {                                                                                         \
    cudaError_t epf_cuda_err_ = (expr);                                                        \
    if (epf_cuda_err_ != cudaSuccess)                                                          \
      return ::epfabric::kernels::CudaErrorToStatus(epf_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)
