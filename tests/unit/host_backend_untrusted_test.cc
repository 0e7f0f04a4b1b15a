// Data from shared memory is untrusted (issue #13): a stale, buggy or malicious peer writes a bad count, range, tail,
// index or barrier counter into this rank's region, and the host backend must return an error naming the peer and
// the field — never crash, never write outside its outputs. Each test plays the peer by hand: it writes what a peer
// would (here a bad value) into the region of rank 0 and advances rank 0's barrier counters as the peer's arrivals
// would, then runs rank 0 alone. The regression tests for the original finding (whole regions of random bytes before
// the first call) are in host_backend_garbage_test.cc. Outputs are allocated with guard bytes behind them (and the
// tests run under ASan too, see docs/host-backend.md).
#include <cstring>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "host_backend_threads.h"

namespace epfabric::kernels::host_backend_test {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kShortTimeoutNs = 200ull * 1000 * 1000;
constexpr uint8_t kGuard = 0xEE;
constexpr size_t kGuardBytes = 4096;

// Host memory for an output of `bytes`, followed by guard bytes that no call may touch.
class Guarded {
 public:
  explicit Guarded(size_t bytes) : bytes_(bytes), buffer_(bytes + kGuardBytes) {
    std::memset(buffer_.data, 0xAB, bytes);
    std::memset(buffer_.data + bytes, kGuard, kGuardBytes);
  }
  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(buffer_.data);
  }
  bool GuardIntact() const {
    for (size_t i = 0; i < kGuardBytes; ++i) {
      if (buffer_.data[bytes_ + i] != kGuard) return false;
    }
    return true;
  }

 private:
  size_t bytes_;
  AlignedBuffer buffer_;
};

template <typename T>
T* At(uint8_t* region, size_t offset) {
  return reinterpret_cast<T*>(region + offset);
}

// ---------------------------------------------------------------------------------------------------------------
// Intranode: 2 ranks (3 for the overflow case), rank 1 played by the test.

IntranodeRegionConfig SmallConfig(int num_ranks = 2) {
  return {.num_ranks = num_ranks,
          .max_tokens_per_rank = 16,
          .max_hidden = 256,
          .max_topk = 4,
          .num_experts = 4 * num_ranks,
          .max_channels = 2};
}

IntranodeRegionLayout LayoutOf(const IntranodeRegionConfig& config) {
  absl::StatusOr<IntranodeRegionLayout> layout = ComputeIntranodeRegionLayout(config);
  EXPECT_TRUE(layout.ok()) << layout.status();
  return layout.value_or(IntranodeRegionLayout{});
}

// Peer `peer`'s arrivals at `times` barriers (lane 0) in `reader`'s region, as its barrier calls would add them.
void Arrive(IntranodeRegions& regions, int reader, int peer, int times) {
  const IntranodeRegionLayout l = LayoutOf(regions.config());
  At<int32_t>(regions.region(reader), l.barrier_arrive)[peer] += times;
}

// Rank 0's notify with no tokens of its own, after rank 1 (played by the test) published `rank_counts` (per
// destination) and `expert_counts` (for rank 0's local experts) into rank 0's region.
absl::Status NotifyAgainst(const std::vector<int32_t>& rank_counts, const std::vector<int32_t>& expert_counts,
                           std::vector<int32_t>* prefix = nullptr, KernelStatus* status = nullptr) {
  const IntranodeRegionConfig config = SmallConfig();
  IntranodeRegions regions(config);
  const IntranodeRegionLayout l = LayoutOf(config);
  const int R = 2, epr = 4;
  for (int d = 0; d < R; ++d) At<int32_t>(regions.region(0), l.notify_rank_counts)[1 * R + d] = rank_counts[d];
  for (int e = 0; e < epr; ++e) At<int32_t>(regions.region(0), l.notify_expert_counts)[1 * epr + e] = expert_counts[e];
  Arrive(regions, 0, 1, 2);
  std::vector<int32_t> per_rank(R, 0), per_expert(config.num_experts, 0), local_prefix(R * R, -7);
  std::vector<int32_t> host_per_expert(epr, -1);
  int32_t host_num_recv = -1;
  IntranodeNotifyParams np;
  np.num_tokens_per_rank = per_rank.data();
  np.num_tokens_per_expert = per_expert.data();
  np.num_experts = config.num_experts;
  np.rank_prefix_matrix = local_prefix.data();
  np.host_num_recv_tokens = &host_num_recv;
  np.host_num_recv_tokens_per_expert = host_per_expert.data();
  const absl::Status s = host_backend::IntranodeNotify(regions.Group(0, kShortTimeoutNs, status), np);
  if (!s.ok()) {
    EXPECT_EQ(host_num_recv, -1) << "no count is published after bad peer data";
  } else {
    EXPECT_EQ(host_num_recv, local_prefix[1 * R + 0]);
  }
  if (prefix != nullptr) *prefix = local_prefix;
  return s;
}

