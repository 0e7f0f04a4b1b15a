// Exact data or an error when clients come and go (issue #32): 4 real daemons (host backend) and one epfabric_worker
// process per rank on ONE low-latency group that outlives them. Every worker checks every element of every round
// against the single-process reference (tools/epfabric_worker/).
//
// - Fresh clients, run after run, on the same group: each run's clients meet regions that earlier clients of every
//   rank wrote into. Their signals carry another generation's tags and are never read as this call's.
// - A client killed at a random point of a run: without enable_shrink the survivors' calls fail naming it (never a
//   round that completes with it masked), and the next run's fresh clients get exact data.
#include <signal.h>

#include <iostream>
#include <random>

#include "integration/e2e_fixture.h"

namespace epfabric::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::vector<std::string> LowLatencyShape(uint64_t seed, int repeats) {
  // The timeout also bounds the first call's wait for every rank's client (x5 under sanitizers, as e2e's workers).
  return Shape("low_latency", 16, 256, 4, 16, /*fp8=*/true, seed,
               {absl::StrCat("--repeats=", repeats),
                absl::StrCat("--timeout_ms=", static_cast<int>(5000 * kSanitizerSlowdown)), "--fixed_tokens"});
}

// A worker's outcome when it was not the one killed: exact rounds (ok=1), or a failed call that names a rank and is
// not a round that ran with a rank masked behind the caller's back. Never a mismatch. True when it failed.
bool ExpectExactOrAnError(const Finished& f, const std::string& what) {
  const std::string mismatches = f.result.count("mismatches") ? f.result.at("mismatches") : "0";
  EXPECT_EQ(mismatches, "0") << what << ": wrong data\n" << f.Describe();
  if (f.result.count("ok") && f.result.at("ok") == "1") return false;
  EXPECT_NE(f.exit_code, 0) << what << "\n" << f.Describe();
  const std::string error = f.result.count("error") ? f.result.at("error") : "";
  EXPECT_THAT(error, HasSubstr("rank")) << what << ": the error names no rank\n" << f.Describe();
  EXPECT_THAT(error, Not(HasSubstr("masked"))) << what << ": a rank was masked without enable_shrink\n" << f.Describe();
  std::cout << what << ": rank " << f.rank << ": " << error << "\n";
  return true;
}

class Generations : public E2e {};

TEST_F(Generations, FreshClientsRunAfterRunOnOneGroupGetExactData) {
  const std::vector<std::string> shape = LowLatencyShape(TestSeed(), 3);
  auto token = CreateGroup("gen-runs", shape);
  ASSERT_TRUE(token.ok()) << token.status();
  for (int run = 0; run < 6; ++run) {
    std::vector<std::string> scenario = shape;
    scenario.push_back(absl::StrCat("--seed=", TestSeed() + run));
    std::vector<Subprocess> workers = StartWorkers("gen-runs", *token, scenario);
    std::vector<Finished> finished;
    for (int r = 0; r < static_cast<int>(workers.size()); ++r) finished.push_back(Finish(workers[r], r));
    ExpectAllOk(finished, absl::StrCat("run ", run));
    if (HasFailure()) return;
  }
}

TEST_F(Generations, AKilledClientFailsItsPeersAndTheNextClientsGetExactData) {
  std::mt19937_64 rng(TestSeed() ^ 0x5eed);
  const std::vector<std::string> shape = LowLatencyShape(TestSeed(), 200);
  auto token = CreateGroup("gen-kill", shape);
  ASSERT_TRUE(token.ok()) << token.status();
  int failed = 0;
  for (int run = 0; run < 3; ++run) {
    const int victim = static_cast<int>(rng() % kRanks);
    const int delay_ms = static_cast<int>(rng() % 100);
    const std::string what =
        absl::StrCat("run ", run, " (rank ", victim, " killed ", delay_ms, " ms after every rank's first round)");
    std::vector<Subprocess> workers = StartWorkers("gen-kill", *token, shape);
    ASSERT_EQ(workers.size(), static_cast<size_t>(kRanks));
    // Killed while the ranks make rounds, not while they start (a rank that never attached fails its peers' first
    // call after their whole timeout, which tests nothing here).
    const absl::Time deadline = absl::Now() + absl::Seconds(30 * kSanitizerSlowdown);
    for (Subprocess& worker : workers) {
      while (worker.Stdout().find(" running") == std::string::npos && worker.running() && absl::Now() < deadline) {
        absl::SleepFor(absl::Milliseconds(2));
      }
    }
    absl::SleepFor(absl::Milliseconds(delay_ms));
    workers[victim].Signal(SIGKILL);
    for (int r = 0; r < kRanks; ++r) {
      Finished f = Finish(workers[r], r);
      if (r == victim) continue;
      failed += ExpectExactOrAnError(f, what) ? 1 : 0;
      EXPECT_THAT(f.result.count("error") ? f.result.at("error") : "", Not(HasSubstr("no client attached")))
          << what << ": the kill came before the rank attached\n"
          << f.Describe();
    }
    // Fresh clients of every rank on the same group: exact data.
    std::vector<std::string> clean = LowLatencyShape(TestSeed() + 100 + run, 2);
    std::vector<Subprocess> next = StartWorkers("gen-kill", *token, clean);
    std::vector<Finished> finished;
    for (int r = 0; r < static_cast<int>(next.size()); ++r) finished.push_back(Finish(next[r], r));
    ExpectAllOk(finished, what + ", then fresh clients");
    if (HasFailure()) return;
  }
  // The kills came while the survivors were still making rounds (200 of them), so some of their calls met the loss.
  EXPECT_GT(failed, 0) << "no survivor's call met a killed peer: the test did not test it";
}

}  // namespace
}  // namespace epfabric::testing
