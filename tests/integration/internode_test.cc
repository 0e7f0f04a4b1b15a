// Internode normal dispatch/combine (issue #12) through the product: real epfabricd daemons (host backend) acting as
// several hosts (--host_id), the transport on its socket wire, one epfabric_worker process per rank. Every worker
// computes every rank's inputs from the seed and checks its outputs element by element against the internode
// reference (kernels/reference/internode_reference.h): dispatch outputs and combine exactly, combine also against the
// weighted sum in double precision. Shapes: 2 hosts x 2 ranks, 3 x 1, 2 x 3, and one host forced through the
// internode path (which must give the intranode reference's bits).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "integration/fabric_under_test.h"
#include "integration/subprocess.h"

namespace epfabric::testing {
namespace {

using ::testing::HasSubstr;

const char* WorkerBinary() {
  const char* env = std::getenv("EPF_WORKER_BINARY");
  return env != nullptr && *env != '\0' ? env : EPF_WORKER_BINARY;
}

std::string TransportFlag() {
  const char* env = std::getenv("EPF_TRANSPORT");
  return absl::StrCat("--transport=", env != nullptr && *env != '\0' ? env : "socket");
}

class InternodeTest : public ::testing::Test {
 protected:
  void StartFabric(int hosts, int per_host) {
    hosts_ = hosts;
    per_host_ = per_host;
    std::map<int, std::vector<std::string>> flags;
    for (int r = 0; r < hosts * per_host; ++r) flags[r] = {absl::StrCat("--host_id=host-", r / per_host)};
    auto fabric = FabricUnderTest::Start(hosts * per_host,
                                         {"--heartbeat_ms=100", "--heartbeat_misses=10", TransportFlag()}, flags);
    ASSERT_TRUE(fabric.ok()) << fabric.status();
    fabric_ = std::move(*fabric);
    ASSERT_TRUE(fabric_->WaitComplete().ok());
  }
  int world() const { return hosts_ * per_host_; }

  // RequiredGroupBytes for `scenario`, from the worker (the same code the ranks run).
  absl::StatusOr<std::pair<uint64_t, uint64_t>> GroupBytes(const std::vector<std::string>& scenario) {
    std::vector<std::string> argv = {WorkerBinary(), "--region_bytes", absl::StrCat("--ranks=", per_host_),
                                     absl::StrCat("--hosts=", hosts_)};
    argv.insert(argv.end(), scenario.begin(), scenario.end());
    RunResult run = RunBinary(argv);
    std::vector<std::string> parts = absl::StrSplit(absl::StripAsciiWhitespace(run.out), ' ');
    uint64_t nvl = 0, rdma = 0;
    if (run.exit_code != 0 || parts.size() != 2 || !absl::SimpleAtoi(parts[0], &nvl) ||
        !absl::SimpleAtoi(parts[1], &rdma)) {
      return absl::InternalError(absl::StrCat("--region_bytes: ", run.exit_code, " ", run.out, run.err));
    }
    return std::make_pair(nvl, rdma);
  }

  absl::StatusOr<std::string> CreateGroup(const std::string& name, const std::vector<std::string>& scenario) {
    auto bytes = GroupBytes(scenario);
    if (!bytes.ok()) return bytes.status();
    v1::CreateGroupRequest request;
    request.set_name(name);
    for (int r = 0; r < world(); ++r) request.add_ranks(r);
    request.set_num_nvl_bytes(bytes->first);
    request.set_num_rdma_bytes(bytes->second);
    request.set_low_latency(std::find(scenario.begin(), scenario.end(), "--mode=low_latency") != scenario.end());
    v1::CreateGroupResponse response;
    grpc::Status status;
    for (int attempt = 0; attempt < 20; ++attempt) {
      grpc::ClientContext context;
      status = fabric_->Control(0)->CreateGroup(&context, request, &response);
      if (status.error_code() != grpc::StatusCode::ABORTED) break;
      absl::SleepFor(absl::Milliseconds(100));
    }
    if (!status.ok()) return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
    return response.token();
  }

  // Runs `scenario` on a fresh group, one worker per rank; every worker must report ok=1 and exit 0.
  void Run(const std::string& group, std::vector<std::string> scenario) {
    SCOPED_TRACE(group);
    auto token = CreateGroup(group, scenario);
    ASSERT_TRUE(token.ok()) << token.status();
    std::vector<Subprocess> workers;
    for (int r = 0; r < world(); ++r) {
      std::vector<std::string> argv = {WorkerBinary(), "--socket=" + fabric_->daemon(r).socket(), "--group=" + group,
                                       absl::StrCat("--rank=", r), "--token=" + *token};
      argv.insert(argv.end(), scenario.begin(), scenario.end());
      auto worker = Subprocess::Start(argv);
      ASSERT_TRUE(worker.ok()) << worker.status();
      workers.push_back(std::move(*worker));
    }
    for (int r = 0; r < world(); ++r) {
      auto code = workers[r].Wait(absl::Seconds(120));
      ASSERT_TRUE(code.ok()) << "rank " << r << ": " << code.status();
      EXPECT_EQ(*code, 0) << "rank " << r << ":\n" << workers[r].Stdout() << workers[r].Stderr();
      EXPECT_THAT(workers[r].Stdout(), HasSubstr(" ok=1 ")) << workers[r].Stderr();
    }
  }