TEST(UntrustedIntranode, NotifyTakesValidPeerCounts) {
  std::vector<int32_t> prefix;
  ASSERT_TRUE(NotifyAgainst({3, 2}, {1, 2, 0, 0}, &prefix).ok());
  EXPECT_EQ(prefix, (std::vector<int32_t>{0, 0, 3, 2}));
}

TEST(UntrustedIntranode, NotifyRejectsBadTokenCountsNamingThePeer) {
  KernelStatus status{};
  const absl::Status huge = NotifyAgainst({2147483000, 0}, {0, 0, 0, 0}, nullptr, &status);
  EXPECT_EQ(huge.code(), absl::StatusCode::kDataLoss) << huge;
  EXPECT_EQ(huge.message(),
            "rank 0 read notify token count = 2147483000 from rank 1 (destination rank 0; valid [0, 16]): stale or "
            "corrupt peer data");
  EXPECT_EQ(KernelStatusToStatus(status), huge) << "the status word says the same, as the GPU's would";

  const absl::Status negative = NotifyAgainst({0, -1}, {0, 0, 0, 0});
  EXPECT_EQ(negative.code(), absl::StatusCode::kDataLoss) << negative;
  EXPECT_THAT(negative.message(), HasSubstr("notify token count = -1 from rank 1 (destination rank 1"));

  const absl::Status one_past = NotifyAgainst({17, 0}, {0, 0, 0, 0});
  EXPECT_THAT(one_past.message(), HasSubstr("= 17 from rank 1"));
}

TEST(UntrustedIntranode, NotifyRejectsBadExpertCounts) {
  const absl::Status negative = NotifyAgainst({0, 0}, {0, -5, 0, 0});
  EXPECT_EQ(negative.code(), absl::StatusCode::kDataLoss) << negative;
  EXPECT_THAT(negative.message(),
              HasSubstr("notify expert token count = -5 from rank 1 (local expert 1; valid [0, 64])"));
  const absl::Status huge = NotifyAgainst({0, 0}, {0, 0, 0, 65});
  EXPECT_THAT(huge.message(), HasSubstr("= 65 from rank 1 (local expert 3"));
}

TEST(UntrustedIntranode, NotifyRejectsCountsWhoseSumWouldOverflow) {
  // Ranks 1 and 2 each publish 1.5e9 tokens for rank 0: their sum does not fit int32. Each count is checked before
  // anything is summed (UBSan would report a signed overflow otherwise).
  const IntranodeRegionConfig config = SmallConfig(3);
  IntranodeRegions regions(config);
  const IntranodeRegionLayout l = LayoutOf(config);
  for (int peer = 1; peer < 3; ++peer) {
    At<int32_t>(regions.region(0), l.notify_rank_counts)[peer * 3 + 0] = 1500000000;
    Arrive(regions, 0, peer, 2);
  }
  std::vector<int32_t> per_rank(3, 0), per_expert(12, 0), prefix(9, -7);
  IntranodeNotifyParams np;
  np.num_tokens_per_rank = per_rank.data();
  np.num_tokens_per_expert = per_expert.data();
  np.num_experts = 12;
  np.rank_prefix_matrix = prefix.data();
  const absl::Status s = host_backend::IntranodeNotify(regions.Group(0, kShortTimeoutNs), np);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("notify token count = 1500000000 from rank 1"));
  EXPECT_EQ(prefix, std::vector<int32_t>(9, -7)) << "nothing derived from bad counts is written";
}

TEST(UntrustedIntranode, BarrierRejectsStaleArrivalCounters) {
  // Rank 1's arrivals in rank 0's region are far ahead of rank 0's barriers (leftovers of an earlier run): trusting
  // them would let rank 0 through without rank 1.
  const IntranodeRegionConfig config = SmallConfig();
  IntranodeRegions regions(config);
  Arrive(regions, 0, 1, 12345);
  std::vector<int32_t> per_rank(2, 0), per_expert(8, 0), prefix(4, -7);
  IntranodeNotifyParams np;
  np.num_tokens_per_rank = per_rank.data();
  np.num_tokens_per_expert = per_expert.data();
  np.num_experts = 8;
  np.rank_prefix_matrix = prefix.data();
  const absl::Status s = host_backend::IntranodeNotify(regions.Group(0, kShortTimeoutNs), np);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(s.message(),
            "rank 0 read barrier arrivals ahead of this rank = 12345 from rank 1 (barrier lane 0; valid [1, 2]): stale "
            "or corrupt peer data");
}

