// Host-only tests of the intranode reference (layout, dispatch order and handle, combine), of the region layout
// and of the input validation that runs before any launch. No GPU needed: validation failures return before the
// first CUDA call.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "epfabric/kernels/intranode.h"
#include "epfabric/kernels/reference/intranode_reference.h"

namespace epfabric::kernels {
namespace {

namespace ref = reference;
using ::testing::HasSubstr;

TEST(IntranodeReferenceTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(ref::FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(ref::Bf16ToFloat(0x3f80), 1.0f);
  // 1 + 2^-8 is exactly half-way between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(ref::FloatToBf16(1.0f + 1.0f / 256), 0x3f80);
  // 1 + 3 * 2^-8 is half-way between 1 + 2^-7 (odd) and 1 + 2^-6: rounds up to the even one.
  EXPECT_EQ(ref::FloatToBf16(1.0f + 3.0f / 256), 0x3f82);
  EXPECT_EQ(ref::FloatToBf16(-2.5f), 0xc020);
}

TEST(IntranodeReferenceTest, ChannelsSplitTokensEvenly) {
  EXPECT_EQ(ref::ChannelTokenBegin(10, 3, 0), 0);
  EXPECT_EQ(ref::ChannelTokenBegin(10, 3, 1), 3);
  EXPECT_EQ(ref::ChannelTokenBegin(10, 3, 2), 6);
  EXPECT_EQ(ref::ChannelTokenBegin(10, 3, 3), 10);
  EXPECT_EQ(ref::ChannelTokenBegin(0, 24, 24), 0);
}

TEST(IntranodeReferenceTest, LayoutCountsTokensPerRankAndExpert) {
  // 8 experts on 2 ranks (0-3 on rank 0, 4-7 on rank 1), top-2.
  const std::vector<int64_t> topk = {0,  1,   // rank 0 only
                                     2,  5,   // both
                                     -1, 7,   // rank 1 only
                                     -1, -1,  // nowhere
                                     9,  3};  // 9 is out of range: ignored, counted as invalid
  const ref::Layout l = ref::ComputeLayout(topk.data(), 5, 2, 8, 2);
  EXPECT_EQ(l.num_tokens_per_rank, (std::vector<int32_t>{3, 2}));
  EXPECT_EQ(l.num_tokens_per_expert, (std::vector<int32_t>{1, 1, 1, 1, 0, 1, 0, 1}));
  EXPECT_EQ(l.is_token_in_rank, (std::vector<uint8_t>{1, 0, 1, 1, 0, 1, 0, 0, 1, 0}));
  EXPECT_EQ(l.num_tokens_per_rdma_rank, (std::vector<int32_t>{4}));
  EXPECT_EQ(l.num_invalid_topk, 1);
}

// Two ranks, 8 experts, top-2, hidden of one int32 per token (row_bytes 4) so that rows are easy to read.
struct SmallCase {
  std::vector<ref::RankInput> inputs;
  ref::DispatchConfig config;
};

SmallCase MakeSmallCase(int num_channels) {
  SmallCase c;
  c.config.num_ranks = 2;
  c.config.row_bytes = 4;
  c.config.num_topk = 2;
  c.config.has_weights = true;
  c.config.num_experts = 8;
  c.config.num_channels = num_channels;
  c.config.expert_alignment = 4;
  c.inputs.resize(2);
  const std::vector<std::vector<int64_t>> topk = {{0, 5, /**/ 6, 7, /**/ 1, 2}, {4, -1, /**/ 0, 4}};
  for (int r = 0; r < 2; ++r) {
    ref::RankInput& in = c.inputs[r];
    in.routing_topk = 2;
    in.topk_idx = topk[r];
    in.num_tokens = static_cast<int>(topk[r].size() / 2);
    for (int t = 0; t < in.num_tokens; ++t) {
      const int32_t value = 100 * r + t;  // row content: source rank and token
      const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&value);
      in.x.insert(in.x.end(), bytes, bytes + 4);
      in.topk_weights.push_back(0.5f + t);
      in.topk_weights.push_back(0.25f + t);
    }
  }
  return c;
}

int32_t RowValue(const ref::RankOutput& o, int row) {
  int32_t v;
  std::memcpy(&v, o.recv_x.data() + 4 * row, 4);
  return v;
}

TEST(IntranodeReferenceTest, DispatchOrdersBySourceRankThenToken) {
  const SmallCase c = MakeSmallCase(2);
  const std::vector<ref::RankOutput> out = ref::Dispatch(c.inputs, c.config);
  // Rank 0 (experts 0-3) receives rank 0's tokens 0 and 2, then rank 1's token 1.
  ASSERT_EQ(out[0].num_recv_tokens, 3);
  EXPECT_EQ(RowValue(out[0], 0), 0);
  EXPECT_EQ(RowValue(out[0], 1), 2);
  EXPECT_EQ(RowValue(out[0], 2), 101);
  EXPECT_EQ(out[0].recv_src_idx, (std::vector<int32_t>{0, 2, 1}));
  // Rank 1 (experts 4-7) receives rank 0's tokens 0 and 1, then rank 1's tokens 0 and 1.
  ASSERT_EQ(out[1].num_recv_tokens, 4);
  EXPECT_EQ(RowValue(out[1], 0), 0);
  EXPECT_EQ(RowValue(out[1], 1), 1);
  EXPECT_EQ(RowValue(out[1], 2), 100);
  EXPECT_EQ(RowValue(out[1], 3), 101);
  // Rank prefix matrix, inclusive over sources: [s][d].
  EXPECT_EQ(out[0].rank_prefix_matrix, (std::vector<int32_t>{2, 2, 3, 4}));
  // Expert counts aligned to 4: rank 0's experts 0..3 get 2, 1, 1, 0 tokens.
  EXPECT_EQ(out[0].num_recv_tokens_per_expert, (std::vector<int32_t>{4, 4, 4, 0}));
}

TEST(IntranodeReferenceTest, DispatchRemapsTopkToLocalExperts) {
  const SmallCase c = MakeSmallCase(1);
  const std::vector<ref::RankOutput> out = ref::Dispatch(c.inputs, c.config);
  // Rank 1, row 0 is rank 0's token 0 with experts {0, 5}: 0 is not on rank 1, 5 is its local expert 1.
  EXPECT_EQ(out[1].recv_topk_idx[0], -1);
  EXPECT_EQ(out[1].recv_topk_idx[1], 1);
  EXPECT_EQ(out[1].recv_topk_weights[0], 0.0f);
  EXPECT_EQ(out[1].recv_topk_weights[1], 0.25f);
  // Rank 0, row 2 is rank 1's token 1 with experts {0, 4}.
  EXPECT_EQ(out[0].recv_topk_idx[4], 0);
  EXPECT_EQ(out[0].recv_topk_idx[5], -1);
  EXPECT_EQ(out[0].recv_topk_weights[4], 1.5f);
  EXPECT_EQ(out[0].recv_topk_weights[5], 0.0f);
}

TEST(IntranodeReferenceTest, HandleHasSlotsAndChannelPrefixes) {
  const SmallCase c = MakeSmallCase(2);
  const std::vector<ref::RankOutput> out = ref::Dispatch(c.inputs, c.config);
  // Rank 0's tokens: 0 -> both, 1 -> rank 1, 2 -> rank 0.
  EXPECT_EQ(out[0].send_slot, (std::vector<int32_t>{0, 0, -1, 1, 1, -1}));
  // Rank 0 splits its 3 tokens into channels [0, 1) and [1, 3); on rank 1 the channel-1 rows from rank 0 start at
  // slot 1 (token 0 went to rank 1 in channel 0).
  EXPECT_EQ(out[1].recv_channel_prefix, (std::vector<int32_t>{0, 1, 0, 1}));
  EXPECT_EQ(out[0].recv_channel_prefix, (std::vector<int32_t>{0, 1, 0, 0}));
}

TEST(IntranodeReferenceTest, CombineSumsEveryRankThatReceivedTheToken) {
  const SmallCase c = MakeSmallCase(2);
  const std::vector<ref::RankOutput> out = ref::Dispatch(c.inputs, c.config);
  const int hidden = 8;
  std::vector<ref::CombineInput> in(2);
  for (int r = 0; r < 2; ++r) {
    for (int row = 0; row < out[r].num_recv_tokens; ++row) {
      for (int i = 0; i < hidden; ++i) in[r].x.push_back(ref::FloatToBf16(static_cast<float>(10 * r + row + i)));
    }
    in[r].topk_weights = out[r].recv_topk_weights;
  }
  in[0].bias_0.assign(3 * hidden, ref::FloatToBf16(0.5f));
  const std::vector<ref::CombineOutput> combined = ref::Combine(out, in, hidden, 2);
  // Rank 0 token 0 went to rank 0 (row 0) and rank 1 (row 0): (0 + i) + (10 + i) + 0.5.
  EXPECT_EQ(combined[0].combined_x_float[3], 0.0f + 3 + 10 + 3 + 0.5f);
  // Rank 0 token 1 went to rank 1 only (row 1): 11 + i + 0.5.
  EXPECT_EQ(combined[0].combined_x_float[hidden + 2], 11.0f + 2 + 0.5f);
  // Rank 1 token 1 went to rank 0 (row 2) and rank 1 (row 3), no bias.
  EXPECT_EQ(combined[1].combined_x_float[hidden + 1], 2.0f + 1 + 13 + 1);
  EXPECT_EQ(combined[1].combined_x[hidden + 1], ref::FloatToBf16(17.0f));
  // Weights: the received (zeroed where not local) weights sum back to the original ones.
  for (int r = 0; r < 2; ++r) {
    for (size_t i = 0; i < c.inputs[r].topk_weights.size(); ++i) {
      const bool routed = c.inputs[r].topk_idx[i] >= 0;
      EXPECT_EQ(combined[r].combined_topk_weights[i], routed ? c.inputs[r].topk_weights[i] : 0.0f) << r << " " << i;
    }
  }
}

TEST(IntranodeReferenceTest, CombineWeightsDoNotDependOnWhatRankZeroReceived) {
  // Rank 0's only token goes to rank 1 (expert 5 of 8); rank 0 receives nothing, rank 1 has no tokens.
  ref::DispatchConfig config;
  config.num_ranks = 2;
  config.row_bytes = 16;
  config.num_topk = 1;
  config.has_weights = true;
  config.num_experts = 8;
  std::vector<ref::RankInput> inputs(2);
  inputs[0].num_tokens = 1;
  inputs[0].routing_topk = 1;
  inputs[0].x.assign(16, 0);
  inputs[0].topk_idx = {5};
  inputs[0].topk_weights = {0.75f};
  inputs[1].routing_topk = 1;
  const std::vector<ref::RankOutput> out = ref::Dispatch(inputs, config);
  ASSERT_EQ(out[0].num_recv_tokens, 0);
  ASSERT_EQ(out[1].num_recv_tokens, 1);
  std::vector<ref::CombineInput> in(2);
  in[1].x.assign(8, ref::FloatToBf16(1.0f));
  in[1].topk_weights = out[1].recv_topk_weights;
  const std::vector<ref::CombineOutput> combined = ref::Combine(out, in, 8, 1);
  EXPECT_EQ(combined[0].combined_topk_weights, (std::vector<float>{0.75f}));
  EXPECT_EQ(combined[0].combined_x_float[7], 1.0f);
}

IntranodeRegionConfig BenchRegion() {
  IntranodeRegionConfig c;
  c.num_ranks = 2;
  c.max_tokens_per_rank = 4096;
  c.max_hidden = 7168;
  c.max_topk = 8;
  c.num_experts = 256;
  c.max_channels = 24;
  return c;
}

TEST(IntranodeRegionTest, SectionsAreAlignedDisjointAndFit) {
  const IntranodeRegionConfig c = BenchRegion();
  absl::StatusOr<IntranodeRegionLayout> l = ComputeIntranodeRegionLayout(c);
  ASSERT_TRUE(l.ok()) << l.status();
  struct Section {
    size_t offset, bytes;
  };
  std::vector<Section> sections = {
      {l->barrier_arrive, 24 * 2 * 4},
      {l->barrier_epoch, 24 * 4},
      {l->dispatch_range, 2 * 24 * 8},
      {l->channel_tail, 2 * 24 * 4},
      {l->notify_rank_counts, 2 * 2 * 4},
      {l->notify_expert_counts, 2 * 128 * 4},
      {l->staging_x, 2 * l->staging_x_pool_bytes},
      {l->staging_scales, 2 * l->staging_scales_pool_bytes},
      {l->staging_topk_idx, 2 * l->staging_topk_idx_pool_bytes},
      {l->staging_topk_weights, 2 * l->staging_topk_weights_pool_bytes},
      {l->staging_src_idx, 2 * l->staging_src_idx_pool_bytes},
  };
  std::sort(sections.begin(), sections.end(), [](const Section& a, const Section& b) { return a.offset < b.offset; });
  for (size_t i = 0; i < sections.size(); ++i) {
    EXPECT_EQ(sections[i].offset % 256, 0u) << i;
    const size_t end = sections[i].offset + sections[i].bytes;
    if (i + 1 < sections.size()) EXPECT_LE(end, sections[i + 1].offset) << i;
    EXPECT_LE(end, l->total_bytes);
  }
  EXPECT_GE(l->staging_x_pool_bytes, 4096u * 7168 * 2);
  EXPECT_GE(l->staging_scales_pool_bytes, 4096u * 56 * 4);
  EXPECT_GE(l->staging_topk_idx_pool_bytes, 4096u * 8 * 8);
  EXPECT_LE(l->signal_bytes, l->staging_x);
  EXPECT_GE(l->signal_bytes, l->notify_expert_counts + 2 * 128 * 4);
  absl::StatusOr<size_t> bytes = IntranodeRegionBytes(c);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(*bytes, l->total_bytes);
  // About 2 x 58.7 MB of BF16 staging plus small sections.
  EXPECT_LT(*bytes, 2ull * 4096 * 7168 * 2 + 8ull * 1024 * 1024);
  EXPECT_EQ(IntranodeWorstCaseRecvTokens(c), 8192);
}

// The dispatch kernel's shared arrays hold at most 26 copy warps (32 less the publisher and five receiver warps:
// kMaxCopyWarps in kernels/api/launch.h); every choice must fit, and the measured settings must be the ones chosen.
TEST(IntranodeLaunchTest, CopyWarpsFitTheBlockAndFollowTheMeasuredTable) {
  for (TunedGpu gpu : {TunedGpu::kH100, TunedGpu::kH200}) {
    for (int ranks = 1; ranks <= 8; ++ranks) {
      for (int row_bytes : {16, 512, 4080, 4096, 7168, 8192, 14336, 65536}) {
        for (int sms = 1; sms <= 64; ++sms) {
          const int copy = IntranodeDispatchCopyWarps(ranks, row_bytes, sms, gpu);
          EXPECT_GE(copy, 1) << ranks << " " << row_bytes << " " << sms;
          EXPECT_LE(copy, 26) << ranks << " " << row_bytes << " " << sms;
        }
      }
    }
    EXPECT_EQ(IntranodeDispatchCopyWarps(2, 7168 * 2, 24, gpu), 11);  // BF16, hidden 7168
    EXPECT_EQ(IntranodeDispatchCopyWarps(2, 7168 * 2, 20, gpu), 15);
    EXPECT_EQ(IntranodeDispatchCopyWarps(2, 7168, 24, gpu), 15);  // FP8
    EXPECT_EQ(IntranodeDispatchCopyWarps(4, 7168 * 2, 24, gpu), 4);
    EXPECT_EQ(IntranodeDispatchCopyWarps(4, 7168, 24, gpu), 7);
    EXPECT_EQ(IntranodeDispatchCopyWarps(4, 256 * 2, 24, gpu), 15);  // small rows: not swept
  }
  EXPECT_EQ(IntranodeDispatchCopyWarps(2, 7168 * 2, 32, TunedGpu::kH100), 9);
  EXPECT_EQ(IntranodeDispatchCopyWarps(2, 7168 * 2, 32, TunedGpu::kH200), 7);
}

// The combine sender's stages hold at most 24 KB chunks (kMaxCombineChunkBytes in kernels/api/launch.h) that bulk
// copies move (multiples of 16 bytes); the measured settings must be the ones chosen.
TEST(IntranodeLaunchTest, CombineChunksFitTheStagesAndFollowTheMeasuredTable) {
  for (TunedGpu gpu : {TunedGpu::kH100, TunedGpu::kH200}) {
    for (int ranks = 1; ranks <= 8; ++ranks) {
      for (int channels = 1; channels <= 64; ++channels) {
        const int chunk = IntranodeCombineChunkBytes(ranks, channels, gpu);
        EXPECT_GE(chunk, 16) << ranks << " " << channels;
        EXPECT_LE(chunk, 24576) << ranks << " " << channels;
        EXPECT_EQ(chunk % 16, 0) << ranks << " " << channels;
      }
    }
    EXPECT_EQ(IntranodeCombineChunkBytes(4, 24, gpu), 16384);  // 3+ ranks: not swept
  }
  EXPECT_EQ(IntranodeCombineChunkBytes(2, 16, TunedGpu::kH100), 20480);
  EXPECT_EQ(IntranodeCombineChunkBytes(2, 20, TunedGpu::kH100), 16384);
  EXPECT_EQ(IntranodeCombineChunkBytes(2, 24, TunedGpu::kH100), 14336);
  EXPECT_EQ(IntranodeCombineChunkBytes(2, 32, TunedGpu::kH100), 16384);
  EXPECT_EQ(IntranodeCombineChunkBytes(2, 16, TunedGpu::kH200), 24576);
  EXPECT_EQ(IntranodeCombineChunkBytes(2, 20, TunedGpu::kH200), 14336);
  EXPECT_EQ(IntranodeCombineChunkBytes(2, 24, TunedGpu::kH200), 10240);
  EXPECT_EQ(IntranodeCombineChunkBytes(2, 32, TunedGpu::kH200), 24576);
}

// Without a GPU (CI) the current device takes the H100's settings (those every other GPU takes); on an H100 or H200
// its own (the kind comes from the memory bandwidth, checked here against the device's name).
TEST(IntranodeLaunchTest, TunedGpuIsTheDevicesKind) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    EXPECT_EQ(CurrentTunedGpu(), TunedGpu::kH100);
    return;
  }
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  const std::string name = prop.name;
  if (name.find("H200") != std::string::npos) EXPECT_EQ(CurrentTunedGpu(), TunedGpu::kH200) << name;
  if (name.find("H100") != std::string::npos) EXPECT_EQ(CurrentTunedGpu(), TunedGpu::kH100) << name;
}

