// The host backend with ranks as threads over malloc'ed regions: every data-path operation compared element by
// element with the host references (intranode_reference, low_latency_reference) on fresh random inputs, edge cases,
// back-to-back calls, and a rank that never takes part (bounded wait, error naming it, clean call afterwards).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "epfabric/kernels/host_backend_numeric.h"
#include "host_backend_threads.h"

namespace epfabric::kernels::host_backend_test {
namespace {

constexpr uint64_t kShortTimeoutNs = 100ull * 1000 * 1000;

// Runs the cases one after the other on one group (back-to-back calls on the same regions).
std::string RunIntranodeSequence(const std::vector<IntranodeCase>& cases) {
  std::vector<IntranodeExpected> expected;
  for (const IntranodeCase& c : cases) expected.push_back(MakeIntranodeExpected(c));
  IntranodeRegions regions(IntranodeConfigFor(cases));
  return RunRanks(cases.front().num_ranks(), [&](int rank, Mismatches* m) {
    const IntranodeGroup group = regions.Group(rank);
    for (const IntranodeExpected& x : expected) RunIntranodeCase(group, x, m);
  });
}

TEST(HostIntranode, OneRankBf16AndFp8) {
  EXPECT_EQ(RunIntranodeSequence({Case({37}, 256, 4, 8, false, 1), Case({50}, 256, 4, 8, true, 2)}), "");
}

TEST(HostIntranode, TwoRanksAllTopkModesAndBias) {
  IntranodeCase a = Case({100, 61}, 512, 6, 32, false, 3);
  a.bias = true;
  a.expert_alignment = 4;
  IntranodeCase b = Case({40, 90}, 512, 6, 32, true, 4);
  b.topk = TopkMode::kIdsOnly;
  b.worst_case_capacity = true;
  IntranodeCase c = Case({70, 70}, 256, 3, 32, false, 5);
  c.topk = TopkMode::kNone;
  c.num_channels = 1;
  EXPECT_EQ(RunIntranodeSequence({a, b, c}), "");
}

TEST(HostIntranode, FourRanksHidden7168) {
  IntranodeCase a = Case({64, 33, 0, 48}, 7168, 8, 64, false, 6);
  a.bias = true;
  a.num_channels = 5;
  IntranodeCase b = Case({20, 64, 17, 1}, 7168, 8, 64, true, 7);
  b.routing.invalid_fraction = 0.05;
  IntranodeCase packed = Case({9, 64, 30, 0}, 7168, 8, 64, true, 11);
  packed.packed_scales = true;  // DeepEP's UE8M0 int32 scale words, 14 per token
  EXPECT_EQ(RunIntranodeSequence({a, b, packed}), "");
}

TEST(HostIntranode, EdgeCases) {
  // No tokens anywhere; one token each; a rank that sends nothing; every token to expert 0; many empty slots and
  // ids out of range; more channels than tokens.
  IntranodeCase none = Case({0, 0}, 256, 2, 8, false, 8);
  IntranodeCase ones = Case({1, 1}, 256, 2, 8, true, 9);
  ones.num_channels = 4;
  IntranodeCase silent = Case({30, 25, 12, 40}, 256, 4, 16, false, 10);
  silent.routing.silent_rank = 2;
  silent.bias = true;
  IntranodeCase one_expert = Case({30, 25, 12, 40}, 256, 4, 16, true, 11);
  one_expert.routing.all_to_one_expert = true;
  IntranodeCase sparse = Case({33, 21, 0, 1}, 256, 8, 16, false, 12);
  sparse.routing.empty_fraction = 0.7;
  sparse.routing.invalid_fraction = 0.2;
  EXPECT_EQ(RunIntranodeSequence({none, ones}), "");
  EXPECT_EQ(RunIntranodeSequence({silent, one_expert, sparse}), "");
}

TEST(HostIntranode, ManyBackToBackCallsWithRandomShapes) {
  std::mt19937_64 rng(1234);
  std::vector<IntranodeCase> cases;
  for (int i = 0; i < 40; ++i) {
    IntranodeCase c =
        Case({static_cast<int>(rng() % 40), static_cast<int>(rng() % 40), static_cast<int>(rng() % 40)},
             128 * static_cast<int>(1 + rng() % 3), 1 + static_cast<int>(rng() % 6), 24, i % 2 == 1, 100 + i);
    c.num_channels = 1 + static_cast<int>(rng() % 6);
    c.topk = static_cast<TopkMode>(rng() % 3);
    c.bias = rng() % 2 == 0;
    cases.push_back(c);
  }
  EXPECT_EQ(RunIntranodeSequence(cases), "");
}

TEST(HostIntranode, RejectsBadInputNamingFieldAndValue) {
  IntranodeRegions regions(IntranodeConfigFor({Case({4, 4}, 256, 2, 8, false, 1)}));
  IntranodeGroup group = regions.Group(0);
  IntranodeNotifyParams np;
  int32_t counts[8] = {};
  int32_t prefix[4];
  np.num_tokens_per_rank = counts;
  np.num_tokens_per_expert = counts;
  np.num_tokens = 5;  // more than max_tokens_per_rank
  np.num_experts = 8;
  np.rank_prefix_matrix = prefix;
  absl::Status s = host_backend::IntranodeNotify(group, np);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), testing::HasSubstr("num_tokens = 5"));
  group.rank = 2;
  s = host_backend::IntranodeNotify(group, np);
  EXPECT_THAT(s.message(), testing::HasSubstr("group.rank = 2"));
}