// Rank 0 dispatches nothing and receives kRows rows from rank 1 over 2 channels ([0, 3) and [3, 5)); the test writes
// rank 1's ranges, tails and staging rows into rank 0's region, then `corrupt` changes some of them.
constexpr int kRows = 5;

struct DispatchFixture {
  IntranodeRegionConfig config = SmallConfig();
  IntranodeRegions regions{config};
  IntranodeRegionLayout l = LayoutOf(config);
  static constexpr int kHidden = 256, kTopk = 2, kChannels = 2;
  static constexpr size_t kRowBytes = kHidden * 2;

  int64_t* Range(int channel) { return At<int64_t>(regions.region(0), l.dispatch_range) + 1 * 2 + channel; }
  int32_t* Tail(int channel) { return At<int32_t>(regions.region(0), l.channel_tail) + 1 * 2 + channel; }
  uint8_t* StagedRow(int row) { return regions.region(0) + l.staging_x + l.staging_x_pool_bytes + row * kRowBytes; }
  int32_t* StagedSrcIdx() { return At<int32_t>(regions.region(0), l.staging_src_idx + l.staging_src_idx_pool_bytes); }
  int64_t* StagedTopkIdx() {
    return At<int64_t>(regions.region(0), l.staging_topk_idx + l.staging_topk_idx_pool_bytes);
  }
  static int64_t PackRange(int64_t begin, int64_t end) { return ((end + 1) << 32) | static_cast<uint32_t>(begin); }

  // What a correct rank 1 publishes.
  DispatchFixture() {
    *Range(0) = PackRange(0, 3);
    *Range(1) = PackRange(3, kRows);
    *Tail(0) = 3;
    *Tail(1) = 2;
    for (int row = 0; row < kRows; ++row) {
      std::memset(StagedRow(row), 0x10 + row, kRowBytes);
      StagedSrcIdx()[row] = 2 * row;
      for (int k = 0; k < kTopk; ++k) StagedTopkIdx()[row * kTopk + k] = k == 0 ? row % 4 : -1;
    }
    Arrive(regions, 0, 1, 1);
  }

  // Runs rank 0's dispatch; checks that nothing was written past the outputs.
  absl::Status Run() {
    Guarded recv_x(kRows * kRowBytes), recv_idx(kRows * kTopk * 8), recv_w(kRows * kTopk * 4), src_idx(kRows * 4),
        channel_prefix(2 * kChannels * 4);
    const int32_t prefix[4] = {0, 0, kRows, 0};  // column 0 (this rank): rank 0 sends 0, rank 1 sends kRows
    IntranodeHandle h;
    h.num_tokens = 0;
    h.num_recv_tokens = kRows;
    h.rank_prefix_matrix = const_cast<int32_t*>(prefix);
    h.recv_channel_prefix = channel_prefix.as<int32_t>();
    h.recv_src_idx = src_idx.as<int32_t>();
    static const int64_t no_topk[1] = {};
    static const float no_weights[1] = {};
    static const uint16_t no_x[8] = {};
    IntranodeDispatchParams p;
    p.x = no_x;
    p.hidden = kHidden;
    p.topk_idx = no_topk;
    p.topk_weights = no_weights;
    p.num_topk = kTopk;
    p.num_experts = config.num_experts;
    p.num_sms = kChannels;
    p.recv_capacity = kRows;
    p.recv_x = recv_x.as<void>();
    p.recv_topk_idx = recv_idx.as<int64_t>();
    p.recv_topk_weights = recv_w.as<float>();
    const absl::Status s = host_backend::IntranodeDispatch(regions.Group(0, kShortTimeoutNs), p, &h);
    for (Guarded* g : {&recv_x, &recv_idx, &recv_w, &src_idx, &channel_prefix}) {
      EXPECT_TRUE(g->GuardIntact()) << "a write past an output";
    }
    if (s.ok()) {
      for (int row = 0; row < kRows; ++row) {
        EXPECT_EQ(recv_x.as<uint8_t>()[row * kRowBytes + 7], 0x10 + row);
        EXPECT_EQ(src_idx.as<int32_t>()[row], 2 * row);
      }
      EXPECT_EQ(channel_prefix.as<int32_t>()[1 * kChannels + 1], 3);
    }
    return s;
  }
};

