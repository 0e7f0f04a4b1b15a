// The Buffer API on the host backend against real daemons: one Client + Lease + Buffer per rank, each rank on its
// own thread (the host backend runs on the calling thread and waits on its peers). Every output is compared element
// by element with the host references (kernels/host/*_reference) on fresh random inputs.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "epfabric/client/buffer.h"
#include "epfabric/client/client.h"
#include "integration/buffer_test_cases.h"
#include "integration/fabric_under_test.h"

namespace epfabric::testing {
namespace {

using client::Buffer;
using client::BufferConfig;
using client::Client;
using client::Lease;
using client::TensorView;
using kernels::DType;

// A fresh seed per run (printed, so a failure can be replayed with EPF_SEED).
uint64_t Seed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("EPF_SEED");
    const uint64_t s = env != nullptr ? std::strtoull(env, nullptr, 10) : std::random_device{}();
    std::printf("buffer_host_test seed: %llu (EPF_SEED to replay)\n", static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

template <typename T>
TensorView View(const std::vector<T>& v, DType dtype, std::vector<int64_t> shape) {
  return TensorView{const_cast<T*>(v.data()), dtype, std::move(shape)};
}

// One group on a running fabric: a lease and a Buffer per rank.
struct Ranks {
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<std::unique_ptr<Lease>> leases;
  std::vector<std::unique_ptr<Buffer>> buffers;
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

  static absl::StatusOr<v1::CreateGroupResponse> CreateGroup(int n, uint64_t nvl_bytes, bool low_latency) {
    static int counter = 0;
    v1::CreateGroupRequest request;
    request.set_name(absl::StrCat("buf", n, "_", counter++));
    for (int r = 0; r < n; ++r) request.add_ranks(r);
    request.set_num_nvl_bytes(nvl_bytes);
    request.set_low_latency(low_latency);
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

  static std::map<int, std::unique_ptr<FabricUnderTest>> fabrics_;
};

std::map<int, std::unique_ptr<FabricUnderTest>> BufferHostTest::fabrics_;

BufferConfig NormalConfig(int hidden, int max_tokens = 96, int num_experts = 16, int max_topk = 8) {
  return BufferConfig{.max_tokens_per_rank = max_tokens,
                      .hidden = hidden,
                      .max_topk = max_topk,
                      .num_experts = num_experts,
                      .num_sms = 3,
                      .low_latency = false,
                      .timeout = absl::Seconds(10)};
}

hbt::IntranodeCase CaseFor(const BufferConfig& config, std::vector<int> num_tokens, uint64_t salt) {
  hbt::IntranodeCase c;
  c.num_tokens = std::move(num_tokens);
  c.hidden = config.hidden;
  c.num_topk = 4;
  c.num_experts = config.num_experts;
  c.num_channels = config.num_sms;
  c.seed = Seed() * 1000003 + salt;
  return c;
}

void RunNormalCases(Ranks& ranks, const std::vector<hbt::IntranodeCase>& cases) {
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
        RunNormalCase(memory, r, *ranks.buffers[r], x, &found[r]);
      });
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < n; ++r) EXPECT_TRUE(found[r].empty()) << "rank " << r << ":\n" << found[r].str();
  }
}

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

// ---------------------------------------------------------------------------------------------------------------
// Low latency.

BufferConfig LowLatencyConfig(int hidden, int max_tokens, int num_experts) {
  return BufferConfig{.max_tokens_per_rank = max_tokens,
                      .hidden = hidden,
                      .max_topk = 8,
                      .num_experts = num_experts,
                      .low_latency = true,
                      .timeout = absl::Seconds(10)};
}