// Notify inputs of one token per rank and no expert counts, for calls that stop at the barrier.
struct BarrierOnlyNotify {
  BarrierOnlyNotify(int num_ranks, int num_experts)
      : per_rank(num_ranks, 1), per_expert(num_experts, 0), prefix(num_ranks * num_ranks) {
    params.num_tokens_per_rank = per_rank.data();
    params.num_tokens_per_expert = per_expert.data();
    params.num_tokens = num_ranks;
    params.num_experts = num_experts;
    params.rank_prefix_matrix = prefix.data();
  }
  BarrierOnlyNotify(const BarrierOnlyNotify&) = delete;  // params point into the vectors
  std::vector<int32_t> per_rank, per_expert, prefix;
  IntranodeNotifyParams params;
};

TEST(HostIntranode, MissingPeerTimesOutNamingItThenResetAndCleanCallWork) {
  const IntranodeCase c = Case({20, 30}, 256, 4, 8, false, 42);
  IntranodeRegions regions(IntranodeConfigFor({c}));
  KernelStatus status{};
  const IntranodeGroup group = regions.Group(0, kShortTimeoutNs, &status);
  const BarrierOnlyNotify notify(2, 8);
  const IntranodeNotifyParams& np = notify.params;
  const auto start = std::chrono::steady_clock::now();
  const absl::Status s = host_backend::IntranodeNotify(group, np);  // rank 1 never calls
  const double elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_EQ(s.message(), "rank 0 timed out waiting for barrier from rank 1 (channel 0)");
  EXPECT_GE(elapsed_s, 0.1);
  EXPECT_LT(elapsed_s, 1.0);
  // The status word says the same, as the GPU's would.
  EXPECT_EQ(KernelStatusToStatus(status), s);

  // Rank 0's arrival is still counted in rank 1's region: every rank resets, then the group works again.
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(host_backend::IntranodeResetRegion(regions.Group(r)).ok());
  const IntranodeExpected x = MakeIntranodeExpected(c);
  EXPECT_EQ(RunRanks(2, [&](int rank, Mismatches* m) { RunIntranodeCase(regions.Group(rank), x, m); }), "");
}

// Normal mode needs every rank: a wait on a live but silent peer (rank 1) ends as soon as another rank (2) is
// published as lost, naming the lost one, long before the timeout; a lost rank the Buffer ignores (lost_ignore) is
// waited for as before.
TEST(HostIntranode, AWaitOnAnyPeerEndsWhenAnotherRankIsLost) {
  const IntranodeCase c = Case({20, 30, 10}, 256, 4, 12, false, 43);
  IntranodeRegions regions(IntranodeConfigFor({c}));
  uint64_t lost[kLostRankWords] = {uint64_t{1} << 2};
  const BarrierOnlyNotify notify(3, 12);
  const IntranodeNotifyParams& np = notify.params;

  KernelStatus status{};
  IntranodeGroup group = regions.Group(0, 10ull * 1000 * 1000 * 1000, &status);
  group.lost_ranks = lost;
  const auto start = std::chrono::steady_clock::now();
  const absl::Status s = host_backend::IntranodeNotify(group, np);  // ranks 1 and 2 never call
  const double elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()),
              testing::StartsWith("rank 0 stopped waiting for barrier from rank 2 (channel 0): rank 2 is lost"));
  EXPECT_LT(elapsed_s, 1.0);

  for (int r = 0; r < 3; ++r) ASSERT_TRUE(host_backend::IntranodeResetRegion(regions.Group(r)).ok());
  KernelStatus status2{};
  IntranodeGroup ignoring = regions.Group(0, kShortTimeoutNs, &status2);
  ignoring.lost_ranks = lost;
  ignoring.lost_ignore[0] = uint64_t{1} << 2;
  const absl::Status t = host_backend::IntranodeNotify(ignoring, np);
  EXPECT_EQ(t.code(), absl::StatusCode::kDeadlineExceeded) << t;
  EXPECT_EQ(t.message(), "rank 0 timed out waiting for barrier from rank 1 (channel 0)");
}

