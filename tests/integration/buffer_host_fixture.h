// The fixture of the Buffer tests on the host backend (buffer_host_test.cc: checked cases;
// buffer_host_failures_test.cc: bad input, timeouts, recovery): real daemons (a 2-rank and a 4-rank fabric), one Client
// + Lease + Buffer per rank, each rank on its own thread (the host backend runs on the calling thread and waits on its
// peers).
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "epfabric/client/buffer.h"
#include "epfabric/client/client.h"
#include "integration/buffer_test_cases.h"
#include "integration/fabric_under_test.h"

namespace epfabric::testing {

using client::Buffer;
using client::BufferConfig;
using client::Client;
using client::Lease;
using client::TensorView;
using kernels::DType;

// A fresh seed per run (printed, so a failure can be replayed with EPF_SEED).
inline uint64_t Seed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("EPF_SEED");
    const uint64_t s = env != nullptr ? std::strtoull(env, nullptr, 10) : std::random_device{}();
    std::printf("buffer_host_test seed: %llu (EPF_SEED to replay)\n", static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

template <typename T>
inline TensorView View(const std::vector<T>& v, DType dtype, std::vector<int64_t> shape) {
  return TensorView{const_cast<T*>(v.data()), dtype, std::move(shape)};
}

// One group on a running fabric: a lease and a Buffer per rank.
struct Ranks {
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<std::unique_ptr<Lease>> leases;
  std::vector<std::unique_ptr<Buffer>> buffers;
  std::string token;  // the group's
};

class BufferHostTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    for (int n : {2, 4}) {
      auto fabric = FabricUnderTest::Start(n);
      ASSERT_TRUE(fabric.ok()) << fabric.status();
      ASSERT_TRUE((*fabric)->WaitComplete().ok());
      fabrics_[n] = std::move(*fabric);
    }
  }
  static void TearDownTestSuite() { fabrics_.clear(); }

  static absl::StatusOr<v1::CreateGroupResponse> CreateGroup(int n, uint64_t nvl_bytes, bool low_latency,
                                                             uint64_t num_normal_bytes = 0) {
    static int counter = 0;
    v1::CreateGroupRequest request;
    request.set_name(absl::StrCat("buf", n, "_", counter++));
    for (int r = 0; r < n; ++r) request.add_ranks(r);
    request.set_num_nvl_bytes(nvl_bytes);
    request.set_low_latency(low_latency);
    request.set_num_normal_bytes(num_normal_bytes);
    grpc::ClientContext context;
    v1::CreateGroupResponse response;
    const grpc::Status status = fabrics_[n]->Control(0)->CreateGroup(&context, request, &response);
    if (!status.ok()) return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
    return response;
  }

  // A group sized with RequiredRegionBytes, attached on every rank, with a Buffer each.
  static void MakeRanks(int n, const BufferConfig& config, Ranks* ranks) {
    ASSERT_TRUE(fabrics_.count(n) == 1 && fabrics_[n] != nullptr) << "the " << n << "-rank fabric did not start";
    auto bytes = client::RequiredRegionBytes(config, n);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    auto group = CreateGroup(n, *bytes, config.low_latency);
    ASSERT_TRUE(group.ok()) << group.status();
    ranks->token = group->token();
    for (int r = 0; r < n; ++r) {
      auto connected = Client::Connect(fabrics_[n]->daemon(r).socket(), {.client_name = "buffer_host_test"});
      ASSERT_TRUE(connected.ok()) << connected.status();
      auto lease = (*connected)->Attach(group->group().name(), r, group->token());
      ASSERT_TRUE(lease.ok()) << lease.status();
      auto buffer = Buffer::Create(lease->get(), config);
      ASSERT_TRUE(buffer.ok()) << buffer.status();
      EXPECT_EQ((*buffer)->rank(), r);
      EXPECT_EQ((*buffer)->num_ranks(), n);
      ranks->clients.push_back(std::move(*connected));
      ranks->leases.push_back(std::move(*lease));
      ranks->buffers.push_back(std::move(*buffer));
    }
  }

  static inline std::map<int, std::unique_ptr<FabricUnderTest>> fabrics_;
};

inline BufferConfig NormalConfig(int hidden, int max_tokens = 96, int num_experts = 16, int max_topk = 8) {
  return BufferConfig{.max_tokens_per_rank = max_tokens,
                      .hidden = hidden,
                      .max_topk = max_topk,
                      .num_experts = num_experts,
                      .num_sms = 3,
                      .low_latency = false,
                      .timeout = absl::Seconds(10)};
}

inline hbt::IntranodeCase CaseFor(const BufferConfig& config, std::vector<int> num_tokens, uint64_t salt) {
  hbt::IntranodeCase c;
  c.num_tokens = std::move(num_tokens);
  c.hidden = config.hidden;
  c.num_topk = 4;
  c.num_experts = config.num_experts;
  c.num_channels = config.num_sms;
  c.seed = Seed() * 1000003 + salt;
  return c;
}

inline void RunNormalCases(Ranks& ranks, const std::vector<hbt::IntranodeCase>& cases, int num_worst_tokens = 0) {
  for (const hbt::IntranodeCase& c : cases) {
    SCOPED_TRACE(absl::StrCat("case: tokens ", absl::StrJoin(c.num_tokens, ","), " hidden ", c.hidden, " fp8 ", c.fp8,
                              " topk mode ", static_cast<int>(c.topk), " bias ", c.bias));
    const hbt::IntranodeExpected x = hbt::MakeIntranodeExpected(c);
    const int n = static_cast<int>(ranks.buffers.size());
    std::vector<hbt::Mismatches> found(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        HostTestMemory memory;
        RunNormalCase(memory, r, *ranks.buffers[r], x, &found[r], nullptr, num_worst_tokens);
      });
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < n; ++r) EXPECT_TRUE(found[r].empty()) << "rank " << r << ":\n" << found[r].str();
  }
}

inline BufferConfig LowLatencyConfig(int hidden, int max_tokens, int num_experts) {
  return BufferConfig{.max_tokens_per_rank = max_tokens,
                      .hidden = hidden,
                      .max_topk = 8,
                      .num_experts = num_experts,
                      .low_latency = true,
                      .timeout = absl::Seconds(10)};
}

inline void RunLowLatencyCases(Ranks& ranks, const std::vector<hbt::LowLatencyCase>& cases) {
  for (const hbt::LowLatencyCase& c : cases) {
    SCOPED_TRACE(absl::StrCat("case: hidden ", c.hidden, " fp8 ", c.fp8, " round ", c.round_scale, " ue8m0 ", c.ue8m0,
                              " hook ", c.hook, " zero copy ", c.zero_copy, " iterations ", c.iterations));
    const std::vector<hbt::LowLatencyIteration> its = hbt::MakeLowLatencyExpected(c);
    const int n = static_cast<int>(ranks.buffers.size());
    std::vector<hbt::Mismatches> found(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        HostTestMemory memory;
        RunLowLatencyIterations(memory, r, *ranks.buffers[r], c, its, &found[r]);
      });
    }
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < n; ++r) EXPECT_TRUE(found[r].empty()) << "rank " << r << ":\n" << found[r].str();
  }
}

inline hbt::LowLatencyCase LowLatencyCaseFor(const BufferConfig& config, int num_ranks, uint64_t salt) {
  hbt::LowLatencyCase c;
  c.num_ranks = num_ranks;
  c.max_tokens = config.max_tokens_per_rank;
  c.hidden = config.hidden;
  c.num_experts = config.num_experts;
  c.num_topk = 4;
  c.seed = Seed() * 7919 + salt;
  return c;
}

}  // namespace epfabric::testing
