// The low-latency layout, argument checks and host reference, on cases small enough to work out by hand.
#include "epfabric/kernels/reference/low_latency_reference.h"

#include <algorithm>
#include <cmath>
#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "epfabric/kernels/low_latency.h"
#include "epfabric/kernels/reference/fp8.h"

namespace epfabric::kernels::host {
namespace {

// 2 ranks, 4 experts (2 per rank), hidden 128, up to 4 tokens per rank, top-2.
//   rank 0: t0 -> {1, 2}, t1 -> {2, -1}, t2 -> {3, 1}
//   rank 1: t0 -> {0, 2}, t1 -> {2, 2} (the same expert twice)
LowLatencyShape SmallShape() {
  return {.num_ranks = 2, .num_experts = 4, .hidden = 128, .max_tokens_per_rank = 4, .num_topk = 2};
}

std::vector<LowLatencyRankInput> SmallInputs() {
  std::vector<LowLatencyRankInput> in(2);
  in[0].num_tokens = 3;
  in[0].topk_idx = {1, 2, 2, -1, 3, 1};
  in[1].num_tokens = 2;
  in[1].topk_idx = {0, 2, 2, 2};
  for (int r = 0; r < 2; ++r) {
    in[r].x.resize(in[r].num_tokens * 128);
    for (size_t i = 0; i < in[r].x.size(); ++i) in[r].x[i] = FloatToBf16(static_cast<float>(r * 1000 + i));
    in[r].topk_weights.assign(in[r].num_tokens * 2, 0.0f);
    for (int t = 0; t < in[r].num_tokens; ++t) {
      in[r].topk_weights[t * 2] = 0.5f;
      in[r].topk_weights[t * 2 + 1] = 0.25f;
    }
  }
  return in;
}

int64_t Range(int64_t begin, int64_t count) { return (begin << 32) | count; }

TEST(LowLatencyReference, DispatchPacksBySourceRankThenTokenIndex) {
  const LowLatencyShape shape = SmallShape();
  const auto in = SmallInputs();
  const auto out = LowLatencyDispatchReference(shape, {.use_fp8 = false}, in);
  ASSERT_EQ(out.size(), 2u);
  const int slots = 8;
  // Rank 0, expert 0: rank 1's t0 only. Expert 1: rank 0's t0 (top-k position 0) and t2 (position 1).
  EXPECT_EQ(out[0].packed_recv_count, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(out[0].layout_range, (std::vector<int64_t>{Range(0, 0), Range(0, 1), Range(0, 2), Range(2, 0)}));
  EXPECT_EQ(out[0].src_info[0], 0);
  EXPECT_EQ(out[0].src_info[slots + 0], 0);
  EXPECT_EQ(out[0].src_info[slots + 1], 2);
  EXPECT_EQ(out[0].topk_slot[slots + 1], 1);
  // Rank 1, expert 2: rank 0's t0 (position 1), t1 (0), then rank 1's t0 (1), t1 (0, once despite the duplicate).
  EXPECT_EQ(out[1].packed_recv_count, (std::vector<int32_t>{4, 1}));
  EXPECT_EQ(out[1].layout_range, (std::vector<int64_t>{Range(0, 2), Range(2, 2), Range(0, 1), Range(1, 0)}));
  EXPECT_EQ((std::vector<int32_t>(out[1].src_info.begin(), out[1].src_info.begin() + 4)),
            (std::vector<int32_t>{0, 1, 0, 1}));
  EXPECT_EQ((std::vector<int32_t>(out[1].topk_slot.begin(), out[1].topk_slot.begin() + 4)),
            (std::vector<int32_t>{1, 0, 1, 0}));
  // Token map of rank 1: rank 1's token 1 has expert 2 (local 0) at top-k position 0, packed slot 3.
  EXPECT_EQ(out[1].token_map[(1 * 4 + 1) * 16 + 0], 3);
  EXPECT_EQ(out[1].token_map[(1 * 4 + 1) * 16 + 1], -1);
  EXPECT_EQ(out[0].token_map[(0 * 4 + 2) * 16 + 1], slots + 1);  // rank 0's t2, expert 1 at position 1
  // BF16 payload is the source row, unchanged: rank 1 expert 2 slot 3 is rank 1's token 1.
  const uint16_t* row = reinterpret_cast<const uint16_t*>(&out[1].packed_recv_x[3 * 128 * 2]);
  EXPECT_EQ(Bf16ToFloat(row[0]), Bf16ToFloat(FloatToBf16(1000.0f + 128.0f)));
}

// Expert output rows are constants 1 + 8 r + 4 local + slot, so every combined value can be worked out by hand.
std::vector<std::vector<uint16_t>> ConstantExpertOutputs(const LowLatencyShape& shape) {
  std::vector<std::vector<uint16_t>> outs(shape.num_ranks);
  for (int r = 0; r < shape.num_ranks; ++r) {
    outs[r].resize(static_cast<size_t>(shape.num_local_experts()) * shape.recv_slots() * shape.hidden);
    for (int local = 0; local < shape.num_local_experts(); ++local) {
      for (int p = 0; p < shape.recv_slots(); ++p) {
        for (int i = 0; i < shape.hidden; ++i) {
          outs[r][(static_cast<size_t>(local) * shape.recv_slots() + p) * shape.hidden + i] =
              FloatToBf16(1.0f + 8 * r + 4 * local + p);
        }
      }
    }
  }
  return outs;
}

TEST(LowLatencyReference, CombineSumsWeightedExpertOutputs) {
  const LowLatencyShape shape = SmallShape();
  const auto in = SmallInputs();
  const auto dispatched = LowLatencyDispatchReference(shape, {.use_fp8 = false}, in);
  const auto combined = LowLatencyCombineReference(shape, in, ConstantExpertOutputs(shape), dispatched);
  auto at = [&](int r, int t) { return Bf16ToFloat(combined[r][t * 128 + 17]); };
  EXPECT_EQ(at(0, 0), 0.5f * 5 + 0.25f * 9);    // expert 1 slot 0 (5), expert 2 slot 0 (9)
  EXPECT_EQ(at(0, 1), 0.5f * 10);               // expert 2 slot 1; the -1 entry adds nothing
  EXPECT_EQ(at(0, 2), 0.5f * 13 + 0.25f * 6);   // expert 3 slot 0 (13), expert 1 slot 1 (6)
  EXPECT_EQ(at(1, 0), 0.5f * 1 + 0.25f * 11);   // expert 0 slot 0 (1), expert 2 slot 2 (11)
  EXPECT_EQ(at(1, 1), 0.5f * 12 + 0.25f * 12);  // expert 2 twice: one copy, both weights
}

// The expert rank rounds its partial sum to bf16 before the token's rank adds the partial sums: with experts 2 and 3
// on rank 1 (values 1 and 2^-8) and expert 0 on rank 0 (2^-8), all weights 1, rank 1's partial 1 + 2^-8 rounds
// (ties to even) to 1, and 1 + 2^-8 rounds to 1 again; one rounding of the whole sum would give 1 + 2^-7.
TEST(LowLatencyReference, CombineRoundsEachExpertRanksPartialSum) {
  const LowLatencyShape shape{.num_ranks = 2, .num_experts = 4, .hidden = 128, .max_tokens_per_rank = 2, .num_topk = 3};
  std::vector<LowLatencyRankInput> in(2);
  in[0].num_tokens = 1;
  in[0].topk_idx = {2, 3, 0};
  in[0].topk_weights = {1.0f, 1.0f, 1.0f};
  in[0].x.assign(128, FloatToBf16(1.0f));
  const auto dispatched = LowLatencyDispatchReference(shape, {.use_fp8 = false}, in);
  std::vector<std::vector<uint16_t>> outs(2, std::vector<uint16_t>(2 * 4 * 128, 0));
  auto row = [&](int r, int local, int slot) { return &outs[r][(local * 4 + slot) * 128]; };
  std::fill_n(row(1, 0, 0), 128, FloatToBf16(1.0f));
  std::fill_n(row(1, 1, 0), 128, FloatToBf16(0.00390625f));
  std::fill_n(row(0, 0, 0), 128, FloatToBf16(0.00390625f));
  const auto combined = LowLatencyCombineReference(shape, in, outs, dispatched);
  EXPECT_EQ(Bf16ToFloat(combined[0][5]), 1.0f);
  const auto exact = LowLatencyCombineExact(shape, in, outs, dispatched);
  EXPECT_EQ(exact[0][5], 1.0078125);
}

TEST(LowLatencyReference, MaskedRankTakesNoPart) {
  const LowLatencyShape shape = SmallShape();
  const auto in = SmallInputs();
  const std::vector<bool> mask = {false, true};
  const auto dispatched = LowLatencyDispatchReference(shape, {.use_fp8 = false}, in, mask);
  EXPECT_EQ(dispatched[0].packed_recv_count, (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(dispatched[1].packed_recv_count, (std::vector<int32_t>{0, 0}));
  const auto combined = LowLatencyCombineReference(shape, in, ConstantExpertOutputs(shape), dispatched, mask);
  EXPECT_EQ(Bf16ToFloat(combined[0][0]), 0.5f * 5);  // expert 2 lives on the masked rank
}

// Elastic EP's oracle (issue #36): with any set of ranks masked, every survivor's outputs are the full reference's
// without them, element by element, on random inputs: a masked source's segments are absent (count 0, the later
// sources' segments move up, rows and scales otherwise equal); a survivor's combined rows equal the full combine with
// the masked ranks' expert outputs replaced by zeros (their partial sums add nothing).
TEST(LowLatencyReference, MaskedReferenceIsTheFullOneWithoutTheMaskedRanks) {
  std::mt19937_64 rng(20261129);
  const LowLatencyShape shape{
      .num_ranks = 4, .num_experts = 16, .hidden = 256, .max_tokens_per_rank = 8, .num_topk = 4};
  const int R = shape.num_ranks, L = shape.num_local_experts(), H = shape.hidden, G = H / 128;
  const size_t slots = shape.recv_slots();
  for (int trial = 0; trial < 8; ++trial) {
    std::vector<LowLatencyRankInput> in(R);
    for (LowLatencyRankInput& r : in) {
      r.num_tokens = static_cast<int>(rng() % (shape.max_tokens_per_rank + 1));
      r.topk_idx.resize(static_cast<size_t>(r.num_tokens) * shape.num_topk);
      for (int64_t& e : r.topk_idx) e = static_cast<int64_t>(rng() % (shape.num_experts + 2)) - 1;  // some -1
      r.x.resize(static_cast<size_t>(r.num_tokens) * H);
      for (uint16_t& v : r.x) v = FloatToBf16(static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 64.0f);
      r.topk_weights.resize(r.topk_idx.size());
      for (float& w : r.topk_weights) w = static_cast<float>(rng() % 1000) / 1000.0f;
    }
    std::vector<bool> mask(R, false);
    mask[rng() % R] = true;
    if (trial % 2 == 1) mask[rng() % R] = true;  // sometimes two
    const auto full = LowLatencyDispatchReference(shape, {.use_fp8 = true}, in);
    const auto masked = LowLatencyDispatchReference(shape, {.use_fp8 = true}, in, mask);
    // Expert outputs: a function of each packed row alone (its first element, scaled per expert), so the same
    // token gives the same row wherever its segment landed.
    auto expert_outputs = [&](const std::vector<LowLatencyDispatchOutput>& d, const std::vector<bool>& zero) {
      std::vector<std::vector<uint16_t>> outs(R);
      for (int r = 0; r < R; ++r) {
        outs[r].assign(static_cast<size_t>(L) * slots * H, 0);
        if (zero[r]) continue;
        for (int e = 0; e < L; ++e) {
          for (int j = 0; j < d[r].packed_recv_count[e]; ++j) {
            const size_t row = static_cast<size_t>(e) * slots + j;
            for (int h = 0; h < H; ++h) {
              const float v =
                  Fp8E4M3ToFloat(d[r].packed_recv_x[row * H + h]) * d[r].scales[(e * G + h / 128) * slots + j];
              outs[r][row * H + h] = FloatToBf16(v * (1.0f + 0.125f * (r * L + e)));
            }
          }
        }
      }
      return outs;
    };
    const auto combined = LowLatencyCombineReference(shape, in, expert_outputs(masked, mask), masked, mask);
    const auto zeroed = LowLatencyCombineReference(shape, in, expert_outputs(full, mask), full);
    for (int r = 0; r < R; ++r) {
      SCOPED_TRACE(::testing::Message() << "trial " << trial << ", rank " << r);
      if (mask[r]) {
        EXPECT_EQ(masked[r].packed_recv_count, std::vector<int32_t>(L, 0));
        continue;
      }
      for (int e = 0; e < L; ++e) {
        int64_t begin = 0;
        for (int s = 0; s < R; ++s) {
          const int64_t want_range = full[r].layout_range[e * R + s];
          const int64_t want_begin = want_range >> 32, want_count = want_range & 0xffffffff;
          const int64_t count = mask[s] ? 0 : want_count;
          ASSERT_EQ(masked[r].layout_range[e * R + s], Range(begin, count)) << "expert " << e << " source " << s;
          for (int64_t j = 0; j < count; ++j) {
            const size_t got = e * slots + begin + j, want = e * slots + want_begin + j;
            ASSERT_EQ(masked[r].src_info[got], full[r].src_info[want]);
            ASSERT_EQ(masked[r].topk_slot[got], full[r].topk_slot[want]);
            for (int g = 0; g < G; ++g) {
              ASSERT_EQ(masked[r].scales[(e * G + g) * slots + begin + j],
                        full[r].scales[(e * G + g) * slots + want_begin + j]);
            }
            for (int h = 0; h < H; ++h)
              ASSERT_EQ(masked[r].packed_recv_x[got * H + h], full[r].packed_recv_x[want * H + h]);
          }
          begin += count;
        }
        EXPECT_EQ(masked[r].packed_recv_count[e], begin);
      }
      ASSERT_EQ(combined[r].size(), zeroed[r].size());
      for (size_t i = 0; i < combined[r].size(); ++i) {
        // +0 and -0 alike: the full combine adds the zero partial sums the masked one skips.
        ASSERT_EQ(Bf16ToFloat(combined[r][i]), Bf16ToFloat(zeroed[r][i])) << "element " << i;
      }
    }
  }
}

TEST(LowLatencyReference, Fp8DispatchDequantisesCloseToTheInput) {
  LowLatencyShape shape{.num_ranks = 2, .num_experts = 8, .hidden = 512, .max_tokens_per_rank = 16, .num_topk = 4};
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<LowLatencyRankInput> in(2);
  for (int r = 0; r < 2; ++r) {
    in[r].num_tokens = 16;
    in[r].x.resize(16 * 512);
    for (auto& v : in[r].x) v = FloatToBf16(normal(rng) * 3.0f);
    for (int t = 0; t < 16; ++t) {
      for (int k = 0; k < 4; ++k) in[r].topk_idx.push_back((t + 2 * k) % 8);
    }
  }
  for (bool round_scale : {false, true}) {
    const auto out = LowLatencyDispatchReference(shape, {.use_fp8 = true, .round_scale = round_scale}, in);
    int checked = 0;
    for (int r = 0; r < 2; ++r) {
      for (int local = 0; local < 4; ++local) {
        for (int p = 0; p < out[r].packed_recv_count[local]; ++p) {
          const size_t slot = static_cast<size_t>(local) * 32 + p;
          // The source rank of slot p: the first whose range covers it.
          int s = 0;
          while (p >= ((out[r].layout_range[local * 2 + s] >> 32) + (out[r].layout_range[local * 2 + s] & 0xFFFFFFFF)))
            ++s;
          const int t = out[r].src_info[slot];
          for (int i = 0; i < 512; ++i) {
            const float scale = out[r].scales[(static_cast<size_t>(local) * 4 + i / 128) * 32 + p];
            const float deq = Fp8E4M3ToFloat(out[r].packed_recv_x[slot * 512 + i]) * scale;
            const float x = Bf16ToFloat(in[s].x[t * 512 + i]);
            ASSERT_LE(std::fabs(deq - x), std::fabs(x) / 16 + scale / 512) << "rank " << r << " slot " << p;
            ++checked;
          }
        }
      }
    }
    EXPECT_EQ(checked, 2 * 16 * 4 * 512);  // every (token, expert) pair arrived once
  }
}

TEST(LowLatencyLayout, SizesAndOffsets) {
  absl::StatusOr<LowLatencyLayout> l = MakeLowLatencyLayout(128, 7168, 2, 288);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->num_local_experts, 144);
  EXPECT_EQ(l->dispatch_msg_bytes, 16u + 7168u * 2);
  EXPECT_EQ(l->dispatch_count_offset, 0u);
  EXPECT_EQ(l->combine_flag_offset, 144u * 2 * 8);  // 64-bit count signals
  EXPECT_GE(l->dispatch_table_offset, l->signal_bytes);
  EXPECT_EQ(l->dispatch_msgs_offset - l->dispatch_table_offset, 144u * 2 * 128 * 4);
  EXPECT_EQ(l->combine_weights_offset - l->dispatch_msgs_offset, 2u * 128 * (16 + 7168 * 2));
  EXPECT_EQ(l->combine_recv_offset - l->combine_weights_offset, 2u * 128 * 16 * 4);
  EXPECT_EQ(l->half_bytes - l->combine_recv_offset, 128u * 2 * 7168 * 2);
  EXPECT_EQ(l->total_bytes, 2 * l->half_bytes + 144u * 256 * 7168 * 2);
  EXPECT_EQ(*LowLatencyRegionBytes(128, 7168, 2, 288), l->total_bytes);
}

// A count signal names its call: only the call's own tag decodes it, and a cleaned word (0) never does.
TEST(LowLatencyLayout, CountSignalsDecodeOnlyWithTheirCallsTag) {
  const uint32_t tag = LowLatencyCallTag(0x1234, 7);
  EXPECT_NE(tag, 0u);
  EXPECT_EQ(LowLatencyCountOf(LowLatencyCountSignal(tag, 0), tag), 0);
  EXPECT_EQ(LowLatencyCountOf(LowLatencyCountSignal(tag, 65535), tag), 65535);
  EXPECT_EQ(LowLatencyCountOf(LowLatencyCountSignal(tag, 3), tag ^ 1), -1);
  EXPECT_EQ(LowLatencyCountOf(0, tag), -1);
  // Consecutive calls, and the same call in another generation, have different tags.
  EXPECT_NE(LowLatencyCallTag(0x1234, 7), LowLatencyCallTag(0x1234, 8));
  EXPECT_NE(LowLatencyCallTag(0x1234, 7), LowLatencyCallTag(0x1235, 7));
  for (uint64_t g = 0; g < 1000; ++g) EXPECT_NE(LowLatencyCallTag(g, g * 3), 0u);
}

TEST(LowLatencyLayout, RejectsBadShapesNamingTheField) {
  EXPECT_EQ(MakeLowLatencyLayout(128, 7000, 2, 288).status().message(),
            "hidden = 7000: must be a positive multiple of 128");
  EXPECT_EQ(MakeLowLatencyLayout(128, 7168, 2, 287).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeLowLatencyLayout(0, 7168, 2, 288).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeLowLatencyLayout(128, 7168, 257, 257).status().message(), "num_ranks = 257: must be in [1, 256]");
  EXPECT_TRUE(MakeLowLatencyLayout(128, 7168, 9, 288).ok());    // beyond one host's 8 (across hosts)
  EXPECT_TRUE(MakeLowLatencyLayout(128, 7168, 256, 256).ok());  // 32 hosts of 8
}

// Across hosts a rank writes its slots of a remote rank's half into a compact outbox: the same fields as its slots
// in the full half, of the same sizes, in memory that does not grow with the ranks.
TEST(LowLatencyLayout, TheOutboxHoldsOneSourcesSlotsCompactly) {
  for (int ranks : {2, 16, 64}) {
    absl::StatusOr<LowLatencyLayout> l = MakeLowLatencyLayout(128, 7168, ranks, 4 * ranks);
    ASSERT_TRUE(l.ok()) << l.status();
    const size_t m = 128, row = 7168 * 2, L = 4;
    const LowLatencySlots& o = l->outbox;
    EXPECT_EQ(o.count, 0u);
    EXPECT_EQ(o.count_stride, 8u);
    EXPECT_GE(o.weights_flag, L * 8);
    EXPECT_GE(o.combine_flag, o.weights_flag + 4);
    EXPECT_LE(o.combine_flag + 4, l->outbox_signal_bytes);
    EXPECT_GE(o.table, l->outbox_signal_bytes);
    EXPECT_GE(o.msgs, o.table + L * o.table_stride);
    EXPECT_GE(o.weights, o.msgs + m * l->dispatch_msg_bytes);
    EXPECT_GE(o.recv, o.weights + m * kLowLatencyMaxTopk * 4);
    EXPECT_EQ(o.recv_stride, row);
    EXPECT_GE(l->outbox_half_bytes, o.recv + m * row);
    EXPECT_LT(l->outbox_half_bytes, m * (l->dispatch_msg_bytes + row + kLowLatencyMaxTopk * 4 + L * 4) + 1024 + L * 8);
    for (int s : {0, ranks - 1}) {
      const LowLatencySlots full = LowLatencySourceSlots(*l, s);
      EXPECT_EQ(full.count, l->dispatch_count_offset + 8u * s);
      EXPECT_EQ(full.count_stride, 8u * ranks);
      EXPECT_EQ(full.weights_flag, l->weights_flag_offset + 4u * s);
      EXPECT_EQ(full.combine_flag, l->combine_flag_offset + 4u * s);
      EXPECT_EQ(full.table, l->dispatch_table_offset + 4u * m * s);
      EXPECT_EQ(full.table_stride, 4u * m * ranks);
      EXPECT_EQ(full.msgs, l->dispatch_msgs_offset + m * l->dispatch_msg_bytes * s);
      EXPECT_EQ(full.weights, l->combine_weights_offset + m * kLowLatencyMaxTopk * 4 * s);
      EXPECT_EQ(full.recv, l->combine_recv_offset + row * s);
      EXPECT_EQ(full.recv_stride, row * ranks);
      // The last source's last row ends inside the half.
      EXPECT_LE(full.recv + (m - 1) * full.recv_stride + row, l->half_bytes);
    }
  }
}

// Dispatch arguments of that shape whose every pointer is `dummy` (checks that run before a launch only).
LowLatencyDispatchArgs ArgsPointingAt(int* dummy, int tokens, int topk, int hidden, int max_tokens, int experts) {
  LowLatencyDispatchArgs a;
  a.x = dummy;
  a.topk_idx = reinterpret_cast<const int64_t*>(dummy);
  a.num_tokens = tokens;
  a.num_topk = topk;
  a.hidden = hidden;
  a.max_tokens_per_rank = max_tokens;
  a.num_experts = experts;
  a.packed_recv_x = a.packed_recv_x_scales = dummy;
  a.packed_recv_count = a.packed_recv_src_info = a.packed_recv_topk_slot = dummy;
  a.packed_recv_layout_range = reinterpret_cast<int64_t*>(dummy);
  a.packed_recv_token_map = dummy;
  return a;
}

TEST(LowLatencyValidate, RefusesBeforeLaunch) {
  LowLatencyContext ctx;
  ctx.num_ranks = 2;
  ctx.layout = *MakeLowLatencyLayout(128, 4096, 2, 16);
  int dummy = 0;
  ctx.peer_regions[0] = ctx.peer_regions[1] = &dummy;
  KernelStatus status{};
  ctx.status = &status;
  LowLatencyDispatchArgs a = ArgsPointingAt(&dummy, 129, 8, 4096, 128, 16);
  EXPECT_EQ(ValidateLowLatencyDispatch(ctx, a).message(), "num_tokens = 129: must be in [0, max_tokens_per_rank]");
  a.num_tokens = 128;
  EXPECT_TRUE(ValidateLowLatencyDispatch(ctx, a).ok());
  a.use_ue8m0 = true;
  EXPECT_EQ(ValidateLowLatencyDispatch(ctx, a).code(), absl::StatusCode::kInvalidArgument);  // needs round_scale
  a.round_scale = true;
  EXPECT_TRUE(ValidateLowLatencyDispatch(ctx, a).ok());
  a.num_topk = 17;
  EXPECT_EQ(ValidateLowLatencyDispatch(ctx, a).message(), "num_topk = 17: must be in [1, 16]");
  a.num_topk = 8;
  a.hidden = 2048;
  EXPECT_EQ(ValidateLowLatencyDispatch(ctx, a).message(), "hidden = 2048: differs from the layout's");
}

// A group across hosts or past one NVLink domain runs the wide kernels, which read the regions from device memory: a
// context without that table is refused before anything is launched (no GPU needed to see it).
TEST(LowLatencyValidate, AWideGroupNeedsItsRegionTable) {
  LowLatencyContext ctx;
  ctx.num_ranks = 8;
  EXPECT_FALSE(LowLatencyWideGroup(ctx));
  ctx.remote_ranks.add(7);
  EXPECT_TRUE(LowLatencyWideGroup(ctx));
  ctx = LowLatencyContext{};
  ctx.num_ranks = 72;
  EXPECT_TRUE(LowLatencyWideGroup(ctx));
  ctx.rank = 70;
  ctx.layout = *MakeLowLatencyLayout(8, 128, 72, 72);
  int dummy = 0;
  for (int r = 0; r < 72; ++r) ctx.peer_regions[r] = &dummy;
  KernelStatus status{};
  ctx.status = &status;
  LowLatencyDispatchArgs a = ArgsPointingAt(&dummy, 8, 2, 128, 8, 72);
  ASSERT_TRUE(ValidateLowLatencyDispatch(ctx, a).ok());
  const absl::Status refused = LowLatencyDispatch(ctx, a, nullptr);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.message()), ::testing::HasSubstr("peer_region_table is null"));
}

}  // namespace
}  // namespace epfabric::kernels::host
