// GPU tests of the intranode kernels: groups of 1, 2 and 4 ranks driven from one process (a region per rank, one
// stream per rank, every rank's kernel launched before any is waited on), compared element by element with the
// host reference (kernels/reference/intranode_reference.h). Rank r runs on GPU r mod (visible GPUs): on a one-GPU
// machine all ranks share GPU 0 (peers addressed by plain device pointers), with several GPUs through peer access.
// Every case needs one GPU; the channel counts are chosen so that 4 ranks x channels fit on one H100/H200 (132 SMs; the
// harness refuses a shape whose blocks cannot all be resident). Inputs are fresh random data (the seed is printed) and
// every output is poisoned with 0xFF bytes before each kernel writes it.
//
// Tolerance for combine: the kernels accumulate in float in the same order as the reference (source ranks
// ascending, then bias_0, then bias_1) and round once to BF16, so the results are expected to be identical; the
// check allows |gpu - ref| <= 1e-2 * |ref| + 1e-2 (ref = the float sum before rounding: one BF16 rounding is at
// most 2^-8 relative) and reports how many elements differ from the reference's BF16 at all.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "epfabric/kernels/intranode.h"
#include "epfabric/kernels/reference/intranode_reference.h"
#include "gpu_env.h"
#include "intranode_harness.h"

namespace epfabric::testing {
namespace {

namespace ref = kernels::reference;

constexpr int kNumExperts = 256;

kernels::IntranodeRegionConfig RegionConfig(int num_ranks) {
  kernels::IntranodeRegionConfig c;
  c.num_ranks = num_ranks;
  c.max_tokens_per_rank = 4096;
  c.max_hidden = 7168;
  c.max_topk = 8;
  c.num_experts = kNumExperts;
  c.max_channels = 32;
  return c;
}

uint64_t FreshSeed() {
  return std::random_device{}() ^ static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
}

// Collects mismatch descriptions (at most a few per array).
class Mismatches {
 public:
  template <typename T>
  void CompareExact(const std::string& what, const std::vector<T>& got, const std::vector<T>& want) {
    if (got.size() != want.size()) {
      Add(absl::StrFormat("%s: size %d != %d", what, got.size(), want.size()));
      return;
    }
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
        if (bad++ == 0) first = i;
      }
    }
    if (bad > 0) {
      Add(absl::StrCat(what, ": ", bad, " of ", got.size(), " elements differ, first at ", first, " (got ",
                       ToString(got[first]), ", want ", ToString(want[first]), ")"));
    }
  }
  void Add(std::string message) { messages_.push_back(std::move(message)); }
  bool empty() const { return messages_.empty(); }
  std::string ToString() const { return absl::StrJoin(messages_, "\n"); }

 private:
  template <typename T>
  static std::string ToString(const T& v) {
    if constexpr (std::is_floating_point_v<T>)
      return absl::StrFormat("%g", v);
    else
      return absl::StrCat(static_cast<int64_t>(v));
  }
  std::vector<std::string> messages_;
};