TEST(IntranodeRegionTest, SizeGrowsWithTheConfiguration) {
  IntranodeRegionConfig c = BenchRegion();
  const size_t base = *IntranodeRegionBytes(c);
  c.num_ranks = 8;
  EXPECT_GT(*IntranodeRegionBytes(c), 3 * base);
  c = BenchRegion();
  c.max_tokens_per_rank = 8192;
  EXPECT_GT(*IntranodeRegionBytes(c), base);
}

TEST(IntranodeRegionTest, RejectsBadConfigurationsNamingTheField) {
  IntranodeRegionConfig c = BenchRegion();
  c.num_ranks = 9;
  absl::StatusOr<size_t> s = IntranodeRegionBytes(c);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("config.num_ranks = 9"));
  c = BenchRegion();
  c.num_experts = 255;
  EXPECT_THAT(std::string(IntranodeRegionBytes(c).status().message()), HasSubstr("config.num_experts = 255"));
  c = BenchRegion();
  c.max_hidden = 100;
  EXPECT_THAT(std::string(IntranodeRegionBytes(c).status().message()), HasSubstr("config.max_hidden = 100"));
  c = BenchRegion();
  c.max_channels = 0;
  EXPECT_THAT(std::string(IntranodeRegionBytes(c).status().message()), HasSubstr("config.max_channels = 0"));
}

