// A Buffer's counters for the daemon's metrics (kernels/datapath_stats.h): plain stores into the lease's counters
// page after each call, no RPC. Low-latency expert counts accumulate where the kernels run (device memory on cuda)
// and are copied into the page every kLowLatencyStatsPeriod calls and at Check().
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epfabric/kernels/datapath_stats.h"
#include "epfabric/v1/common.pb.h"

namespace epfabric::client::internal {

class DataPathRecorder {
 public:
  // `page`: the lease's counters page (its first Buffer marks it); `num_local_experts` are counted one by one up to
  // kDataPathStatsMaxExperts. Low latency keeps its own expert totals (where the kernels run) and publishes them;
  // normal mode adds the host's per-call counts to the page directly.
  static absl::StatusOr<std::unique_ptr<DataPathRecorder>> Create(kernels::DataPathStats* page, v1::Backend backend,
                                                                  int num_local_experts, bool low_latency);
  // Low latency: the Buffer's rank mask (int32 [num_ranks], device memory on cuda), published with the totals.
  void SetRankMask(const int32_t* mask, int num_ranks);
  ~DataPathRecorder();
  DataPathRecorder(const DataPathRecorder&) = delete;
  DataPathRecorder& operator=(const DataPathRecorder&) = delete;

  // One finished call: counted, and its failure kind when it failed.
  void Call(kernels::DataPathOp op, const absl::Status& status);
  void Failure(const absl::Status& status);
  void Sent(int64_t tokens, int64_t bytes);
  void Received(int64_t tokens, int64_t bytes);
  void AddExpertCounts(const std::vector<int32_t>& per_local_expert);
  // Low latency: the uint64 [num_local_experts] totals the dispatch kernels add to (nullptr when not counted).
  uint64_t* expert_load() const { return expert_load_; }
  // After a low-latency dispatch was launched on `stream`: publishes every kLowLatencyStatsPeriod calls.
  absl::Status AfterLowLatencyDispatch(cudaStream_t stream);
  // Copies the low-latency totals into the page now (cuda: asynchronously on `stream`).
  absl::Status Publish(cudaStream_t stream);

 private:
  DataPathRecorder() = default;

  kernels::DataPathStats* page_ = nullptr;
  v1::Backend backend_ = v1::BACKEND_UNSPECIFIED;
  int counted_experts_ = 0;
  uint64_t* expert_load_ = nullptr;    // device (cuda) or host_totals_.data()
  std::vector<uint64_t> host_totals_;  // host backend
  int low_latency_calls_ = 0;
  const int32_t* rank_mask_ = nullptr;
  int mask_ranks_ = 0;
};

}  // namespace epfabric::client::internal