#define EPF_ASSIGN_OR_FAIL(lhs, expr, mism)   \
  auto lhs##_or = (expr);                     \
  if (!lhs##_or.ok()) {                       \
    (mism).Add(lhs##_or.status().ToString()); \
    return;                                   \
  }                                           \
  auto lhs = std::move(*lhs##_or)

#define EPF_OK_OR_FAIL(expr, mism)                          \
  do {                                                      \
    absl::Status s_ = (expr);                               \
    if (!s_.ok()) {                                         \
      (mism).Add(absl::StrCat(#expr, ": ", s_.ToString())); \
      return;                                               \
    }                                                       \
  } while (0)

void CompareDispatch(PipelineRunner& runner, const std::vector<ref::RankOutput>& want, const std::string& tag,
                     Mismatches& m) {
  const CaseConfig& c = runner.config();
  const ref::DispatchConfig d = MakeReferenceConfig(c);
  const int R = static_cast<int>(want.size());
  for (int r = 0; r < R; ++r) {
    RankBuffers& b = runner.buffers(r);
    const ref::RankOutput& w = want[r];
    const std::string p = absl::StrCat(tag, " rank ", r, " ");
    const size_t n = w.num_recv_tokens;
    if (b.num_recv_tokens != w.num_recv_tokens) {
      m.Add(absl::StrCat(p, "num_recv_tokens ", b.num_recv_tokens, " != ", w.num_recv_tokens));
      return;
    }
    EPF_ASSIGN_OR_FAIL(recv_x, DownloadVector<uint8_t>(b.recv_x, n * d.row_bytes), m);
    m.CompareExact(p + "recv_x", recv_x, w.recv_x);
    if (c.fp8) {
      EPF_ASSIGN_OR_FAIL(scales, DownloadVector<float>(b.recv_x_scales, n * d.num_scales), m);
      m.CompareExact(p + "recv_x_scales", scales, w.recv_x_scales);
    }
    if (c.send_topk) {
      EPF_ASSIGN_OR_FAIL(idx, DownloadVector<int64_t>(b.recv_topk_idx, n * c.num_topk), m);
      m.CompareExact(p + "recv_topk_idx", idx, w.recv_topk_idx);
      if (c.send_weights) {
        EPF_ASSIGN_OR_FAIL(weights, DownloadVector<float>(b.recv_topk_weights, n * c.num_topk), m);
        m.CompareExact(p + "recv_topk_weights", weights, w.recv_topk_weights);
      }
    }
    EPF_ASSIGN_OR_FAIL(src_idx, DownloadVector<int32_t>(b.recv_src_idx, n), m);
    m.CompareExact(p + "recv_src_idx", src_idx, w.recv_src_idx);
    EPF_ASSIGN_OR_FAIL(chan, DownloadVector<int32_t>(b.recv_channel_prefix, w.recv_channel_prefix.size()), m);
    m.CompareExact(p + "recv_channel_prefix", chan, w.recv_channel_prefix);
    EPF_ASSIGN_OR_FAIL(slots, DownloadVector<int32_t>(b.send_slot, w.send_slot.size()), m);
    m.CompareExact(p + "send_slot", slots, w.send_slot);
  }
}

struct CombineStats {
  size_t elements = 0;
  size_t not_bitwise_equal = 0;
  double max_abs_error = 0;
};

// Runs layout, notify, dispatch, cached dispatch and combine for one case; appends mismatches to `m`.
void RunCase(IntranodeTestGroup& group, const CaseConfig& c, uint64_t seed, Mismatches& m, CombineStats* stats) {
  std::mt19937_64 rng(seed);
  const std::vector<ref::RankInput> inputs = MakeInputs(c, rng);
  const ref::DispatchConfig dcfg = MakeReferenceConfig(c);
  const std::vector<ref::RankOutput> want = ref::Dispatch(inputs, dcfg);
  const int R = group.num_ranks();
  PipelineRunner runner(&group, c);
  EPF_OK_OR_FAIL(runner.Prepare(inputs), m);

  // Layout.
  EPF_OK_OR_FAIL(runner.RunLayout(), m);
  for (int r = 0; r < R; ++r) {
    RankBuffers& b = runner.buffers(r);
    const std::string p = absl::StrCat("layout rank ", r, " ");
    EPF_ASSIGN_OR_FAIL(per_rank, DownloadVector<int32_t>(b.num_tokens_per_rank, R), m);
    m.CompareExact(p + "num_tokens_per_rank", per_rank, want[r].layout.num_tokens_per_rank);
    EPF_ASSIGN_OR_FAIL(per_expert, DownloadVector<int32_t>(b.num_tokens_per_expert, c.num_experts), m);
    m.CompareExact(p + "num_tokens_per_expert", per_expert, want[r].layout.num_tokens_per_expert);
    EPF_ASSIGN_OR_FAIL(in_rank, DownloadVector<uint8_t>(b.is_token_in_rank, static_cast<size_t>(b.num_tokens) * R), m);
    m.CompareExact(p + "is_token_in_rank", in_rank, want[r].layout.is_token_in_rank);
    EPF_ASSIGN_OR_FAIL(invalid, DownloadVector<int32_t>(b.num_invalid_topk, 1), m);
    m.CompareExact(p + "num_invalid_topk", invalid, std::vector<int32_t>{want[r].layout.num_invalid_topk});
  }
  if (!m.empty()) return;

  // Notify.
  EPF_OK_OR_FAIL(runner.RunNotify(), m);
  for (int r = 0; r < R; ++r) {
    RankBuffers& b = runner.buffers(r);
    const std::string p = absl::StrCat("notify rank ", r, " ");
    EPF_ASSIGN_OR_FAIL(prefix, DownloadVector<int32_t>(b.rank_prefix_matrix, R * R), m);
    m.CompareExact(p + "rank_prefix_matrix", prefix, want[r].rank_prefix_matrix);
    const int epr = c.num_experts / R;
    std::vector<int32_t> host_counts(group.rank(r).host_counts, group.rank(r).host_counts + 1 + epr);
    std::vector<int32_t> want_counts{want[r].num_recv_tokens};
    want_counts.insert(want_counts.end(), want[r].num_recv_tokens_per_expert.begin(),
                       want[r].num_recv_tokens_per_expert.end());
    m.CompareExact(p + "mapped host counts", host_counts, want_counts);
    EPF_ASSIGN_OR_FAIL(dev_counts, DownloadVector<int32_t>(b.recv_counts, 1 + epr), m);
    m.CompareExact(p + "device recv_counts", dev_counts, want_counts);
  }
  if (!m.empty()) return;

  // Dispatch, then cached dispatch (same handle, no notify) into re-poisoned outputs.
  EPF_OK_OR_FAIL(runner.RunDispatch(), m);
  CompareDispatch(runner, want, "dispatch", m);
  if (!m.empty()) return;
  EPF_OK_OR_FAIL(runner.PoisonRecv(), m);
  EPF_OK_OR_FAIL(runner.RunDispatch(), m);
  CompareDispatch(runner, want, "cached dispatch", m);
  if (!m.empty()) return;

  // Combine: random BF16 expert outputs per received row, the received weights, optional biases.
  std::vector<ref::CombineInput> cin(R);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  const bool weights = c.send_topk && c.send_weights;
  for (int r = 0; r < R; ++r) {
    cin[r].x.resize(static_cast<size_t>(want[r].num_recv_tokens) * c.hidden);
    for (uint16_t& v : cin[r].x) v = ref::FloatToBf16(value(rng));
    if (weights) cin[r].topk_weights = want[r].recv_topk_weights;
    if (c.with_bias) {
      cin[r].bias_0.resize(static_cast<size_t>(inputs[r].num_tokens) * c.hidden);
      cin[r].bias_1.resize(cin[r].bias_0.size());
      for (uint16_t& v : cin[r].bias_0) v = ref::FloatToBf16(value(rng));
      for (uint16_t& v : cin[r].bias_1) v = ref::FloatToBf16(value(rng));
    }
  }
  const std::vector<ref::CombineOutput> want_combined = ref::Combine(want, cin, c.hidden, weights ? c.num_topk : 0);
  EPF_OK_OR_FAIL(runner.PrepareCombine(cin), m);
  EPF_OK_OR_FAIL(runner.RunCombine(), m);
  for (int r = 0; r < R; ++r) {
    RankBuffers& b = runner.buffers(r);
    const size_t n = static_cast<size_t>(inputs[r].num_tokens) * c.hidden;
    EPF_ASSIGN_OR_FAIL(got, DownloadVector<uint16_t>(b.combined_x, n), m);
    size_t bad = 0, first_bad = 0;
    for (size_t i = 0; i < n; ++i) {
      const float g = ref::Bf16ToFloat(got[i]);
      const float w = want_combined[r].combined_x_float[i];
      const double err = std::fabs(static_cast<double>(g) - w);
      if (!(err <= 1e-2 * std::fabs(w) + 1e-2)) {
        if (bad++ == 0) first_bad = i;
      }
      if (stats != nullptr) {
        stats->elements++;
        if (got[i] != want_combined[r].combined_x[i]) stats->not_bitwise_equal++;
        if (err > stats->max_abs_error) stats->max_abs_error = err;
      }
    }
    if (bad > 0) {
      m.Add(absl::StrFormat("combine rank %d: %d of %d elements out of tolerance, first at %d (got %g, want %g)", r,
                            bad, n, first_bad, ref::Bf16ToFloat(got[first_bad]),
                            want_combined[r].combined_x_float[first_bad]));
    }
    if (weights) {
      EPF_ASSIGN_OR_FAIL(got_w, DownloadVector<float>(b.combined_weights, inputs[r].num_tokens * c.num_topk), m);
      m.CompareExact(absl::StrCat("combine rank ", r, " combined_topk_weights"), got_w,
                     want_combined[r].combined_topk_weights);
    }
  }
}

struct GpuCase {
  std::string name;
  int num_ranks;
  CaseConfig config;
};

CaseConfig Make(int hidden, std::vector<int> tokens, int topk, bool fp8, bool send_topk, bool send_weights,
                bool bias = false, int num_sms = 24) {
  CaseConfig c;
  c.hidden = hidden;
  c.num_tokens = std::move(tokens);
  c.num_topk = topk;
  c.num_experts = kNumExperts;
  c.fp8 = fp8;
  c.send_topk = send_topk;
  c.send_weights = send_weights;
  c.with_bias = bias;
  c.num_sms = num_sms;
  c.empty_slot_fraction = 0.05;
  return c;
}

std::vector<GpuCase> Cases() {
  std::vector<GpuCase> cases = {
      {"TwoRanksBf16H7168T4096Top8", 2, Make(7168, {4096, 4096}, 8, false, true, true)},
      {"TwoRanksFp8H7168T4096Top8", 2, Make(7168, {4096, 4096}, 8, true, true, true)},
      {"TwoRanksBf16H4096UnevenTop4NoTopkBias", 2, Make(4096, {4096, 1000}, 4, false, false, false, true)},
      {"TwoRanksFp8H4096UnevenTop1IdxOnly", 2, Make(4096, {1000, 4096}, 1, true, true, false)},
      {"TwoRanksBf16H256OneAndZeroTokens", 2, Make(256, {1, 0}, 1, false, true, true, true)},
      {"TwoRanksFp8H256ZeroTokens", 2, Make(256, {0, 0}, 8, true, true, true)},
      {"TwoRanksBf16H256T4096Top8Sms7", 2, Make(256, {4096, 3000}, 8, false, true, true, false, 7)},
      // Combine chunks by channel count (IntranodeCombineChunkBytes): 24 channels take 14 KB (the cases above), 16 take
      // 20 KB, 20 take 16 KB.
      {"TwoRanksBf16H7168UnevenTop8Sms16Bias", 2, Make(7168, {4096, 3000}, 8, false, true, true, true, 16)},
      {"TwoRanksBf16H7168UnevenTop8Sms20", 2, Make(7168, {2500, 4096}, 8, false, true, true, false, 20)},
      {"TwoRanksFp8H7168T1Top4", 2, Make(7168, {1, 1}, 4, true, true, true)},
      // 4 ranks x 24 channels = 96 blocks: resident together on one GPU of 132 (or 114) SMs.
      {"FourRanksBf16H7168T4096Top8", 4, Make(7168, {4096, 4096, 4096, 4096}, 8, false, true, true, true)},
      {"FourRanksFp8H4096UnevenTop4", 4, Make(4096, {3000, 0, 4096, 17}, 4, true, true, true, false, 16)},
      {"FourRanksBf16H2048UnevenNoTopk", 4, Make(2048, {1, 2048, 100, 4096}, 8, false, false, false, true, 24)},
      {"FourRanksBf16H256T4096Top8Sms7", 4, Make(256, {4096, 3000, 1, 2048}, 8, false, true, true, false, 7)},
      {"OneRankBf16H7168T4096Top8", 1, Make(7168, {4096}, 8, false, true, true, true)},
      {"OneRankFp8H256T1Top4", 1, Make(256, {1}, 4, true, true, true)},
      {"OneRankBf16H4096T0Top8", 1, Make(4096, {0}, 8, false, true, true)},
  };
  return cases;
}

class IntranodeDispatchCombineTest : public ::testing::TestWithParam<GpuCase> {};

TEST_P(IntranodeDispatchCombineTest, MatchesHostReference) {
  const GpuCase& gc = GetParam();
  EPF_REQUIRE_GPUS(1);
  auto group = IntranodeTestGroup::Create(RegionConfig(gc.num_ranks));
  ASSERT_TRUE(group.ok()) << group.status();
  std::printf("[   INFO   ] %s\n", (*group)->placement().ToString().c_str());
  const uint64_t seed = FreshSeed();
  Mismatches m;
  CombineStats stats;
  RunCase(**group, gc.config, seed, m, &stats);
  EXPECT_TRUE(m.empty()) << "seed " << seed << "\n" << m.ToString();
  std::printf("[   INFO   ] seed %llu: combine %zu elements, %zu not bitwise equal to the reference, max |err| %g\n",
              static_cast<unsigned long long>(seed), stats.elements, stats.not_bitwise_equal, stats.max_abs_error);
}

INSTANTIATE_TEST_SUITE_P(Cases, IntranodeDispatchCombineTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<GpuCase>& info) { return info.param.name; });

// One region, many calls: different configurations back to back on the same group (barrier lanes, signal reset).
void RunRepeatedCalls(int num_ranks, int iterations) {
  EPF_REQUIRE_GPUS(1);
  auto group = IntranodeTestGroup::Create(RegionConfig(num_ranks));
  ASSERT_TRUE(group.ok()) << group.status();
  const uint64_t seed = FreshSeed();
  std::mt19937_64 rng(seed);
  int failed_iterations = 0;
  std::string first_failure;
  const auto start = std::chrono::steady_clock::now();
  for (int it = 0; it < iterations; ++it) {
    std::vector<int> tokens(num_ranks);
    for (int& t : tokens) t = static_cast<int>(rng() % 300);
    CaseConfig c =
        Make(256, tokens, 1 + rng() % 8, (it % 2) == 1, true, true, (it % 3) == 0, 1 + static_cast<int>(rng() % 24));
    Mismatches m;
    RunCase(**group, c, rng(), m, nullptr);
    if (!m.empty()) {
      if (failed_iterations++ == 0) first_failure = absl::StrCat("iteration ", it, ": ", m.ToString());
      if (failed_iterations > 5) break;
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(failed_iterations, 0) << "seed " << seed << "\n" << first_failure;
  std::printf("[   INFO   ] %s: %d iterations (layout+notify+dispatch+cached+combine, checked) in %.1f s, seed %llu\n",
              (*group)->placement().ToString().c_str(), iterations, seconds, static_cast<unsigned long long>(seed));
}

TEST(IntranodeGpuTest, RepeatedCallsOnOneGroup) { RunRepeatedCalls(2, 1000); }
TEST(IntranodeGpuTest, RepeatedCallsOnOneGroupFourRanks) { RunRepeatedCalls(4, 250); }

// Notify and dispatch back to back without the host waiting for the counts (worst-case sized outputs).
TEST(IntranodeGpuTest, WorstCaseModeNeedsNoHostWait) {
  EPF_REQUIRE_GPUS(1);
  auto group = IntranodeTestGroup::Create(RegionConfig(2));
  ASSERT_TRUE(group.ok()) << group.status();
  const uint64_t seed = FreshSeed();
  std::mt19937_64 rng(seed);
  CaseConfig c = Make(4096, {2000, 3000}, 8, false, true, true);
  const std::vector<ref::RankInput> inputs = MakeInputs(c, rng);
  const std::vector<ref::RankOutput> want = ref::Dispatch(inputs, MakeReferenceConfig(c));
  PipelineRunner runner(group->get(), c);
  ASSERT_TRUE(runner.Prepare(inputs).ok());
  ASSERT_TRUE(runner.RunLayout().ok());
  const int worst = static_cast<int>(kernels::IntranodeWorstCaseRecvTokens((*group)->config()));
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(runner.AllocateRecv(r, worst).ok());
  ASSERT_TRUE(runner.PoisonRecv().ok());
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(runner.LaunchNotify(r).ok());
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(runner.LaunchDispatch(r).ok());
  ASSERT_TRUE((*group)->SyncAndCheck().ok());
  for (int r = 0; r < 2; ++r) {
    RankBuffers& b = runner.buffers(r);
    auto counts = DownloadVector<int32_t>(b.recv_counts, 1);
    ASSERT_TRUE(counts.ok());
    EXPECT_EQ((*counts)[0], want[r].num_recv_tokens);
    b.num_recv_tokens = want[r].num_recv_tokens;  // compare the rows that were received
  }
  Mismatches m;
  CompareDispatch(runner, want, "worst-case dispatch", m);
  EXPECT_TRUE(m.empty()) << "seed " << seed << "\n" << m.ToString();
}

// Two ranks of which only rank 0 calls: the group, a case with its inputs, the layout run. Rank 0's waits end after
// `timeout_ns`.
struct OneRankCalls {
  std::unique_ptr<IntranodeTestGroup> group;
  CaseConfig c = Make(256, {64, 64}, 4, false, true, true);
  std::unique_ptr<PipelineRunner> runner;

  void SetUp(uint64_t timeout_ns) {
    auto made = IntranodeTestGroup::Create(RegionConfig(2));
    ASSERT_TRUE(made.ok()) << made.status();
    group = std::move(*made);
    std::mt19937_64 rng(FreshSeed());
    const std::vector<ref::RankInput> inputs = MakeInputs(c, rng);
    runner = std::make_unique<PipelineRunner>(group.get(), c);
    ASSERT_TRUE(runner->Prepare(inputs).ok());
    ASSERT_TRUE(runner->RunLayout().ok());
    group->rank(0).group.timeout_ns = timeout_ns;
  }

  // Launches `call` ("notify", or "dispatch": every block waits at its barrier) on rank 0 alone; returns what its
  // status word records, and the time it took to say so.
  absl::Status LaunchAlone(const std::string& call, double* ms) {
    const auto start = std::chrono::steady_clock::now();
    absl::Status launched;
    if (call == "notify") {
      launched = runner->LaunchNotify(0);
    } else {
      runner->buffers(0).num_recv_tokens = 0;
      launched = runner->AllocateRecv(0, 128);
      if (launched.ok()) launched = runner->LaunchDispatch(0);
    }
    if (!launched.ok()) return launched;
    const absl::Status s = kernels::ReadKernelStatus(group->rank(0).group.status, group->rank(0).stream);
    *ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    std::printf("[   INFO   ] %s: \"%s\" after %.1f ms\n", call.c_str(), std::string(s.message()).c_str(), *ms);
    return s;
  }

  // After a reset of every region the group works again.
  void ExpectWorksAfterReset() {
    group->rank(0).group.timeout_ns = kernels::kDefaultWaitTimeoutNs;
    ASSERT_TRUE(group->ResetAll().ok());
    Mismatches m;
    RunCase(*group, c, FreshSeed(), m, nullptr);
    EXPECT_TRUE(m.empty()) << m.ToString();
  }
};

// One rank launches, the other never does: the kernel must give up after the timeout and name the missing rank.
TEST(IntranodeGpuTest, MissingPeerTimesOutAndNamesIt) {
  EPF_REQUIRE_GPUS(1);
  OneRankCalls t;
  ASSERT_NO_FATAL_FAILURE(t.SetUp(50ull * 1000 * 1000));
  for (const char* call : {"notify", "dispatch"}) {
    ASSERT_TRUE(t.group->ResetAll().ok());
    double ms = 0;
    const absl::Status s = t.LaunchAlone(call, &ms);
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << call << ": " << s;
    const std::string want =
        std::string(call) == "notify" ? "rank 0 timed out waiting for barrier from rank 1" : "from rank 1";
    EXPECT_NE(s.message().find(want), std::string::npos) << call << ": " << s;
    EXPECT_LT(ms, 2000.0) << call;
  }
  ASSERT_NO_FATAL_FAILURE(t.ExpectWorksAfterReset());
}

// A rank whose call failed elsewhere (a group across hosts) marks its departure (IntranodeAbandonCall): a peer waiting
// for it at a barrier stops at once with UNAVAILABLE naming it, not at its timeout (10 s here); after a reset of every
// region the group works again. Without the marker the wait would time out; a kernel that counted the marker as
// arrivals would report bad peer data (DATA_LOSS) instead.
TEST(IntranodeGpuTest, APeerThatLeftTheCallEndsTheWaitAtOnce) {
  EPF_REQUIRE_GPUS(1);
  OneRankCalls t;
  ASSERT_NO_FATAL_FAILURE(t.SetUp(10ull * 1000 * 1000 * 1000));
  for (const char* call : {"notify", "dispatch"}) {
    ASSERT_TRUE(t.group->ResetAll().ok());
    ASSERT_EQ(cudaSetDevice(t.group->rank(1).device), cudaSuccess);
    ASSERT_TRUE(kernels::IntranodeAbandonCall(t.group->rank(1).group).ok());
    double ms = 0;
    const absl::Status s = t.LaunchAlone(call, &ms);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << call << ": " << s;
    EXPECT_NE(s.message().find("rank 1 left the call"), std::string::npos) << call << ": " << s;
    EXPECT_LT(ms, 2000.0) << call;
    ASSERT_TRUE(kernels::ClearKernelStatus(t.group->rank(0).group.status, t.group->rank(0).stream).ok());
  }
  ASSERT_NO_FATAL_FAILURE(t.ExpectWorksAfterReset());
}

// The placement itself (no GPU needed): rank r on GPU r mod n, n = min(visible, ranks).
TEST(GpuPlacementTest, RanksShareGpusRoundRobin) {
  auto one = PlaceRanks(4, /*visible=*/1);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->num_gpus, 1);
  EXPECT_TRUE(one->shared());
  EXPECT_EQ(one->ranks_per_gpu(), 4);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(one->device(r), 0);
  auto two = PlaceRanks(4, 2);
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(two->ranks_per_gpu(), 2);
  EXPECT_EQ(two->device(1), 1);
  EXPECT_EQ(two->device(2), 0);
  auto three = PlaceRanks(4, 3);
  ASSERT_TRUE(three.ok());
  EXPECT_EQ(three->ranks_per_gpu(), 2);  // GPU 0 holds ranks 0 and 3
  EXPECT_EQ(three->device(3), 0);
  auto own = PlaceRanks(2, 8);
  ASSERT_TRUE(own.ok());
  EXPECT_EQ(own->num_gpus, 2);
  EXPECT_FALSE(own->shared());
  EXPECT_EQ(own->ranks_per_gpu(), 1);
  EXPECT_TRUE(absl::IsFailedPrecondition(PlaceRanks(2, 0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(PlaceRanks(0, 1).status()));
}

}  // namespace
}  // namespace epfabric::testing
