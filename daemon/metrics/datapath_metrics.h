// Data-path metrics: what each group's lease holder published in its counters page (kernels/datapath_stats.h),
// read at scrape time. Calls, tokens and bytes per direction, failures, and expert load: the tokens this rank's
// local experts received, as an imbalance gauge (max / mean over the rank's experts) and, behind
// --metrics_expert_series, one series per expert. Group-wide imbalance comes from the ranks' series in PromQL
// (max over ranks / avg over ranks of epfabric_expert_tokens_received_rank_total), see docs/operations.md.
#pragma once

#include <vector>

#include "groups/local_groups.h"
#include "metrics/registry.h"

namespace epfabric::daemon::metrics {

std::vector<Family> DataPathFamilies(const std::vector<groups::GroupDataPathStats>& groups, bool expert_series);

// max / mean of the first `n` counts (0 when they are all 0); n is clamped to the page's capacity.
double LoadImbalance(const kernels::DataPathStats& stats, uint64_t n);

}  // namespace epfabric::daemon::metrics
