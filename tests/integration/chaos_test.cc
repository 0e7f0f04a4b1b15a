// Chaos (issue #14): 4 host-backend daemons and their clients (epctl for CreateGroup/DeleteGroup, one epfabric_worker
// process per rank for Attach and dispatch/combine), and one random fault per iteration: SIGKILL, or SIGSTOP then
// SIGCONT, of a daemon or of a client, at a random point of CreateGroup, Attach, dispatch/combine or DeleteGroup.
// Killed daemons are restarted (a new incarnation). After every iteration, and after the recovery docs/fabric.md
// documents (restart, delete the group with its token, a forced delete where the token is unknown):
//   - no orphan group: a failed create or a deleted group is gone on every member, a live group is listed by every
//     member that did not restart and by the coordinator, all with the state expected (READY, or DEGRADED when a
//     member restarted);
//   - no leak: no region memfd, /dev/shm entry or lease is left, and no daemon holds more descriptors than when it
//     was first seen clean;
//   - every call ended within its bound (chaos_harness.h, Bounds), and every worker either succeeded or reported an
//     error (never wrong data);
//   - health tells the truth: a killed or stopped daemon is shown down by every survivor within the bound, and PASS
//     everywhere once recovered.
// EPF_CHAOS_SEED, EPF_CHAOS_ITERATIONS, EPF_CHAOS_ITERATION, EPF_CHAOS_LONG=1, EPF_RELIABILITY_JSON_DIR:
// docs/reliability.md.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "integration/chaos_faults.h"
#include "integration/chaos_fixture.h"
#include "integration/chaos_harness.h"
#include "integration/fabric_under_test.h"
#include "integration/subprocess.h"

