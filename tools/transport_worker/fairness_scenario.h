// Fairness between groups on one daemon (issue #34, Medium 6; tests/integration/security_fairness_test.cc):
//   flood    every channel at once (a thread each) puts `flood_bytes` from the start of this rank's region to its
//            second half, on itself, in batches of 4 with a quiet, until `duration` passes; prints EPF_FLOODING once
//            the first batch is posted and `EPF_RESULT ok=1 scenario=flood puts=N` at the end.
//   signals  `count` 8-byte signal_adds to itself on channel 0, one at a time, each timed from its publish to its
//            completion (a quiet), `gap` apart; checks the word counted every one; prints
//            `EPF_LATENCY median_us=.. p90_us=.. max_us=..` and EPF_RESULT.
#pragma once

#include <cstdint>

#include "absl/time/time.h"
#include "issue.h"
#include "region_access.h"

namespace epfabric::tools {

int FloodScenario(client::Lease& lease, Issuers& issuers, uint64_t flood_bytes, absl::Duration duration);
int SignalLatencyScenario(client::Lease& lease, RegionAccess& region, Issuers& issuers, int count, absl::Duration gap);

}  // namespace epfabric::tools
