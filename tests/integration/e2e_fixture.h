// The end-to-end fixture: 4 real epfabricd daemons (host backend) and epfabric_worker processes, one per rank (see
// e2e_test.cc). Shared by the test files that run workers against the same fabric.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "integration/fabric_under_test.h"
#include "integration/subprocess.h"
#include "support/sanitizers.h"

namespace epfabric::testing {

inline constexpr int kRanks = 4;
// Heartbeats every 100 ms (the fabric forms quickly), a daemon DOWN only after 3 s of silence: no test here kills or
// stops a daemon, and a daemon starved for 0.5 s (ASan, CI's two cores) would otherwise count as DOWN for a moment,
// degrade the group and make the low-latency calls then under way mask its rank while it is alive (CI, ASan:
// `E2e.RestartProbe...`'s rank 0 timed out waiting for the count of a rank that had masked it).
inline const std::vector<std::string> kFast = {"--heartbeat_ms=100", "--heartbeat_misses=30"};

inline const char* WorkerBinary() {
  const char* env = std::getenv("EPF_WORKER_BINARY");
  return env != nullptr && *env != '\0' ? env : EPF_WORKER_BINARY;
}

// Seed of the random shapes: $EPF_E2E_SEED to replay a run, else a fresh one (printed).
inline uint64_t TestSeed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("EPF_E2E_SEED");
    uint64_t value = 0;
    if (env == nullptr || !absl::SimpleAtoi(env, &value)) value = std::random_device()();
    std::cout << "EPF_E2E_SEED=" << value << "\n";
    return value;
  }();
  return seed;
}

// key=value fields of a worker's EPF_RESULT line, or of its line starting with `prefix` (empty when there is none).
inline std::map<std::string, std::string> ResultFields(const std::string& out,
                                                       absl::string_view prefix = "EPF_RESULT ") {
  std::map<std::string, std::string> fields;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (!absl::ConsumePrefix(&line, prefix)) continue;
    // Values without spaces, except error="..." which comes last.
    if (size_t error = line.find(" error="); error != absl::string_view::npos) {
      fields["error"] = std::string(line.substr(error + 7));
      line = line.substr(0, error);
    }
    for (absl::string_view field : absl::StrSplit(line, ' ', absl::SkipEmpty())) {
      std::pair<std::string, std::string> kv = absl::StrSplit(field, absl::MaxSplits('=', 1));
      fields.insert(kv);
    }
  }
  return fields;
}

struct Finished {
  int rank = -1;
  int exit_code = -1;
  std::string out, err;
  std::map<std::string, std::string> result;
  std::string Describe() const {
    return absl::StrCat("worker rank ", rank, " exit ", exit_code, "\n--- stdout\n", out, "--- stderr\n", err);
  }
};

