// Regions holding leftovers of an earlier run (the original finding of issue #13: here random bytes before the first
// call) give correct results or a clean error, never a crash; and the notify counter's bad-data value ends the
// host's wait at once. The hand-played bad values of single fields are in host_backend_untrusted_test.cc.
#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "host_backend_threads.h"

namespace epfabric::kernels::host_backend_test {
namespace {

constexpr uint64_t kShortTimeoutNs = 200ull * 1000 * 1000;

void FillRandom(uint8_t* data, size_t bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i + 8 <= bytes; i += 8) {
    const uint64_t v = rng();
    std::memcpy(data + i, &v, 8);
  }
}

IntranodeCase GarbageCase() {
  IntranodeCase c;
  c.num_tokens = {12, 9};
  c.hidden = 256;
  c.num_topk = 4;
  c.num_experts = 8;
  c.num_channels = 2;
  c.bias = true;
  c.seed = 77;
  return c;
}

TEST(UntrustedIntranode, GarbageOutsideTheSignalsGivesCorrectResults) {
  // The protocol relies only on the signals (zeroed by the daemon / IntranodeResetRegion); staging data is always
  // written before the signal that publishes it, so leftovers there cannot show through.
  const IntranodeCase c = GarbageCase();
  const IntranodeExpected x = MakeIntranodeExpected(c);
  IntranodeRegions regions(IntranodeConfigFor({c}));
  const absl::StatusOr<IntranodeRegionLayout> layout = ComputeIntranodeRegionLayout(regions.config());
  ASSERT_TRUE(layout.ok()) << layout.status();
  const IntranodeRegionLayout& l = *layout;
  for (int r = 0; r < 2; ++r) {
    FillRandom(regions.region(r) + l.signal_bytes, regions.region_bytes() - l.signal_bytes, 100 + r);
  }
  EXPECT_EQ(RunRanks(2, [&](int rank, Mismatches* m) { RunIntranodeCase(regions.Group(rank), x, m); }), "");
}

TEST(UntrustedIntranode, GarbageEverywhereGivesACleanErrorOrCorrectResultsThenResetWorks) {
  const IntranodeCase c = GarbageCase();
  const IntranodeExpected x = MakeIntranodeExpected(c);
  for (uint64_t seed = 0; seed < 4; ++seed) {
    IntranodeRegions regions(IntranodeConfigFor({c}));
    for (int r = 0; r < 2; ++r) FillRandom(regions.region(r), regions.region_bytes(), 1000 * seed + r);
    std::vector<absl::Status> errors(2);
    const std::string mismatches = RunRanks(2, [&](int rank, Mismatches* m) {
      RunIntranodeCase(regions.Group(rank, kShortTimeoutNs), x, m, &errors[rank]);
    });
    for (int r = 0; r < 2; ++r) {
      if (errors[r].ok()) continue;
      EXPECT_TRUE(absl::IsDataLoss(errors[r]) || absl::IsDeadlineExceeded(errors[r]))
          << "seed " << seed << " rank " << r << ": " << errors[r];
    }
    if (errors[0].ok() && errors[1].ok()) EXPECT_EQ(mismatches, "") << "seed " << seed;
    // After an error, every rank resets; then the group works.
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(host_backend::IntranodeResetRegion(regions.Group(r)).ok());
    EXPECT_EQ(RunRanks(2, [&](int rank, Mismatches* m) { RunIntranodeCase(regions.Group(rank), x, m); }), "")
        << "seed " << seed;
  }
}

LowLatencyCase GarbageLowLatencyCase() {
  LowLatencyCase c = LLCase(/*ranks=*/2, /*max_tokens=*/8, /*hidden=*/256, /*experts=*/4, /*topk=*/2, /*seed=*/78);
  c.iterations = 2;
  return c;
}

TEST(UntrustedLowLatency, GarbageOutsideTheSignalsGivesCorrectResults) {
  const LowLatencyCase c = GarbageLowLatencyCase();
  const std::vector<LowLatencyIteration> its = MakeLowLatencyExpected(c);
  LowLatencyRegions regions(c);
  const LowLatencyLayout& l = regions.layout();
  for (int r = 0; r < 2; ++r) {
    for (int half = 0; half < 2; ++half) {
      FillRandom(regions.region(r) + half * l.half_bytes + l.signal_bytes, l.half_bytes - l.signal_bytes,
                 200 + 2 * r + half);
    }
  }
  EXPECT_EQ(RunRanks(2, [&](int rank, Mismatches* m) { RunLowLatencyCase(regions.Context(rank), c, its, m); }), "");
}

TEST(UntrustedLowLatency, GarbageEverywhereGivesACleanErrorOrCorrectResultsThenResetWorks) {
  const LowLatencyCase c = GarbageLowLatencyCase();
  const std::vector<LowLatencyIteration> its = MakeLowLatencyExpected(c);
  for (uint64_t seed = 0; seed < 4; ++seed) {
    LowLatencyRegions regions(c);
    for (int r = 0; r < 2; ++r) FillRandom(regions.region(r), regions.layout().total_bytes, 3000 * seed + r);
    std::vector<absl::Status> errors(2);
    const std::string mismatches = RunRanks(2, [&](int rank, Mismatches* m) {
      RunLowLatencyCase(regions.Context(rank, kShortTimeoutNs), c, its, m, nullptr, &errors[rank]);
    });
    for (int r = 0; r < 2; ++r) {
      if (errors[r].ok()) continue;
      EXPECT_TRUE(absl::IsDataLoss(errors[r]) || absl::IsDeadlineExceeded(errors[r]))
          << "seed " << seed << " rank " << r << ": " << errors[r];
    }
    if (errors[0].ok() && errors[1].ok()) EXPECT_EQ(mismatches, "") << "seed " << seed;
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(host_backend::LowLatencyResetRegion(regions.Context(r)).ok());
    EXPECT_EQ(RunRanks(2, [&](int rank, Mismatches* m) { RunLowLatencyCase(regions.Context(rank), c, its, m); }), "")
        << "seed " << seed;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The host side of the GPU's report: the notify counter's bad-data value ends the host's wait at once.

TEST(UntrustedCounters, WaitRecvCountsReportsBadPeerDataAtOnce) {
  const int32_t counter = kRecvCountBadPeerData;
  const auto start = std::chrono::steady_clock::now();
  const absl::StatusOr<int32_t> got = IntranodeWaitRecvCounts(&counter, kTestTimeoutNs);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << got.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
}

}  // namespace
}  // namespace epfabric::kernels::host_backend_test
