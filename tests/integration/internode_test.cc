// Internode normal dispatch/combine (issue #12) through the product: real epfabricd daemons (host backend) acting as
// several hosts (--host_id), the transport on its socket wire, one epfabric_worker process per rank. Every worker
// computes every rank's inputs from the seed and checks its outputs element by element against the internode
// reference (kernels/reference/internode_reference.h): dispatch outputs and combine exactly, combine also against the
// weighted sum in double precision. Shapes: 2 hosts x 2 ranks, 3 x 1, 2 x 3, and one host forced through the
// internode path (which must give the intranode reference's bits).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "epfabric/client/buffer.h"
#include "epfabric/client/client.h"
#include "integration/fabric_under_test.h"
#include "integration/subprocess.h"
#include "support/sanitizers.h"

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

  // --mode=both: a low-latency group whose regions start with normal mode's parts (num_normal_bytes and
  // num_normal_rdma_bytes, each rounded up to 4096), low latency's after them.
  absl::StatusOr<std::string> CreateGroup(const std::string& name, const std::vector<std::string>& scenario) {
    const bool both = std::find(scenario.begin(), scenario.end(), "--mode=both") != scenario.end();
    auto in_mode = [&](const char* mode) {
      std::vector<std::string> changed = scenario;
      std::replace(changed.begin(), changed.end(), std::string("--mode=both"), std::string(mode));
      return GroupBytes(changed);
    };
    auto bytes = both ? in_mode("--mode=low_latency") : GroupBytes(scenario);
    uint64_t normal_nvl = 0, normal_rdma = 0;
    if (both) {
      auto normal = in_mode("--mode=normal");
      if (!normal.ok()) return normal.status();
      normal_nvl = (normal->first + 4095) / 4096 * 4096;
      normal_rdma = (normal->second + 4095) / 4096 * 4096;
    }
    if (!bytes.ok()) return bytes.status();
    v1::CreateGroupRequest request;
    request.set_name(name);
    for (int r = 0; r < world(); ++r) request.add_ranks(r);
    request.set_num_nvl_bytes(normal_nvl + bytes->first);
    request.set_num_rdma_bytes(normal_rdma + bytes->second);
    request.set_num_normal_bytes(normal_nvl);
    request.set_num_normal_rdma_bytes(normal_rdma);
    request.set_low_latency(both ||
                            std::find(scenario.begin(), scenario.end(), "--mode=low_latency") != scenario.end());
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

  // Every rank's Buffer in this process (threads as ranks) on a fresh group sized for `config`; allocators[r] (when
  // given and not null) is rank r's.
  struct InProcess {
    std::vector<std::unique_ptr<client::Client>> clients;
    std::vector<std::unique_ptr<client::Lease>> leases;
    std::vector<std::unique_ptr<client::Buffer>> buffers;
  };
  void AttachInProcess(const std::string& name, const client::BufferConfig& config, InProcess* out,
                       const std::vector<std::shared_ptr<client::Allocator>>& allocators = {}) {
    auto bytes = client::RequiredGroupBytes(config, hosts_, per_host_);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    v1::CreateGroupRequest request;
    request.set_name(name);
    for (int r = 0; r < world(); ++r) request.add_ranks(r);
    request.set_num_nvl_bytes(bytes->nvl);
    request.set_num_rdma_bytes(bytes->rdma);
    request.set_low_latency(config.low_latency);
    v1::CreateGroupResponse response;
    grpc::ClientContext context;
    ASSERT_TRUE(fabric_->Control(0)->CreateGroup(&context, request, &response).ok());
    for (int r = 0; r < world(); ++r) {
      auto connected = client::Client::Connect(fabric_->daemon(r).socket(), {.client_name = "internode_test"});
      ASSERT_TRUE(connected.ok()) << connected.status();
      auto lease = (*connected)->Attach(name, r, response.token());
      ASSERT_TRUE(lease.ok()) << lease.status();
      auto buffer = client::Buffer::Create(lease->get(), config,
                                           r < static_cast<int>(allocators.size()) ? allocators[r] : nullptr);
      ASSERT_TRUE(buffer.ok()) << buffer.status();
      out->clients.push_back(std::move(*connected));
      out->leases.push_back(std::move(*lease));
      out->buffers.push_back(std::move(*buffer));
    }
  }

  // Rank 3's worker is SIGKILLed mid-run: every survivor's wait ends within 2 s (x5 sanitizers) with UNAVAILABLE
  // naming it, every survivor resets, a new process takes rank 3, and all four finish checked rounds.
  void KillAndRejoin(const std::string& group, const std::vector<std::string>& scenario);

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

// One low-latency group that serves normal mode too (SGLang's auto mode across hosts): each round a normal round
// (dispatch, cached dispatch, combine), then a low-latency round, on two Buffers of each rank's lease, each mode in its
// own parts of both regions, every output checked; no clean-up between the modes.
std::vector<std::string> BothModes(int tokens, int hidden, int topk, int experts, bool fp8, int seed,
                                   std::vector<std::string> extra = {}) {
  std::vector<std::string> args = Scenario(tokens, hidden, topk, experts, fp8, seed, std::move(extra));
  args[0] = "--mode=both";
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
  Run("fp8-packed-ue8m0-scales", Scenario(24, 1024, 4, 16, true, 63, {"--packed_scales"}));
  Run("bad-input", Scenario(16, 128, 4, 8, false, 20, {"--bad_input"}));
  Run("ll-fp8", LowLatency(16, 256, 4, 16, true, 51));
  Run("ll-bf16", LowLatency(16, 256, 4, 16, false, 52, {"--empty_fraction=0.6"}));
  Run("ll-silent", LowLatency(16, 128, 4, 8, true, 53, {"--routing=silent", "--silent_rank=3"}));
  Run("ll-one-expert", LowLatency(16, 128, 4, 8, false, 54, {"--routing=one_expert"}));
  Run("ll-hidden-7168", LowLatency(8, 7168, 8, 32, true, 55, {"--fixed_tokens"}));
  Run("ll-bad-input", LowLatency(8, 128, 4, 8, false, 56, {"--bad_input"}));
  // The relay the cuda backend runs (BufferConfig.low_latency_relay), here on the host backend; odd rounds through
  // the receive hooks.
  Run("ll-relay-fp8", LowLatency(16, 256, 4, 16, true, 57, {"--relay", "--hooks"}));
  Run("ll-relay-bf16", LowLatency(16, 256, 4, 16, false, 58, {"--relay", "--hooks", "--empty_fraction=0.6"}));
  Run("ll-relay-silent", LowLatency(16, 128, 4, 8, true, 59, {"--relay", "--routing=silent", "--silent_rank=3"}));
  Run("ll-relay-one-expert", LowLatency(16, 128, 4, 8, false, 60, {"--relay", "--routing=one_expert"}));
  Run("ll-relay-hidden-7168", LowLatency(8, 7168, 8, 32, true, 61, {"--relay", "--fixed_tokens"}));
  Run("both-modes", BothModes(16, 256, 4, 16, false, 64));
  Run("both-modes-fp8-relay", BothModes(16, 256, 4, 16, true, 65, {"--relay", "--empty_fraction=0.4"}));
}

TEST_F(InternodeTest, ThreeHostsOfOneRank) {
  ASSERT_NO_FATAL_FAILURE(StartFabric(3, 1));
  Run("random", Scenario(32, 256, 4, 12, false, 21));
  Run("fp8", Scenario(32, 256, 4, 12, true, 22, {"--empty_fraction=0.6"}));
  Run("one-expert", Scenario(16, 128, 2, 6, false, 23, {"--routing=one_expert"}));
  Run("ll", LowLatency(16, 256, 4, 12, true, 24));
  Run("ll-relay", LowLatency(16, 256, 4, 12, true, 25, {"--relay", "--hooks"}));
}

TEST_F(InternodeTest, TwoHostsOfThreeRanks) {
  ASSERT_NO_FATAL_FAILURE(StartFabric(2, 3));
  Run("random", Scenario(24, 256, 4, 12, false, 31));
  Run("fp8-silent", Scenario(24, 256, 6, 24, true, 32, {"--routing=silent", "--silent_rank=4"}));
  Run("ll", LowLatency(16, 256, 4, 12, false, 33));
  Run("ll-relay", LowLatency(16, 256, 4, 12, false, 34, {"--relay", "--hooks", "--empty_fraction=0.4"}));
  Run("both-modes", BothModes(16, 256, 4, 12, false, 35));
}

// A one-host group forced through the internode path (RDMA stage included) gives the intranode path's bits: the
// workers compare against the intranode reference exactly.
TEST_F(InternodeTest, OneHostThroughTheInternodePathMatchesIntranodeBitForBit) {
  ASSERT_NO_FATAL_FAILURE(StartFabric(1, 2));
  Run("forced", Scenario(32, 256, 4, 8, false, 41, {"--force_internode"}));
  Run("forced-fp8", Scenario(32, 256, 4, 8, true, 42, {"--force_internode", "--empty_fraction=0.5"}));
}

bool WaitForFiles(const std::string& dir, const std::vector<std::string>& names, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (const std::string& name : names) {
    while (!std::filesystem::exists(dir + "/" + name)) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
  return true;
}

// A client killed mid-run (rank 3, host 1): its peers' calls end within 2 s, naming a rank. Its daemon publishes it as
// lost (issue #14): a wait on it ends at once with UNAVAILABLE (the RDMA stage's waits poll those bits by group
// rank, the NVLink stage's by index on the host); a survivor whose call fails (rank 1 or 2, waiting for rank 3's rows
// or in a stage with it) tells the ranks that wait for it, so rank 0's wait for them ends at once too (UNAVAILABLE,
// "left the call"), in its NVLink stage or its RDMA stage. The Buffer timeout is 10 s, so that only the loss and those
// marks can end a wait within the 2 s (x5 under sanitizers), and every survivor's error is UNAVAILABLE. Every survivor
// resets, a new process takes rank 3, and all four finish checked rounds on the group.
TEST_F(InternodeTest, AKilledClientTimesOutItsPeersAndTheRankRejoins) {
  ASSERT_NO_FATAL_FAILURE(StartFabric(2, 2));
  KillAndRejoin("kill", Scenario(32, 512, 4, 16, false, 61));  // 10 s timeout
}

// Low latency through the relay (the cuda path's, run by the host backend): the survivors mask the killed rank (their
// rounds report it: "ran with rank(s) 3 masked") within 2 s, reset, and finish checked rounds with its successor.
TEST_F(InternodeTest, AKilledClientIsMaskedByTheRelayAndTheRankRejoins) {
  ASSERT_NO_FATAL_FAILURE(StartFabric(2, 2));
  KillAndRejoin("kill-ll", LowLatency(16, 256, 4, 16, true, 62, {"--relay", "--hooks"}));
}

void InternodeTest::KillAndRejoin(const std::string& group, const std::vector<std::string>& scenario) {
  constexpr int kVictim = 3;
  const std::string dir = ::testing::TempDir() + "/internode-" + group + "-" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto token = CreateGroup(group, scenario);
  ASSERT_TRUE(token.ok()) << token.status();
  auto start = [&](int r, std::vector<std::string> extra) {
    std::vector<std::string> argv = {WorkerBinary(), "--socket=" + fabric_->daemon(r).socket(), "--group=" + group,
                                     absl::StrCat("--rank=", r), "--token=" + *token};
    argv.insert(argv.end(), scenario.begin(), scenario.end());
    argv.insert(argv.end(), extra.begin(), extra.end());
    return Subprocess::Start(argv);
  };
  std::vector<Subprocess> workers;
  for (int r = 0; r < world(); ++r) {
    auto worker = start(r, {"--until_timeout", "--recover_dir=" + dir, "--max_seconds=60"});
    ASSERT_TRUE(worker.ok()) << worker.status();
    workers.push_back(std::move(*worker));
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  for (Subprocess& worker : workers) {
    while (worker.Stdout().find(" running") == std::string::npos && worker.running() && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  absl::SleepFor(absl::Milliseconds(100));
  ASSERT_TRUE(workers[kVictim].running()) << workers[kVictim].Stdout() << workers[kVictim].Stderr();
  workers[kVictim].Signal(SIGKILL);
  // From its exit: the kernel closes a killed process' sockets (how its daemon learns of the death) only after
  // unmapping its memory, which took over a second on a loaded 2-core machine (docs/reliability.md).
  ASSERT_TRUE(workers[kVictim].Wait(absl::Seconds(10)).ok());
  const absl::Time killed = absl::Now();
  ASSERT_TRUE(WaitForFiles(dir, {"timedout.0", "timedout.1", "timedout.2"}, absl::Seconds(15)))
      << "survivors did not time out:\n"
      << workers[0].Stdout() << workers[1].Stdout() << workers[2].Stdout();
  const double detect_ms = absl::ToDoubleMilliseconds(absl::Now() - killed);
  std::cout << "survivors timed out within " << detect_ms << " ms of the kill\n";
  EXPECT_LT(detect_ms, 2000 * kSanitizerSlowdown);
  bool named_victim = false;
  for (int r = 0; r < kVictim; ++r) {
    const std::string out = workers[r].Stdout();
    const size_t at = out.find(absl::StrCat("EPF_EVENT rank=", r, " timeout "));
    ASSERT_NE(at, std::string::npos) << out;
    const std::string event = out.substr(at, out.find('\n', at) - at);
    std::cout << event << "\n";
    EXPECT_THAT(event, HasSubstr("UNAVAILABLE")) << "a survivor waited out its timeout";
    EXPECT_TRUE(absl::StrContains(event, "rank ") || absl::StrContains(event, "rank(s) ")) << "names no rank";
    // As lost: by group rank, or in its host's NVLink stage by its index there (1; host ranks start at group rank 2).
    const bool named = absl::StrContains(event, "rank 3 is lost") || absl::StrContains(event, "rank(s) 3 masked") ||
                       (absl::StrContains(event, "group rank 2 + i") && absl::StrContains(event, "rank 1 is lost"));
    named_victim = named_victim || named || absl::StrContains(event, "from rank 3");
  }
  EXPECT_TRUE(named_victim) << "no survivor named the killed rank";

  std::ofstream(dir + "/reset").put('\n');
  ASSERT_TRUE(WaitForFiles(dir, {"reset.0", "reset.1", "reset.2"}, absl::Seconds(15)));
  auto fresh = start(kVictim, {"--reset_first", "--recover_dir=" + dir});
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  ASSERT_TRUE(WaitForFiles(dir, {"ready.3"}, absl::Seconds(15))) << fresh->Stdout() << fresh->Stderr();
  std::ofstream(dir + "/go").put('\n');
  for (int r = 0; r < world(); ++r) {
    Subprocess& w = r == kVictim ? *fresh : workers[r];
    auto code = w.Wait(absl::Seconds(60));
    ASSERT_TRUE(code.ok()) << "rank " << r << ": " << code.status();
    EXPECT_EQ(*code, 0) << "rank " << r << ":\n" << w.Stdout() << w.Stderr();
    EXPECT_THAT(w.Stdout(), HasSubstr(" ok=1 ")) << w.Stderr();
  }
  std::filesystem::remove_all(dir);
}

// An allocator that refuses every request once armed: a dispatch that fails inside the internode path on one rank.
class RefusingAllocator final : public client::Allocator {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes, cudaStream_t stream) override {
    if (armed) return absl::ResourceExhaustedError("refused by the test");
    return base_->Allocate(bytes, stream);
  }
  void Free(void* ptr, cudaStream_t stream) override { base_->Free(ptr, stream); }
  std::atomic<bool> armed{false};

 private:
  std::shared_ptr<client::Allocator> base_ = client::DefaultAllocator(v1::BACKEND_HOST);
};

// A rank whose dispatch fails before it sent its rows (its allocator refuses: the same path as a lost rank's peer, bad
// peer data or a broken transport) tells the ranks on other hosts that wait for it: their wait ends at once with
// UNAVAILABLE naming it, not at their 10 s timeout. After both reset, the group dispatches and combines correctly. A
// call that every rank refuses (bad arguments) tells nobody: the next round works without a reset.
TEST_F(InternodeTest, ARankWhoseDispatchFailsTellsThePeersThatWaitForIt) {
  ASSERT_NO_FATAL_FAILURE(StartFabric(2, 1));
  const client::BufferConfig config{.max_tokens_per_rank = 16,
                                    .hidden = 256,
                                    .max_topk = 2,
                                    .num_experts = 4,
                                    .num_sms = 2,
                                    .timeout = absl::Seconds(10)};
  auto refusing = std::make_shared<RefusingAllocator>();
  InProcess group;
  ASSERT_NO_FATAL_FAILURE(AttachInProcess("leave", config, &group, {nullptr, refusing}));
  std::vector<std::unique_ptr<client::Buffer>>& buffers = group.buffers;
  // Fresh random rows in [1, 2) (bf16: exponent 0, random mantissa), each token to two distinct random experts of 4:
  // both ranks (2 experts each) or one of them.
  const unsigned seed = std::random_device()();
  std::cout << "seed " << seed << "\n";
  std::mt19937 random(seed);
  constexpr int kTokens = 8;
  std::vector<uint16_t> x(kTokens * 256);
  for (uint16_t& v : x) v = static_cast<uint16_t>(0x3f80 | (random() & 0x7f));
  std::vector<int64_t> idx(kTokens * 2);
  for (int t = 0; t < kTokens; ++t) {
    idx[2 * t] = random() % 4;
    idx[2 * t + 1] = (idx[2 * t] + 1 + random() % 3) % 4;
  }
  const client::TensorView x_view{x.data(), kernels::DType::kBF16, {kTokens, 256}};
  const client::TensorView idx_view{idx.data(), kernels::DType::kInt64, {kTokens, 2}};
  // One round on both ranks. kRefused: a dispatch without topk_idx, which every rank refuses. kFailing: rank 1's
  // allocator refuses its dispatch's memory. kChecked: dispatch, then combine the received rows unchanged, which sums
  // a token once per rank that received it: x * (1 or 2), exact in bf16.
  // kWorst: kChecked with num_worst_tokens (outputs of 2 * kTokens rows; rows past the received ones are padding with
  // top-k -1).
  enum class Round { kRefused, kFailing, kChecked, kWorst };
  std::vector<absl::Status> status(2);
  std::vector<double> took_ms(2);
  auto run = [&](Round kind) {
    std::vector<std::vector<uint16_t>> combined(2);
    auto rank = [&](int r) -> absl::Status {
      if (r == 1) refusing->armed = false;
      auto layout = buffers[r]->GetDispatchLayout(idx_view);
      if (!layout.ok()) return layout.status();
      if (r == 1) refusing->armed = kind == Round::kFailing;
      client::DispatchArgs args{.x = x_view, .topk_idx = idx_view, .layout = &*layout};
      if (kind == Round::kRefused) args.topk_idx = {};
      if (kind == Round::kWorst) args.num_worst_tokens = 2 * kTokens;
      auto recv = buffers[r]->Dispatch(args);
      if (!recv.ok() || (kind != Round::kChecked && kind != Round::kWorst)) return recv.status();
      if (kind == Round::kWorst) {
        // Both ranks send the same tokens: this rank receives each token with an expert here once from each.
        int received = 0;
        for (int t = 0; t < kTokens; ++t) received += (idx[2 * t] / 2 == r || idx[2 * t + 1] / 2 == r) ? 2 : 0;
        if (recv->recv_x.view.shape[0] != 2 * kTokens || recv->recv_topk_idx.view.shape[0] != 2 * kTokens) {
          return absl::InternalError(absl::StrCat("worst-case outputs have ", recv->recv_x.view.shape[0], " rows"));
        }
        const auto* recv_idx = static_cast<const int64_t*>(recv->recv_topk_idx.view.data);
        for (int row = 0; row < 2 * kTokens; ++row) {
          const bool padding = recv_idx[2 * row] == -1 && recv_idx[2 * row + 1] == -1;
          if (padding != (row >= received)) {
            return absl::InternalError(absl::StrCat("row ", row, " of ", received, " received: recv_topk_idx ",
                                                    recv_idx[2 * row], ",", recv_idx[2 * row + 1]));
          }
        }
      }
      auto out = buffers[r]->Combine({.x = recv->recv_x.view, .handle = recv->handle});
      if (!out.ok()) return out.status();
      const auto* rows = static_cast<const uint16_t*>(out->combined_x.view.data);
      combined[r].assign(rows, rows + x.size());
      return absl::OkStatus();
    };
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        const absl::Time start = absl::Now();
        status[r] = rank(r);
        took_ms[r] = absl::ToDoubleMilliseconds(absl::Now() - start);
      });
    }
    for (std::thread& t : threads) t.join();
    if (kind != Round::kChecked && kind != Round::kWorst) return;
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r] << " (rank " << 1 - r << ": " << status[1 - r]
                                  << ")";
      for (int t = 0; t < kTokens; ++t) {
        const int ranks = idx[2 * t] / 2 == idx[2 * t + 1] / 2 ? 1 : 2;
        for (int h = 0; h < 256; ++h) {
          const uint16_t want = ranks == 1 ? x[t * 256 + h] : static_cast<uint16_t>(x[t * 256 + h] + 0x80);
          ASSERT_EQ(combined[r][t * 256 + h], want) << "rank " << r << " token " << t << " column " << h;
        }
      }
    }
  };

  // A call every rank refuses tells nobody: the group is as it was, the next round is correct.
  run(Round::kRefused);
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(absl::IsInvalidArgument(status[r])) << "rank " << r << ": " << status[r];
  ASSERT_NO_FATAL_FAILURE(run(Round::kChecked));

  run(Round::kFailing);
  EXPECT_TRUE(absl::IsResourceExhausted(status[1])) << status[1];
  EXPECT_TRUE(absl::IsUnavailable(status[0])) << status[0];
  EXPECT_THAT(std::string(status[0].message()), HasSubstr("from rank 1 (host 1): rank 1 left the call"));
  EXPECT_LT(took_ms[0], 2000) << "rank 0 waited for its timeout";

  for (auto& buffer : buffers) ASSERT_TRUE(buffer->Reset().ok());
  ASSERT_NO_FATAL_FAILURE(run(Round::kChecked));
  // num_worst_tokens across hosts: DeepEP's output shapes (the host still waits for the RDMA stage).
  ASSERT_NO_FATAL_FAILURE(run(Round::kWorst));
}

