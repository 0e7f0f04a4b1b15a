// Host backend of the dispatch layout (GetDispatchLayout): per token, the ranks and experts its top-k entries reach,
// as the CUDA layout kernel computes them.
#include <algorithm>
#include <vector>

#include "api/intranode_checks.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/kernels/host_backend.h"

namespace epfabric::kernels::host_backend {

absl::Status GetDispatchLayout(const DispatchLayoutParams& p) {
  EPF_RETURN_IF_ERROR(intranode_checks::CheckLayout(p));
  const int num_rdma_ranks = (p.num_ranks + kMaxNvlPeers - 1) / kMaxNvlPeers;
  const int experts_per_rank = p.num_experts / p.num_ranks;
  std::fill(p.num_tokens_per_rank, p.num_tokens_per_rank + p.num_ranks, 0);
  std::fill(p.num_tokens_per_expert, p.num_tokens_per_expert + p.num_experts, 0);
  if (p.num_tokens_per_rdma_rank != nullptr) {
    std::fill(p.num_tokens_per_rdma_rank, p.num_tokens_per_rdma_rank + num_rdma_ranks, 0);
  }
  int32_t invalid = 0;
  std::vector<uint8_t> in_rdma(num_rdma_ranks);
  for (int t = 0; t < p.num_tokens; ++t) {
    bool* in_rank = p.is_token_in_rank + static_cast<size_t>(t) * p.num_ranks;
    std::fill(in_rank, in_rank + p.num_ranks, false);
    for (int k = 0; k < p.num_topk; ++k) {
      const int64_t e = p.topk_idx[static_cast<size_t>(t) * p.num_topk + k];
      if (e < -1 || e >= p.num_experts) {
        ++invalid;  // treated as -1, counted so that the caller can tell
        continue;
      }
      if (e < 0) continue;
      ++p.num_tokens_per_expert[e];
      in_rank[e / experts_per_rank] = true;
    }
    std::fill(in_rdma.begin(), in_rdma.end(), 0);
    for (int r = 0; r < p.num_ranks; ++r) {
      if (!in_rank[r]) continue;
      ++p.num_tokens_per_rank[r];
      in_rdma[r / kMaxNvlPeers] = 1;
    }
    if (p.num_tokens_per_rdma_rank != nullptr) {
      for (int rr = 0; rr < num_rdma_ranks; ++rr) p.num_tokens_per_rdma_rank[rr] += in_rdma[rr];
    }
  }
  if (p.num_invalid_topk != nullptr) *p.num_invalid_topk = invalid;
  return absl::OkStatus();
}

}  // namespace epfabric::kernels::host_backend
