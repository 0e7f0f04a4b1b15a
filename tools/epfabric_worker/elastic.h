// epfabric_worker --elastic_dir: elastic EP at call boundaries (docs/elastic.md), orchestrated through files in DIR
// by the test or benchmark that runs the workers (tests/integration/elastic_test.cc, bench/elastic_bench.cc):
//
//   survivors (every rank started together, --shrink): rounds 0, 1, ... checked against the reference without the
//     ranks masked at the time (a killed rank is masked; its rounds are checked, not failed). Before each round:
//     the first time Buffer::RanksWaitingToRejoin is not empty, write DIR/waiting_seen.<rank> holding the round
//     number; once DIR/rejoin_at (a round number N, written by the orchestrator after every survivor saw the
//     replacement waiting) exists, call Buffer::Rejoin before round N, then run rounds N .. N + --repeats - 1, each
//     at full strength (no rank masked, else the round fails). A survivor already past N fails.
//   --replacement (a new process for a rank whose client left): attach, Buffer::Create, write DIR/attached.<rank>,
//     wait for DIR/rejoin_at, Rejoin, then rounds N .. N + --repeats - 1 at full strength.
//
// Printed: `EPF_EVENT rank=R running` after round 0, `EPF_EVENT rank=R masked_ok round=N unix_ns=T ranks=..` when a
// call first returned with a rank masked (T: when it returned), `EPF_EVENT rank=R waiting_seen round=N ranks=..`,
// `EPF_EVENT rank=R rejoined round=N rejoin_ms=X`.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "worker.h"

namespace epfabric::worker {

struct ElasticOptions {
  std::string dir;
  bool replacement = false;
  int rounds_after = 1;                         // full-strength rounds from the rejoin round on
  int round_pause_ms = 0;                       // between rounds (a serving engine's work between steps)
  absl::Duration max_time = absl::Seconds(60);  // bound of the whole run (waits for files included)
};

struct ElasticOutcome {
  int rounds = 0;
  int masked_rounds = 0;      // rounds checked with a rank masked
  int full_rounds_after = 0;  // full-strength rounds from the rejoin on
  int rejoin_round = -1;
  double rejoin_ms = 0;  // the Rejoin call
  int64_t first_masked_ok_unix_ns = 0;
};

absl::Status RunElastic(Buffer& buffer, Memory& mem, const Scenario& s, const ElasticOptions& options, Checks& checks,
                        ElasticOutcome* out);

}  // namespace epfabric::worker
