// One tenant cannot starve another group's commands on a shared daemon (issue #34, Medium 6). The audit's attack:
// one tenant posts large local puts (a member's region into itself) on every channel, and another group's 8-byte
// signal waited up to 26.8 s, because the proxy thread that served both rings made the copies itself, 64 commands
// of a ring per sweep. Now large local copies run on the daemon's copier, a chunk at a time round robin across
// channels, and the proxy threads only queue them: the other group's signal completes within 10 ms at the median.
// Host backend, one daemon, two epfabric_transport_worker processes (tools/transport_worker/fairness_scenario.h).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "integration/fabric_under_test.h"
#include "integration/subprocess.h"

namespace epfabric::testing {
namespace {

const char* WorkerBinary() {
  const char* env = std::getenv("EPF_TRANSPORT_WORKER_BINARY");
  return env != nullptr && *env != '\0' ? env : EPF_TRANSPORT_WORKER_BINARY;
}

constexpr uint64_t kFloodBytes = 64ull << 20;

// `key`=<number> from a worker's `prefix` line, or -1.
double Field(const std::string& out, const std::string& prefix, const std::string& key) {
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (!absl::StartsWith(line, prefix)) continue;
    for (absl::string_view word : absl::StrSplit(line, ' ')) {
      double value = 0;
      if (absl::ConsumePrefix(&word, key + "=") && absl::SimpleAtod(word, &value)) return value;
    }
  }
  return -1;
}

class Fairness : public ::testing::Test {
 protected:
  void SetUp() override {
    auto fabric = FabricUnderTest::Start(1, {"--transport=socket"});
    ASSERT_TRUE(fabric.ok()) << fabric.status();
    fabric_ = std::move(*fabric);
    ASSERT_TRUE(fabric_->WaitComplete().ok());
  }

  std::string CreateGroup(const std::string& name, uint64_t rdma_bytes, uint32_t channels) {
    v1::CreateGroupRequest request;
    request.set_name(name);
    request.add_ranks(0);
    request.set_num_nvl_bytes(4096);
    request.set_num_rdma_bytes(rdma_bytes);
    request.set_transport_channels(channels);
    v1::CreateGroupResponse response;
    grpc::ClientContext context;
    const grpc::Status status = fabric_->Control(0)->CreateGroup(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.token();
  }

  absl::StatusOr<Subprocess> Worker(const std::string& group, const std::string& token,
                                    const std::vector<std::string>& args) {
    std::vector<std::string> argv = {WorkerBinary(),     "--socket=" + fabric_->daemon(0).socket(),
                                     "--group=" + group, "--rank=0",
                                     "--token=" + token, "--timeout_ms=60000"};
    argv.insert(argv.end(), args.begin(), args.end());
    return Subprocess::Start(argv);
  }

  std::unique_ptr<FabricUnderTest> fabric_;
};

TEST_F(Fairness, AnotherGroupsSignalIsNotStarvedByLargeLocalPuts) {
  const std::string flood_token = CreateGroup("flood", 2 * kFloodBytes, 4);
  const std::string quiet_token = CreateGroup("quiet", 1 << 20, 1);
  auto flood = Worker("flood", flood_token,
                      {"--scenario=flood", absl::StrCat("--flood_bytes=", kFloodBytes), "--duration_ms=30000"});
  ASSERT_TRUE(flood.ok()) << flood.status();
  // The flood is on once its first batch is posted.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!absl::StrContains(flood->Stdout(), "EPF_FLOODING") && flood->running() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(absl::StrContains(flood->Stdout(), "EPF_FLOODING")) << flood->Stdout() << flood->Stderr();
  absl::SleepFor(absl::Milliseconds(300));
  auto signals = Worker("quiet", quiet_token, {"--scenario=signals", "--signals=100", "--signal_gap_ms=5"});
  ASSERT_TRUE(signals.ok()) << signals.status();
  auto code = signals->Wait(absl::Seconds(120));
  ASSERT_TRUE(code.ok()) << code.status();
  const bool flooding = flood->running();
  flood->Signal(SIGKILL);
  (void)flood->Wait(absl::Seconds(10));
  std::cout << signals->Stdout();
  ASSERT_EQ(*code, 0) << signals->Stdout() << signals->Stderr();
  EXPECT_TRUE(flooding) << "the flood ended before the signals did: nothing was measured under it\n"
                        << flood->Stdout() << flood->Stderr();
  const double median_us = Field(signals->Stdout(), "EPF_LATENCY", "median_us");
  const double max_us = Field(signals->Stdout(), "EPF_LATENCY", "max_us");
  ASSERT_GE(median_us, 0) << signals->Stdout();
  // The goal is 10 ms at the median and 50 ms at worst (bench it on an idle machine); the worst case here is allowed
  // more because CI runs this on two loaded cores, where a process can wait that long for a core. The unfair proxy
  // made the median hundreds of milliseconds (each sweep copied 2 GiB).
  EXPECT_LT(median_us, 10'000) << signals->Stdout();
  EXPECT_LT(max_us, 250'000) << signals->Stdout();
}

}  // namespace
}  // namespace epfabric::testing
