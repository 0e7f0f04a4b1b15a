// The Buffer API on the host backend against real daemons, checked cases: every output is compared element by element
// with the host references (kernels/host/*_reference) on fresh random inputs. Fixture: buffer_host_fixture.h; bad
// input, timeouts and recovery: buffer_host_failures_test.cc (the same binary).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "integration/buffer_host_fixture.h"

namespace epfabric::testing {
namespace {

TEST_F(BufferHostTest, NormalTwoRanksBf16AndFp8WithAndWithoutTopk) {
  const BufferConfig config = NormalConfig(256);
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(MakeRanks(2, config, &ranks));
  std::vector<hbt::IntranodeCase> cases;
  uint64_t salt = 0;
  for (bool fp8 : {false, true}) {
    for (hbt::TopkMode mode : {hbt::TopkMode::kIdsAndWeights, hbt::TopkMode::kIdsOnly, hbt::TopkMode::kNone}) {
      hbt::IntranodeCase c = CaseFor(config, {96, 61}, ++salt);
      c.fp8 = fp8;
      c.topk = mode;
      c.bias = mode == hbt::TopkMode::kIdsAndWeights;
      cases.push_back(c);
    }
  }
  // A small hidden (128, fp8 needs a multiple of 128), expert alignment, biases without weights.
  hbt::IntranodeCase small = CaseFor(config, {40, 33}, ++salt);
  small.hidden = 128;
  small.fp8 = true;
  small.expert_alignment = 4;
  cases.push_back(small);
  hbt::IntranodeCase bias_only = CaseFor(config, {17, 70}, ++salt);
  bias_only.topk = hbt::TopkMode::kIdsOnly;
  bias_only.bias = true;
  cases.push_back(bias_only);
  RunNormalCases(ranks, cases);
}

TEST_F(BufferHostTest, NormalFourRanksEdgeCases) {
  const BufferConfig config = NormalConfig(7168, 48);
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(MakeRanks(4, config, &ranks));
  std::vector<hbt::IntranodeCase> cases;
  uint64_t salt = 100;
  // Hidden 7168, bf16 and fp8, a rank with 0 tokens.
  hbt::IntranodeCase wide = CaseFor(config, {48, 0, 31, 12}, ++salt);
  wide.bias = true;
  cases.push_back(wide);
  hbt::IntranodeCase wide_fp8 = CaseFor(config, {20, 48, 0, 5}, ++salt);
  wide_fp8.fp8 = true;
  cases.push_back(wide_fp8);
  // DeepEP's packed UE8M0 int32 scales (hidden / 512 words per token), returned in kind.
  hbt::IntranodeCase packed = CaseFor(config, {33, 7, 48, 0}, ++salt);
  packed.hidden = 1536;
  packed.fp8 = true;
  packed.packed_scales = true;
  cases.push_back(packed);
  // Every token to expert 0 (rank 0 receives everything), the rest of each row -1.
  hbt::IntranodeCase one_expert = CaseFor(config, {48, 48, 48, 48}, ++salt);
  one_expert.hidden = 512;
  one_expert.routing.all_to_one_expert = true;
  cases.push_back(one_expert);
  // Many -1 entries and a rank whose tokens go nowhere.
  hbt::IntranodeCase sparse = CaseFor(config, {30, 30, 30, 30}, ++salt);
  sparse.hidden = 1024;
  sparse.routing.empty_fraction = 0.6;
  sparse.routing.silent_rank = 2;
  cases.push_back(sparse);
  // Nobody sends anything.
  hbt::IntranodeCase empty = CaseFor(config, {0, 0, 0, 0}, ++salt);
  empty.hidden = 256;
  cases.push_back(empty);
  RunNormalCases(ranks, cases);
}

// A long sequence of random shapes on one group: every call's outputs checked, the Buffer reused throughout.
TEST_F(BufferHostTest, NormalRandomSequence) {
  const BufferConfig config = NormalConfig(1024, 64, 32, 8);
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(MakeRanks(2, config, &ranks));
  std::mt19937_64 rng(Seed() + 77);
  std::vector<hbt::IntranodeCase> cases;
  for (int i = 0; i < 16; ++i) {
    hbt::IntranodeCase c = CaseFor(config, {static_cast<int>(rng() % 65), static_cast<int>(rng() % 65)}, 200 + i);
    c.fp8 = rng() % 2 == 0;
    c.hidden = 128 * static_cast<int>(1 + rng() % 8);
    c.num_topk = static_cast<int>(1 + rng() % 8);
    c.topk = static_cast<hbt::TopkMode>(rng() % 3);
    c.bias = rng() % 2 == 0;
    c.expert_alignment = 1 + static_cast<int>(rng() % 4);
    c.routing.empty_fraction = (rng() % 5) * 0.1;
    cases.push_back(c);
  }
  RunNormalCases(ranks, cases);
}

// num_worst_tokens: no wait for the count, outputs of exactly that many rows (the most a rank can receive, and more),
// combine through the worst-case handle. Too few rows: the receiving rank moves nothing (ResourceExhausted), its peer
// times out naming it, and after Reset the group works.
TEST_F(BufferHostTest, NormalWorstCaseTokens) {
  BufferConfig config = NormalConfig(256, 48);
  config.timeout = absl::Seconds(1);
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(MakeRanks(2, config, &ranks));
  hbt::IntranodeCase bias = CaseFor(config, {48, 31}, 950);
  bias.bias = true;
  hbt::IntranodeCase fp8 = CaseFor(config, {20, 48}, 951);
  fp8.fp8 = true;
  fp8.topk = hbt::TopkMode::kIdsOnly;
  hbt::IntranodeCase none = CaseFor(config, {7, 0}, 952);
  none.topk = hbt::TopkMode::kNone;
  RunNormalCases(ranks, {bias, fp8, none}, 2 * 48);
  RunNormalCases(ranks, {CaseFor(config, {5, 9}, 953)}, 1000);

  hbt::IntranodeCase all_to_0 = CaseFor(config, {16, 16}, 954);
  all_to_0.routing.all_to_one_expert = true;  // rank 0 receives 32 rows
  const hbt::IntranodeExpected x = hbt::MakeIntranodeExpected(all_to_0);
  std::vector<absl::Status> status(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      const auto& in = x.inputs[r];
      const TensorView topk = View(in.topk_idx, DType::kInt64, {in.num_tokens, all_to_0.num_topk});
      auto layout = ranks.buffers[r]->GetDispatchLayout(topk);
      if (!layout.ok()) return void(status[r] = layout.status());
      status[r] = ranks.buffers[r]
                      ->Dispatch({.x = View(in.x, DType::kBF16, {in.num_tokens, all_to_0.hidden}),
                                  .topk_idx = topk,
                                  .layout = &*layout,
                                  .num_worst_tokens = 31})
                      .status();
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_TRUE(absl::IsResourceExhausted(status[0])) << status[0];
  EXPECT_NE(status[0].message().find("rank 0 receives 32 tokens but its dispatch outputs have room for 31 rows"),
            std::string::npos)
      << status[0];
  EXPECT_TRUE(absl::IsDeadlineExceeded(status[1])) << status[1];
  EXPECT_NE(status[1].message().find("from rank 0"), std::string::npos) << status[1];
  for (auto& buffer : ranks.buffers) ASSERT_TRUE(buffer->Reset().ok());
  RunNormalCases(ranks, {all_to_0}, 32);
  client::DispatchArgs bad;
  bad.num_worst_tokens = -1;
  bad.x = View(x.inputs[0].x, DType::kBF16, {16, 256});
  EXPECT_NE(ranks.buffers[0]->Dispatch(bad).status().message().find("num_worst_tokens = -1"), std::string::npos);
}

// Low latency.

TEST_F(BufferHostTest, LowLatencyTwoRanksFp8VariantsBf16HookZeroCopy) {
  const BufferConfig config = LowLatencyConfig(512, 24, 8);
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(MakeRanks(2, config, &ranks));
  std::vector<hbt::LowLatencyCase> cases;
  uint64_t salt = 0;
  hbt::LowLatencyCase plain = LowLatencyCaseFor(config, 2, ++salt);
  plain.iterations = 3;  // several consecutive calls: both halves, twice
  cases.push_back(plain);
  hbt::LowLatencyCase round = LowLatencyCaseFor(config, 2, ++salt);
  round.round_scale = true;
  round.hook = true;
  cases.push_back(round);
  hbt::LowLatencyCase ue8m0 = LowLatencyCaseFor(config, 2, ++salt);
  ue8m0.round_scale = true;
  ue8m0.ue8m0 = true;
  ue8m0.zero_copy = true;
  ue8m0.iterations = 2;
  cases.push_back(ue8m0);
  hbt::LowLatencyCase bf16 = LowLatencyCaseFor(config, 2, ++salt);
  bf16.fp8 = false;
  bf16.hook = true;
  bf16.zero_copy = true;
  bf16.iterations = 2;
  cases.push_back(bf16);
  // Edge cases: a rank with 0 tokens, every token to one expert, many -1 entries, a full rank.
  hbt::LowLatencyCase zero = LowLatencyCaseFor(config, 2, ++salt);
  zero.num_tokens = {0, 24};
  cases.push_back(zero);
  hbt::LowLatencyCase one_expert = LowLatencyCaseFor(config, 2, ++salt);
  one_expert.num_tokens = {24, 24};
  one_expert.routing.all_to_one_expert = true;
  cases.push_back(one_expert);
  hbt::LowLatencyCase sparse = LowLatencyCaseFor(config, 2, ++salt);
  sparse.routing.empty_fraction = 0.5;
  sparse.routing.allow_duplicates = true;
  cases.push_back(sparse);
  RunLowLatencyCases(ranks, cases);
}

TEST_F(BufferHostTest, LowLatencyFourRanksHidden7168) {
  const BufferConfig config = LowLatencyConfig(7168, 8, 16);
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(MakeRanks(4, config, &ranks));
  hbt::LowLatencyCase c = LowLatencyCaseFor(config, 4, 50);
  c.iterations = 2;
  c.round_scale = true;
  c.ue8m0 = true;
  hbt::LowLatencyCase hook = LowLatencyCaseFor(config, 4, 51);
  hook.hook = true;
  hook.zero_copy = true;
  hook.iterations = 4;
  hbt::LowLatencyCase bf16 = LowLatencyCaseFor(config, 4, 52);
  bf16.fp8 = false;
  bf16.iterations = 3;
  bf16.routing.empty_fraction = 0.3;
  RunLowLatencyCases(ranks, {c, hook, bf16});
}

// A low-latency group that also serves normal mode (num_normal_bytes; SGLang's auto mode): every rank holds a normal
// and a low-latency Buffer on one lease and the calls alternate (prefill, decode, prefill, ...), every output checked
// against the references. Each mode has its own part of the regions: no clean-up between them. Groups and Buffers
// that do not fit the parts are refused.
TEST_F(BufferHostTest, OneLowLatencyGroupServesBothModes) {
  constexpr int n = 4;
  const BufferConfig normal = NormalConfig(256, 48);
  const BufferConfig ll = LowLatencyConfig(512, 16, 16);
  auto normal_bytes = client::RequiredRegionBytes(normal, n);
  auto ll_bytes = client::RequiredRegionBytes(ll, n);
  ASSERT_TRUE(normal_bytes.ok() && ll_bytes.ok());
  const uint64_t part = (*normal_bytes + 4095) / 4096 * 4096;

  // The daemon's rules: low latency only, a multiple of 4096, below num_nvl_bytes.
  for (auto [low_latency, normal_part, why] :
       {std::tuple{false, part, "needs low_latency"}, std::tuple{true, part + 1, "must be a multiple of 4096"},
        std::tuple{true, part + *ll_bytes + 4096, "below num_nvl_bytes"}}) {
    auto refused = CreateGroup(n, part + *ll_bytes, low_latency, normal_part);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
    EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr(why)) << refused.status();
  }

  auto group = CreateGroup(n, part + *ll_bytes, /*low_latency=*/true, part);
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_EQ(group->group().num_normal_bytes(), part);
  Ranks both;         // clients, leases and the normal-mode Buffers
  Ranks low_latency;  // the same leases' low-latency Buffers (destroyed first)
  for (int r = 0; r < n; ++r) {
    auto connected = Client::Connect(fabrics_[n]->daemon(r).socket(), {.client_name = "buffer_host_test"});
    ASSERT_TRUE(connected.ok()) << connected.status();
    auto lease = (*connected)->Attach(group->group().name(), r, group->token());
    ASSERT_TRUE(lease.ok()) << lease.status();
    if (r == 0) {
      // A normal-mode shape that does not fit the normal part is refused, naming the part.
      auto too_big = Buffer::Create(lease->get(), NormalConfig(256, 96));
      EXPECT_EQ(too_big.status().code(), absl::StatusCode::kInvalidArgument) << too_big.status();
      EXPECT_THAT(std::string(too_big.status().message()), ::testing::HasSubstr("normal-mode part of rank 0"));
    }
    auto normal_buffer = Buffer::Create(lease->get(), normal);
    ASSERT_TRUE(normal_buffer.ok()) << normal_buffer.status();
    auto ll_buffer = Buffer::Create(lease->get(), ll);
    ASSERT_TRUE(ll_buffer.ok()) << ll_buffer.status();
    both.clients.push_back(std::move(*connected));
    both.leases.push_back(std::move(*lease));
    both.buffers.push_back(std::move(*normal_buffer));
    low_latency.buffers.push_back(std::move(*ll_buffer));
  }
  for (uint64_t round = 0; round < 3; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    hbt::IntranodeCase prefill = CaseFor(normal, {48, 17, 33, 0}, 100 + round);
    prefill.fp8 = round == 1;
    RunNormalCases(both, {prefill});
    hbt::LowLatencyCase decode = LowLatencyCaseFor(ll, n, 200 + round);
    decode.iterations = 2;
    RunLowLatencyCases(low_latency, {decode});
  }

  // A low-latency group without a normal-mode part refuses a normal-mode Buffer.
  auto ll_only = CreateGroup(n, *ll_bytes, /*low_latency=*/true);
  ASSERT_TRUE(ll_only.ok()) << ll_only.status();
  auto connected = Client::Connect(fabrics_[n]->daemon(0).socket(), {.client_name = "buffer_host_test"});
  ASSERT_TRUE(connected.ok()) << connected.status();
  auto lease = (*connected)->Attach(ll_only->group().name(), 0, ll_only->token());
  ASSERT_TRUE(lease.ok()) << lease.status();
  auto refused = Buffer::Create(lease->get(), normal);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("no normal-mode part"));
}

}  // namespace
}  // namespace epfabric::testing