namespace epfabric::testing::chaos {

Outcome Chaos::Epctl(int iteration, const Fault& fault, bool faulted_phase, int rank, std::vector<std::string> args,
                     std::string* out, std::unique_ptr<Injector>* injector) {
  if (faulted_phase && OnDaemon(fault.kind))
    *injector = MakeInjector(fault, fabric_->daemon(fault.target).process().pid());
  std::vector<std::string> argv = {EpctlBinary(), "--socket=" + fabric_->daemon(rank).socket(),
                                   absl::StrCat("--timeout_ms=", bounds_.control_deadline_ms), "--json"};
  argv.insert(argv.end(), args.begin(), args.end());
  const absl::Time start = absl::Now();
  const absl::Duration bound = bounds_.Control(faulted_phase ? fault.Paused() : absl::ZeroDuration());
  absl::StatusOr<int> code;
  std::string err;
  if (faulted_phase && OnClient(fault.kind)) {
    // The caller itself is the target: a real epctl process.
    auto process = Subprocess::Start(argv);
    if (!process.ok()) {
      ADD_FAILURE() << process.status();
      return Outcome::kError;
    }
    *injector = MakeInjector(fault, process->pid());
    (*injector)->WaitFired();
    code = process->Wait(bound + absl::Seconds(5));
    *out = process->Stdout();
    err = process->Stderr();
  } else {
    // The same call from this process (saves starting epctl: the time box).
    RunResult run =
        ControlInProcess(fabric_->daemon(rank).socket(), args, absl::Milliseconds(bounds_.control_deadline_ms));
    code = run.exit_code;
    *out = run.out;
    err = run.err;
  }
  const absl::Duration took = absl::Now() - start;
  if (!code.ok() || took > bound) {
    Violation(iteration, fault,
              absl::StrCat(args[0], " took ", absl::FormatDuration(took), " (bound ", absl::FormatDuration(bound),
                           "): ", err),
              &tally_.bound_violations);
  }
  if (code.ok() && *code == 128 + SIGKILL) return Outcome::kUnknown;
  // The daemon the call went through, or the coordinator, died under it: the caller cannot know how far the create
  // or delete went (a coordinator killed after Commit leaves the group on the members, and its successor adopts it
  // DEGRADED; docs/reliability.md, known limits).
  if (code.ok() && *code != 0 && fault.kind == Kind::kKillDaemon && (fault.target == rank || fault.target == 0) &&
      *injector != nullptr && (*injector)->fired()) {
    std::cout << "  " << args[0] << " lost its daemon: " << absl::StripAsciiWhitespace(err) << "\n";
    return Outcome::kUnknown;
  }
  if (code.ok() && *code == 0) return Outcome::kOk;
  ++tally_.control_errors;
  if (*injector != nullptr && (*injector)->fired()) tally_.NoteError(absl::Now() - (*injector)->fired_at());
  std::cout << "  " << args[0] << " failed: " << absl::StripAsciiWhitespace(err) << "\n";
  return Outcome::kError;
}

void Chaos::RunIteration(int iteration) {
  // Each iteration draws from its own stream: the faults of a seed do not depend on what earlier iterations met.
  rng_.seed(config_.seed * 1000003 + static_cast<uint64_t>(iteration));
  const Fault fault = PickFault(iteration);
  const std::string name = absl::StrCat("chaos-", iteration);
  const Shape& shape = shapes_[Uniform(static_cast<int>(shapes_.size()))];
  std::cout << "iteration " << iteration << ": " << fault.Describe() << (shape.low_latency ? " low_latency" : "")
            << "\n";
  ++tally_.faults[Name(fault.kind)];
  if (fault.kind != Kind::kNone) ++tally_.by_phase[Name(fault.phase)];
  std::unique_ptr<Injector> injector;
  // Where the time goes, printed with the iteration's end.
  std::string stages;
  absl::Time stage_start = absl::Now();
  auto stage = [&](const char* what) {
    absl::StrAppend(&stages, " ", what, "=", absl::ToInt64Milliseconds(absl::Now() - stage_start));
    stage_start = absl::Now();
  };

  // CreateGroup, through any daemon.
  std::vector<std::string> create = {"create-group", "--group=" + name, "--ranks=0,1,2,3",
                                     absl::StrCat("--nvl_bytes=", shape.region_bytes)};
  if (shape.low_latency) create.push_back("--low_latency");
  std::string out;
  const Outcome created =
      Epctl(iteration, fault, fault.phase == Phase::kCreate, Uniform(kRanks), create, &out, &injector);
  std::string token;
  if (created == Outcome::kOk) {
    const size_t at = out.find("\"token\": \"");
    if (at != std::string::npos) token = out.substr(at + 10, 32);
    EXPECT_EQ(token.size(), 32u) << out;
  }

  stage("create");
  // Workers where the fault is theirs (attach, data), and in the iterations without a fault; a fault of the create or
  // delete phase meets no worker (they are done before DeleteGroup in any case).
  const bool with_workers = fault.kind == Kind::kNone || fault.phase == Phase::kAttach || fault.phase == Phase::kData;
  if (!token.empty() && with_workers) RunWorkers(iteration, fault, name, token, shape, &injector);
  stage("workers");

  // DeleteGroup, with the token, through any daemon that was not killed.
  Outcome deleted = Outcome::kNotRun;
  if (!token.empty()) {
    int via = Uniform(kRanks);
    if (injector != nullptr && fault.kind == Kind::kKillDaemon && injector->fired() && via == fault.target) {
      via = (via + 1) % kRanks;
    }
    deleted = Epctl(iteration, fault, fault.phase == Phase::kDelete, via,
                    {"delete-group", "--group=" + name, "--token=" + token}, &out, &injector);
  }
  if (injector != nullptr) injector->Join();
  std::set<int> restarted;
  stage("delete");
  Recover(iteration, fault, injector.get(), &restarted);
  stage("recover");
  CheckRegistries(iteration, fault, name, created, deleted, restarted);
  stage("check");
  CleanUpAndCheckLeaks(iteration, fault, name, token);
  stage("clean");
  std::cout << "  ms:" << stages << std::endl;
}

// Attach and dispatch/combine: one worker per rank, on its own daemon (none where the daemon is already dead).
void Chaos::RunWorkers(int iteration, const Fault& fault, const std::string& name, const std::string& token,
                       const Shape& shape, std::unique_ptr<Injector>* injector) {
  const bool faulted = fault.kind != Kind::kNone && (fault.phase == Phase::kAttach || fault.phase == Phase::kData);
  auto dead = [&](int r) {
    return fault.kind == Kind::kKillDaemon && fault.target == r && *injector != nullptr && (*injector)->fired();
  };
  // Most daemon faults of the attach phase hit once the target's worker has its lease (the regions are being mapped,
  // the Buffer made); one in eight hits from the start, before the worker may have connected (Connect then waits for
  // ClientOptions.timeout, 5 s: kept rare for the time box).
  const bool daemon_fault_at_attach = faulted && OnDaemon(fault.kind) && fault.phase == Phase::kAttach;
  const bool from_spawn = daemon_fault_at_attach && Uniform(8) == 0;
  // A fault of the create phase that has not hit yet hits before the workers start (not in their Connect).
  if (fault.phase == Phase::kCreate && *injector != nullptr) (*injector)->WaitFired();
  if (from_spawn) *injector = MakeInjector(fault, fabric_->daemon(fault.target).process().pid());
  // The workers attach and make their Buffer, write DIR/ready.<rank>, and start their rounds together when DIR/go
  // appears (--recover_dir): no rank's first call waits for a peer that is still starting.
  const std::string dir = MakeTempDir();
  const absl::Time spawned = absl::Now();
  std::vector<std::optional<Subprocess>> workers(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    if (dead(r)) continue;
    std::vector<std::string> argv = {WorkerBinary(),        "--socket=" + fabric_->daemon(r).socket(),
                                     "--group=" + name,     absl::StrCat("--rank=", r),
                                     "--token=" + token,    absl::StrCat("--seed=", iteration),
                                     "--recover_dir=" + dir};
    argv.insert(argv.end(), shape.args.begin(), shape.args.end());
    auto worker = Subprocess::Start(argv);
    ASSERT_TRUE(worker.ok()) << worker.status();
    workers[r].emplace(std::move(*worker));
  }
  if (faulted && OnClient(fault.kind) && fault.phase == Phase::kAttach) {
    *injector = MakeInjector(fault, workers[fault.target]->pid());
  }
  auto wait_ready = [&](const std::vector<int>& ranks) {
    const absl::Time deadline = absl::Now() + bounds_.Worker(fault.Paused());
    for (int r : ranks) {
      while (absl::Now() < deadline && workers[r].has_value() && workers[r]->running() &&
             !std::filesystem::exists(absl::StrCat(dir, "/ready.", r))) {
        absl::SleepFor(absl::Milliseconds(1));
      }
    }
  };
  if (daemon_fault_at_attach && !from_spawn) {
    // Once the target's worker has its lease: its regions are being mapped, its Buffer made.
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (absl::Now() < deadline && workers[fault.target]->running() &&
           Leases(fabric_->daemon(fault.target).socket(), name).value_or(0) == 0) {
      absl::SleepFor(absl::Milliseconds(2));
    }
    Fault after_lease = fault;
    after_lease.delay = absl::Milliseconds(Uniform(30));
    *injector = MakeInjector(after_lease, fabric_->daemon(fault.target).process().pid());
  }
  wait_ready({0, 1, 2, 3});
  const absl::Time attached = absl::Now();
  std::ofstream(dir + "/go").put('\n');
  if (faulted && fault.phase == Phase::kData) {
    *injector = MakeInjector(
        fault, OnDaemon(fault.kind) ? fabric_->daemon(fault.target).process().pid() : workers[fault.target]->pid());
  }
  if (faulted && OnClient(fault.kind)) (*injector)->WaitFired();
  const absl::Duration bound = bounds_.Worker(faulted ? fault.Paused() : absl::ZeroDuration());
  const bool must_succeed = fault.kind == Kind::kNone || fault.phase == Phase::kDelete;
  // Every worker's exit is seen when it happens (time to an error), none later than the bound.
  std::vector<absl::StatusOr<int>> codes(kRanks, absl::DeadlineExceededError("running"));
  std::vector<absl::Time> exits(kRanks, absl::InfiniteFuture());
  int running = 0;
  for (int r = 0; r < kRanks; ++r) running += workers[r].has_value() ? 1 : 0;
  while (running > 0 && absl::Now() < spawned + bound) {
    for (int r = 0; r < kRanks; ++r) {
      if (!workers[r].has_value() || codes[r].ok() || !(codes[r] = workers[r]->Wait(absl::ZeroDuration())).ok()) {
        continue;
      }
      exits[r] = absl::Now();
      --running;
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
  std::string all_workers;  // what every worker said, for a failure that needs the whole picture
  for (int r = 0; r < kRanks; ++r) {
    if (!workers[r].has_value()) continue;
    absl::StrAppend(&all_workers, "--- worker ", r, " exit ", codes[r].ok() ? *codes[r] : -1, "\n",
                    workers[r]->Stdout(), workers[r]->Stderr());
  }
  for (int r = 0; r < kRanks; ++r) {
    if (!workers[r].has_value()) continue;
    const std::string stdout_text = workers[r]->Stdout();
    if (!codes[r].ok()) {
      workers[r]->Signal(SIGKILL);
      Violation(iteration, fault, absl::StrCat("worker ", r, " still running after ", absl::FormatDuration(bound)),
                &tally_.bound_violations);
      continue;
    }
    if (absl::StrContains(stdout_text, "mismatches=")) {
      Violation(iteration, fault, absl::StrCat("worker ", r, " got WRONG DATA\n", stdout_text, workers[r]->Stderr()),
                &tally_.wrong_results);
    }
    if (*codes[r] == 0 || *codes[r] == 128 + SIGKILL) continue;
    ++tally_.worker_errors;
    std::cout << "  worker " << r << " exit " << *codes[r] << " " << absl::ToInt64Milliseconds(exits[r] - attached)
              << " ms after go: " << stdout_text.substr(std::min(stdout_text.size(), stdout_text.find("error=")));
    if (must_succeed) {
      Violation(iteration, fault, absl::StrCat("worker ", r, " failed without a fault in its phase\n", all_workers),
                &tally_.wrong_results);
    } else if (*injector != nullptr && (*injector)->fired() && exits[r] > (*injector)->fired_at()) {
      const absl::Duration to_error = exits[r] - (*injector)->fired_at();
      tally_.NoteError(to_error);
      const absl::Duration error_bound = bounds_.Error(fault.Paused(), OnDaemon(fault.kind));
      if (to_error > error_bound) {
        Violation(iteration, fault,
                  absl::StrCat("worker ", r, " reported its error ", absl::FormatDuration(to_error),
                               " after the fault (bound ", absl::FormatDuration(error_bound), ")"),
                  &tally_.bound_violations);
      }
    }
  }
  if (iteration == 0) {
    attach_window_ms_ = std::max(50.0, absl::ToDoubleMilliseconds(attached - spawned));
    // Until the first worker is done with its rounds (the others then only exit).
    data_window_ms_ =
        std::max(20.0, absl::ToDoubleMilliseconds(*std::min_element(exits.begin(), exits.end()) - attached));
    std::cout << "  calibrated: attach window " << attach_window_ms_ << " ms, data window " << data_window_ms_
              << " ms\n";
  }
  // The leases of processes that are gone end (connection closed; TTL for one never bound to a connection).
  const absl::Time deadline = absl::Now() + bounds_.LeaseEnd();
  for (int r = 0; r < kRanks; ++r) {
    if (OnDaemon(fault.kind) && fault.target == r && *injector != nullptr && (*injector)->fired()) continue;
    int left = 0;
    while ((left = Leases(fabric_->daemon(r).socket(), name).value_or(0)) != 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    if (left != 0) Violation(iteration, fault, absl::StrCat("rank ", r, " still lists a lease"), &tally_.leaks);
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

TEST_F(Chaos, RandomFaultsLeaveNoOrphanNoLeakAndEveryCallEndsInItsBound) {
  ASSERT_NE(fabric_, nullptr);
  const absl::Time start = absl::Now();
  for (int i = 0; i < config_.iterations; ++i) {
    // A replay runs the calibration and the one iteration: its faults come from (seed, iteration) alone.
    if (config_.only_iteration > 0 && i != 0 && i != config_.only_iteration) continue;
    if (absl::Now() - start > config_.time_box) {
      std::cout << "time box of " << absl::FormatDuration(config_.time_box) << " reached after " << i
                << " iterations\n";
      break;
    }
    const absl::Time began = absl::Now();
    RunIteration(i);
    ++tally_.iterations;
    std::cout << "  took " << absl::ToInt64Milliseconds(absl::Now() - began) << " ms" << std::endl;
    if (::testing::Test::HasFatalFailure()) break;
  }
  tally_.elapsed = absl::Now() - start;
  // The fabric's own names are checked after every iteration; the whole of /dev/shm (other tests may run beside
  // this one) is only reported.
  std::cout << "/dev/shm entries: " << shm_baseline_ << " before, " << ShmEntries() << " after\n";
  std::cout << "chaos: " << tally_.iterations << " iterations in " << absl::FormatDuration(tally_.elapsed)
            << ", restarts " << tally_.daemon_restarts << ", worker errors " << tally_.worker_errors
            << ", control errors " << tally_.control_errors << ", leaks " << tally_.leaks << ", orphans "
            << tally_.orphans << ", longest time to an error " << tally_.longest_error_ms << " ms, longest detection "
            << tally_.longest_detection_ms << " ms\n";
  EXPECT_EQ(tally_.leaks, 0);
  EXPECT_EQ(tally_.orphans, 0);
  if (!config_.json_dir.empty()) {
    auto path = WriteReport(config_, bounds_, tally_);
    EXPECT_TRUE(path.ok()) << path.status();
    if (path.ok()) std::cout << "wrote " << *path << "\n";
  }
}

}  // namespace epfabric::testing::chaos