// A rank that leaves a call before its intranode stage (a group across hosts whose RDMA stage failed) tells its
// peers: rank 0's barrier wait for it ends at once with UNAVAILABLE naming it, not at the (10 s) timeout; rank 2,
// which arrived, is not blamed. After every rank resets, the group gives correct results again.
TEST(HostIntranode, AWaitOnAPeerThatLeftTheCallEndsAtOnce) {
  const IntranodeCase c = Case({20, 30, 10}, 256, 4, 12, false, 44);
  IntranodeRegions regions(IntranodeConfigFor({c}));
  const BarrierOnlyNotify notify(3, 12);
  ASSERT_TRUE(host_backend::IntranodeAbandonCall(regions.Group(1)).ok());
  absl::Status third;
  std::thread rank2([&] { third = host_backend::IntranodeNotify(regions.Group(2, kShortTimeoutNs), notify.params); });
  KernelStatus status{};
  const auto start = std::chrono::steady_clock::now();
  const absl::Status s =
      host_backend::IntranodeNotify(regions.Group(0, 10ull * 1000 * 1000 * 1000, &status), notify.params);
  const double elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  rank2.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ(s.message(),
            "rank 0 stopped waiting for barrier from rank 1 (channel 0): rank 1 left the call (its own error says "
            "why)");
  EXPECT_LT(elapsed_s, 1.0);
  EXPECT_EQ(KernelStatusToStatus(status), s);  // the status word says the same
  EXPECT_EQ(third.code(), absl::StatusCode::kUnavailable) << third;
  EXPECT_THAT(std::string(third.message()), testing::HasSubstr("from rank 1 (channel 0): rank 1 left the call"));

  for (int r = 0; r < 3; ++r) ASSERT_TRUE(host_backend::IntranodeResetRegion(regions.Group(r)).ok());
  const IntranodeExpected x = MakeIntranodeExpected(c);
  EXPECT_EQ(RunRanks(3, [&](int rank, Mismatches* m) { RunIntranodeCase(regions.Group(rank), x, m); }), "");
}

// ---------------------------------------------------------------------------------------------------------------

// `ranks_per_host` > 0: the ranks form hosts (LowLatencyRegions).
std::string RunLowLatency(const LowLatencyCase& c, int ranks_per_host = 0) {
  const std::vector<LowLatencyIteration> its = MakeLowLatencyExpected(c);
  LowLatencyRegions regions(c, ranks_per_host);
  // With masked ranks: each running rank has its own mask (device memory per rank on the GPU); masked ranks run
  // nothing.
  std::vector<std::vector<int32_t>> masks(c.num_ranks, std::vector<int32_t>(c.num_ranks, 0));
  for (int r = 0; r < static_cast<int>(c.masked.size()); ++r) {
    for (auto& mask : masks) mask[r] = c.masked[r] ? 1 : 0;
  }
  return RunRanks(c.num_ranks, [&](int rank, Mismatches* m) {
    if (rank < static_cast<int>(c.masked.size()) && c.masked[rank]) return;
    RunLowLatencyCase(regions.Context(rank, kTestTimeoutNs, nullptr, c.masked.empty() ? nullptr : masks[rank].data()),
                      c, its, m);
  });
}

// Across hosts, past one NVLink domain's 8 ranks, and past 64 and 128 (the second and third words of the rank sets):
// what a rank writes for a rank on another host goes through its compact outbox into that rank's inbox (a 4-byte put
// last).
TEST(HostLowLatency, RanksOnSeveralHostsThroughOutboxes) {
  for (const auto& [ranks, per_host] : std::vector<std::pair<int, int>>{{4, 2}, {12, 4}, {40, 8}, {72, 8}, {136, 8}}) {
    LowLatencyCase c = LLCase(ranks, 6, 256, 2 * ranks, 8, 40 + ranks);
    c.fp8 = ranks != 12;
    c.iterations = 3;
    EXPECT_EQ(RunLowLatency(c, per_host), "") << ranks << " ranks, " << per_host << " per host";
  }
}

