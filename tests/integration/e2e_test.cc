// End to end: 4 real epfabricd daemons (host backend) and real client processes (epfabric_worker, one per rank)
// running dispatch + combine through the Buffer API. Every worker computes the single-process expected results with
// the host references and compares its outputs element by element (see tools/epfabric_worker/); the test
// asserts on each worker's exit code and result line.
//
// Failure recovery (E2eKill.*): after a peer is SIGKILLed (from outside at a random point, or by itself 100 us into
// a normal or low-latency dispatch) its daemon sees the lease end and tells the other daemons, which publish the rank
// as lost to their clients' waits (issue #14): within 100 ms the survivors' normal calls fail with UNAVAILABLE naming
// it, and their low-latency calls mask it (the round reports that); they stop, every survivor calls
// Buffer::Reset() (as buffer.h documents), the new process of the dead rank attaches, calls Reset() too, and all
// four continue on the SAME group (not a fresh one) with correct results. The worker and the test rendezvous through
// files in a directory (timedout.<r>, reset, reset.<r>, ready.<r>, go), so that no rank resets while a peer's call
// is still in flight.
#include "integration/e2e_fixture.h"

namespace epfabric::testing {
namespace {

using ::testing::HasSubstr;

// Random shapes and the edge cases, each on its own group, every output compared element by element.
TEST_F(E2e, ScenariosMatchTheSingleProcessReference) {
  std::mt19937_64 rng(TestSeed());
  auto pick = [&](std::vector<int> values) { return values[rng() % values.size()]; };
  struct Named {
    std::string name;
    std::vector<std::string> args;
  };
  std::vector<Named> scenarios = {
      // Random shapes.
      {"normal-random-bf16", Shape("normal", pick({1, 17, 48, 64}), pick({64, 256, 520}), pick({1, 3, 4, 8}),
                                   pick({8, 16, 32}), false, rng())},
      {"normal-random-fp8", Shape("normal", pick({5, 33, 64}), pick({128, 512}), pick({2, 4, 6}), pick({16, 32}), true,
                                  rng(), {absl::StrCat("--num_sms=", pick({1, 3, 8}))})},
      {"ll-random-fp8",
       Shape("low_latency", pick({1, 9, 32}), pick({128, 256, 512}), pick({1, 4, 8}), pick({8, 16, 32}), true, rng())},
      {"ll-random-bf16",
       Shape("low_latency", pick({3, 16}), pick({128, 384}), pick({2, 5}), pick({8, 16}), false, rng())},
      // Edge cases.
      {"normal-rank-sends-nothing",
       Shape("normal", 32, 256, 4, 16, false, rng(), {"--routing=silent", "--silent_rank=2"})},
      {"normal-tokens-go-nowhere",
       Shape("normal", 32, 256, 4, 16, false, rng(), {"--routing=nowhere", "--silent_rank=1"})},
      {"normal-every-token-to-one-expert", Shape("normal", 48, 256, 4, 16, false, rng(), {"--routing=one_expert"})},
      {"normal-many-minus-one", Shape("normal", 40, 256, 8, 32, false, rng(), {"--empty_fraction=0.6"})},
      {"normal-hidden-7168", Shape("normal", 24, 7168, 8, 32, false, rng(), {"--fixed_tokens"})},
      {"normal-hidden-7168-fp8", Shape("normal", 24, 7168, 8, 32, true, rng())},
      {"normal-small-hidden-8", Shape("normal", 40, 8, 2, 8, false, rng())},
      {"ll-rank-sends-nothing",
       Shape("low_latency", 16, 256, 4, 16, true, rng(), {"--routing=silent", "--silent_rank=3"})},
      {"ll-every-token-to-one-expert", Shape("low_latency", 16, 128, 4, 16, true, rng(), {"--routing=one_expert"})},
      {"ll-many-minus-one", Shape("low_latency", 16, 128, 8, 32, false, rng(), {"--empty_fraction=0.6"})},
      {"ll-hidden-7168", Shape("low_latency", 8, 7168, 8, 32, true, rng(), {"--fixed_tokens"})},
      {"ll-small-hidden-128", Shape("low_latency", 16, 128, 2, 8, false, rng())},
  };
  for (const Named& s : scenarios) {
    SCOPED_TRACE(s.name + ": " + absl::StrJoin(s.args, " "));
    const absl::Time start = absl::Now();
    ExpectAllOk(RunScenario("e2e-" + s.name, s.args), s.name);
    std::cout << s.name << ": " << absl::ToDoubleMilliseconds(absl::Now() - start) << " ms\n";
  }
}

// Two groups on the same daemons, used at the same time by two sets of workers with the same shapes and different
// data: any byte of one group landing in the other shows as a mismatch.
TEST_F(E2e, TwoGroupsAtOnceDoNotCrossTalk) {
  const std::vector<std::string> a = Shape("normal", 48, 512, 4, 16, false, 1001, {"--repeats=4"});
  const std::vector<std::string> b = Shape("normal", 48, 512, 4, 16, false, 2002, {"--repeats=4"});
  const std::vector<std::string> c = Shape("low_latency", 16, 256, 4, 16, true, 3003, {"--repeats=4"});
  auto token_a = CreateGroup("e2e-tenant-a", a);
  auto token_b = CreateGroup("e2e-tenant-b", b);
  auto token_c = CreateGroup("e2e-tenant-c", c);
  ASSERT_TRUE(token_a.ok() && token_b.ok() && token_c.ok());
  std::vector<Subprocess> wa = StartWorkers("e2e-tenant-a", *token_a, a);
  std::vector<Subprocess> wb = StartWorkers("e2e-tenant-b", *token_b, b);
  std::vector<Subprocess> wc = StartWorkers("e2e-tenant-c", *token_c, c);
  std::vector<Finished> fa, fb, fc;
  for (int r = 0; r < kRanks; ++r) {
    fa.push_back(Finish(wa[r], r));
    fb.push_back(Finish(wb[r], r));
    fc.push_back(Finish(wc[r], r));
  }
  ExpectAllOk(fa, "tenant a");
  ExpectAllOk(fb, "tenant b");
  ExpectAllOk(fc, "tenant c");
}

// Bad input (dtype, shape, expert index, too many tokens, unaligned / wrong hidden) is refused with
// InvalidArgument on every rank before anything runs; the valid rounds that follow are correct.
TEST_F(E2e, BadInputIsRefusedAndTheNextCallIsCorrect) {
  for (const std::vector<std::string>& scenario : {Shape("normal", 16, 256, 4, 16, false, 77, {"--bad_input"}),
                                                   Shape("low_latency", 16, 256, 4, 16, true, 78, {"--bad_input"})}) {
    const std::string group = absl::StrCat("e2e-bad-", scenario[0].substr(7));
    std::vector<Finished> finished = RunScenario(group, scenario);
    ExpectAllOk(finished, group);
    for (const Finished& f : finished) {
      const std::string refused = f.result.count("bad_input_refused") ? f.result.at("bad_input_refused") : "";
      std::pair<std::string, std::string> counts = absl::StrSplit(refused, '/');
      EXPECT_EQ(counts.first, counts.second) << f.Describe();
      int cases = 0;
      EXPECT_TRUE(absl::SimpleAtoi(counts.second, &cases) && cases >= 5) << f.Describe();
      EXPECT_THAT(f.out, HasSubstr("refused case=\"expert index >= num_experts\"")) << f.Describe();
    }
    if (!finished.empty()) {
      for (absl::string_view line : absl::StrSplit(finished[0].out, '\n')) {
        if (absl::StrContains(line, " refused ")) std::cout << line << "\n";
      }
    }
  }
}

// The checks can fail: one flipped bit of one combined value per rank is reported (ok=0, exit 1) by the exact
// comparison and, with --exact=false, by the weighted-sum comparison alone.
TEST_F(E2e, AWrongCombinedValueIsReported) {
  for (const char* exact : {"--exact=true", "--exact=false"}) {
    const std::vector<std::string> scenario = Shape(
        "normal", 8, 128, 2, 8, false, 99, {"--fixed_tokens", "--routing=one_expert", "--flip_one_output", exact});
    std::vector<Finished> finished = RunScenario(absl::StrCat("e2e-flip-", exact + 8), scenario);
    ASSERT_EQ(finished.size(), static_cast<size_t>(kRanks));
    for (const Finished& f : finished) {
      EXPECT_EQ(f.exit_code, 1) << f.Describe();
      EXPECT_EQ(f.result.count("ok") ? f.result.at("ok") : "", "0") << f.Describe();
      EXPECT_THAT(f.err, HasSubstr("combined_x")) << f.Describe();
    }
  }
}

// --restart_probe (issue #5's restart cost): fresh worker processes of every rank, started at once against the
// running daemons, each report on one EPF_RESTART line the milliseconds from their launch to each stage (main,
// connect, attach, Buffer::Create, inputs, first dispatch complete) and exit 0. Twice per group, as device-checks
// runs trials back to back: a rank is attachable again as soon as its previous process has exited.
TEST_F(E2e, RestartProbeReportsTheStagesFromLaunchToTheFirstDispatch) {
  for (const std::vector<std::string>& scenario : {Shape("normal", 64, 7168, 8, 32, false, 5, {"--fixed_tokens"}),
                                                   Shape("low_latency", 16, 512, 4, 16, true, 6, {"--fixed_tokens"})}) {
    const std::string group = absl::StrCat("e2e-restart-", scenario[0].substr(7));
    auto token = CreateGroup(group, scenario);
    ASSERT_TRUE(token.ok()) << token.status();
    for (int trial = 0; trial < 2; ++trial) {
      std::vector<Subprocess> workers;
      for (int r = 0; r < kRanks; ++r) {
        std::vector<std::string> args = scenario;
        args.insert(args.end(), {"--restart_probe", absl::StrCat("--launch_unix_ns=", absl::ToUnixNanos(absl::Now()))});
        auto worker = StartWorker(group, *token, r, args);
        ASSERT_TRUE(worker.ok()) << worker.status();
        workers.push_back(std::move(*worker));
      }
      for (int r = 0; r < kRanks; ++r) {
        Finished f = Finish(workers[r], r);
        SCOPED_TRACE(absl::StrCat(group, " trial ", trial, "\n", f.Describe()));
        EXPECT_EQ(f.exit_code, 0);
        const std::map<std::string, std::string> line = ResultFields(f.out, "EPF_RESTART ");
        ASSERT_EQ(line.count("ok") ? line.at("ok") : "", "1");
        EXPECT_EQ(line.at("rank"), std::to_string(r));
        EXPECT_EQ(line.at("backend"), "host");
        EXPECT_EQ(line.at("restart_to_first_dispatch_ms"), line.at("dispatch_ms"));
        double previous = 0;
        for (const char* stage : {"main_ms", "connect_ms", "attach_ms", "buffer_ms", "inputs_ms", "dispatch_ms"}) {
          double ms = -1;
          ASSERT_TRUE(absl::SimpleAtod(line.at(stage), &ms)) << stage;
          EXPECT_GE(ms, previous) << stage << " comes before the stage it follows";
          previous = ms;
        }
        EXPECT_GT(previous, 0);
        EXPECT_LT(previous, 30000);
        if (r == 0) std::cout << f.out.substr(f.out.find("EPF_RESTART "));
      }
    }
  }
  // Without a launch time there is nothing to measure from: a usage error.
  RunResult run = RunBinary({WorkerBinary(), "--restart_probe", "--socket=/nonexistent", "--rank=0"});
  EXPECT_EQ(run.exit_code, 2) << run.out << run.err;
  EXPECT_THAT(run.err, HasSubstr("--launch_unix_ns"));
}

bool WaitForFiles(const std::string& dir, const std::vector<std::string>& names, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (const std::string& name : names) {
    while (!std::filesystem::exists(dir + "/" + name)) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  return true;
}

void Touch(const std::string& path) { std::ofstream(path).put('\n'); }

// The value of " <field>=N" in one event line (0 when absent or not a number).
int64_t EventField(const std::string& event, const std::string& field) {
  const std::string key = absl::StrCat(" ", field, "=");
  const size_t at = event.find(key);
  if (at == std::string::npos) return 0;
  int64_t value = 0;
  const size_t begin = at + key.size();
  return absl::SimpleAtoi(event.substr(begin, event.find_first_of(" \n", begin) - begin), &value) ? value : 0;
}

// The unix_ns of rank `rank`'s first "EPF_EVENT rank=<rank> <what> unix_ns=N" line in `out` (0 when absent).
int64_t EventNanos(const std::string& out, int rank, const std::string& what) {
  const size_t at = out.find(absl::StrCat("EPF_EVENT rank=", rank, " ", what, " "));
  if (at == std::string::npos) return 0;
  return EventField(out.substr(at, out.find('\n', at) - at), "unix_ns");
}

// How long a survivor's call waited on the dead rank: from the victim's death, or from the start of the last
// survivor's failing call when that came later, to its error. No survivor's call can end before every survivor has
// joined it (the barrier and the data need them all), and a survivor may be seconds late on CI's 2 busy cores (busy
// with the host-side checks of its previous round; CI saw 1.1 s under ASan). Issue #14: within 100 ms in normal mode.
// Low latency counts to the return of the call that came back with the rank masked (the worker's mask_seen_unix_ns):
// the round's combine that follows is the survivor's own work. Its bound is looser: CI measured 396 ms once (stop 22,
// with the combine then), against 20-90 ms here; 500 ms still tells a published loss from a timeout (10 s).
double LossBoundMs(bool low_latency) { return (low_latency ? 500 : 100) * kSanitizerSlowdown; }

// kill -9 of one worker in the middle of its calls: the other workers' calls fail with UNAVAILABLE naming the dead
// rank as lost (normal) or run with it masked (low latency), long before their Buffer timeout; every survivor resets,
// a new process takes the dead rank, and the same group gives correct results again. `self_kill`: the victim SIGKILLs
// itself 100 us into its third dispatch call (from a second thread while the call runs; the survivors' messages,
// printed, show where they were waiting); otherwise the test kills it from outside at a random point of its loop of
// calls.
class E2eKill : public E2e {
 public:
  void Run(const std::string& group, const std::vector<std::string>& scenario, bool self_kill);
};

void E2eKill::Run(const std::string& group, const std::vector<std::string>& scenario, bool self_kill) {
  constexpr int kVictim = 3;
  auto token = CreateGroup(group, scenario);
  ASSERT_TRUE(token.ok()) << token.status();
  const std::string dir = MakeTempDir();
  std::vector<std::string> looping = scenario;
  looping.insert(looping.end(), {"--until_timeout", "--max_seconds=90", "--recover_dir=" + dir});
  std::vector<Subprocess> workers;
  for (int r = 0; r < kRanks; ++r) {
    std::vector<std::string> args = looping;
    if (self_kill && r == kVictim) args.insert(args.end(), {"--sigkill_in_dispatch=3", "--sigkill_delay_us=100"});
    auto worker = StartWorker(group, *token, r, args);
    ASSERT_TRUE(worker.ok()) << worker.status();
    workers.push_back(std::move(*worker));
  }
  int64_t killed_ns = 0;  // when the victim died (see below), or the test's signal
  absl::Time killed;
  if (self_kill) {
    // Generous: three checked rounds (host references included) take 10-30 s under ASan on 2 busy cores.
    auto code = workers[kVictim].Wait(absl::Seconds(90));
    killed = absl::Now();
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 128 + SIGKILL) << workers[kVictim].Stdout() << workers[kVictim].Stderr();
    EXPECT_THAT(workers[kVictim].Stdout(), HasSubstr("dying in dispatch 3"));
    // The later of its last line before raise(SIGKILL) and its exit as seen here: the kernel closes a killed
    // process' sockets (which is how its daemon learns of the death) only after unmapping its memory, and that took
    // 1.2-1.9 s in 2 of 22 runs with three CPU hogs on 2 cores (the daemon's poller saw the hang-up only then).
    killed_ns = std::max(EventNanos(workers[kVictim].Stdout(), kVictim, "sigkill"), absl::ToUnixNanos(killed));
  } else {
    // Every worker is in its loop of calls, then the victim dies without any clean-up.
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    for (Subprocess& worker : workers) {
      while (worker.Stdout().find(" running") == std::string::npos && worker.running() && absl::Now() < deadline) {
        absl::SleepFor(absl::Milliseconds(5));
      }
    }
    absl::SleepFor(absl::Milliseconds(50 + std::random_device()() % 200));
    ASSERT_TRUE(workers[kVictim].running()) << Finish(workers[kVictim], kVictim).Describe();
    killed = absl::Now();
    killed_ns = absl::ToUnixNanos(killed);
    workers[kVictim].Signal(SIGKILL);
  }
  ASSERT_TRUE(WaitForFiles(dir, {"timedout.0", "timedout.1", "timedout.2"}, absl::Seconds(15)))
      << "survivors did not time out";
  std::cout << "survivors stopped within " << absl::ToDoubleMilliseconds(absl::Now() - killed)
            << " ms of the kill as the test saw it\n";
  ASSERT_GT(killed_ns, 0);
  double slowest_ms = 0;
  int64_t last_call_ns = 0;        // when the last survivor's failing call started
  std::vector<int64_t> failed_ns;  // when each survivor's call failed
  for (int r = 0; r < kRanks; ++r) {
    if (r == kVictim) continue;
    const std::string out = workers[r].Stdout();
    const size_t at = out.find("EPF_EVENT rank=" + std::to_string(r) + " timeout ");
    ASSERT_NE(at, std::string::npos) << out;
    const std::string event = out.substr(at, out.find('\n', at) - at);
    std::cout << event << "\n";
    // Not the Buffer's timeout: the daemons published the rank as lost.
    EXPECT_THAT(event, HasSubstr("UNAVAILABLE"));
    EXPECT_THAT(event, ::testing::AnyOf(HasSubstr(absl::StrCat("rank ", kVictim, " is lost")),
                                        HasSubstr(absl::StrCat("rank(s) ", kVictim, " masked"))))
        << "the error does not name the dead rank";
    const int64_t mask_seen_ns = EventField(event, "mask_seen_unix_ns");
    failed_ns.push_back(mask_seen_ns > 0 ? mask_seen_ns : EventNanos(out, r, "timeout"));
    const int64_t call_ns = EventField(event, "call_unix_ns");  // when the failing call started
    ASSERT_GT(call_ns, 0) << event;
    slowest_ms = std::max(slowest_ms, (failed_ns.back() - killed_ns) / 1e6);
    last_call_ns = std::max(last_call_ns, call_ns);
  }
  double longest_wait_ms = 0;
  for (int64_t ns : failed_ns)
    longest_wait_ms = std::max(longest_wait_ms, (ns - std::max(killed_ns, last_call_ns)) / 1e6);
  std::cout << "survivors stopped " << slowest_ms << " ms after the victim died (slowest survivor); the longest "
            << longest_wait_ms
            << " ms after the victim died or the last survivor's call started, whichever was later\n";
  // Sanitizer builds run several times slower on CI's 2 cores.
  const bool low_latency = std::find(scenario.begin(), scenario.end(), "--mode=low_latency") != scenario.end();
  EXPECT_LT(longest_wait_ms, LossBoundMs(low_latency));

  // Recovery: every survivor resets (none has a call in flight any more), then the new rank 3 joins.
  Touch(dir + "/reset");
  ASSERT_TRUE(WaitForFiles(dir, {"reset.0", "reset.1", "reset.2"}, absl::Seconds(15)));
  std::vector<std::string> rejoin = scenario;
  rejoin.insert(rejoin.end(), {"--reset_first", "--recover_dir=" + dir});
  auto fresh = StartWorker(group, *token, kVictim, rejoin);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  ASSERT_TRUE(WaitForFiles(dir, {"ready.3"}, absl::Seconds(15))) << Finish(*fresh, kVictim).Describe();
  Touch(dir + "/go");
  std::vector<Finished> finished;
  for (int r = 0; r < kRanks; ++r) finished.push_back(Finish(r == kVictim ? *fresh : workers[r], r));
  ExpectAllOk(finished, "after the rejoin");
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(finished[r].result["timeouts"], r == kVictim ? "0" : "1") << finished[r].Describe();
    EXPECT_EQ(finished[r].result["rounds"], "3") << finished[r].Describe();
  }
  std::filesystem::remove_all(dir);
}

// Far longer than the loss takes to reach the survivors (their errors must say UNAVAILABLE, not a timeout), so that
// a round of 4 processes slowed down by a busy machine (a peer seconds late with its host-side checks) is not
// taken for a lost one.
constexpr const char* kLongTimeout = "--timeout_ms=10000";

TEST_F(E2eKill, WorkerKilledFromOutsideTimesOutItsPeersAndTheRankRejoins) {
  Run("e2e-kill-outside", Shape("normal", 64, 2048, 4, 16, false, 4242, {kLongTimeout, "--fixed_tokens"}),
      /*self_kill=*/false);
}

TEST_F(E2eKill, WorkerKilledInsideADispatchTimesOutItsPeersAndTheRankRejoins) {
  Run("e2e-kill-dispatch", Shape("normal", 64, 2048, 4, 16, false, 4343, {kLongTimeout, "--fixed_tokens"}),
      /*self_kill=*/true);
}

TEST_F(E2eKill, LowLatencyWorkerKilledInsideADispatchTimesOutItsPeersAndTheRankRejoins) {
  Run("e2e-kill-ll", Shape("low_latency", 64, 4096, 4, 16, true, 4444, {kLongTimeout, "--fixed_tokens"}),
      /*self_kill=*/true);
}

}  // namespace
}  // namespace epfabric::testing
