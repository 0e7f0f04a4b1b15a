// The fixture of the internode tests (internode_test.cc: worker processes per rank; internode_in_process_test.cc:
// Buffers driven from the test process): real epfabricd daemons (host backend) acting as several hosts (--host_id),
// the transport on its socket wire.
#pragma once

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

inline const char* WorkerBinary() {
  const char* env = std::getenv("EPF_WORKER_BINARY");
  return env != nullptr && *env != '\0' ? env : EPF_WORKER_BINARY;
}

inline std::string TransportFlag() {
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
    std::vector<std::string> fabric_flags = DataPathHeartbeatFlags();
    fabric_flags.push_back(TransportFlag());
    auto fabric = FabricUnderTest::Start(hosts * per_host, fabric_flags, flags);
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
      EXPECT_THAT(workers[r].Stdout(), ::testing::HasSubstr(" ok=1 ")) << workers[r].Stderr();
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

// The workers' Buffer timeout: 10 s, x5 under sanitizers. A wait that a fault ends (a kill, a lost daemon) must end
// well within it (the tests check 2 s, x5 under sanitizers); a slow CI machine under ASan with 12 daemons and 12
// workers on 2 cores took more than 10 s for one relayed round's wait, with nothing lost.
inline std::string WorkerTimeoutFlag() {
  return absl::StrCat("--timeout_ms=", static_cast<int>(10000 * kSanitizerSlowdown));
}

// Worker arguments of a scenario (epfabric_worker's flags): low latency, normal (with a cached dispatch), both modes.
inline std::vector<std::string> LowLatency(int tokens, int hidden, int topk, int experts, bool fp8, int seed,
                                           std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--mode=low_latency",
                                   absl::StrCat("--tokens=", tokens),
                                   absl::StrCat("--hidden=", hidden),
                                   absl::StrCat("--topk=", topk),
                                   absl::StrCat("--experts=", experts),
                                   absl::StrCat("--seed=", seed),
                                   "--repeats=4",
                                   WorkerTimeoutFlag()};
  if (fp8) args.push_back("--fp8");
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

inline std::vector<std::string> Scenario(int tokens, int hidden, int topk, int experts, bool fp8, int seed,
                                         std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--mode=normal",
                                   absl::StrCat("--tokens=", tokens),
                                   absl::StrCat("--hidden=", hidden),
                                   absl::StrCat("--topk=", topk),
                                   absl::StrCat("--experts=", experts),
                                   absl::StrCat("--seed=", seed),
                                   "--repeats=3",
                                   "--cached",
                                   WorkerTimeoutFlag()};
  if (fp8) args.push_back("--fp8");
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// One low-latency group that serves normal mode too (SGLang's auto mode across hosts): each round a normal round
// (dispatch, cached dispatch, combine), then a low-latency round, on two Buffers of each rank's lease, each mode in its
// own parts of both regions, every output checked; no clean-up between the modes.
inline std::vector<std::string> BothModes(int tokens, int hidden, int topk, int experts, bool fp8, int seed,
                                          std::vector<std::string> extra = {}) {
  std::vector<std::string> args = Scenario(tokens, hidden, topk, experts, fp8, seed, std::move(extra));
  args[0] = "--mode=both";
  return args;
}

}  // namespace epfabric::testing