// A reset clears every signal a later call could take for this call's: both halves of the own region and of the inbox,
// and of the outbox for every rank on another host (what a relay sends when it finds it nonzero).
TEST(HostLowLatency, ResetClearsTheInboxAndOutboxSignals) {
  const LowLatencyCase c = LLCase(4, 4, 256, 8, 2, 50);
  LowLatencyRegions regions(c, /*ranks_per_host=*/2);
  const LowLatencyContext ctx = regions.Context(0);
  const LowLatencyLayout& l = regions.layout();
  std::vector<std::pair<uint8_t*, size_t>> signals;
  for (int half = 0; half < 2; ++half) {
    signals.push_back({static_cast<uint8_t*>(ctx.peer_regions[0]) + half * l.half_bytes, l.signal_bytes});
    signals.push_back({static_cast<uint8_t*>(ctx.remote_inbox) + half * l.half_bytes, l.signal_bytes});
    for (int r : {2, 3}) {
      signals.push_back(
          {static_cast<uint8_t*>(ctx.peer_regions[r]) + half * l.outbox_half_bytes, l.outbox_signal_bytes});
    }
  }
  for (const auto& [at, bytes] : signals) std::memset(at, 0x5a, bytes);
  ASSERT_TRUE(host_backend::LowLatencyResetRegion(ctx).ok());
  for (const auto& [at, bytes] : signals) {
    EXPECT_EQ(std::count(at, at + bytes, 0), static_cast<std::ptrdiff_t>(bytes)) << "a signal range kept its bytes";
  }
}

TEST(HostLowLatency, OneRankFp8AndBf16) {
  LowLatencyCase c = LLCase(1, 9, 256, 4, 3, 1);
  c.iterations = 3;
  EXPECT_EQ(RunLowLatency(c), "");
  c.fp8 = false;
  c.hook = true;
  c.zero_copy = true;
  EXPECT_EQ(RunLowLatency(c), "");
}

TEST(HostLowLatency, TwoRanksAllNumericModes) {
  for (int mode = 0; mode < 4; ++mode) {
    LowLatencyCase c = LLCase(2, 24, 1024, 16, 6, 10 + mode);
    c.iterations = 2;
    c.fp8 = mode != 3;
    c.round_scale = mode >= 1;
    c.ue8m0 = mode == 2;
    c.zero_copy = mode % 2 == 1;
    c.hook = mode >= 2;
    EXPECT_EQ(RunLowLatency(c), "") << "mode " << mode;
  }
}

TEST(HostLowLatency, FourRanksHidden7168HookAndZeroCopy) {
  LowLatencyCase c = LLCase(4, 16, 7168, 32, 8, 20);
  c.round_scale = true;
  c.ue8m0 = true;
  c.hook = true;
  c.zero_copy = true;
  c.iterations = 2;
  EXPECT_EQ(RunLowLatency(c), "");
  c.fp8 = false;
  c.round_scale = c.ue8m0 = false;
  c.hook = c.zero_copy = false;
  c.seed = 21;
  EXPECT_EQ(RunLowLatency(c), "");
}

TEST(HostLowLatency, EdgeCases) {
  LowLatencyCase zero = LLCase(2, 4, 256, 4, 2, 30);
  zero.num_tokens = {0, 0};
  EXPECT_EQ(RunLowLatency(zero), "");
  LowLatencyCase ones = LLCase(4, 1, 256, 8, 2, 31);
  ones.num_tokens = {1, 1, 1, 1};
  EXPECT_EQ(RunLowLatency(ones), "");
  LowLatencyCase silent = LLCase(4, 12, 256, 8, 4, 32);
  silent.routing.silent_rank = 1;
  silent.iterations = 3;
  EXPECT_EQ(RunLowLatency(silent), "");
  LowLatencyCase one_expert = LLCase(4, 12, 512, 8, 4, 33);
  one_expert.routing.all_to_one_expert = true;
  one_expert.round_scale = one_expert.ue8m0 = true;
  EXPECT_EQ(RunLowLatency(one_expert), "");
  LowLatencyCase sparse = LLCase(2, 12, 256, 8, 8, 34);
  sparse.routing.empty_fraction = 0.6;
  sparse.routing.invalid_fraction = 0.2;
  sparse.max_tokens = 12;
  sparse.num_tokens = {12, 12};
  EXPECT_EQ(RunLowLatency(sparse), "");
}

