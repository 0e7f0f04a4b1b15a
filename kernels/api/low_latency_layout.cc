// The low-latency region layout and the argument checks done before any launch.
#include <algorithm>

#include "absl/strings/str_format.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/kernels/low_latency.h"

namespace epfabric::kernels {
namespace {

constexpr size_t kAlign = 128;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

absl::Status CheckShape(int max_tokens_per_rank, int hidden, int num_ranks, int num_experts) {
  if (max_tokens_per_rank <= 0 || max_tokens_per_rank > kLowLatencyMaxTokensPerRank)
    return InvalidValue("max_tokens_per_rank", max_tokens_per_rank, "must be in [1, 65535]");
  if (hidden <= 0 || hidden % kFp8GroupSize != 0)
    return InvalidValue("hidden", hidden, "must be a positive multiple of 128");
  if (num_ranks <= 0 || num_ranks > kMaxLowLatencyRanks)
    return InvalidValue("num_ranks", num_ranks, absl::StrFormat("must be in [1, %d]", kMaxLowLatencyRanks));
  if (num_experts <= 0 || num_experts % num_ranks != 0)
    return InvalidValue("num_experts", num_experts, "must be a positive multiple of num_ranks");
  return absl::OkStatus();
}

absl::Status CheckContext(const LowLatencyContext& ctx, int max_tokens_per_rank, int hidden, int num_experts) {
  const LowLatencyLayout& l = ctx.layout;
  if (ctx.num_ranks <= 0 || ctx.num_ranks > kMaxLowLatencyRanks)
    return InvalidValue("ctx.num_ranks", ctx.num_ranks, absl::StrFormat("not in [1, %d]", kMaxLowLatencyRanks));
  if (ctx.rank < 0 || ctx.rank >= ctx.num_ranks) return InvalidValue("ctx.rank", ctx.rank, "not in [0, num_ranks)");
  if (l.num_ranks != ctx.num_ranks) return InvalidValue("layout.num_ranks", l.num_ranks, "differs from ctx.num_ranks");
  for (int r = 0; r < ctx.num_ranks; ++r) {
    if (ctx.peer_regions[r] == nullptr)
      return InvalidValue("ctx.peer_regions[r] is null for r", r, "every rank needs a region");
  }
  if (ctx.status == nullptr) return absl::InvalidArgumentError("ctx.status is null: a status word is required");
  if (max_tokens_per_rank != l.max_tokens_per_rank)
    return InvalidValue("max_tokens_per_rank", max_tokens_per_rank, "differs from the layout's");
  if (hidden != l.hidden) return InvalidValue("hidden", hidden, "differs from the layout's");
  if (num_experts != l.num_experts) return InvalidValue("num_experts", num_experts, "differs from the layout's");
  return absl::OkStatus();
}

absl::Status CheckTokens(int num_tokens, int num_topk, int max_tokens_per_rank, const void* topk_idx) {
  EPF_RETURN_IF_ERROR(CheckNumTokens("num_tokens", num_tokens, max_tokens_per_rank));
  EPF_RETURN_IF_ERROR(CheckNumTopk("num_topk", num_topk, kLowLatencyMaxTopk));
  if (num_tokens > 0 && topk_idx == nullptr) return absl::InvalidArgumentError("topk_idx is null");
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckLowLatencyScaleOptions(bool use_fp8, bool round_scale, bool use_ue8m0, int hidden) {
  if (use_ue8m0 && !(use_fp8 && round_scale)) {
    return absl::InvalidArgumentError(
        "use_ue8m0 = true needs use_fp8 = true and round_scale = true (scales must be powers of two)");
  }
  if (use_ue8m0 && hidden % (kFp8GroupSize * kUe8m0ScalesPerInt32) != 0) {
    return InvalidValue("hidden", hidden, "must be a multiple of 512 with use_ue8m0 (4 scales per int32)");
  }
  return absl::OkStatus();
}

absl::StatusOr<LowLatencyLayout> MakeLowLatencyLayout(int max_tokens_per_rank, int hidden, int num_ranks,
                                                      int num_experts) {
  EPF_RETURN_IF_ERROR(CheckShape(max_tokens_per_rank, hidden, num_ranks, num_experts));
  LowLatencyLayout l;
  l.max_tokens_per_rank = max_tokens_per_rank;
  l.hidden = hidden;
  l.num_ranks = num_ranks;
  l.num_experts = num_experts;
  l.num_local_experts = num_experts / num_ranks;
  const size_t m = static_cast<size_t>(max_tokens_per_rank);
  const size_t h = static_cast<size_t>(hidden);
  const size_t num_scales = h / kFp8GroupSize;
  // A message carries either BF16 data, or FP8 data followed by one float scale per 128 channels.
  l.dispatch_msg_bytes =
      kLowLatencyMessageHeaderBytes + (std::max(h * 2, h + num_scales * sizeof(float)) + 15) / 16 * 16;

  size_t off = 0;
  l.dispatch_count_offset = off;
  off += static_cast<size_t>(l.num_local_experts) * num_ranks * sizeof(uint64_t);
  l.combine_flag_offset = off;
  off += static_cast<size_t>(num_ranks) * sizeof(int32_t);
  l.weights_flag_offset = off;
  off += static_cast<size_t>(num_ranks) * sizeof(int32_t);
  l.dispatch_done_offset = off;
  off += sizeof(int32_t);
  l.combine_done_offset = off;
  off += sizeof(int32_t);
  l.signal_bytes = AlignUp(off);
  off = l.signal_bytes;
  l.dispatch_table_offset = off;
  off = AlignUp(off + static_cast<size_t>(l.num_local_experts) * num_ranks * m * sizeof(int32_t));
  l.dispatch_msgs_offset = off;
  off = AlignUp(off + static_cast<size_t>(num_ranks) * m * l.dispatch_msg_bytes);
  l.combine_weights_offset = off;
  off = AlignUp(off + static_cast<size_t>(num_ranks) * m * kLowLatencyMaxTopk * sizeof(float));
  l.combine_recv_offset = off;
  off = AlignUp(off + m * num_ranks * h * 2);
  l.half_bytes = off;
  l.combine_send_offset = 2 * l.half_bytes;
  l.total_bytes = AlignUp(l.combine_send_offset + static_cast<size_t>(l.num_local_experts) * num_ranks * m * h * 2);

  // The outbox: one source's slots, compact.
  LowLatencySlots& o = l.outbox;
  off = 0;
  o.count = off;
  o.count_stride = sizeof(uint64_t);
  off += static_cast<size_t>(l.num_local_experts) * sizeof(uint64_t);
  o.weights_flag = off;
  off += sizeof(int32_t);
  o.combine_flag = off;
  off += sizeof(int32_t);
  l.outbox_signal_bytes = AlignUp(off);
  o.table = l.outbox_signal_bytes;
  o.table_stride = m * sizeof(int32_t);
  o.msgs = AlignUp(o.table + static_cast<size_t>(l.num_local_experts) * o.table_stride);
  o.weights = AlignUp(o.msgs + m * l.dispatch_msg_bytes);
  o.recv = AlignUp(o.weights + m * kLowLatencyMaxTopk * sizeof(float));
  o.recv_stride = h * 2;
  l.outbox_half_bytes = AlignUp(o.recv + m * o.recv_stride);
  return l;
}

LowLatencySlots LowLatencySourceSlots(const LowLatencyLayout& l, int src) {
  const size_t s = static_cast<size_t>(src), r = static_cast<size_t>(l.num_ranks);
  const size_t m = static_cast<size_t>(l.max_tokens_per_rank), row = static_cast<size_t>(l.hidden) * 2;
  LowLatencySlots slots;
  slots.count = l.dispatch_count_offset + s * sizeof(uint64_t);
  slots.count_stride = r * sizeof(uint64_t);
  slots.weights_flag = l.weights_flag_offset + s * sizeof(int32_t);
  slots.combine_flag = l.combine_flag_offset + s * sizeof(int32_t);
  slots.table = l.dispatch_table_offset + s * m * sizeof(int32_t);
  slots.table_stride = r * m * sizeof(int32_t);
  slots.msgs = l.dispatch_msgs_offset + s * m * l.dispatch_msg_bytes;
  slots.weights = l.combine_weights_offset + s * m * kLowLatencyMaxTopk * sizeof(float);
  slots.recv = l.combine_recv_offset + s * row;
  slots.recv_stride = r * row;
  return slots;
}

uint32_t LowLatencyCallTag(uint64_t generation, uint64_t call_index) {
  // splitmix64's finaliser over both inputs: consecutive calls and nearby generations get unrelated tags.
  uint64_t z = generation + 0x9e3779b97f4a7c15ull * (call_index + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  const uint32_t tag = static_cast<uint32_t>(z ^ (z >> 32));
  return tag != 0 ? tag : 1;
}

absl::StatusOr<size_t> LowLatencyRegionBytes(int max_tokens_per_rank, int hidden, int num_ranks, int num_experts) {
  EPF_ASSIGN_OR_RETURN(const LowLatencyLayout layout,
                       MakeLowLatencyLayout(max_tokens_per_rank, hidden, num_ranks, num_experts));
  return layout.total_bytes;
}

absl::Status ValidateLowLatencyDispatch(const LowLatencyContext& ctx, const LowLatencyDispatchArgs& a) {
  EPF_RETURN_IF_ERROR(CheckShape(a.max_tokens_per_rank, a.hidden, ctx.num_ranks, a.num_experts));
  EPF_RETURN_IF_ERROR(CheckContext(ctx, a.max_tokens_per_rank, a.hidden, a.num_experts));
  EPF_RETURN_IF_ERROR(CheckTokens(a.num_tokens, a.num_topk, a.max_tokens_per_rank, a.topk_idx));
  if (a.buffer_half != 0 && a.buffer_half != 1) return InvalidValue("buffer_half", a.buffer_half, "must be 0 or 1");
  if (a.call_tag == 0) return InvalidValue("call_tag", 0, "must be nonzero (a cleaned signal reads 0)");
  EPF_RETURN_IF_ERROR(CheckLowLatencyScaleOptions(a.use_fp8, a.round_scale, a.use_ue8m0, a.hidden));
  const int phases = static_cast<int>(a.phases);
  if (phases < 1 || phases > 3) return InvalidValue("phases", phases, "must be 1, 2 or 3");
  const bool sends = (phases & static_cast<int>(LowLatencyPhases::kSend)) != 0;
  const bool receives = (phases & static_cast<int>(LowLatencyPhases::kRecv)) != 0;
  if (sends && a.num_tokens > 0 && a.x == nullptr) return absl::InvalidArgumentError("x is null");
  if (receives) {
    if (a.packed_recv_x == nullptr) return absl::InvalidArgumentError("packed_recv_x is null");
    if (a.use_fp8 && a.packed_recv_x_scales == nullptr)
      return absl::InvalidArgumentError("packed_recv_x_scales is null with use_fp8 = true");
    if (a.packed_recv_count == nullptr || a.packed_recv_src_info == nullptr || a.packed_recv_layout_range == nullptr ||
        a.packed_recv_topk_slot == nullptr || a.packed_recv_token_map == nullptr)
      return absl::InvalidArgumentError("packed_recv_count/src_info/layout_range/topk_slot/token_map must all be set");
  }
  return absl::OkStatus();
}

absl::Status ValidateLowLatencyCombine(const LowLatencyContext& ctx, const LowLatencyCombineArgs& a) {
  EPF_RETURN_IF_ERROR(CheckShape(a.max_tokens_per_rank, a.hidden, ctx.num_ranks, a.num_experts));
  EPF_RETURN_IF_ERROR(CheckContext(ctx, a.max_tokens_per_rank, a.hidden, a.num_experts));
  EPF_RETURN_IF_ERROR(CheckTokens(a.num_tokens, a.num_topk, a.max_tokens_per_rank, a.topk_idx));
  if (a.buffer_half != 0 && a.buffer_half != 1) return InvalidValue("buffer_half", a.buffer_half, "must be 0 or 1");
  if (a.call_tag == 0) return InvalidValue("call_tag", 0, "must be nonzero (a cleaned signal reads 0)");
  if (a.handle.num_tokens != a.num_tokens)
    return InvalidValue("num_tokens", a.num_tokens, "differs from the dispatch handle's num_tokens");
  const int phases = static_cast<int>(a.phases);
  const bool weights_only = a.phases == LowLatencyPhases::kCombineWeights;
  if ((phases < 1 || phases > 3) && !weights_only && a.phases != LowLatencyPhases::kSendWeightsPublished) {
    return InvalidValue("phases", phases, "must be 1, 2, 3 (or 4, 9 across hosts)");
  }
  const bool sends = (phases & static_cast<int>(LowLatencyPhases::kSend)) != 0 || weights_only;
  const bool receives = (phases & static_cast<int>(LowLatencyPhases::kRecv)) != 0;
  if (sends) {
    if (!a.zero_copy && a.x == nullptr) return absl::InvalidArgumentError("x is null and zero_copy = false");
    if (a.handle.packed_recv_token_map == nullptr)
      return absl::InvalidArgumentError("the dispatch handle has no token map");
    if (a.num_tokens > 0 && a.topk_weights == nullptr) return absl::InvalidArgumentError("topk_weights is null");
  }
  if (receives && a.num_tokens > 0 && (a.topk_weights == nullptr || a.combined_x == nullptr))
    return absl::InvalidArgumentError("topk_weights and combined_x must be set");
  return absl::OkStatus();
}

void* LowLatencyCombineInputBuffer(const LowLatencyContext& ctx) {
  return static_cast<uint8_t*>(ctx.peer_regions[ctx.rank]) + ctx.layout.combine_send_offset;
}

}  // namespace epfabric::kernels