TEST(UntrustedIntranode, DispatchTakesValidPeerRanges) {
  DispatchFixture f;
  EXPECT_TRUE(f.Run().ok());
}

TEST(UntrustedIntranode, DispatchRejectsRangesPastThePeersRows) {
  DispatchFixture past;
  *past.Range(0) = DispatchFixture::PackRange(0, 1000);  // more rows than the prefix matrix gives rank 1
  absl::Status s = past.Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(s.message(),
            "rank 0 read dispatch slot range end = 1000 from rank 1 (channel 0; valid [0, 5]): stale or corrupt peer "
            "data");

  DispatchFixture gap;
  *gap.Range(1) = DispatchFixture::PackRange(4, kRows);  // does not start where channel 0 ended
  s = gap.Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("dispatch slot range begin = 4 from rank 1 (channel 1; valid [3, 3])"));

  DispatchFixture short_last;
  *short_last.Range(1) = DispatchFixture::PackRange(3, kRows - 1);  // fewer rows than the prefix matrix promised
  s = short_last.Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("dispatch slot range end = 4 from rank 1 (channel 1; valid [5, 5])"));

  DispatchFixture inverted;
  *inverted.Range(0) = DispatchFixture::PackRange(0, -5);
  s = inverted.Run();
  EXPECT_THAT(s.message(), HasSubstr("dispatch slot range end = -5 from rank 1 (channel 0"));

  for (const int64_t garbage : {int64_t{-1}, int64_t{0x7eadbeefcafef00d}, INT64_MIN}) {
    DispatchFixture f;
    *f.Range(0) = garbage;
    s = f.Run();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << garbage << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("from rank 1 (channel 0"));
  }
}

TEST(UntrustedIntranode, DispatchRejectsTailsOtherThanTheRangesCount) {
  for (const int32_t tail : {1000, -7, 1, INT32_MIN}) {
    DispatchFixture f;
    *f.Tail(0) = tail;
    const absl::Status s = f.Run();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << tail << ": " << s;
    EXPECT_THAT(s.message(),
                HasSubstr(absl::StrFormat("dispatch tail = %d from rank 1 (channel 0; valid [3, 3])", tail)));
  }
}

TEST(UntrustedIntranode, DispatchRejectsOutOfRangeSourceAndExpertIndices) {
  DispatchFixture src;
  src.StagedSrcIdx()[4] = 70000;
  absl::Status s = src.Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("dispatch source token index = 70000 from rank 1 (channel 1; valid [0, 15])"));

  for (const int64_t expert : {int64_t{4}, int64_t{-2}, INT64_MAX}) {
    DispatchFixture f;
    f.StagedTopkIdx()[1 * DispatchFixture::kTopk + 1] = expert;
    s = f.Run();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << expert << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("dispatch local expert id"));
    EXPECT_THAT(s.message(), HasSubstr("from rank 1 (channel 0; valid [-1, 3])"));
  }
}

// Rank 0 combines 4 own tokens, all sent to rank 1 (slots 0..3, one channel); rank 1 (the test) returned their rows.
absl::Status CombineAgainstTail(int32_t tail) {
  const IntranodeRegionConfig config = SmallConfig();
  IntranodeRegions regions(config);
  const IntranodeRegionLayout l = LayoutOf(config);
  constexpr int T = 4, H = 256;
  for (int t = 0; t < T; ++t) {
    uint16_t* row = At<uint16_t>(regions.region(0), l.staging_x + l.staging_x_pool_bytes + t * H * 2);
    for (int h = 0; h < H; ++h) row[h] = ref::FloatToBf16(static_cast<float>(t + 1));
  }
  At<int32_t>(regions.region(0), l.channel_tail)[1 * 2 + 0] = tail;
  Arrive(regions, 0, 1, 1);
  const bool in_rank[T * 2] = {false, true, false, true, false, true, false, true};
  const int32_t send_slot[T * 2] = {-1, 0, -1, 1, -1, 2, -1, 3};
  const int32_t prefix[4] = {0, T, 0, 0};
  int32_t channel_prefix[2] = {0, 0};
  IntranodeHandle h;
  h.num_tokens = T;
  h.num_recv_tokens = 0;
  h.num_channels = 1;
  h.is_token_in_rank = in_rank;
  h.rank_prefix_matrix = const_cast<int32_t*>(prefix);
  h.recv_channel_prefix = channel_prefix;
  h.send_slot = const_cast<int32_t*>(send_slot);
  Guarded combined(T * H * 2);
  IntranodeCombineParams p;
  p.hidden = H;
  p.combined_x = combined.as<void>();
  const absl::Status s = host_backend::IntranodeCombine(regions.Group(0, kShortTimeoutNs), p, h);
  EXPECT_TRUE(combined.GuardIntact());
  if (s.ok()) EXPECT_EQ(combined.as<uint16_t>()[3 * H + 5], ref::FloatToBf16(4.0f));
  return s;
}

