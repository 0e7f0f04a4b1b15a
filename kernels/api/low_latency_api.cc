// Host side of the low-latency launches: validation (before any launch), the kernels' parameter blocks and the grid
// size. The kernels themselves are in kernels/cuda/low_latency_{dispatch,combine}.cu.
#include "absl/strings/str_cat.h"
#include "api/launch.h"
#include "api/launch_error.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/kernels/low_latency.h"
#include "epfabric/kernels/low_latency_remote.h"
#include "epfabric/kernels/transport/ring.h"

namespace epfabric::kernels {
namespace {

low_latency::GroupView MakeGroupView(const LowLatencyContext& ctx, int half, LowLatencyPhases phases, uint32_t tag) {
  low_latency::GroupView g = {};
  g.layout = ctx.layout;
  for (int r = 0; r < kMaxNvlPeers && r < ctx.num_ranks; ++r) g.regions[r] = static_cast<uint8_t*>(ctx.peer_regions[r]);
  g.region_table = reinterpret_cast<uint8_t* const*>(ctx.peer_region_table);
  g.self = static_cast<uint8_t*>(ctx.peer_regions[ctx.rank]);
  g.own = LowLatencySourceSlots(ctx.layout, ctx.rank);
  g.rank = ctx.rank;
  g.num_ranks = ctx.num_ranks;
  g.half = half;
  g.phases = static_cast<int>(phases);
  g.tag = tag;
  g.remote = ctx.remote_ranks;
  g.inbox = static_cast<uint8_t*>(ctx.remote_inbox);
  g.rank_mask = ctx.rank_mask;
  g.status = ctx.status;
  g.timeout_ns = ctx.timeout_ns;
  g.profile = ctx.profile_ns;
  g.lost_ranks = ctx.lost_ranks;
  for (int i = 0; i < kLostRankWords; ++i) g.lost_ignore[i] = ctx.lost_ignore[i];
  return g;
}

// A wide group's kernels read region addresses from ctx.peer_region_table (low_latency_common.cuh).
absl::Status CheckRegionTable(const LowLatencyContext& ctx) {
  if (LowLatencyWideGroup(ctx) && ctx.peer_region_table == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("ctx.peer_region_table is null: a group of ", ctx.num_ranks,
                                                   " ranks (across hosts or more than ", kMaxNvlPeers,
                                                   ") needs its regions in device memory (LowLatencyRegionTable)"));
  }
  return absl::OkStatus();
}

// Blocks per launch: ctx.num_blocks or the device's SM count.
absl::StatusOr<int> BlocksFor(const LowLatencyContext& ctx) {
  if (ctx.num_blocks > 0) return ctx.num_blocks;
  int device = 0, sms = 0;
  EPF_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  EPF_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

}  // namespace

bool LowLatencyWideGroup(const LowLatencyContext& ctx) {
  return !ctx.remote_ranks.empty() || ctx.num_ranks > kMaxNvlPeers;
}

absl::StatusOr<LowLatencyRegionTable> LowLatencyRegionTable::Create(const LowLatencyContext& ctx, cudaStream_t stream) {
  if (ctx.num_ranks <= 0 || ctx.num_ranks > kMaxLowLatencyRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("ctx.num_ranks = ", ctx.num_ranks, ", expected 1 to ", kMaxLowLatencyRanks));
  }
  LowLatencyRegionTable table;
  const size_t bytes = sizeof(void*) * ctx.num_ranks;
  EPF_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&table.table_), bytes));
  EPF_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(table.table_, ctx.peer_regions, bytes, cudaMemcpyHostToDevice, stream));
  EPF_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return table;
}

LowLatencyRegionTable& LowLatencyRegionTable::operator=(LowLatencyRegionTable&& other) noexcept {
  if (this != &other) {
    if (table_ != nullptr) cudaFree(table_);
    table_ = other.table_;
    other.table_ = nullptr;
  }
  return *this;
}

LowLatencyRegionTable::~LowLatencyRegionTable() {
  if (table_ != nullptr) cudaFree(table_);
}

absl::Status LowLatencyPreloadKernels() {
  return LaunchError(low_latency::PreloadKernels(), "loading the low-latency kernels");
}

