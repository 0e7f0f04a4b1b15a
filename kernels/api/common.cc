#include "epfabric/kernels/common.h"

#include <algorithm>
#include <climits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace epfabric::kernels {
namespace {

constexpr int64_t kFp8ScaleBlockSize = 128;  // channels per FP8 scale

int32_t SaturateInt32(int64_t v) { return static_cast<int32_t>(std::clamp<int64_t>(v, INT32_MIN, INT32_MAX)); }

// What the `channel` field of a bad-peer-data record indexes.
const char* PeerDataIndexName(PeerDataField field) {
  switch (field) {
    case PeerDataField::kNotifyRankCount:
      return "destination rank";
    case PeerDataField::kNotifyExpertCount:
    case PeerDataField::kLowLatencyRecvCount:
    case PeerDataField::kLowLatencyRoutingToken:
    case PeerDataField::kLowLatencyRoutingTopk:
      return "local expert";
    case PeerDataField::kBarrierArrivals:
      return "barrier lane";
    case PeerDataField::kLowLatencyDoneCounter:
      return "index";
    case PeerDataField::kInternodeRowCount:
    case PeerDataField::kInternodeCachedRowCount:
      return "host";
    default:
      return "channel";
  }
}

}  // namespace

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return 2;
    case DType::kFP8E4M3:
    case DType::kBool:
      return 1;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kFP8E4M3:
      return "fp8_e4m3";
    case DType::kFloat32:
      return "float32";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kBool:
      return "bool";
  }
  return "unknown";
}

const char* WaitSiteName(WaitSite site) {
  switch (site) {
    case WaitSite::kNone:
      return "none";
    case WaitSite::kBarrier:
      return "barrier";
    case WaitSite::kNotifyCounts:
      return "notify counts";
    case WaitSite::kDispatchFifoSpace:
      return "dispatch FIFO space";
    case WaitSite::kDispatchFifoData:
      return "dispatch FIFO data";
    case WaitSite::kCombineFifoSpace:
      return "combine FIFO space";
    case WaitSite::kCombineFifoData:
      return "combine FIFO data";
    case WaitSite::kLowLatencyRecvCount:
      return "low-latency receive count";
    case WaitSite::kLowLatencyCombineFlag:
      return "low-latency combine flag";
    case WaitSite::kTransportRingSpace:
      return "transport ring space";
    case WaitSite::kTransportQuiet:
      return "transport quiet";
    case WaitSite::kInternodeDispatchRows:
      return "internode dispatch rows";
    case WaitSite::kInternodeSlabFree:
      return "internode release of the previous dispatch's slabs";
    case WaitSite::kInternodeCombineRows:
      return "internode combine rows";
  }
  return "unknown";
}

const char* PeerDataFieldName(PeerDataField field) {
  switch (field) {
    case PeerDataField::kNone:
      return "none";
    case PeerDataField::kNotifyRankCount:
      return "notify token count";
    case PeerDataField::kNotifyExpertCount:
      return "notify expert token count";
    case PeerDataField::kDispatchRangeBegin:
      return "dispatch slot range begin";
    case PeerDataField::kDispatchRangeEnd:
      return "dispatch slot range end";
    case PeerDataField::kDispatchTail:
      return "dispatch tail";
    case PeerDataField::kDispatchSrcIdx:
      return "dispatch source token index";
    case PeerDataField::kDispatchTopkIdx:
      return "dispatch local expert id";
    case PeerDataField::kCombineTail:
      return "combine tail";
    case PeerDataField::kCombineRange:
      return "combine slot range";
    case PeerDataField::kLowLatencyRecvCount:
      return "low-latency token count";
    case PeerDataField::kLowLatencyRoutingToken:
      return "low-latency routing token";
    case PeerDataField::kLowLatencyRoutingTopk:
      return "low-latency routing top-k position";
    case PeerDataField::kBarrierArrivals:
      return "barrier arrivals ahead of this rank";
    case PeerDataField::kLowLatencyDoneCounter:
      return "low-latency work counter";
    case PeerDataField::kInternodeRowCount:
      return "internode row count";
    case PeerDataField::kInternodeCachedRowCount:
      return "internode row count (a cached dispatch must receive the cached handle's)";
  }
  return "unknown field";
}

KernelStatus BadPeerDataRecord(PeerDataField field, int reading_rank, int peer_rank, int index, int64_t value,
                               int64_t min_value, int64_t max_value) {
  KernelStatus record{};
  record.code = kKernelStatusBadPeerData;
  record.site = static_cast<int32_t>(field);
  record.waiting_rank = reading_rank;
  record.peer_rank = peer_rank;
  record.channel = index;
  record.value = SaturateInt32(value);
  record.min_value = SaturateInt32(min_value);
  record.max_value = SaturateInt32(max_value);
  return record;
}

KernelStatus RecvCapacityRecord(CapacitySite site, int rank, int64_t num_recv, int64_t capacity) {
  KernelStatus record{};
  record.code = kKernelStatusRecvCapacity;
  record.site = static_cast<int32_t>(site);
  record.waiting_rank = rank;
  record.peer_rank = -1;
  record.channel = -1;
  record.value = SaturateInt32(num_recv);
  record.max_value = SaturateInt32(capacity);
  return record;
}

