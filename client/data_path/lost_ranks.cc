#include "data_path/lost_ranks.h"

#include "epfabric/kernels/status_word.h"

namespace epfabric::client::internal {

void InitLostIgnore(const uint64_t* lost_ranks_host, uint64_t* ignore) {
  for (int i = 0; i < kernels::kLostRankWords; ++i) {
    ignore[i] = lost_ranks_host != nullptr ? __atomic_load_n(lost_ranks_host + i, __ATOMIC_ACQUIRE) : 0;
  }
}

void RefreshLostIgnore(const uint64_t* lost_ranks_host, uint64_t* ignore) {
  if (lost_ranks_host == nullptr) return;
  for (int i = 0; i < kernels::kLostRankWords; ++i) ignore[i] &= __atomic_load_n(lost_ranks_host + i, __ATOMIC_ACQUIRE);
}

bool RankLost(const uint64_t* lost_ranks_host, const uint64_t* ignore, int rank) {
  if (lost_ranks_host == nullptr || rank < 0 || rank >= kernels::kMaxLostRanks) return false;
  const uint64_t word = __atomic_load_n(lost_ranks_host + rank / 64, __ATOMIC_ACQUIRE) & ~ignore[rank / 64];
  return ((word >> (rank % 64)) & 1u) != 0;
}

int FirstLostRank(const uint64_t* lost_ranks_host, const uint64_t* ignore, int num_ranks, int self) {
  for (int r = 0; r < num_ranks; ++r) {
    if (r != self && RankLost(lost_ranks_host, ignore, r)) return r;
  }
  return -1;
}

}  // namespace epfabric::client::internal