// A host's daemon killed mid-run: the transport to it breaks, so the rank that sends to it fails at once
// (UNAVAILABLE naming it) instead of waiting out its timeout; every other call ends within its own bound.
TEST_F(InternodeTest, AKilledDaemonFailsTheCallsThatNeedItAtOnce) {
  ASSERT_NO_FATAL_FAILURE(StartFabric(2, 2));
  const std::vector<std::string> scenario = Scenario(32, 512, 4, 16, false, 71, {"--timeout_ms=3000"});
  auto token = CreateGroup("daemon-kill", scenario);
  ASSERT_TRUE(token.ok()) << token.status();
  std::vector<Subprocess> workers;
  for (int r = 0; r < world(); ++r) {
    std::vector<std::string> argv = {WorkerBinary(),        "--socket=" + fabric_->daemon(r).socket(),
                                     "--group=daemon-kill", absl::StrCat("--rank=", r),
                                     "--token=" + *token,   "--until_timeout",
                                     "--max_seconds=60"};
    argv.insert(argv.end(), scenario.begin(), scenario.end());
    auto worker = Subprocess::Start(argv);
    ASSERT_TRUE(worker.ok()) << worker.status();
    workers.push_back(std::move(*worker));
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  for (Subprocess& worker : workers) {
    while (worker.Stdout().find(" running") == std::string::npos && worker.running() && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  absl::SleepFor(absl::Milliseconds(100));
  fabric_->Kill(3);  // returns once the daemon exited (see the client kill above)
  const absl::Time killed = absl::Now();
  // Rank 1 is rank 3's gateway and sends to it every call.
  auto code = workers[1].Wait(absl::Seconds(10));
  const double ms = absl::ToDoubleMilliseconds(absl::Now() - killed);
  ASSERT_TRUE(code.ok()) << "rank 1 did not finish";
  std::cout << "rank 1 ended " << ms << " ms after the kill: " << workers[1].Stdout() << "\n";
  EXPECT_LT(ms, 2000);
  EXPECT_THAT(workers[1].Stdout(), HasSubstr("UNAVAILABLE"));
  EXPECT_THAT(workers[1].Stdout(), HasSubstr("rank 3"));
  for (int r : {0, 2, 3}) {
    auto ended = workers[r].Wait(absl::Seconds(20));
    EXPECT_TRUE(ended.ok()) << "rank " << r << " hangs: " << workers[r].Stdout();
    if (!ended.ok()) workers[r].Signal(SIGKILL);
  }
}

// Low latency through the relay with a rank that never calls: the other rank's host-side wait ends at its deadline
// (once, not twice: the kernel then runs without the silent rank), the call fails with DEADLINE_EXCEEDED naming it, and
// the rank stays masked for later calls, as a kernel's timed-out wait would leave it.
TEST_F(InternodeTest, TheRelayMasksARankThatStaysSilent) {
  ASSERT_NO_FATAL_FAILURE(StartFabric(2, 1));
  const client::BufferConfig config{.max_tokens_per_rank = 8,
                                    .hidden = 128,
                                    .max_topk = 2,
                                    .num_experts = 4,
                                    .low_latency = true,
                                    .timeout = absl::Milliseconds(500),
                                    .low_latency_relay = true};
  InProcess group;
  ASSERT_NO_FATAL_FAILURE(AttachInProcess("silent", config, &group));
  std::vector<uint16_t> x(4 * 128, 0x3f80);
  std::vector<int64_t> idx = {0, 2, 1, 3, 2, 0, 3, 1};  // every token to both ranks
  const client::TensorView x_view{x.data(), kernels::DType::kBF16, {4, 128}};
  const client::TensorView idx_view{idx.data(), kernels::DType::kInt64, {4, 2}};
  const absl::Time start = absl::Now();
  auto recv = group.buffers[0]->LowLatencyDispatch({.x = x_view, .topk_idx = idx_view, .use_fp8 = false});
  const double took_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  ASSERT_FALSE(recv.ok());
  EXPECT_TRUE(absl::IsDeadlineExceeded(recv.status())) << recv.status();
  EXPECT_THAT(std::string(recv.status().message()), HasSubstr("from rank 1"));
  EXPECT_GE(took_ms, 450);
  EXPECT_LT(took_ms, 950 * kSanitizerSlowdown) << "the wait ran twice";
  const client::TensorView mask = group.buffers[0]->LowLatencyRankMask();
  ASSERT_EQ(mask.shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(static_cast<const int32_t*>(mask.data)[1], 1) << "rank 1 is not masked";
}

// Who issues low latency's puts across hosts (decision 84): the lease reports its daemon's wire, and the device-side
// issuer is refused on the host backend with a message that says why, before anything is set up.
TEST_F(InternodeTest, TheLowLatencyIssuerFollowsTheWireAndNeedsCudaToIssueFromTheDevice) {
  ASSERT_NO_FATAL_FAILURE(StartFabric(2, 1));
  client::BufferConfig config{.max_tokens_per_rank = 8,
                              .hidden = 128,
                              .max_topk = 2,
                              .num_experts = 4,
                              .low_latency = true,
                              .timeout = absl::Seconds(5)};
  InProcess group;
  ASSERT_NO_FATAL_FAILURE(AttachInProcess("issuer", config, &group));  // kAuto: the host backend's own sends
  for (const auto& lease : group.leases) EXPECT_EQ(lease->transport(), v1::TRANSPORT_SOCKET);
  group.buffers.clear();
  config.low_latency_issue = client::BufferConfig::LowLatencyIssue::kDevice;
  auto refused = client::Buffer::Create(group.leases[0].get(), config);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("needs a cuda group"));
  // The environment's choice is for cuda groups; the host backend has none to make.
  setenv("EPF_LOW_LATENCY_ISSUE", "device", 1);
  config.low_latency_issue = client::BufferConfig::LowLatencyIssue::kAuto;
  auto created = client::Buffer::Create(group.leases[0].get(), config);
  unsetenv("EPF_LOW_LATENCY_ISSUE");
  EXPECT_TRUE(created.ok()) << created.status();
}

}  // namespace
}  // namespace epfabric::testing