TEST(HostLowLatency, MaskedRanksTakeNoPart) {
  // Mooncake-style masking: ranks 1 and 2 of 4 are masked from the start; the others neither send to them nor wait
  // for them, and their experts count as zero (the references with the same mask).
  LowLatencyCase c = LLCase(4, 10, 256, 8, 4, 45);
  c.masked = {false, true, true, false};
  c.iterations = 4;
  c.hook = true;
  EXPECT_EQ(RunLowLatency(c), "");
}

TEST(HostLowLatency, ManyBackToBackCallsAlternateHalves) {
  // 60 dispatch + combine pairs per setting (the halves alternate 240 times), random token counts each time.
  for (int hook = 0; hook < 2; ++hook) {
    LowLatencyCase c = LLCase(3, 8, 128, 6, 3, 40 + hook);
    c.iterations = 60;
    c.hook = hook == 1;
    c.zero_copy = hook == 1;
    c.round_scale = true;
    EXPECT_EQ(RunLowLatency(c), "") << "hook " << hook;
  }
}

TEST(HostLowLatency, RejectsBadArguments) {
  const LowLatencyCase c = LLCase(2, 4, 256, 4, 2, 1);
  LowLatencyRegions regions(c);
  LowLatencyDispatchArgs d;
  d.num_tokens = 5;
  d.num_topk = 2;
  d.hidden = 256;
  d.max_tokens_per_rank = 4;
  d.num_experts = 4;
  const absl::Status s = host_backend::LowLatencyDispatch(regions.Context(0), d);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), testing::HasSubstr("num_tokens = 5"));
}

TEST(HostLowLatency, MissingPeerTimesOutNamingItThenResetAndCleanCallWork) {
  LowLatencyCase c = LLCase(2, 8, 256, 4, 2, 50);
  c.num_tokens = {8, 8};
  LowLatencyRegions regions(c);
  const std::vector<LowLatencyIteration> its = MakeLowLatencyExpected(c);
  KernelStatus status{};
  int32_t rank_mask[2] = {0, 0};
  const LowLatencyContext ctx = regions.Context(0, kShortTimeoutNs, &status, rank_mask);
  // Rank 0 dispatches alone: its receive phase waits for rank 1's counts.
  const host::LowLatencyRankInput& in = its[0].inputs[0];
  const int L = 2, slots = 16;
  std::vector<uint8_t> packed_x(L * slots * 256);
  std::vector<float> scales(L * slots * 2);
  std::vector<int32_t> count(L), src_info(L * slots), topk_slot(L * slots), token_map(slots * kLowLatencyMaxTopk);
  std::vector<int64_t> layout_range(L * 2);
  LowLatencyDispatchArgs d;
  d.x = in.x.data();
  d.topk_idx = in.topk_idx.data();
  d.num_tokens = in.num_tokens;
  d.num_topk = 2;
  d.hidden = 256;
  d.max_tokens_per_rank = 8;
  d.num_experts = 4;
  d.packed_recv_x = packed_x.data();
  d.packed_recv_x_scales = scales.data();
  d.packed_recv_count = count.data();
  d.packed_recv_src_info = src_info.data();
  d.packed_recv_layout_range = layout_range.data();
  d.packed_recv_topk_slot = topk_slot.data();
  d.packed_recv_token_map = token_map.data();
  const auto start = std::chrono::steady_clock::now();
  const absl::Status s = host_backend::LowLatencyDispatch(ctx, d);
  const double elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_EQ(s.message(), "rank 0 timed out waiting for low-latency receive count from rank 1 (channel 0)");
  EXPECT_LT(elapsed_s, 1.0);  // one wait per silent peer, not one per expert
  EXPECT_EQ(rank_mask[1], 1) << "the silent peer is masked, as on the GPU";
  EXPECT_EQ(KernelStatusToStatus(status), s);
  // What rank 0 received is rank 0's own share: the reference with rank 1 masked.
  const auto masked = host::LowLatencyDispatchReference(ShapeOf(c), {.use_fp8 = true}, its[0].inputs, {false, true});
  EXPECT_EQ(count, masked[0].packed_recv_count);

  // Reset every rank's region (both halves), restart the cursors, unmask: a clean run passes.
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(host_backend::LowLatencyResetRegion(regions.Context(r)).ok());
  EXPECT_EQ(RunRanks(2, [&](int rank, Mismatches* m) { RunLowLatencyCase(regions.Context(rank), c, its, m); }), "");
}