// A group whose pointers are never dereferenced: validation must fail before anything touches them.
struct FakeGroup {
  FakeGroup() {
    group.config = BenchRegion();
    group.rank = 0;
    group.peer_regions[0] = reinterpret_cast<void*>(0x100000);
    group.peer_regions[1] = reinterpret_cast<void*>(0x200000);
    group.status = reinterpret_cast<KernelStatus*>(0x300000);
    handle.num_tokens = 16;
    handle.num_recv_tokens = 32;
    handle.is_token_in_rank = reinterpret_cast<const bool*>(0x400000);
    handle.rank_prefix_matrix = reinterpret_cast<int32_t*>(0x500000);
    handle.recv_channel_prefix = reinterpret_cast<int32_t*>(0x600000);
    handle.send_slot = reinterpret_cast<int32_t*>(0x700000);
    handle.recv_src_idx = reinterpret_cast<int32_t*>(0x800000);
    params.x = reinterpret_cast<void*>(0x900000);
    params.hidden = 7168;
    params.num_experts = 256;
    params.num_sms = 24;
    params.recv_capacity = 32;
    params.recv_x = reinterpret_cast<void*>(0xa00000);
  }
  std::string DispatchError() {
    absl::Status s = IntranodeDispatch(group, params, &handle, nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    return std::string(s.message());
  }
  IntranodeGroup group;
  IntranodeHandle handle;
  IntranodeDispatchParams params;
};

TEST(IntranodeValidationTest, DispatchRefusesBadInputBeforeLaunch) {
  {
    FakeGroup f;
    f.params.num_sms = 0;
    EXPECT_THAT(f.DispatchError(), HasSubstr("num_sms = 0"));
  }
  {
    FakeGroup f;
    f.params.num_sms = 25;
    EXPECT_THAT(f.DispatchError(), HasSubstr("num_sms = 25"));
  }
  {
    FakeGroup f;
    f.params.hidden = 7170;
    EXPECT_THAT(f.DispatchError(), HasSubstr("hidden = 7170"));
  }
  {
    FakeGroup f;
    f.params.x_dtype = DType::kFP8E4M3;
    f.params.hidden = 7104;  // multiple of 8, not of 128
    EXPECT_THAT(f.DispatchError(), HasSubstr("hidden = 7104"));
  }
  {
    FakeGroup f;
    f.params.x_dtype = DType::kFP8E4M3;
    EXPECT_THAT(f.DispatchError(), HasSubstr("x_scales is null"));
  }
  {
    FakeGroup f;
    f.params.x_dtype = DType::kFloat32;
    EXPECT_THAT(f.DispatchError(), HasSubstr("x_dtype = float32"));
  }
  {
    FakeGroup f;
    f.handle.num_tokens = 4097;
    EXPECT_THAT(f.DispatchError(), HasSubstr("handle.num_tokens = 4097"));
  }
  {
    FakeGroup f;
    f.params.num_experts = 128;
    EXPECT_THAT(f.DispatchError(), HasSubstr("num_experts = 128"));
  }
  {
    FakeGroup f;
    f.params.topk_idx = reinterpret_cast<const int64_t*>(0xb00000);
    f.params.num_topk = 9;
    EXPECT_THAT(f.DispatchError(), HasSubstr("num_topk = 9"));
  }
  {
    FakeGroup f;
    f.params.topk_weights = reinterpret_cast<const float*>(0xb00000);
    EXPECT_THAT(f.DispatchError(), HasSubstr("topk_idx is null"));
  }
  {
    FakeGroup f;
    f.handle.num_recv_tokens = 33;
    EXPECT_THAT(f.DispatchError(), HasSubstr("handle.num_recv_tokens = 33"));
  }
  {
    FakeGroup f;
    f.params.recv_capacity = -1;
    f.handle.num_recv_tokens = 0;
    EXPECT_THAT(f.DispatchError(), HasSubstr("recv_capacity = -1"));
  }
  {
    FakeGroup f;
    f.group.peer_regions[1] = nullptr;
    EXPECT_THAT(f.DispatchError(), HasSubstr("peer_regions[1] is null"));
  }
  {
    FakeGroup f;
    f.group.rank = 2;
    EXPECT_THAT(f.DispatchError(), HasSubstr("group.rank = 2"));
  }
  {
    FakeGroup f;
    f.params.x = reinterpret_cast<void*>(0x900008);
    EXPECT_THAT(f.DispatchError(), HasSubstr("16-byte aligned"));
  }
  {
    FakeGroup f;
    f.group.status = nullptr;
    EXPECT_THAT(f.DispatchError(), HasSubstr("group.status is null"));
  }
}

TEST(IntranodeValidationTest, CombineNotifyAndLayoutRefuseBadInput) {
  FakeGroup f;
  IntranodeCombineParams combine;
  combine.x = reinterpret_cast<void*>(0x900000);
  combine.combined_x = reinterpret_cast<void*>(0xa00000);
  combine.hidden = 7168;
  f.handle.num_channels = 0;  // no dispatch yet
  absl::Status s = IntranodeCombine(f.group, combine, f.handle, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("handle.num_channels = 0"));
  f.handle.num_channels = 24;
  combine.hidden = 8192;
  EXPECT_THAT(std::string(IntranodeCombine(f.group, combine, f.handle, nullptr).message()), HasSubstr("hidden = 8192"));

  IntranodeNotifyParams notify;
  notify.num_tokens_per_rank = reinterpret_cast<const int32_t*>(0x100);
  notify.num_tokens_per_expert = reinterpret_cast<const int32_t*>(0x200);
  notify.rank_prefix_matrix = reinterpret_cast<int32_t*>(0x300);
  notify.num_tokens = 16;
  notify.num_experts = 256;
  notify.expert_alignment = 0;
  EXPECT_THAT(std::string(IntranodeNotify(f.group, notify, nullptr).message()), HasSubstr("expert_alignment = 0"));

  DispatchLayoutParams layout;
  layout.topk_idx = reinterpret_cast<const int64_t*>(0x100);
  layout.num_tokens = 4;
  layout.num_topk = 8;
  layout.num_experts = 250;
  layout.num_ranks = 8;
  layout.num_tokens_per_rank = reinterpret_cast<int32_t*>(0x200);
  layout.num_tokens_per_expert = reinterpret_cast<int32_t*>(0x300);
  layout.is_token_in_rank = reinterpret_cast<bool*>(0x400);
  s = GetDispatchLayout(layout, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("num_experts = 250"));
}

}  // namespace
}  // namespace epfabric::kernels