  int hosts_ = 0, per_host_ = 0;
  std::unique_ptr<FabricUnderTest> fabric_;
};

std::vector<std::string> LowLatency(int tokens, int hidden, int topk, int experts, bool fp8, int seed,
                                    std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--mode=low_latency",
                                   absl::StrCat("--tokens=", tokens),
                                   absl::StrCat("--hidden=", hidden),
                                   absl::StrCat("--topk=", topk),
                                   absl::StrCat("--experts=", experts),
                                   absl::StrCat("--seed=", seed),
                                   "--repeats=4",
                                   "--timeout_ms=10000"};
  if (fp8) args.push_back("--fp8");
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

std::vector<std::string> Scenario(int tokens, int hidden, int topk, int experts, bool fp8, int seed,
                                  std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--mode=normal",
                                   absl::StrCat("--tokens=", tokens),
                                   absl::StrCat("--hidden=", hidden),
                                   absl::StrCat("--topk=", topk),
                                   absl::StrCat("--experts=", experts),
                                   absl::StrCat("--seed=", seed),
                                   "--repeats=3",
                                   "--cached",
                                   "--timeout_ms=10000"};
  if (fp8) args.push_back("--fp8");
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

TEST_F(InternodeTest, TwoHostsOfTwoRanks) {
  ASSERT_NO_FATAL_FAILURE(StartFabric(2, 2));
  Run("random-bf16", Scenario(32, 256, 4, 16, false, 11));
  Run("random-fp8", Scenario(32, 256, 4, 16, true, 12));
  Run("silent-rank", Scenario(24, 128, 4, 8, false, 13, {"--routing=silent", "--silent_rank=2"}));
  Run("nowhere", Scenario(24, 128, 4, 8, false, 14, {"--routing=nowhere", "--silent_rank=1"}));
  // Expert 0 lives on host 0: every token of host 1 crosses to one rank of the other host.
  Run("one-expert-on-another-host", Scenario(24, 128, 4, 8, false, 15, {"--routing=one_expert"}));
  Run("many-minus-one", Scenario(24, 128, 8, 16, false, 16, {"--empty_fraction=0.6"}));
  Run("one-token", Scenario(1, 128, 2, 8, false, 17, {"--fixed_tokens"}));
  Run("hidden-7168", Scenario(16, 7168, 8, 32, false, 18, {"--fixed_tokens"}));
  Run("hidden-7168-fp8", Scenario(16, 7168, 8, 32, true, 19, {"--fixed_tokens"}));
  Run("bad-input", Scenario(16, 128, 4, 8, false, 20, {"--bad_input"}));
  Run("ll-fp8", LowLatency(16, 256, 4, 16, true, 51));
  Run("ll-bf16", LowLatency(16, 256, 4, 16, false, 52, {"--empty_fraction=0.6"}));
  Run("ll-silent", LowLatency(16, 128, 4, 8, true, 53, {"--routing=silent", "--silent_rank=3"}));
  Run("ll-one-expert", LowLatency(16, 128, 4, 8, false, 54, {"--routing=one_expert"}));
  Run("ll-hidden-7168", LowLatency(8, 7168, 8, 32, true, 55, {"--fixed_tokens"}));
  Run("ll-bad-input", LowLatency(8, 128, 4, 8, false, 56, {"--bad_input"}));
}

TEST_F(InternodeTest, ThreeHostsOfOneRank) {
  ASSERT_NO_FATAL_FAILURE(StartFabric(3, 1));
  Run("random", Scenario(32, 256, 4, 12, false, 21));
  Run("fp8", Scenario(32, 256, 4, 12, true, 22, {"--empty_fraction=0.6"}));
  Run("one-expert", Scenario(16, 128, 2, 6, false, 23, {"--routing=one_expert"}));
  Run("ll", LowLatency(16, 256, 4, 12, true, 24));
}

TEST_F(InternodeTest, TwoHostsOfThreeRanks) {
  ASSERT_NO_FATAL_FAILURE(StartFabric(2, 3));
  Run("random", Scenario(24, 256, 4, 12, false, 31));
  Run("fp8-silent", Scenario(24, 256, 6, 24, true, 32, {"--routing=silent", "--silent_rank=4"}));
  Run("ll", LowLatency(16, 256, 4, 12, false, 33));
}

// A one-host group forced through the internode path (RDMA stage included) gives the intranode path's bits: the
// workers compare against the intranode reference exactly.
TEST_F(InternodeTest, OneHostThroughTheInternodePathMatchesIntranodeBitForBit) {
  ASSERT_NO_FATAL_FAILURE(StartFabric(1, 2));
  Run("forced", Scenario(32, 256, 4, 8, false, 41, {"--force_internode"}));
  Run("forced-fp8", Scenario(32, 256, 4, 8, true, 42, {"--force_internode", "--empty_fraction=0.5"}));
}

}  // namespace
}  // namespace epfabric::testing