TEST(UntrustedIntranode, CombineRejectsTailsOtherThanTheChannelEnd) {
  EXPECT_TRUE(CombineAgainstTail(4).ok());
  for (const int32_t tail : {1000, 2, -1}) {
    const absl::Status s = CombineAgainstTail(tail);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << tail << ": " << s;
    EXPECT_EQ(s.message(), absl::StrFormat("rank 0 read combine tail = %d from rank 1 (channel 0; valid [4, 4]): "
                                           "stale or corrupt peer data",
                                           tail));
  }
}

TEST(UntrustedIntranode, CombineRejectsAHandleWhoseRangesLeaveThePeersRows) {
  // A handle from a dispatch that failed half way: its channel range for rank 1 points past rank 1's rows.
  const IntranodeRegionConfig config = SmallConfig();
  IntranodeRegions regions(config);
  Arrive(regions, 0, 1, 1);
  constexpr int N = 3, H = 256;
  const int32_t prefix[4] = {0, 0, N, 0};
  int32_t channel_prefix[2] = {0, 7};
  IntranodeHandle h;
  h.num_tokens = 0;
  h.num_recv_tokens = N;
  h.num_channels = 1;
  h.rank_prefix_matrix = const_cast<int32_t*>(prefix);
  h.recv_channel_prefix = channel_prefix;
  Guarded x(N * H * 2);
  IntranodeCombineParams p;
  p.x = x.as<void>();
  p.hidden = H;
  const absl::Status s = host_backend::IntranodeCombine(regions.Group(0, kShortTimeoutNs), p, h);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("combine slot range = 7 from rank 1 (channel 0; valid [0, 3])"));
}

// ---------------------------------------------------------------------------------------------------------------
// Low latency: 2 ranks, 8 tokens per rank, 4 experts (2 local), BF16; rank 1 played by the test.

struct LowLatencyFixture {
  LowLatencyCase c = [] {
    LowLatencyCase c;
    c.num_ranks = 2;
    c.max_tokens = 8;
    c.hidden = 256;
    c.num_experts = 4;
    c.num_topk = 2;
    c.fp8 = false;
    return c;
  }();
  LowLatencyRegions regions{c};
  static constexpr int R = 2, M = 8, H = 256, L = 2;

  uint8_t* Half0() { return regions.region(0); }
  uint64_t* Count(int local) { return At<uint64_t>(Half0(), regions.layout().dispatch_count_offset) + local * R + 1; }
  static constexpr uint32_t kTag = 0x5eed;  // the call's tag (LowLatencyDispatchArgs::call_tag)
  int32_t* Table(int local) {
    return At<int32_t>(Half0(), regions.layout().dispatch_table_offset) + (local * R + 1) * M;
  }
  uint16_t* Payload(int t) {
    return At<uint16_t>(Half0(), regions.layout().dispatch_msgs_offset +
                                     (1 * M + t) * regions.layout().dispatch_msg_bytes + kLowLatencyMessageHeaderBytes);
  }

  // What a correct rank 1 publishes: local expert 0 gets its tokens 1 (top-k 0) and 3 (top-k 1), expert 1 none.
  LowLatencyFixture() {
    Table(0)[0] = 1 | (0 << 16);
    Table(0)[1] = 3 | (1 << 16);
    *Count(0) = LowLatencyCountSignal(kTag, 2);
    *Count(1) = LowLatencyCountSignal(kTag, 0);
    for (int t = 0; t < M; ++t) {
      for (int h = 0; h < H; ++h) Payload(t)[h] = static_cast<uint16_t>(100 * t + h);
    }
  }

