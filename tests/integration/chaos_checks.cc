// What the chaos test checks after each iteration (chaos_test.cc): recovery and health, the registries' agreement,
// and that the clean-up leaves no lease, memfd, /dev/shm entry or descriptor behind.
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "integration/chaos_fixture.h"

namespace epfabric::testing::chaos {

void Chaos::Recover(int iteration, const Fault& fault, Injector* injector, std::set<int>* restarted) {
  if (injector == nullptr || !OnDaemon(fault.kind) || !injector->fired()) return;
  const bool must_show = fault.kind == Kind::kKillDaemon || fault.pause >= bounds_.Down();
  if (injector->detected().has_value()) {
    tally_.longest_detection_ms =
        std::max(tally_.longest_detection_ms, absl::ToDoubleMilliseconds(*injector->detected()));
  }
  if (must_show && (!injector->detected().has_value() || *injector->detected() > bounds_.Down())) {
    Violation(iteration, fault,
              absl::StrCat("not every survivor's health showed rank ", fault.target, " down within ",
                           absl::FormatDuration(bounds_.Down()), " (last: ", injector->last_health(), ")"),
              &tally_.bound_violations);
  }
  if (fault.kind == Kind::kKillDaemon) {
    fd_baseline_.erase(fabric_->daemon(fault.target).process().pid());
    fabric_->Kill(fault.target);
    const absl::Status started = fabric_->Restart(fault.target);
    ASSERT_TRUE(started.ok()) << started;
    ++tally_.daemon_restarts;
    restarted->insert(fault.target);
  }
  const absl::Status complete = fabric_->WaitComplete(bounds_.Settle());
  if (!complete.ok()) Violation(iteration, fault, "fabric not complete: " + complete.ToString(), &tally_.disagreements);
}

void Chaos::CheckRegistries(int iteration, const Fault& fault, const std::string& name, Outcome created,
                            Outcome deleted, const std::set<int>& restarted) {
  // What must hold once the fabric is complete again; polled, since states travel with heartbeats.
  const bool must_be_gone = created == Outcome::kError || deleted == Outcome::kOk;
  // A delete that failed may still have happened (the caller's deadline passed while a member was stopped).
  const bool must_exist = created == Outcome::kOk && deleted == Outcome::kNotRun;
  const bool lost_member = !restarted.empty();
  const v1::GroupState expected = lost_member ? v1::GROUP_STATE_DEGRADED : v1::GROUP_STATE_READY;
  const absl::Time start = absl::Now();
  std::string problem;
  while (true) {
    problem.clear();
    auto groups = GroupsEverywhere(*fabric_);
    if (!groups.ok()) {
      problem = groups.status().ToString();
    } else {
      for (const auto& [group, holders] : *groups) {
        // A delete whose coordinator died under it may have reached only some members (the successor adopts the
        // group from those that still hold it): they and the coordinator must agree, the others may have released.
        const bool half_deleted = group == name && deleted == Outcome::kUnknown;
        // Likewise a create whose coordinator died while Commit was on its way: the members it reached hold the group
        // (the successor adopts it, DEGRADED), one it had not reached releases its prepared part when it sees rank 0
        // back as another incarnation (seed 20261124, iteration 174: holders 0, 1, 2; rank 3 had released).
        const bool half_committed = group == name && created == Outcome::kUnknown && restarted.count(0) != 0;
        std::string why =
            Disagreement(*groups, group, half_deleted || half_committed ? std::set<int>{0, 1, 2, 3} : restarted,
                         group == name && created == Outcome::kOk ? expected : v1::GROUP_STATE_UNSPECIFIED);
        // A coordinator killed between Prepare and Commit leaves the group CREATING on the members that prepared
        // it: released by them after 60 s, or at once by a forced delete (docs/fabric.md), which the clean-up does.
        bool only_prepared = group == name && created == Outcome::kUnknown;
        for (const auto& [rank, info] : holders) only_prepared &= info.state() == v1::GROUP_STATE_CREATING;
        if (only_prepared) why.clear();
        std::string where;
        for (const auto& [rank, info] : holders) {
          absl::StrAppend(&where, " rank ", rank, ":", v1::GroupState_Name(info.state()));
        }
        if (group == name && must_be_gone) {
          why = absl::StrCat("group '", name, "' is still listed (an orphan) on", where, " (create ",
                             static_cast<int>(created), ", delete ", static_cast<int>(deleted), ")");
        }
        if (group != name)
          why = absl::StrCat("group '", group, "' of an earlier iteration is listed (an orphan) on", where);
        if (!why.empty()) problem = why;
      }
      if (must_exist && groups->count(name) == 0)
        problem = "group '" + name + "' is gone although it was never deleted";
    }
    if (problem.empty() || absl::Now() - start > bounds_.Settle()) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  const double settle_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  tally_.longest_settle_ms = std::max(tally_.longest_settle_ms, settle_ms);
  if (!problem.empty()) {
    Violation(iteration, fault, problem,
              absl::StrContains(problem, "orphan") ? &tally_.orphans : &tally_.disagreements);
  }
  // Health says what the registries say: a group a daemon lists DEGRADED is a GROUP_DEGRADED incident of its health
  // (groups a failed or unknown delete left, before the clean-up removes them).
  auto groups = GroupsEverywhere(*fabric_);
  if (!problem.empty() || !groups.ok()) return;
  for (const auto& [group, holders] : *groups) {
    for (const auto& [rank, info] : holders) {
      if (info.state() != v1::GROUP_STATE_DEGRADED) continue;
      auto report = Health(fabric_->daemon(rank).socket());
      bool listed = false;
      const v1::HealthReport seen = report.ok() ? *report : v1::HealthReport();
      for (const auto& incident : seen.incidents()) {
        listed |= incident.code() == "GROUP_DEGRADED" && incident.entity() == "group " + group;
      }
      ++tally_.degraded_health_checks;
      if (!listed) {
        Violation(iteration, fault,
                  absl::StrCat("rank ", rank, " lists '", group, "' DEGRADED but its health does not: ",
                               report.ok() ? Describe(seen) : report.status().ToString()),
                  &tally_.disagreements);
      }
    }
  }
}

void Chaos::CleanUpAndCheckLeaks(int iteration, const Fault& fault, const std::string& name, const std::string& token) {
  // The documented recovery: delete what is left, with its token, else forced (the token was never learned).
  const absl::Time deadline = absl::Now() + bounds_.Settle();
  bool tried_token = false;
  while (true) {
    auto groups = GroupsEverywhere(*fabric_);
    if (groups.ok() && groups->empty()) break;
    if (absl::Now() > deadline) {
      Violation(iteration, fault, "groups left after the clean-up", &tally_.orphans);
      return;
    }
    if (groups.ok()) {
      for (const auto& [group, holders] : *groups) {
        std::vector<std::string> argv = {EpctlBinary(), "--socket=" + fabric_->daemon(holders.begin()->first).socket(),
                                         "delete-group", "--group=" + group};
        const bool with_token = group == name && !token.empty() && !tried_token;
        argv.push_back(with_token ? "--token=" + token : "--force");
        tried_token |= with_token;
        tally_.forced_deletes += with_token ? 0 : 1;
        RunResult run = RunBinary(argv);
        if (run.exit_code != 0) std::cout << "  clean-up of '" << group << "': " << run.err;
      }
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  // Nothing is left: no region memfd, no /dev/shm entry, no lease, no descriptor more than the daemon started with.
  absl::Time leak_deadline = absl::Now() + absl::Seconds(2);
  while (fabric_->MemfdRegions() != 0 && absl::Now() < leak_deadline) absl::SleepFor(absl::Milliseconds(10));
  if (const int left = fabric_->MemfdRegions(); left != 0) {
    Violation(iteration, fault, absl::StrCat(left, " region memfds left"), &tally_.leaks);
  }
  if (const int shm = ShmEntries("epf." + fabric_->fabric_id() + "."); shm != 0) {
    Violation(iteration, fault, absl::StrCat(shm, " /dev/shm entries of the fabric"), &tally_.leaks);
  }
  for (int r = 0; r < kRanks; ++r) {
    if (const int leases = Leases(fabric_->daemon(r).socket()).value_or(-1); leases != 0) {
      Violation(iteration, fault, absl::StrCat("rank ", r, " lists ", leases, " leases"), &tally_.leaks);
    }
    const pid_t pid = fabric_->daemon(r).process().pid();
    int fds = OpenFds(pid);
    auto [it, first] = fd_baseline_.emplace(pid, fds);
    leak_deadline = absl::Now() + absl::Seconds(1);
    while (!first && fds > it->second + kFdSlack && absl::Now() < leak_deadline) {
      absl::SleepFor(absl::Milliseconds(20));
      fds = OpenFds(pid);
    }
    if (fds > it->second + kFdSlack) {
      Violation(iteration, fault,
                absl::StrCat("rank ", r, " holds ", fds, " descriptors, ", it->second, " when first seen"),
                &tally_.leaks);
    }
  }
  // Health tells the truth once everything is back: PASS everywhere.
  for (int r = 0; r < kRanks; ++r) {
    absl::StatusOr<v1::HealthReport> report;
    const absl::Time health_deadline = absl::Now() + bounds_.Settle();
    do {
      report = Health(fabric_->daemon(r).socket());
    } while ((!report.ok() || report->overall() != v1::HealthReport::PASS) && absl::Now() < health_deadline &&
             (absl::SleepFor(absl::Milliseconds(20)), true));
    if (!report.ok() || report->overall() != v1::HealthReport::PASS) {
      Violation(iteration, fault,
                absl::StrCat("rank ", r,
                             " health after recovery: ", report.ok() ? Describe(*report) : report.status().ToString()),
                &tally_.disagreements);
    }
  }
}
}  // namespace epfabric::testing::chaos