// ---------------------------------------------------------------------------------------------------------------
// The numeric helpers against the references' scalar functions (the FMA-instruction path included).

TEST(HostNumeric, RowHelpersMatchTheReferencesBitForBit) {
  std::mt19937_64 rng(5);
  const int n = 1031;  // not a multiple of any vector width
  std::vector<uint16_t> row(n);
  std::vector<float> acc(n), want(n);
  for (int trial = 0; trial < 20; ++trial) {
    for (int i = 0; i < n; ++i) {
      row[i] = RandomWideBf16(rng);
      acc[i] = want[i] = ref::Bf16ToFloat(RandomWideBf16(rng));
    }
    const float w = ref::Bf16ToFloat(RandomWideBf16(rng)) * 0.37f;
    host_backend::internal::FmaBf16Row(acc.data(), row.data(), w, n);
    for (int i = 0; i < n; ++i) want[i] = std::fmaf(ref::Bf16ToFloat(row[i]), w, want[i]);
    ASSERT_EQ(std::memcmp(acc.data(), want.data(), n * sizeof(float)), 0) << "trial " << trial;
    host_backend::internal::AddBf16Row(acc.data(), row.data(), n);
    for (int i = 0; i < n; ++i) want[i] += ref::Bf16ToFloat(row[i]);
    ASSERT_EQ(std::memcmp(acc.data(), want.data(), n * sizeof(float)), 0) << "trial " << trial;
  }
  const float specials[] = {0.0f, -0.0f, 1.00390625f, 1.01171875f, 3.4e38f, -3.4e38f, std::nanf(""), INFINITY, 1e-40f};
  std::vector<uint16_t> got(std::size(specials));
  host_backend::internal::StoreBf16Row(got.data(), specials, static_cast<int>(std::size(specials)));
  for (size_t i = 0; i < std::size(specials); ++i) EXPECT_EQ(got[i], ref::FloatToBf16(specials[i])) << specials[i];
}

TEST(HostNumeric, FastFp8MatchesTheReferenceConversion) {
  // 17 million float bit patterns spread over the whole range, then every rounding tie of the normal range.
  for (uint64_t bits = 0; bits <= 0xffffffffull; bits += 251) {
    const uint32_t b = static_cast<uint32_t>(bits);
    float v;
    std::memcpy(&v, &b, sizeof(v));
    ASSERT_EQ(host_backend::internal::FloatToFp8E4M3Fast(v), host::FloatToFp8E4M3(v)) << std::hexfloat << v;
  }
  for (uint32_t exponent = 100; exponent < 140; ++exponent) {
    for (uint32_t mantissa = 0; mantissa < 16; ++mantissa) {
      for (uint32_t sign = 0; sign < 2; ++sign) {
        const uint32_t b = (sign << 31) | (exponent << 23) | (mantissa << 19) | (mantissa % 2 == 1 ? 0 : 0x40000);
        float v;
        std::memcpy(&v, &b, sizeof(v));
        ASSERT_EQ(host_backend::internal::FloatToFp8E4M3Fast(v), host::FloatToFp8E4M3(v)) << std::hexfloat << v;
      }
    }
  }
  // Subnormal ties: odd multiples of 2^-10.
  for (int k = 1; k < 32; k += 2) {
    const float v = std::ldexp(static_cast<float>(k), -10);
    ASSERT_EQ(host_backend::internal::FloatToFp8E4M3Fast(v), host::FloatToFp8E4M3(v)) << v;
  }
  std::mt19937_64 rng(9);
  std::vector<uint16_t> row(1024);
  std::vector<uint8_t> got(1024), want(1024);
  std::vector<float> got_scales(8), want_scales(8);
  for (int trial = 0; trial < 50; ++trial) {
    for (uint16_t& v : row) v = trial % 2 == 0 ? RandomWideBf16(rng) : RandomBf16(rng, 500.0f);
    const bool round_scale = trial % 4 < 2;
    host_backend::internal::QuantizeRowFp8Fast(row.data(), 1024, round_scale, got.data(), got_scales.data());
    host::QuantizeRowFp8(row.data(), 1024, round_scale, want.data(), want_scales.data());
    ASSERT_EQ(got, want) << "trial " << trial;
    ASSERT_EQ(std::memcmp(got_scales.data(), want_scales.data(), 8 * sizeof(float)), 0) << "trial " << trial;
  }
}

}  // namespace
}  // namespace epfabric::kernels::host_backend_test