class E2e : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto fabric = FabricUnderTest::Start(kRanks, kFast);
    ASSERT_TRUE(fabric.ok()) << fabric.status();
    ASSERT_TRUE((*fabric)->WaitComplete().ok());
    fabric_ = fabric->release();
  }
  static void TearDownTestSuite() {
    delete fabric_;
    fabric_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(fabric_, nullptr); }

  static absl::StatusOr<uint64_t> RegionBytes(const std::vector<std::string>& scenario) {
    std::vector<std::string> argv = {WorkerBinary(), "--region_bytes", absl::StrCat("--ranks=", kRanks)};
    argv.insert(argv.end(), scenario.begin(), scenario.end());
    RunResult run = RunBinary(argv);
    uint64_t bytes = 0;
    if (run.exit_code != 0 || !absl::SimpleAtoi(absl::StripAsciiWhitespace(run.out), &bytes)) {
      return absl::InternalError(absl::StrCat("--region_bytes: ", run.exit_code, " ", run.out, run.err));
    }
    return bytes;
  }

  // Creates `name` over all ranks, sized for `scenario`; returns the token.
  static absl::StatusOr<std::string> CreateGroup(const std::string& name, const std::vector<std::string>& scenario) {
    auto bytes = RegionBytes(scenario);
    if (!bytes.ok()) return bytes.status();
    v1::CreateGroupRequest request;
    request.set_name(name);
    for (int r = 0; r < kRanks; ++r) request.add_ranks(r);
    request.set_num_nvl_bytes(*bytes);
    request.set_low_latency(std::find(scenario.begin(), scenario.end(), "--mode=low_latency") != scenario.end());
    grpc::ClientContext context;
    v1::CreateGroupResponse response;
    const grpc::Status status = fabric_->Control(0)->CreateGroup(&context, request, &response);
    if (!status.ok()) return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
    return response.token();
  }

  static absl::StatusOr<Subprocess> StartWorker(const std::string& group, const std::string& token, int rank,
                                                const std::vector<std::string>& scenario) {
    std::vector<std::string> argv = {WorkerBinary(), "--socket=" + fabric_->daemon(rank).socket(), "--group=" + group,
                                     absl::StrCat("--rank=", rank), "--token=" + token};
    argv.insert(argv.end(), scenario.begin(), scenario.end());
    return Subprocess::Start(argv);
  }

  static std::vector<Subprocess> StartWorkers(const std::string& group, const std::string& token,
                                              const std::vector<std::string>& scenario) {
    std::vector<Subprocess> workers;
    for (int r = 0; r < kRanks; ++r) {
      auto worker = StartWorker(group, token, r, scenario);
      EXPECT_TRUE(worker.ok()) << worker.status();
      if (worker.ok()) workers.push_back(std::move(*worker));
    }
    return workers;
  }

  static Finished Finish(Subprocess& worker, int rank, absl::Duration timeout = absl::Seconds(60)) {
    Finished f;
    f.rank = rank;
    auto code = worker.Wait(timeout);
    if (!code.ok()) {
      worker.Signal(SIGKILL);
      (void)worker.Wait(absl::Seconds(5));
    }
    f.exit_code = code.ok() ? *code : -1;
    f.out = worker.Stdout();
    f.err = worker.Stderr();
    f.result = ResultFields(f.out);
    return f;
  }

  // Runs `scenario` on a fresh group with one worker per rank; every worker must report ok=1 and exit 0.
  static std::vector<Finished> RunScenario(const std::string& group, const std::vector<std::string>& scenario) {
    std::vector<Finished> finished;
    auto token = CreateGroup(group, scenario);
    EXPECT_TRUE(token.ok()) << token.status();
    if (!token.ok()) return finished;
    std::vector<Subprocess> workers = StartWorkers(group, *token, scenario);
    for (size_t r = 0; r < workers.size(); ++r) finished.push_back(Finish(workers[r], static_cast<int>(r)));
    return finished;
  }

  static void ExpectAllOk(const std::vector<Finished>& finished, const std::string& what) {
    ASSERT_EQ(finished.size(), static_cast<size_t>(kRanks)) << what;
    for (const Finished& f : finished) {
      EXPECT_EQ(f.exit_code, 0) << what << "\n" << f.Describe();
      EXPECT_EQ(f.result.count("ok") ? f.result.at("ok") : "", "1") << what << "\n" << f.Describe();
    }
  }

  static inline FabricUnderTest* fabric_ = nullptr;
};

inline std::vector<std::string> Shape(const std::string& mode, int tokens, int hidden, int topk, int experts, bool fp8,
                                      uint64_t seed, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--mode=" + mode,
                                   absl::StrCat("--tokens=", tokens),
                                   absl::StrCat("--hidden=", hidden),
                                   absl::StrCat("--topk=", topk),
                                   absl::StrCat("--experts=", experts),
                                   absl::StrCat("--seed=", seed),
                                   "--repeats=3",
                                   "--timeout_ms=10000"};
  if (fp8) args.push_back("--fp8");
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

}  // namespace epfabric::testing
