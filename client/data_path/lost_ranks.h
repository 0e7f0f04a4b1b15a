// Internal: the daemon's lost-ranks words as the data paths read them (kernels/status_word.h, kMaxLostRanks). A rank
// lost already when a path was made is awaited rather than reported until its bit clears (it came back).
#pragma once

#include <cstdint>

namespace epfabric::client::internal {

// When a path is made: the lost-ranks bits set now (ranks lost before it was made), which its waits ignore until they
// clear; all zero without words.
void InitLostIgnore(const uint64_t* lost_ranks_host, uint64_t* ignore);
// Before each call: a rank ignored since the path was made (lost already then: awaited, not reported) stops being
// ignored once its bit has cleared (it came back), so that a later loss is reported.
void RefreshLostIgnore(const uint64_t* lost_ranks_host, uint64_t* ignore);
// A host-side wait's check: the daemon published `rank` as lost and `ignore` does not hide it.
bool RankLost(const uint64_t* lost_ranks_host, const uint64_t* ignore, int rank);
// The first of ranks [0, num_ranks) other than `self` that RankLost reports; -1 when none.
int FirstLostRank(const uint64_t* lost_ranks_host, const uint64_t* ignore, int num_ranks, int self);

}  // namespace epfabric::client::internal