absl::Status KernelStatusToStatus(const KernelStatus& status) {
  if (status.code == kKernelStatusOk) return absl::OkStatus();
  if (status.code == kKernelStatusTimeout) {
    return absl::DeadlineExceededError(
        absl::StrFormat("rank %d timed out waiting for %s from rank %d (channel %d)", status.waiting_rank,
                        WaitSiteName(static_cast<WaitSite>(status.site)), status.peer_rank, status.channel));
  }
  if (status.code == kKernelStatusPeerLost) {
    return absl::UnavailableError(absl::StrFormat(
        "rank %d stopped waiting for %s from rank %d (channel %d): rank %d is lost (its client's lease ended or its "
        "daemon went down)",
        status.waiting_rank, WaitSiteName(static_cast<WaitSite>(status.site)), status.peer_rank, status.channel,
        status.peer_rank));
  }
  if (status.code == kKernelStatusPeerLeftCall) {
    return absl::UnavailableError(
        absl::StrFormat("rank %d stopped waiting for %s from rank %d (channel %d): rank %d left the call (its own "
                        "error says why)",
                        status.waiting_rank, WaitSiteName(static_cast<WaitSite>(status.site)), status.peer_rank,
                        status.channel, status.peer_rank));
  }
  if (status.code == kKernelStatusBadPeerData) {
    const PeerDataField field = static_cast<PeerDataField>(status.site);
    return absl::DataLossError(
        absl::StrFormat("rank %d read %s = %d from rank %d (%s %d; valid [%d, %d]): stale or corrupt peer data",
                        status.waiting_rank, PeerDataFieldName(field), status.value, status.peer_rank,
                        PeerDataIndexName(field), status.channel, status.min_value, status.max_value));
  }
  if (status.code == kKernelStatusRecvCapacity) {
    const bool combine = static_cast<CapacitySite>(status.site) == CapacitySite::kCombine;
    return absl::ResourceExhaustedError(absl::StrFormat(
        "rank %d receives %d tokens but its %s %d rows (num_worst_tokens too small): nothing was %s; every rank "
        "calls Reset",
        status.waiting_rank, status.value, combine ? "combine input x has" : "dispatch outputs have room for",
        status.max_value, combine ? "combined" : "dispatched"));
  }
  return absl::InternalError(absl::StrFormat("kernel status word holds unknown code %d", status.code));
}

absl::Status InvalidValue(std::string_view field, int64_t value, std::string_view requirement) {
  return absl::InvalidArgumentError(absl::StrFormat("%s = %d: %s", field, value, requirement));
}

absl::Status MissingPointer(std::string_view field, std::string_view when) {
  return absl::InvalidArgumentError(absl::StrFormat("%s is null: required %s", field, when));
}

absl::Status CheckNumTokens(std::string_view field, int64_t num_tokens, int64_t max_tokens_per_rank) {
  if (num_tokens < 0 || num_tokens > max_tokens_per_rank) {
    return InvalidValue(field, num_tokens, "must be in [0, max_tokens_per_rank]");
  }
  return absl::OkStatus();
}

absl::Status CheckNumTopk(std::string_view field, int64_t num_topk, int64_t max_topk) {
  if (num_topk < 1 || num_topk > max_topk) {
    return InvalidValue(field, num_topk, absl::StrCat("must be in [1, ", max_topk, "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckDispatchDType(std::string_view field, DType dtype) {
  if (dtype != DType::kBF16 && dtype != DType::kFP8E4M3) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s = %s: dispatch takes bf16 or fp8_e4m3", field, DTypeName(dtype)));
  }
  return absl::OkStatus();
}

absl::Status CheckDispatchHidden(std::string_view field, int64_t hidden, DType dtype, int64_t max_hidden) {
  if (hidden < 1 || hidden > max_hidden) {
    return InvalidValue(field, hidden, absl::StrCat("must be in [1, max_hidden = ", max_hidden, "]"));
  }
  if (dtype == DType::kFP8E4M3 && hidden % kFp8ScaleBlockSize != 0) {
    return InvalidValue(field, hidden, "must be a multiple of 128 for fp8_e4m3 x");
  }
  if (dtype != DType::kFP8E4M3 && hidden % 8 != 0) return InvalidValue(field, hidden, "must be a multiple of 8");
  return absl::OkStatus();
}

absl::Status CheckCombineHidden(std::string_view field, int64_t hidden, int64_t max_hidden) {
  if (hidden < 8 || hidden > max_hidden || hidden % 8 != 0) {
    return InvalidValue(field, hidden, absl::StrCat("must be a multiple of 8 in [8, max_hidden = ", max_hidden, "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckExpertIndices(std::string_view name, const int64_t* topk_idx, int64_t num_tokens, int64_t num_topk,
                                int num_experts) {
  for (int64_t i = 0; i < num_tokens * num_topk; ++i) {
    const int64_t e = topk_idx[i];
    if (e < -1 || e >= num_experts) {
      return absl::InvalidArgumentError(absl::StrFormat("%s[%d][%d] = %d: expert indices must be in [-1, %d)", name,
                                                        i / num_topk, i % num_topk, e, num_experts));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaErrorToStatus(cudaError_t err, const char* expr, const char* file, int line) {
  return absl::InternalError(
      absl::StrFormat("%s failed: %s (%s) at %s:%d", expr, cudaGetErrorName(err), cudaGetErrorString(err), file, line));
}

}  // namespace epfabric::kernels
