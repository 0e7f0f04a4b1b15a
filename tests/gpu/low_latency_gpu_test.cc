// Low-latency dispatch/combine on real GPUs against the host reference: fresh random inputs, outputs poisoned
// first, FP8 data and scales compared bit for bit, combine compared bit for bit with the reference (same
// operations) and within |a - b| <= 1e-2 |b| + 1e-2 + 2^-8 sum|w x| of the exact double sum.
// Groups of 1, 2 and 4 ranks in one process; rank r runs on GPU r mod (visible GPUs), so every test needs one GPU:
// on a one-GPU machine the ranks share it, each with its own stream and SMs / (ranks per GPU) blocks per launch
// (low_latency_harness.h).
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>

#include <gtest/gtest.h>

#include "absl/strings/str_format.h"
#include "gpu/gpu_env.h"
#include "low_latency_harness.h"

namespace epfabric::testing {
namespace {

using kernels::LowLatencyBufferCursor;
using kernels::LowLatencyPhases;
using kernels::host::Bf16ToFloat;
using kernels::host::LowLatencyDispatchOutput;

#define ASSERT_OK(expr)                          \
  do {                                           \
    const ::absl::Status s_ = (expr);            \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_; \
  } while (0)

// Compares every rank's dispatch outputs with the reference; only valid slots carry defined data.
::testing::AssertionResult CompareDispatch(LowLatencyGroup& g, const std::vector<LowLatencyDispatchOutput>& ref,
                                           bool check_stats) {
  const LowLatencyCase& c = g.config();
  const size_t L = g.layout().num_local_experts, slots = static_cast<size_t>(c.num_ranks) * c.max_tokens_per_rank;
  const size_t H = c.hidden, G = H / 128, elem = c.use_fp8 ? 1 : 2;
  for (int r = 0; r < c.num_ranks; ++r) {
    LowLatencyRank& k = g.ranks()[r];
    const auto count = g.Download<int32_t>(r, k.recv_count, L);
    const auto range = g.Download<int64_t>(r, k.layout_range, L * c.num_ranks);
    const auto src_info = g.Download<int32_t>(r, k.src_info, L * slots);
    const auto topk_slot = g.Download<int32_t>(r, k.topk_slot, L * slots);
    if (count != ref[r].packed_recv_count) return ::testing::AssertionFailure() << "rank " << r << ": counts differ";
    if (g.Download<int32_t>(r, k.token_map, ref[r].token_map.size()) != ref[r].token_map)
      return ::testing::AssertionFailure() << "rank " << r << ": token maps differ";
    if (range != ref[r].layout_range) return ::testing::AssertionFailure() << "rank " << r << ": layout ranges differ";
    if (check_stats) {
      const auto stats = g.Download<int32_t>(r, k.cumulative_stats, L);
      if (stats != ref[r].packed_recv_count)
        return ::testing::AssertionFailure() << "rank " << r << ": cumulative stats differ";
    }
    std::vector<uint8_t> scale_bytes;
    if (c.use_fp8) scale_bytes = g.Download<uint8_t>(r, k.recv_scales, L * slots * G * (c.use_ue8m0 ? 1 : 4));
    for (size_t e = 0; e < L; ++e) {
      const int n = count[e];
      std::vector<uint8_t> rows(n * H * elem);
      if (n > 0) {
        (void)cudaSetDevice(k.device);
        (void)cudaMemcpy(rows.data(), k.recv_x + e * slots * H * elem, rows.size(), cudaMemcpyDeviceToHost);
      }
      for (int p = 0; p < n; ++p) {
        const size_t slot = e * slots + p;
        if (src_info[slot] != ref[r].src_info[slot] || topk_slot[slot] != ref[r].topk_slot[slot]) {
          return ::testing::AssertionFailure()
                 << absl::StrFormat("rank %d expert %d slot %d: src %d/%d topk slot %d/%d (got/want)", r, e, p,
                                    src_info[slot], ref[r].src_info[slot], topk_slot[slot], ref[r].topk_slot[slot]);
        }
        if (std::memcmp(&rows[p * H * elem], &ref[r].packed_recv_x[slot * H * elem], H * elem) != 0) {
          size_t i = 0;
          while (rows[p * H * elem + i] == ref[r].packed_recv_x[slot * H * elem + i]) ++i;
          return ::testing::AssertionFailure()
                 << absl::StrFormat("rank %d expert %d slot %d: data byte %d is 0x%02x, want 0x%02x", r, e, p, i,
                                    rows[p * H * elem + i], ref[r].packed_recv_x[slot * H * elem + i]);
        }
        if (!c.use_fp8) continue;
        for (size_t gi = 0; gi < G; ++gi) {
          if (c.use_ue8m0) {
            const size_t at = ((e * (G / 4) + gi / 4) * slots + p) * 4 + gi % 4;
            if (scale_bytes[at] != ref[r].ue8m0_scales[at])
              return ::testing::AssertionFailure()
                     << absl::StrFormat("rank %d expert %d slot %d group %d: ue8m0 %d, want %d", r, e, p, gi,
                                        scale_bytes[at], ref[r].ue8m0_scales[at]);
          } else {
            const size_t at = (e * G + gi) * slots + p;
            float got;
            std::memcpy(&got, &scale_bytes[at * 4], 4);
            if (std::memcmp(&got, &ref[r].scales[at], 4) != 0)
              return ::testing::AssertionFailure() << absl::StrFormat(
                         "rank %d expert %d slot %d group %d: scale %g, want %g", r, e, p, gi, got, ref[r].scales[at]);
          }
        }
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// Bit-exact against the reference (same operations), and within a tolerance of the exact double sum. The kernels
// round each expert rank's partial sum to bf16 before the token's rank adds them, so the tolerance has a term in
// the magnitude S = sum |w x| of the terms (each rounding is at most 2^-9 of what it rounds):
// |a - b| <= 1e-2 |b| + 1e-2 + 2^-8 S.
::testing::AssertionResult CompareCombine(LowLatencyGroup& g, const std::vector<LowLatencyDispatchOutput>& ref,
                                          const std::vector<bool>& mask = {}) {
  const auto bits = kernels::host::LowLatencyCombineReference(g.shape(), g.inputs(), g.expert_outputs(), ref, mask);
  std::vector<std::vector<double>> magnitude;
  const auto exact =
      kernels::host::LowLatencyCombineExact(g.shape(), g.inputs(), g.expert_outputs(), ref, mask, &magnitude);
  for (int r = 0; r < g.config().num_ranks; ++r) {
    if (r < static_cast<int>(mask.size()) && mask[r]) continue;
    const auto got = g.Download<uint16_t>(r, g.combined(r), bits[r].size());
    size_t not_bit_exact = 0, first_diff = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i] != bits[r][i] && not_bit_exact++ == 0) first_diff = i;
    }
    if (not_bit_exact != 0) {
      return ::testing::AssertionFailure() << absl::StrFormat(
                 "rank %d: %d of %d elements differ from the bit-exact reference, first %d: %g vs %g", r, not_bit_exact,
                 got.size(), first_diff, Bf16ToFloat(got[first_diff]), Bf16ToFloat(bits[r][first_diff]));
    }
    for (size_t i = 0; i < got.size(); ++i) {
      const double a = Bf16ToFloat(got[i]), b = exact[r][i];
      if (!(std::fabs(a - b) <= 1e-2 * std::fabs(b) + 1e-2 + magnitude[r][i] / 256))
        return ::testing::AssertionFailure()
               << absl::StrFormat("rank %d element %d: %g, exact %g, magnitude %g", r, i, a, b, magnitude[r][i]);
    }
  }
  return ::testing::AssertionSuccess();
}

absl::Status AllStatusesOk(LowLatencyGroup& g) {
  for (int r = 0; r < g.config().num_ranks; ++r) {
    if (absl::Status s = g.ReadStatus(r); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// One dispatch + combine round on fresh inputs, checked against the reference.
void RunRound(LowLatencyGroup& g, LowLatencyBufferCursor& cursor, bool hook, bool zero_copy, uint64_t seed) {
  SCOPED_TRACE(absl::StrFormat("seed %d hook %d zero_copy %d", seed, hook, zero_copy));
  ASSERT_OK(g.RandomInputs(seed));
  for (int r = 0; r < g.config().num_ranks; ++r) ASSERT_OK(g.ResetStatus(r));
  ASSERT_OK(g.PoisonOutputs());
  const auto ref = kernels::host::LowLatencyDispatchReference(
      g.shape(),
      {.use_fp8 = g.config().use_fp8, .round_scale = g.config().round_scale, .use_ue8m0 = g.config().use_ue8m0},
      g.inputs());
  const int dispatch_half = cursor.Next();
  if (hook) {
    ASSERT_OK(g.Dispatch(dispatch_half, LowLatencyPhases::kSend));
    ASSERT_OK(g.Dispatch(dispatch_half, LowLatencyPhases::kRecv));
  } else {
    ASSERT_OK(g.Dispatch(dispatch_half, LowLatencyPhases::kSendAndRecv));
  }
  ASSERT_OK(g.Sync());
  ASSERT_OK(AllStatusesOk(g));
  ASSERT_TRUE(CompareDispatch(g, ref, /*check_stats=*/true));

  ASSERT_OK(g.RandomExpertOutputs(seed + 1000, ref, zero_copy));
  const int combine_half = cursor.Next();
  if (hook) {
    ASSERT_OK(g.Combine(combine_half, LowLatencyPhases::kSend, zero_copy));
    ASSERT_OK(g.Combine(combine_half, LowLatencyPhases::kRecv, zero_copy));
  } else {
    ASSERT_OK(g.Combine(combine_half, LowLatencyPhases::kSendAndRecv, zero_copy));
  }
  ASSERT_OK(g.Sync());
  ASSERT_OK(AllStatusesOk(g));
  ASSERT_TRUE(CompareCombine(g, ref));
}

struct NamedCase {
  const char* name;
  LowLatencyCase c;
};

std::vector<NamedCase> Cases() {
  return {
      {"h7168_e288_top8_fp8", {.num_experts = 288, .hidden = 7168, .num_topk = 8, .use_fp8 = true}},
      {"h7168_e288_top8_fp8_ue8m0",
       {.num_experts = 288, .hidden = 7168, .num_topk = 8, .use_fp8 = true, .round_scale = true, .use_ue8m0 = true}},
      {"h7168_e256_top8_full_128",
       {.num_experts = 256, .hidden = 7168, .num_topk = 8, .use_fp8 = true, .min_tokens = 128}},
      {"h4096_e256_top6_bf16",
       {.num_experts = 256, .hidden = 4096, .max_tokens_per_rank = 64, .num_topk = 6, .use_fp8 = false}},
      {"h4096_e288_top4_fp8_round", {.num_experts = 288, .hidden = 4096, .num_topk = 4, .round_scale = true}},
      {"h2048_e256_top1_fp8", {.num_experts = 256, .hidden = 2048, .max_tokens_per_rank = 32, .num_topk = 1}},
      {"h2048_e288_top3_one_token",
       {.num_experts = 288,
        .hidden = 2048,
        .max_tokens_per_rank = 128,
        .num_topk = 3,
        .min_tokens = 1,
        .max_tokens = 1}},
      // More (expert, source) items (2048 with 2 ranks) than the grid has warps: a warp group per item, each
      // warp serving several items.
      {"h2048_e1024_top8_fp8_many_experts", {.num_experts = 1024, .hidden = 2048, .num_topk = 8, .use_fp8 = true}},
      // Zero weights travel as a special value (a zeroed entry means "not yet"): a quarter of them +0.0f.
      {"h4096_e288_top8_fp8_zero_weights",
       {.num_experts = 288, .hidden = 4096, .num_topk = 8, .use_fp8 = true, .zero_weight_fraction = 0.25}},
      {"h2048_e256_top8_bf16_many_none",
       {.num_experts = 256, .hidden = 2048, .num_topk = 8, .use_fp8 = false, .none_fraction = 0.5}},
      // DeepEP's traffic (a message per (token, expert)) must give the same outputs.
      {"h7168_e288_top8_fp8_message_per_expert",
       {.num_experts = 288, .hidden = 7168, .num_topk = 8, .use_fp8 = true, .message_per_expert = true}},
      {"h4096_e256_top8_bf16_message_per_expert",
       {.num_experts = 256, .hidden = 4096, .num_topk = 8, .use_fp8 = false, .message_per_expert = true}},
  };
}

class LowLatencyCases : public ::testing::TestWithParam<NamedCase> {};

// Four rounds (plain, hooks, zero-copy, both) of one shape with `num_ranks` ranks.
void RunShape(LowLatencyCase c, int num_ranks) {
  EPF_REQUIRE_GPUS(1);
  c.num_ranks = num_ranks;
  LowLatencyGroup g;
  ASSERT_OK(g.Init(c));
  std::printf("[   INFO   ] %s, %d blocks per launch (0 = all SMs)\n", g.placement().ToString().c_str(),
              g.default_num_blocks());
  LowLatencyBufferCursor cursor;
  for (int round = 0; round < 4; ++round) {
    RunRound(g, cursor, /*hook=*/round % 2 == 1, /*zero_copy=*/round >= 2, 100 * round + c.seed);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST_P(LowLatencyCases, TwoRanksMatchReference) { RunShape(GetParam().c, 2); }
TEST_P(LowLatencyCases, FourRanksMatchReference) { RunShape(GetParam().c, 4); }

// Groups across hosts run these kernels over more ranks than one NVLink domain holds (the wide instantiation: region
// addresses from a device table, masked ranks in shared memory). Here every rank is in one process (regions in the
// GPUs' memory): 16 ranks (past 8), 40 (past 32: a second round of count reads per lane in the dispatch receive, the
// combine receive's second round of loads for tokens whose experts span more than 8 ranks), 72 (past 64) and 120
// (a GPU runs at most 128 kernels at once, and every rank's grid must be resident), FP8 and BF16, checked against the
// reference like the shapes above. Ranks past 128 (the rank sets' third word) run on the host backend's test.
TEST(LowLatencyGpu, ManyRanksMatchReference) {
  EPF_REQUIRE_GPUS(1);
  for (int ranks : {16, 40, 72, 120}) {
    if (auto placement = PlaceRanks(ranks); !placement.ok() || MaxBlocksPerRank(*placement) < 1) {
      std::printf("[   INFO   ] %d ranks skipped: the GPUs cannot hold a block per rank at once\n", ranks);
      continue;
    }
    for (bool fp8 : {true, false}) {
      SCOPED_TRACE(::testing::Message() << ranks << " ranks, " << (fp8 ? "FP8" : "BF16"));
      RunShape({.num_experts = 3 * ranks,
                .hidden = 1024,
                .max_tokens_per_rank = 32,
                .num_topk = 12,
                .use_fp8 = fp8,
                .seed = static_cast<uint64_t>(ranks + fp8)},
               ranks);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, LowLatencyCases, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<NamedCase>& info) { return std::string(info.param.name); });

TEST(LowLatencyGpu, WorldSizeOne) {
  EPF_REQUIRE_GPUS(1);
  for (bool fp8 : {true, false}) {
    LowLatencyGroup g;
    ASSERT_OK(g.Init({.num_ranks = 1, .num_experts = 288, .hidden = 7168, .num_topk = 8, .use_fp8 = fp8}));
    LowLatencyBufferCursor cursor;
    RunRound(g, cursor, false, false, 5);
    RunRound(g, cursor, true, true, 6);
  }
}

// 2 x `rounds` calls alternating halves with no clean-up in between, then a checked round with poisoned outputs.
void RunBackToBackCalls(int num_ranks, int rounds) {
  EPF_REQUIRE_GPUS(1);
  LowLatencyGroup g;
  ASSERT_OK(g.Init({.num_ranks = num_ranks, .num_experts = 288, .hidden = 7168, .num_topk = 8}));
  LowLatencyBufferCursor cursor;
  ASSERT_OK(g.RandomInputs(11));
  const auto ref = kernels::host::LowLatencyDispatchReference(g.shape(), {.use_fp8 = true}, g.inputs());
  ASSERT_OK(g.RandomExpertOutputs(12, ref, false));
  for (int i = 0; i < rounds; ++i) {
    // Every third round uses the receive hooks.
    const int dispatch_half = cursor.Next(), combine_half = cursor.Next();
    if (i % 3 == 0) {
      ASSERT_OK(g.Dispatch(dispatch_half, LowLatencyPhases::kSend));
      ASSERT_OK(g.Dispatch(dispatch_half, LowLatencyPhases::kRecv));
      ASSERT_OK(g.Combine(combine_half, LowLatencyPhases::kSend, false));
      ASSERT_OK(g.Combine(combine_half, LowLatencyPhases::kRecv, false));
    } else {
      ASSERT_OK(g.Dispatch(dispatch_half, LowLatencyPhases::kSendAndRecv));
      ASSERT_OK(g.Combine(combine_half, LowLatencyPhases::kSendAndRecv, false));
    }
  }
  ASSERT_OK(g.Sync());
  ASSERT_OK(AllStatusesOk(g));
  ASSERT_TRUE(CompareCombine(g, ref));
  ASSERT_OK(g.PoisonOutputs());
  ASSERT_OK(g.Dispatch(cursor.Next(), LowLatencyPhases::kSendAndRecv));
  ASSERT_OK(g.Combine(cursor.Next(), LowLatencyPhases::kSendAndRecv, false));
  ASSERT_OK(g.Sync());
  ASSERT_OK(AllStatusesOk(g));
  ASSERT_TRUE(CompareDispatch(g, ref, /*check_stats=*/false));
  ASSERT_TRUE(CompareCombine(g, ref));
}

TEST(LowLatencyGpu, ThousandBackToBackCalls) { RunBackToBackCalls(2, 500); }
TEST(LowLatencyGpu, FourRanksBackToBackCalls) { RunBackToBackCalls(4, 200); }

// Each rank captures dispatch + combine into a CUDA graph; the graphs are replayed together many times.
TEST(LowLatencyGpu, CudaGraphCaptureAndReplay) {
  EPF_REQUIRE_GPUS(1);
  LowLatencyGroup g;
  ASSERT_OK(g.Init({.num_experts = 288, .hidden = 7168, .num_topk = 8, .round_scale = true}));
  ASSERT_OK(g.RandomInputs(21));
  const auto ref =
      kernels::host::LowLatencyDispatchReference(g.shape(), {.use_fp8 = true, .round_scale = true}, g.inputs());
  ASSERT_OK(g.RandomExpertOutputs(22, ref, false));
  std::vector<cudaGraphExec_t> execs(2);
  for (int r = 0; r < 2; ++r) {
    LowLatencyRank& k = g.ranks()[r];
    ASSERT_EQ(cudaSetDevice(k.device), cudaSuccess);
    ASSERT_EQ(cudaStreamBeginCapture(k.stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    ASSERT_OK(kernels::LowLatencyDispatch(k.ctx, g.DispatchArgs(r, 0, LowLatencyPhases::kSendAndRecv), k.stream));
    ASSERT_OK(kernels::LowLatencyCombine(k.ctx, g.CombineArgs(r, 1, LowLatencyPhases::kSendAndRecv, false), k.stream));
    cudaGraph_t graph;
    ASSERT_EQ(cudaStreamEndCapture(k.stream, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&execs[r], graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  }
  for (int replay = 0; replay < 50; ++replay) {
    if (replay == 49) ASSERT_OK(g.PoisonOutputs());
    for (int r = 0; r < 2; ++r) {
      ASSERT_EQ(cudaSetDevice(g.ranks()[r].device), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(execs[r], g.ranks()[r].stream), cudaSuccess);
    }
  }
  ASSERT_OK(g.Sync());
  ASSERT_OK(AllStatusesOk(g));
  ASSERT_TRUE(CompareDispatch(g, ref, /*check_stats=*/false));
  ASSERT_TRUE(CompareCombine(g, ref));
  for (int r = 0; r < 2; ++r) {
    (void)cudaSetDevice(g.ranks()[r].device);
    (void)cudaGraphExecDestroy(execs[r]);
  }
}

// Rank 1 never launches: rank 0 must come back within the timeout, name rank 1, mask it, and a later call with
// the mask must complete without waiting and match the reference with rank 1 masked.
TEST(LowLatencyGpu, PeerThatNeverLaunchesTimesOut) {
  EPF_REQUIRE_GPUS(1);
  LowLatencyGroup g;
  ASSERT_OK(g.Init({.num_experts = 256, .hidden = 4096, .num_topk = 8}, /*timeout_ns=*/50'000'000));
  ASSERT_OK(g.RandomInputs(31));
  ASSERT_OK(g.PoisonOutputs());
  const auto start = std::chrono::steady_clock::now();
  ASSERT_OK(g.Dispatch(0, LowLatencyPhases::kSendAndRecv, /*only=*/{0}));
  ASSERT_OK(g.Sync());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 2.0);
  const absl::Status s = g.ReadStatus(0);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("from rank 1"), std::string::npos) << s;
  const auto mask = g.Download<int32_t>(0, g.ranks()[0].mask, 2);
  EXPECT_EQ(mask[0], 0);
  EXPECT_EQ(mask[1], 1);
  std::printf("timeout: %s after %.1f ms\n", std::string(s.message()).c_str(), seconds * 1e3);

  // Next call on rank 0 only, rank 1 masked: no wait, and the outputs equal the reference without rank 1.
  kernels::KernelStatus zero{};
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(g.ranks()[0].status, &zero, sizeof(zero), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(g.ranks()[0].cumulative_stats, 0, 4 * g.layout().num_local_experts), cudaSuccess);
  ASSERT_OK(g.PoisonOutputs());
  ASSERT_OK(g.Dispatch(1, LowLatencyPhases::kSendAndRecv, /*only=*/{0}));
  ASSERT_OK(g.Sync());
  ASSERT_OK(g.ReadStatus(0));
  const std::vector<bool> masked = {false, true};
  const auto ref = kernels::host::LowLatencyDispatchReference(g.shape(), {.use_fp8 = true}, g.inputs(), masked);
  const auto count = g.Download<int32_t>(0, g.ranks()[0].recv_count, g.layout().num_local_experts);
  EXPECT_EQ(count, ref[0].packed_recv_count);
}

}  // namespace
}  // namespace epfabric::testing