  // Rank 0 dispatches no tokens of its own (so it waits only for rank 1's counts) and receives.
  absl::Status Run() {
    Guarded packed_x(L * R * M * H * 2), count(L * 4), src_info(L * R * M * 4), layout_range(L * R * 8),
        topk_slot(L * R * M * 4), token_map(R * M * kLowLatencyMaxTopk * 4);
    static const uint16_t no_x[8] = {};
    static const int64_t no_topk[2] = {-1, -1};
    LowLatencyDispatchArgs d;
    d.x = no_x;
    d.topk_idx = no_topk;
    d.num_tokens = 0;
    d.num_topk = 2;
    d.hidden = H;
    d.max_tokens_per_rank = M;
    d.num_experts = c.num_experts;
    d.use_fp8 = false;
    d.call_tag = kTag;
    d.packed_recv_x = packed_x.as<void>();
    d.packed_recv_count = count.as<int32_t>();
    d.packed_recv_src_info = src_info.as<int32_t>();
    d.packed_recv_layout_range = layout_range.as<int64_t>();
    d.packed_recv_topk_slot = topk_slot.as<int32_t>();
    d.packed_recv_token_map = token_map.as<int32_t>();
    const absl::Status s = host_backend::LowLatencyDispatch(regions.Context(0, kShortTimeoutNs), d);
    for (Guarded* g : {&packed_x, &count, &src_info, &layout_range, &topk_slot, &token_map}) {
      EXPECT_TRUE(g->GuardIntact()) << "a write past an output";
    }
    if (s.ok()) {
      EXPECT_EQ(count.as<int32_t>()[0], 2);
      EXPECT_EQ(src_info.as<int32_t>()[1], 3);
      EXPECT_EQ(packed_x.as<uint16_t>()[1 * H + 5], 305);
      EXPECT_EQ(token_map.as<int32_t>()[(1 * M + 3) * kLowLatencyMaxTopk + 1], 1);
    }
    return s;
  }
};

TEST(UntrustedLowLatency, DispatchTakesValidPeerCountsAndEntries) {
  LowLatencyFixture f;
  EXPECT_TRUE(f.Run().ok());
}

TEST(UntrustedLowLatency, DispatchRejectsBadCountsNamingThePeer) {
  // A signal with this call's tag whose count is past the bound: 9 tokens (M + 1), and UINT32_MAX - 1 (reported
  // saturated to int32, as the status word holds it).
  for (const int64_t count : {int64_t{9}, int64_t{UINT32_MAX} - 1}) {
    LowLatencyFixture f;
    *f.Count(1) = (uint64_t{LowLatencyFixture::kTag} << 32) | static_cast<uint64_t>(count + 1);
    const absl::Status s = f.Run();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << count << ": " << s;
    EXPECT_EQ(s.message(), absl::StrFormat("rank 0 read low-latency token count = %d from rank 1 (local expert 1; "
                                           "valid [0, 8]): stale or corrupt peer data",
                                           std::min<int64_t>(count, INT32_MAX)));
  }
}

// A count left by another call, Buffer or client (another tag), however plausible, is not this call's: the wait goes
// on and times out naming the peer instead of reading it. The old format (any nonzero word) took it.
TEST(UntrustedLowLatency, DispatchNeverTakesACountOfAnotherCall) {
  for (const uint64_t stale : {LowLatencyCountSignal(LowLatencyFixture::kTag + 1, 1),
                               LowLatencyCountSignal(LowLatencyFixture::kTag ^ 0x80000000u, 2), uint64_t{0xfffffffd}}) {
    LowLatencyFixture f;
    *f.Count(1) = stale;
    const absl::Status s = f.Run();
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_THAT(s.message(), HasSubstr("from rank 1")) << s;
  }
}

TEST(UntrustedLowLatency, DispatchRejectsRoutingEntriesOutsideTheMessageSlots) {
  LowLatencyFixture token;
  token.Table(0)[1] = 8 | (1 << 16);  // token 8: there are 8 message slots (0..7)
  absl::Status s = token.Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("low-latency routing token = 8 from rank 1 (local expert 0; valid [0, 7])"));

  LowLatencyFixture topk;
  topk.Table(0)[0] = 1 | (16 << 16);
  s = topk.Run();
  EXPECT_THAT(s.message(), HasSubstr("low-latency routing top-k position = 16 from rank 1 (local expert 0; valid "
                                     "[0, 15])"));

  LowLatencyFixture negative;
  negative.Table(0)[0] = -1;
  s = negative.Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("from rank 1 (local expert 0"));
}

}  // namespace
}  // namespace epfabric::kernels::host_backend_test