void RunLowLatencyCases(Ranks& ranks, const std::vector<hbt::LowLatencyCase>& cases) {
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

hbt::LowLatencyCase LowLatencyCaseFor(const BufferConfig& config, int num_ranks, uint64_t salt) {
  hbt::LowLatencyCase c;
  c.num_ranks = num_ranks;
  c.max_tokens = config.max_tokens_per_rank;
  c.hidden = config.hidden;
  c.num_experts = config.num_experts;
  c.num_topk = 4;
  c.seed = Seed() * 7919 + salt;
  return c;
}

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

// ---------------------------------------------------------------------------------------------------------------
// Bad input: refused with InvalidArgument before anything runs; the next valid call still works.

TEST_F(BufferHostTest, NormalBadInputIsRefusedAndTheNextCallWorks) {
  const BufferConfig config = NormalConfig(256, 32);
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(MakeRanks(2, config, &ranks));
  Buffer& b = *ranks.buffers[0];
  const std::vector<int64_t> topk(8 * 4, 1);
  const std::vector<uint16_t> x(8 * 256, 0);
  auto layout = b.GetDispatchLayout(View(topk, DType::kInt64, {8, 4}));  // local only: no peer involved
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto expect_invalid = [](const absl::Status& status, const std::string& needle) {
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
    EXPECT_NE(status.message().find(needle), std::string::npos) << status;
  };
  client::DispatchArgs args;
  args.x = View(x, DType::kFloat32, {8, 256});
  args.topk_idx = View(topk, DType::kInt64, {8, 4});
  args.layout = &*layout;
  expect_invalid(b.Dispatch(args).status(), "x.dtype = float32");
  args.x = View(x, DType::kBF16, {8, 256, 1});
  expect_invalid(b.Dispatch(args).status(), "x.shape = [8, 256, 1]");
  args.x = View(x, DType::kBF16, {8, 256});
  args.topk_idx = View(topk, DType::kInt64, {4, 8});
  expect_invalid(b.Dispatch(args).status(), "topk_idx.shape = [4, 8]");
  args.topk_idx = View(topk, DType::kInt32, {8, 4});
  expect_invalid(b.Dispatch(args).status(), "topk_idx.dtype = int32");
  args.topk_idx = View(topk, DType::kInt64, {8, 4});
  args.x = View(x, DType::kFP8E4M3, {16, 200});
  expect_invalid(b.Dispatch(args).status(), "x.shape[1] (hidden) = 200: must be a multiple of 128");
  std::vector<int64_t> bad_topk = topk;
  bad_topk[5] = 16;
  expect_invalid(b.GetDispatchLayout(View(bad_topk, DType::kInt64, {8, 4})).status(), "topk_idx[1][1] = 16");
  bad_topk[5] = -2;
  expect_invalid(b.GetDispatchLayout(View(bad_topk, DType::kInt64, {8, 4})).status(), "= -2");
  const std::vector<int64_t> many(40 * 4, 0);
  expect_invalid(b.GetDispatchLayout(View(many, DType::kInt64, {40, 4})).status(), "= 40");
  const std::vector<int64_t> wide(8 * 9, 0);
  expect_invalid(b.GetDispatchLayout(View(wide, DType::kInt64, {8, 9})).status(), "num_topk) = 9");
  client::CombineArgs cargs;
  expect_invalid(b.Combine(cargs).status(), "handle is null");
  EXPECT_TRUE(absl::IsFailedPrecondition(b.LowLatencyDispatch({}).status()));

  // Afterwards a full valid case on every rank.
  hbt::IntranodeCase c = CaseFor(config, {32, 9}, 900);
  RunNormalCases(ranks, {c});
}

TEST_F(BufferHostTest, NormalFp8UnalignedHiddenAndBadExpertIndexInDispatch) {
  const BufferConfig config = NormalConfig(512, 16);
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(MakeRanks(2, config, &ranks));
  Buffer& b = *ranks.buffers[1];
  const std::vector<int64_t> topk(4 * 2, 3);
  const std::vector<uint8_t> x(4 * 512, 0);
  const std::vector<float> scales(4 * 4, 1.0f);
  auto layout = b.GetDispatchLayout(View(topk, DType::kInt64, {4, 2}));
  ASSERT_TRUE(layout.ok()) << layout.status();
  client::DispatchArgs args;
  args.x = View(x, DType::kFP8E4M3, {4, 200});
  args.x_scales = View(scales, DType::kFloat32, {4, 1});
  args.topk_idx = View(topk, DType::kInt64, {4, 2});
  args.layout = &*layout;
  absl::Status status = b.Dispatch(args).status();
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_NE(status.message().find("x.shape[1] (hidden) = 200: must be a multiple of 128"), std::string::npos) << status;
  args.x = View(x, DType::kFP8E4M3, {4, 512});
  status = b.Dispatch(args).status();  // scales [4, 1] instead of [4, 4]
  EXPECT_NE(status.message().find("x_scales.shape = [4, 1]"), std::string::npos) << status;
  args.x_scales = {};
  status = b.Dispatch(args).status();
  EXPECT_NE(status.message().find("x_scales is not given"), std::string::npos) << status;
  std::vector<int64_t> bad = topk;
  bad[3] = 99;
  args.x_scales = View(scales, DType::kFloat32, {4, 4});
  args.topk_idx = View(bad, DType::kInt64, {4, 2});
  status = b.Dispatch(args).status();
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_NE(status.message().find("topk_idx[1][1] = 99"), std::string::npos) << status;
  hbt::IntranodeCase c = CaseFor(config, {16, 11}, 901);
  c.fp8 = true;
  c.hidden = 512;
  RunNormalCases(ranks, {c});
}

TEST_F(BufferHostTest, LowLatencyBadInputIsRefusedAndTheNextCallWorks) {
  const BufferConfig config = LowLatencyConfig(256, 8, 8);
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(MakeRanks(2, config, &ranks));
  Buffer& b = *ranks.buffers[0];
  const std::vector<uint16_t> x(16 * 256, 0);
  const std::vector<int64_t> topk(16 * 4, 0);
  client::LowLatencyDispatchArgs d;
  d.x = View(x, DType::kBF16, {16, 256});
  d.topk_idx = View(topk, DType::kInt64, {16, 4});
  absl::Status status = b.LowLatencyDispatch(d).status();
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_NE(status.message().find("x.shape[0] (num_tokens) = 16"), std::string::npos) << status;
  d.x = View(x, DType::kBF16, {4, 128});
  status = b.LowLatencyDispatch(d).status();
  EXPECT_NE(status.message().find("x.shape = [4, 128]"), std::string::npos) << status;
  d.x = View(x, DType::kFP8E4M3, {4, 256});
  status = b.LowLatencyDispatch(d).status();
  EXPECT_NE(status.message().find("x.dtype = fp8_e4m3"), std::string::npos) << status;
  d.x = View(x, DType::kBF16, {4, 256});
  d.topk_idx = View(topk, DType::kInt64, {4, 4});
  d.use_ue8m0 = true;
  d.round_scale = true;
  status = b.LowLatencyDispatch(d).status();
  EXPECT_NE(status.message().find("multiple of 512"), std::string::npos) << status;
  d.use_ue8m0 = false;
  std::vector<int64_t> bad = topk;
  bad[2] = 8;
  d.topk_idx = View(bad, DType::kInt64, {4, 4});
  status = b.LowLatencyDispatch(d).status();
  EXPECT_NE(status.message().find("topk_idx[0][2] = 8"), std::string::npos) << status;
  EXPECT_TRUE(absl::IsFailedPrecondition(b.Dispatch({}).status()));
  // Nothing ran, so both ranks' cursors still agree: a valid sequence works.
  hbt::LowLatencyCase c = LowLatencyCaseFor(config, 2, 902);
  c.iterations = 2;
  RunLowLatencyCases(ranks, {c});
}

TEST_F(BufferHostTest, PendingRecvHookBlocksTheNextLowLatencyCall) {
  const BufferConfig config = LowLatencyConfig(256, 8, 8);
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(MakeRanks(2, config, &ranks));
  hbt::LowLatencyCase c = LowLatencyCaseFor(config, 2, 903);
  c.num_tokens = {5, 8};
  const std::vector<hbt::LowLatencyIteration> its = hbt::MakeLowLatencyExpected(c);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Buffer& b = *ranks.buffers[r];
      const auto& in = its[0].inputs[r];
      client::LowLatencyDispatchArgs d;
      d.x = View(in.x, DType::kBF16, {in.num_tokens, 256});
      d.topk_idx = View(in.topk_idx, DType::kInt64, {in.num_tokens, c.num_topk});
      d.return_recv_hook = true;
      auto first = b.LowLatencyDispatch(d);
      if (!first.ok()) return void(errors[r] = first.status().ToString());
      absl::Status early = b.LowLatencyDispatch(d).status();
      if (!absl::IsFailedPrecondition(early) || early.message().find("recv_hook") == std::string::npos) {
        errors[r] = absl::StrCat("second dispatch before the hook: ", early.ToString());
      }
      if (absl::Status hooked = first->recv_hook(nullptr); !hooked.ok()) return void(errors[r] = hooked.ToString());
      client::LowLatencyCombineArgs cb;
      const TensorView into = b.NextLowLatencyCombineBuffer();
      std::memcpy(into.data, its[0].expert_outputs[r].data(), into.bytes());
      cb.zero_copy = true;
      cb.topk_idx = d.topk_idx;
      cb.topk_weights = View(in.topk_weights, DType::kFloat32, {in.num_tokens, c.num_topk});
      cb.handle = first->handle;
      auto combined = b.LowLatencyCombine(cb);
      if (!combined.ok()) return void(errors[r] = combined.status().ToString());
      if (std::memcmp(combined->combined_x.view.data, its[0].combined[r].data(), its[0].combined[r].size() * 2) != 0) {
        errors[r] = "combined_x differs";
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// A rank that never calls: its peer's wait ends with DeadlineExceeded naming it; after Reset on every rank the
// group works again.
TEST_F(BufferHostTest, MissingPeerTimesOutNamingItAndResetRecovers) {
  for (bool low_latency : {false, true}) {
    SCOPED_TRACE(low_latency ? "low latency" : "normal");
    BufferConfig config = low_latency ? LowLatencyConfig(256, 8, 8) : NormalConfig(256, 16);
    config.timeout = absl::Seconds(1);  // short, yet long enough for a loaded 2-core machine in the checked case
    Ranks ranks;
    ASSERT_NO_FATAL_FAILURE(MakeRanks(2, config, &ranks));
    Buffer& b = *ranks.buffers[0];
    const std::vector<int64_t> topk(4 * 2, 3);
    const std::vector<uint16_t> x(4 * 256, 0);
    absl::Status status;
    const absl::Time start = absl::Now();
    if (low_latency) {
      client::LowLatencyDispatchArgs d;
      d.x = View(x, DType::kBF16, {4, 256});
      d.topk_idx = View(topk, DType::kInt64, {4, 2});
      status = b.LowLatencyDispatch(d).status();
    } else {
      auto layout = b.GetDispatchLayout(View(topk, DType::kInt64, {4, 2}));
      ASSERT_TRUE(layout.ok()) << layout.status();
      status = b.Dispatch({.x = View(x, DType::kBF16, {4, 256}),
                           .topk_idx = View(topk, DType::kInt64, {4, 2}),
                           .layout = &*layout})
                   .status();
    }
    const absl::Duration took = absl::Now() - start;
    EXPECT_TRUE(absl::IsDeadlineExceeded(status)) << status;
    EXPECT_NE(status.message().find("rank 0 timed out waiting for"), std::string::npos) << status;
    EXPECT_NE(status.message().find("from rank 1"), std::string::npos) << status;
    EXPECT_LT(took, absl::Seconds(5));
    for (auto& buffer : ranks.buffers) ASSERT_TRUE(buffer->Reset().ok());
    if (low_latency) {
      hbt::LowLatencyCase c = LowLatencyCaseFor(config, 2, 904);
      c.iterations = 2;
      RunLowLatencyCases(ranks, {c});
    } else {
      RunNormalCases(ranks, {CaseFor(config, {16, 7}, 905)});
    }
  }
}

TEST_F(BufferHostTest, AnEndedLeaseIsUnavailableBeforeAnythingRuns) {
  const BufferConfig config = NormalConfig(256, 16);
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(MakeRanks(2, config, &ranks));
  ASSERT_TRUE(ranks.leases[0]->Detach().ok());
  const std::vector<int64_t> topk(4 * 2, 3);
  absl::Status status = ranks.buffers[0]->GetDispatchLayout(View(topk, DType::kInt64, {4, 2})).status();
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
}

TEST_F(BufferHostTest, CreateRefusesASmallRegionAndAModeMismatch) {
  ASSERT_TRUE(fabrics_[2] != nullptr) << "the 2-rank fabric did not start";
  const BufferConfig config = NormalConfig(256, 32);
  auto bytes = client::RequiredRegionBytes(config, 2);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto group = CreateGroup(2, *bytes - 4096, false);
  ASSERT_TRUE(group.ok()) << group.status();
  auto connected = Client::Connect(fabrics_[2]->daemon(0).socket());
  ASSERT_TRUE(connected.ok()) << connected.status();
  auto lease = (*connected)->Attach(group->group().name(), 0, group->token());
  ASSERT_TRUE(lease.ok()) << lease.status();
  auto buffer = Buffer::Create(lease->get(), config);
  EXPECT_TRUE(absl::IsInvalidArgument(buffer.status())) << buffer.status();
  EXPECT_NE(buffer.status().message().find(absl::StrCat("needs RequiredRegionBytes = ", *bytes)), std::string::npos)
      << buffer.status();
  BufferConfig low_latency = config;
  low_latency.low_latency = true;
  buffer = Buffer::Create(lease->get(), low_latency);
  EXPECT_TRUE(absl::IsInvalidArgument(buffer.status())) << buffer.status();
  EXPECT_NE(buffer.status().message().find("low_latency"), std::string::npos) << buffer.status();
  BufferConfig odd = config;
  odd.num_experts = 15;
  EXPECT_TRUE(absl::IsInvalidArgument(client::RequiredRegionBytes(odd, 2).status()));
}

}  // namespace
}  // namespace epfabric::testing
