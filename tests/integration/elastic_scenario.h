// Elastic EP's kill-and-replace scenario on real daemons (host backend) and epfabric_worker processes, one per rank
// (tools/epfabric_worker/elastic.h), shared by elastic_test.cc (which asserts on it) and bench/elastic_bench.cc (which
// times it N times):
//   1. every rank's worker runs low-latency rounds with --shrink, each checked element by element;
//   2. the victim's worker is SIGKILLed; the survivors go on with it masked, their rounds checked against the
//      reference without it; each survivor's first call that returns with it masked is timed from the kill;
//   3. a replacement worker for the victim's rank starts (same group and token); every survivor reports when it sees
//      it waiting (Buffer::RanksWaitingToRejoin); the orchestrator (the serving engine's role) then picks a round a
//      margin ahead of the furthest survivor and writes it; every rank calls Buffer::Rejoin before that round;
//   4. every rank runs --repeats rounds at full strength from there, checked against the full reference.
// The replacement is timed from its launch to the return of its first dispatch (at full strength).
#pragma once

#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "integration/e2e_fixture.h"
#include "integration/subprocess.h"

namespace epfabric::testing {

struct ElasticOptions {
  int victim = 3;
  int rounds_after = 5;    // full-strength rounds from the rejoin round on
  int round_pause_ms = 2;  // the engine's work between steps
  int rejoin_margin = 20;  // rounds between the furthest survivor's round and the rejoin round
  absl::Duration kill_after = absl::Milliseconds(50);  // after every worker finished its first round
};

struct ElasticRun {
  std::vector<double> survivor_next_call_ms;  // per survivor: from the kill to its first call returned with it masked
  double replacement_client_full_strength_ms = -1;  // from the replacement's launch to its first full-strength call
  double replacement_attached_ms = -1;              // from its launch to Buffer::Create done (attached)
  int rejoin_round = -1;
  std::vector<Finished> finished;  // every rank's worker (the victim's replacement at the victim's index)
  std::string log;                 // what happened, for failure messages
};

namespace elastic_internal {

inline bool WaitFor(const std::function<bool()>& done, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

inline int ReadInt(const std::string& path) {
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  int value = -1;
  return absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &value) ? value : -1;
}

// The field `key` of the first `EPF_EVENT rank=R <event> ...` line in `out`.
inline std::string EventField(const std::string& out, int rank, const std::string& event, const std::string& key) {
  const std::map<std::string, std::string> fields =
      ResultFields(out, absl::StrCat("EPF_EVENT rank=", rank, " ", event));
  auto it = fields.find(key);
  return it == fields.end() ? "" : it->second;
}

}  // namespace elastic_internal

// `start(rank, extra)` starts the worker of `rank` with the scenario's flags plus `extra`; `dir` is an empty
// directory for the files the workers and this orchestrator exchange. Errors name the step that did not happen.
inline absl::StatusOr<ElasticRun> RunElasticScenario(
    const std::function<absl::StatusOr<Subprocess>(int, std::vector<std::string>)>& start, int num_ranks,
    const std::string& dir, const ElasticOptions& options, double slowdown) {
  using namespace elastic_internal;
  ElasticRun run;
  const std::vector<std::string> elastic = {"--shrink", "--elastic_dir=" + dir,
                                            absl::StrCat("--repeats=", options.rounds_after),
                                            absl::StrCat("--round_pause_ms=", options.round_pause_ms),
                                            absl::StrCat("--max_seconds=", static_cast<int>(60 * slowdown))};
  std::vector<Subprocess> workers;
  for (int r = 0; r < num_ranks; ++r) {
    auto worker = start(r, elastic);
    if (!worker.ok()) return worker.status();
    workers.push_back(std::move(*worker));
  }
  auto all_out = [&] {
    std::string out;
    for (Subprocess& w : workers) absl::StrAppend(&out, w.Stdout(), w.Stderr());
    return out;
  };
  for (int r = 0; r < num_ranks; ++r) {
    if (!WaitFor([&] { return workers[r].Stdout().find(" running") != std::string::npos || !workers[r].running(); },
                 absl::Seconds(30 * slowdown)) ||
        !workers[r].running()) {
      return absl::DeadlineExceededError(absl::StrCat("rank ", r, " did not finish its first round:\n", all_out()));
    }
  }
  absl::SleepFor(options.kill_after);
  const int64_t kill_ns = absl::GetCurrentTimeNanos();
  workers[options.victim].Signal(SIGKILL);
  if (!workers[options.victim].Wait(absl::Seconds(10)).ok()) return absl::InternalError("the victim did not die");
  // Every survivor's first call that returned with the victim masked.
  for (int r = 0; r < num_ranks; ++r) {
    if (r == options.victim) continue;
    if (!WaitFor(
            [&] {
              return !EventField(workers[r].Stdout(), r, "masked_ok", "unix_ns").empty() || !workers[r].running();
            },
            absl::Seconds(15 * slowdown))) {
      return absl::DeadlineExceededError(
          absl::StrCat("survivor ", r, " never returned with a rank masked:\n", all_out()));
    }
    int64_t ns = 0;
    if (!absl::SimpleAtoi(EventField(workers[r].Stdout(), r, "masked_ok", "unix_ns"), &ns)) {
      return absl::InternalError(absl::StrCat("survivor ", r, " stopped before a masked call:\n", all_out()));
    }
    run.survivor_next_call_ms.push_back(static_cast<double>(ns - kill_ns) / 1e6);
    absl::StrAppend(&run.log, "survivor ", r, ": masked_ok after ", run.survivor_next_call_ms.back(), " ms (ranks ",
                    EventField(workers[r].Stdout(), r, "masked_ok", "ranks"), ")\n");
  }
  // The replacement.
  const int64_t launch_ns = absl::GetCurrentTimeNanos();
  auto replacement = start(
      options.victim,
      {"--shrink", "--elastic_dir=" + dir, "--replacement", absl::StrCat("--repeats=", options.rounds_after),
       absl::StrCat("--max_seconds=", static_cast<int>(60 * slowdown)), absl::StrCat("--launch_unix_ns=", launch_ns)});
  if (!replacement.ok()) return replacement.status();
  workers.push_back(std::move(*replacement));  // Subprocess is not assignable: the victim's slot is left as it is
  auto worker = [&](int r) -> Subprocess& { return r == options.victim ? workers.back() : workers[r]; };
  int furthest = -1;
  for (int r = 0; r < num_ranks; ++r) {
    if (r == options.victim) continue;
    const std::string file = absl::StrCat(dir, "/waiting_seen.", r);
    if (!WaitFor([&] { return ReadInt(file) >= 0 || !worker(r).running(); }, absl::Seconds(15 * slowdown)) ||
        ReadInt(file) < 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("survivor ", r, " never saw the replacement waiting:\n", all_out()));
    }
    furthest = std::max(furthest, ReadInt(file));
  }
  // The survivors run in step: the rejoin round is a margin ahead of the furthest one's report, read just now.
  for (int r = 0; r < num_ranks; ++r) {
    if (r == options.victim) continue;
    int64_t round = 0;
    (void)absl::SimpleAtoi(EventField(worker(r).Stdout(), r, "waiting_seen", "round"), &round);
    furthest = std::max<int>(furthest, static_cast<int>(round));
  }
  run.rejoin_round = furthest + options.rejoin_margin;
  {
    std::ofstream(dir + "/rejoin_at.tmp") << run.rejoin_round << "\n";
    std::filesystem::rename(dir + "/rejoin_at.tmp", dir + "/rejoin_at");
  }
  absl::StrAppend(&run.log, "every survivor saw the replacement waiting by round ", furthest, "; rejoin at round ",
                  run.rejoin_round, "\n");
  for (int r = 0; r < num_ranks; ++r) {
    Finished f;
    f.rank = r;
    auto code = worker(r).Wait(absl::Seconds(60 * slowdown));
    if (!code.ok()) {
      worker(r).Signal(SIGKILL);
      (void)worker(r).Wait(absl::Seconds(5));
    }
    f.exit_code = code.ok() ? *code : -1;
    f.out = worker(r).Stdout();
    f.err = worker(r).Stderr();
    f.result = ResultFields(f.out);
    run.finished.push_back(std::move(f));
  }
  const Finished& fresh = run.finished[options.victim];
  double ms = -1;
  if (fresh.result.count("restart_to_first_dispatch_ms") &&
      absl::SimpleAtod(fresh.result.at("restart_to_first_dispatch_ms"), &ms)) {
    run.replacement_client_full_strength_ms = ms;
  }
  int64_t attached_ns = 0;
  if (absl::SimpleAtoi(EventField(fresh.out, options.victim, "attached", "unix_ns"), &attached_ns)) {
    run.replacement_attached_ms = static_cast<double>(attached_ns - launch_ns) / 1e6;
  }
  absl::StrAppend(&run.log, "replacement: attached after ", run.replacement_attached_ms,
                  " ms, first full-strength dispatch after ", run.replacement_client_full_strength_ms, " ms\n");
  return run;
}

}  // namespace epfabric::testing