absl::Status LowLatencyDispatch(const LowLatencyContext& ctx, const LowLatencyDispatchArgs& args, cudaStream_t stream) {
  EPF_RETURN_IF_ERROR(ValidateLowLatencyDispatch(ctx, args));
  EPF_RETURN_IF_ERROR(CheckRegionTable(ctx));
  EPF_ASSIGN_OR_RETURN(const int blocks, BlocksFor(ctx));
  low_latency::DispatchKernelParams p = {};
  p.g = MakeGroupView(ctx, args.buffer_half, args.phases, args.call_tag);
  p.x = static_cast<const uint16_t*>(args.x);
  p.topk_idx = args.topk_idx;
  p.num_tokens = args.num_tokens;
  p.num_topk = args.num_topk;
  p.use_fp8 = args.use_fp8;
  p.round_scale = args.round_scale;
  p.use_ue8m0 = args.use_ue8m0;
  p.message_per_expert = args.message_per_expert;
  p.cumulative_stats = args.cumulative_stats;
  p.expert_load = args.expert_load;
  p.wait_recv_cost_ns = args.wait_recv_cost_ns;
  p.packed_recv_x = static_cast<uint8_t*>(args.packed_recv_x);
  p.packed_recv_x_scales = args.packed_recv_x_scales;
  p.packed_recv_count = args.packed_recv_count;
  p.packed_recv_src_info = args.packed_recv_src_info;
  p.packed_recv_layout_range = args.packed_recv_layout_range;
  p.packed_recv_topk_slot = args.packed_recv_topk_slot;
  p.packed_recv_token_map = args.packed_recv_token_map;
  return LaunchError(low_latency::LaunchDispatch(p, blocks, stream), "low-latency dispatch launch");
}

absl::Status LowLatencyCombine(const LowLatencyContext& ctx, const LowLatencyCombineArgs& args, cudaStream_t stream) {
  EPF_RETURN_IF_ERROR(ValidateLowLatencyCombine(ctx, args));
  EPF_RETURN_IF_ERROR(CheckRegionTable(ctx));
  EPF_ASSIGN_OR_RETURN(const int blocks, BlocksFor(ctx));
  low_latency::CombineKernelParams p = {};
  p.g = MakeGroupView(ctx, args.buffer_half, args.phases, args.call_tag);
  p.x = static_cast<const uint16_t*>(args.zero_copy ? LowLatencyCombineInputBuffer(ctx) : args.x);
  p.topk_idx = args.topk_idx;
  p.topk_weights = args.topk_weights;
  p.num_tokens = args.num_tokens;
  p.num_topk = args.num_topk;
  p.token_map = args.handle.packed_recv_token_map;
  p.combined_x = static_cast<uint16_t*>(args.combined_x);
  p.wait_recv_cost_ns = args.wait_recv_cost_ns;
  return LaunchError(low_latency::LaunchCombine(p, blocks, stream), "low-latency combine launch");
}

absl::Status LowLatencyRemoteIssue(const LowLatencyContext& ctx, const LowLatencyRemoteRings& rings,
                                   const LowLatencyRemoteArgs& args, cudaStream_t stream) {
  if (ctx.remote_ranks.empty() || ctx.remote_inbox == nullptr) {
    return absl::FailedPreconditionError("device-issued low latency: the group has no rank on another host");
  }
  EPF_RETURN_IF_ERROR(CheckRegionTable(ctx));
  if (rings.num_rings < 1 || rings.num_rings > kMaxNvlPeers) {
    return absl::InvalidArgumentError(
        absl::StrCat("device-issued low latency: num_rings = ", rings.num_rings, ", expected 1 to ", kMaxNvlPeers));
  }
  if (args.buffer_half != 0 && args.buffer_half != 1) {
    return absl::InvalidArgumentError(absl::StrCat("buffer_half = ", args.buffer_half, ", expected 0 or 1"));
  }
  if (args.num_tokens < 0 || args.num_tokens > ctx.layout.max_tokens_per_rank) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens = ", args.num_tokens, ", expected 0 to ", ctx.layout.max_tokens_per_rank));
  }
  if (args.step == LowLatencyRemoteStep::kCombineRows && args.token_map == nullptr) {
    return absl::InvalidArgumentError("device-issued low latency: the combine rows step needs the token map");
  }
  low_latency::RemoteIssueKernelParams p = {};
  // The issuer forwards staged bytes and never reads a signal's tag.
  p.g = MakeGroupView(ctx, args.buffer_half, LowLatencyPhases::kSend, /*tag=*/0);
  for (int c = 0; c < rings.num_rings; ++c) {
    const transport::DeviceRing& ring = rings.rings[c];
    if (ring.ring == nullptr || ring.next == nullptr || !transport::ValidRingSlots(ring.slots)) {
      return absl::InvalidArgumentError(
          absl::StrCat("device-issued low latency: ring ", c, " without memory, counter or a valid slot count"));
    }
    p.rings[c] = {ring.ring, ring.next, ring.slots, ring.channel};
  }
  p.num_rings = rings.num_rings;
  p.rdma_offset = rings.rdma_offset;
  p.step = static_cast<int>(args.step);
  p.num_tokens = args.num_tokens;
  p.token_map = args.token_map;
  return LaunchError(low_latency::LaunchRemoteIssue(p, stream), "low-latency remote issue launch");
}

}  // namespace epfabric::kernels
