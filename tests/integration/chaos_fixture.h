// The chaos test's fixture (chaos_test.cc runs the iterations; chaos_checks.cc holds what is checked after them).
#pragma once

#include <gtest/gtest.h>
#include <sys/types.h>

#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "integration/chaos_faults.h"
#include "integration/chaos_harness.h"
#include "integration/fabric_under_test.h"
#include "integration/subprocess.h"

namespace epfabric::testing::chaos {

inline constexpr int kRanks = 4;
inline constexpr int kFdSlack = 8;  // connections being closed, gRPC's own descriptors coming and going

class Chaos : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = Config::FromEnvironment();
    std::cout << "EPF_CHAOS_SEED=" << config_.seed << " EPF_CHAOS_ITERATIONS=" << config_.iterations
              << (config_.only_iteration > 0 ? absl::StrCat(" EPF_CHAOS_ITERATION=", config_.only_iteration) : "")
              << (config_.long_run ? " (long run)" : "") << "\n";
    const std::vector<std::string> flags = {absl::StrCat("--heartbeat_ms=", bounds_.heartbeat_ms),
                                            absl::StrCat("--heartbeat_misses=", bounds_.heartbeat_misses),
                                            absl::StrCat("--lease_ttl_ms=", bounds_.lease_ttl_ms), "--log_level=warn"};
    auto fabric = FabricUnderTest::Start(kRanks, flags);
    ASSERT_TRUE(fabric.ok()) << fabric.status();
    fabric_ = std::move(*fabric);
    ASSERT_TRUE(fabric_->WaitComplete().ok());
    const std::string timeout = absl::StrCat("--timeout_ms=", bounds_.worker_timeout_ms);
    shapes_ = {{{"--mode=normal", "--tokens=32", "--hidden=256", "--topk=4", "--experts=16", "--repeats=8", timeout}},
               {{"--mode=low_latency", "--tokens=16", "--hidden=256", "--topk=4", "--experts=16", "--fp8",
                 "--repeats=8", timeout},
                0,
                true}};
    for (Shape& shape : shapes_) {
      std::vector<std::string> argv = {WorkerBinary(), "--region_bytes", absl::StrCat("--ranks=", kRanks)};
      argv.insert(argv.end(), shape.args.begin(), shape.args.end());
      RunResult run = RunBinary(argv);
      ASSERT_TRUE(run.exit_code == 0 && absl::SimpleAtoi(absl::StripAsciiWhitespace(run.out), &shape.region_bytes))
          << run.out << run.err;
    }
    shm_baseline_ = ShmEntries();
  }

  int Uniform(int n) { return static_cast<int>(rng_() % static_cast<uint64_t>(n)); }
  absl::Duration UniformMs(int lo, int hi) { return absl::Milliseconds(lo + Uniform(std::max(1, hi - lo))); }

  Fault PickFault(int iteration) {
    Fault f;
    if (iteration == 0) return f;  // the first iteration calibrates the phases' durations
    const int roll = Uniform(100);
    f.kind = roll < 12   ? Kind::kNone
             : roll < 34 ? Kind::kKillDaemon
             : roll < 56 ? Kind::kStopDaemon
             : roll < 78 ? Kind::kKillClient
                         : Kind::kStopClient;
    // Create and delete 30% each, attach and dispatch/combine 20% each: the worker phases cost about a second an
    // iteration more (process start, a peer's timeout), and the time box is 170 s.
    const int phase = Uniform(10);
    f.phase = phase < 3 ? Phase::kCreate : phase < 5 ? Phase::kAttach : phase < 7 ? Phase::kData : Phase::kDelete;
    f.target = Uniform(kRanks);
    // A fraction of the phase's length, so that a seed gives the same faults whatever the calibration measured.
    const double at = Uniform(1000) / 1000.0;
    const double window_ms = f.phase == Phase::kCreate   ? 80
                             : f.phase == Phase::kAttach ? attach_window_ms_
                             : f.phase == Phase::kData   ? data_window_ms_
                                                         : 60;
    f.delay = absl::Milliseconds(static_cast<int64_t>(at * window_ms));
    // Pauses shorter and longer than the heartbeat timeout: the member is marked down, or not.
    f.pause = Stops(f.kind) ? UniformMs(50, 1000) : absl::ZeroDuration();
    return f;
  }

  std::unique_ptr<Injector> MakeInjector(const Fault& fault, pid_t pid) {
    std::map<int, std::string> survivors;
    for (int r = 0; r < kRanks; ++r) {
      if (r != fault.target && fabric_->alive(r)) survivors[r] = fabric_->daemon(r).socket();
    }
    auto injector = std::make_unique<Injector>(fault, pid, survivors, bounds_);
    injector->Start();
    return injector;
  }

  void Violation(int iteration, const Fault& fault, const std::string& what, int* counter) {
    ++*counter;
    violations_.push_back(
        absl::StrCat("EPF_CHAOS_SEED=", config_.seed, " iteration ", iteration, " (", fault.Describe(), "): ", what));
    ADD_FAILURE() << violations_.back();
  }

  // The daemons' warnings while the fabric stops fill the end of the log, which is all that CI shows: the
  // violations again, last.
  void TearDown() override {
    fabric_.reset();
    if (violations_.empty()) return;
    std::cerr << "chaos: " << violations_.size() << " violation(s), as reported above:\n";
    for (const std::string& v : violations_) std::cerr << "  " << v.substr(0, 600) << "\n";
    std::cerr.flush();
  }

  // Runs epctl against `rank`'s socket; `fault` (when it is this call's) hits it or its daemon.
  Outcome Epctl(int iteration, const Fault& fault, bool faulted_phase, int rank, std::vector<std::string> args,
                std::string* out, std::unique_ptr<Injector>* injector);

  void RunIteration(int iteration);
  void RunWorkers(int iteration, const Fault& fault, const std::string& name, const std::string& token,
                  const Shape& shape, std::unique_ptr<Injector>* injector);
  void Recover(int iteration, const Fault& fault, Injector* injector, std::set<int>* restarted);
  void CheckRegistries(int iteration, const Fault& fault, const std::string& name, Outcome created, Outcome deleted,
                       const std::set<int>& restarted);
  void CleanUpAndCheckLeaks(int iteration, const Fault& fault, const std::string& name, const std::string& token);

  Config config_;
  Bounds bounds_;
  Tally tally_;
  std::mt19937_64 rng_;
  std::unique_ptr<FabricUnderTest> fabric_;
  std::vector<Shape> shapes_;
  std::vector<std::string> violations_;
  std::map<pid_t, int> fd_baseline_;  // per daemon process, when first seen clean
  int shm_baseline_ = 0;
  double attach_window_ms_ = 200, data_window_ms_ = 300;
};

}  // namespace epfabric::testing::chaos
