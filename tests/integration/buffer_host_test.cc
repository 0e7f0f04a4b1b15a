// The Buffer API on the host backend against real daemons: one Client + Lease + Buffer per rank, each rank on its
// own thread (the host backend runs on the calling thread and waits on its peers). Every output is compared element
// by element with the host references (kernels/host/*_reference) on fresh random inputs.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "epfabric/client/buffer.h"
#include "epfabric/client/client.h"
#include "integration/fabric_under_test.h"
#include "unit/host_backend_scenarios.h"

namespace epfabric::testing {
namespace {

using client::Buffer;
using client::BufferConfig;
using client::Client;
using client::Lease;
using client::TensorView;
using kernels::DType;
namespace hbt = kernels::host_backend_test;
namespace ref = kernels::reference;

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

template <typename T>
void CompareTensor(hbt::Mismatches* m, const char* what, int rank, const client::Tensor& got,
                   const std::vector<T>& want, size_t n) {
  if (got.view.numel() * kernels::DTypeSize(got.view.dtype) < n * sizeof(T)) {
    m->Add(absl::StrCat("rank ", rank, ": ", what, " has ", got.view.numel(), " elements, want at least ", n));
    return;
  }
  m->CompareArrays(what, rank, static_cast<const T*>(got.view.data), want.data(), n);
}

// ---------------------------------------------------------------------------------------------------------------
// Normal mode: layout, dispatch, cached dispatch, combine of one case on every rank.

void RunNormalCase(int rank, Buffer& buffer, const hbt::IntranodeExpected& x, hbt::Mismatches* m) {
  const hbt::IntranodeCase& c = x.c;
  const int R = c.num_ranks();
  const ref::RankInput& in = x.inputs[rank];
  const ref::RankOutput& want = x.dispatched[rank];
  const int64_t T = in.num_tokens;
  const int K = x.config.num_topk;

  auto layout = buffer.GetDispatchLayout(View(in.topk_idx, DType::kInt64, {T, c.num_topk}));
  if (!layout.ok()) {
    m->Status("GetDispatchLayout", rank, layout.status());
    // The peers go on: issue nothing else (they will time out and report it).
    return;
  }
  CompareTensor(m, "num_tokens_per_rank", rank, layout->num_tokens_per_rank, want.layout.num_tokens_per_rank, R);
  CompareTensor(m, "num_tokens_per_expert", rank, layout->num_tokens_per_expert, want.layout.num_tokens_per_expert,
                c.num_experts);
  CompareTensor(m, "is_token_in_rank", rank, layout->is_token_in_rank, want.layout.is_token_in_rank, T * R);

  client::DispatchArgs args;
  args.x = View(in.x, c.fp8 ? DType::kFP8E4M3 : DType::kBF16, {T, c.hidden});
  if (c.fp8) args.x_scales = View(in.x_scales, DType::kFloat32, {T, c.hidden / 128});
  if (K > 0) args.topk_idx = View(in.topk_idx, DType::kInt64, {T, K});
  if (x.config.has_weights) args.topk_weights = View(in.topk_weights, DType::kFloat32, {T, K});
  args.layout = &*layout;
  args.expert_alignment = c.expert_alignment;
  std::shared_ptr<const client::DispatchHandle> handle;
  for (int pass = 0; pass < 2; ++pass) {
    const char* what = pass == 0 ? "Dispatch" : "cached Dispatch";
    if (pass == 1) {
      args.cached = handle;
      args.layout = nullptr;
    }
    auto got = buffer.Dispatch(args);
    if (!got.ok()) {
      m->Status(what, rank, got.status());
      return;
    }
    const int N = want.num_recv_tokens;
    if (got->handle->num_recv_tokens != N) m->Add(absl::StrCat("rank ", rank, ": ", what, " num_recv_tokens"));
    if (got->recv_x.view.shape != std::vector<int64_t>{N, c.hidden}) {
      m->Add(absl::StrCat("rank ", rank, ": ", what, " recv_x shape"));
    }
    CompareTensor(m, "recv_x", rank, got->recv_x, want.recv_x, want.recv_x.size());
    if (c.fp8)
      CompareTensor(m, "recv_x_scales", rank, got->recv_x_scales, want.recv_x_scales, want.recv_x_scales.size());
    if (K > 0)
      CompareTensor(m, "recv_topk_idx", rank, got->recv_topk_idx, want.recv_topk_idx, want.recv_topk_idx.size());
    if (x.config.has_weights) {
      CompareTensor(m, "recv_topk_weights", rank, got->recv_topk_weights, want.recv_topk_weights,
                    want.recv_topk_weights.size());
    }
    if (pass == 0) {
      if (got->num_recv_tokens_per_expert != want.num_recv_tokens_per_expert) {
        m->Add(absl::StrCat("rank ", rank, ": num_recv_tokens_per_expert"));
      }
    }
    const client::DispatchHandle& h = *got->handle;
    CompareTensor(m, "rank_prefix_matrix", rank, h.rank_prefix_matrix, want.rank_prefix_matrix, R * R);
    CompareTensor(m, "recv_channel_prefix", rank, h.recv_channel_prefix, want.recv_channel_prefix,
                  want.recv_channel_prefix.size());
    CompareTensor(m, "send_slot", rank, h.send_slot, want.send_slot, T * R);
    CompareTensor(m, "recv_src_idx", rank, h.recv_src_idx, want.recv_src_idx, N);
    handle = got->handle;
  }

  const ref::CombineInput& cin = x.combine_inputs[rank];
  const ref::CombineOutput& cwant = x.combined[rank];
  const int combine_topk = x.config.has_weights ? c.num_topk : 0;
  client::CombineArgs cargs;
  cargs.handle = handle;
  cargs.x = View(cin.x, DType::kBF16, {handle->num_recv_tokens, c.hidden});
  if (combine_topk > 0) {
    cargs.topk_weights = View(cin.topk_weights, DType::kFloat32, {handle->num_recv_tokens, combine_topk});
  }
  if (c.bias) {
    cargs.bias_0 = View(cin.bias_0, DType::kBF16, {T, c.hidden});
    cargs.bias_1 = View(cin.bias_1, DType::kBF16, {T, c.hidden});
  }
  auto combined = buffer.Combine(cargs);
  if (!combined.ok()) {
    m->Status("Combine", rank, combined.status());
    return;
  }
  CompareTensor(m, "combined_x", rank, combined->combined_x, cwant.combined_x, cwant.combined_x.size());
  if (combine_topk > 0) {
    CompareTensor(m, "combined_topk_weights", rank, combined->combined_topk_weights, cwant.combined_topk_weights,
                  cwant.combined_topk_weights.size());
  }
}

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
    for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { RunNormalCase(r, *ranks.buffers[r], x, &found[r]); });
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

// ---------------------------------------------------------------------------------------------------------------
// Low latency.

void RunLowLatencyIterations(int rank, Buffer& buffer, const hbt::LowLatencyCase& c,
                             const std::vector<hbt::LowLatencyIteration>& its, hbt::Mismatches* m) {
  const int R = c.num_ranks, M = c.max_tokens, H = c.hidden, L = c.num_experts / R, G = H / 128;
  const size_t slots = static_cast<size_t>(R) * M;
  const size_t elem = c.fp8 ? 1 : 2;
  std::vector<int32_t> stats(L, 0), want_stats(L, 0);
  for (size_t i = 0; i < its.size(); ++i) {
    const hbt::LowLatencyIteration& it = its[i];
    const kernels::host::LowLatencyRankInput& in = it.inputs[rank];
    const kernels::host::LowLatencyDispatchOutput& want = it.dispatched[rank];
    const int64_t T = in.num_tokens;
    client::LowLatencyDispatchArgs d;
    d.x = View(in.x, DType::kBF16, {T, H});
    d.topk_idx = View(in.topk_idx, DType::kInt64, {T, c.num_topk});
    d.use_fp8 = c.fp8;
    d.round_scale = c.round_scale;
    d.use_ue8m0 = c.ue8m0;
    if (c.cumulative_stats) d.cumulative_stats = View(stats, DType::kInt32, {L});
    d.return_recv_hook = c.hook;
    auto got = buffer.LowLatencyDispatch(d);
    if (!got.ok()) {
      m->Status("LowLatencyDispatch", rank, got.status());
      return;
    }
    if (c.hook) {
      if (!got->recv_hook) {
        m->Add("no recv_hook");
        return;
      }
      m->Status("dispatch recv_hook", rank, got->recv_hook(nullptr));
      if (got->recv_hook(nullptr).ok()) m->Add("a recv_hook ran twice");
    }
    CompareTensor(m, "packed_recv_count", rank, got->packed_recv_count, want.packed_recv_count, L);
    CompareTensor(m, "layout_range", rank, got->packed_recv_layout_range, want.layout_range, want.layout_range.size());
    CompareTensor(m, "token_map", rank, got->handle->token_map, want.token_map, want.token_map.size());
    const int32_t* count = static_cast<const int32_t*>(got->packed_recv_count.view.data);
    const uint8_t* packed_x = static_cast<const uint8_t*>(got->packed_recv_x.view.data);
    const int32_t* src_info = static_cast<const int32_t*>(got->packed_recv_src_info.view.data);
    const int32_t* topk_slot = static_cast<const int32_t*>(got->handle->topk_slot.view.data);
    for (int e = 0; e < L; ++e) {
      want_stats[e] += want.packed_recv_count[e];
      const size_t n = std::max(0, std::min<int>(count[e], want.packed_recv_count[e]));
      const size_t base = static_cast<size_t>(e) * slots;
      m->CompareArrays("packed_recv_x", rank, packed_x + base * H * elem, want.packed_recv_x.data() + base * H * elem,
                       n * H * elem);
      m->CompareArrays("src_info", rank, src_info + base, want.src_info.data() + base, n);
      m->CompareArrays("topk_slot", rank, topk_slot + base, want.topk_slot.data() + base, n);
      if (c.fp8 && !c.ue8m0) {
        const float* scales = static_cast<const float*>(got->packed_recv_x_scales.view.data);
        for (int g = 0; g < G; ++g) {
          const size_t at = (static_cast<size_t>(e) * G + g) * slots;
          m->CompareArrays("scales", rank, scales + at, want.scales.data() + at, n);
        }
      } else if (c.ue8m0) {
        const uint8_t* scales = static_cast<const uint8_t*>(got->packed_recv_x_scales.view.data);
        for (int pack = 0; pack < G / 4; ++pack) {
          const size_t at = ((static_cast<size_t>(e) * (G / 4) + pack) * slots) * 4;
          m->CompareArrays("ue8m0 scales", rank, scales + at, want.ue8m0_scales.data() + at, n * 4);
        }
      }
    }
    // Combine.
    client::LowLatencyCombineArgs cb;
    if (c.zero_copy) {
      TensorView into = buffer.NextLowLatencyCombineBuffer();
      if (into.bytes() != it.expert_outputs[rank].size() * 2) m->Add("NextLowLatencyCombineBuffer size");
      std::memcpy(into.data, it.expert_outputs[rank].data(), it.expert_outputs[rank].size() * 2);
    } else {
      cb.x = View(it.expert_outputs[rank], DType::kBF16, {L, static_cast<int64_t>(slots), H});
    }
    cb.topk_idx = d.topk_idx;
    cb.topk_weights = View(in.topk_weights, DType::kFloat32, {T, c.num_topk});
    cb.handle = got->handle;
    cb.zero_copy = c.zero_copy;
    cb.return_recv_hook = c.hook;
    auto combined = buffer.LowLatencyCombine(cb);
    if (!combined.ok()) {
      m->Status("LowLatencyCombine", rank, combined.status());
      return;
    }
    if (c.hook) m->Status("combine recv_hook", rank, combined->recv_hook(nullptr));
    CompareTensor(m, "combined_x", rank, combined->combined_x, it.combined[rank], it.combined[rank].size());
  }
  if (c.cumulative_stats) m->CompareArrays("cumulative_stats", rank, stats.data(), want_stats.data(), L);
}

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
      threads.emplace_back([&, r] { RunLowLatencyIterations(r, *ranks.buffers[r], c, its, &found[r]); });
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
  RunLowLatencyCases(ranks, {c, hook});
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

TEST_F(BufferHostTest, CreateRefusesASmallRegionAndAModeMismatch) {
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
