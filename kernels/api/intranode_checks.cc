#include "api/intranode_checks.h"

#include <cstdint>

#include "absl/strings/str_format.h"
#include "epfabric/common/status_macros.h"

namespace epfabric::kernels::intranode_checks {
namespace {

bool Aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

}  // namespace

absl::StatusOr<IntranodeRegionLayout> CheckGroup(const IntranodeGroup& group, Backend backend) {
  EPF_ASSIGN_OR_RETURN(IntranodeRegionLayout layout, ComputeIntranodeRegionLayout(group.config));
  const int num_ranks = group.config.num_ranks;
  if (group.rank < 0 || group.rank >= num_ranks)
    return InvalidValue("group.rank", group.rank, "must be in [0, num_ranks)");
  for (int r = 0; r < num_ranks; ++r) {
    if (group.peer_regions[r] == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat("group.peer_regions[%d] is null", r));
    }
    if (!Aligned16(group.peer_regions[r])) {
      return absl::InvalidArgumentError(absl::StrFormat("group.peer_regions[%d] is not 16-byte aligned", r));
    }
  }
  if (backend == Backend::kCuda && group.status == nullptr) {
    return MissingPointer("group.status", "always (timeouts are reported there)");
  }
  if (group.timeout_ns == 0) return InvalidValue("group.timeout_ns", 0, "must be positive");
  return layout;
}

absl::Status CheckLayout(const DispatchLayoutParams& p) {
  if (p.num_tokens < 0) return InvalidValue("num_tokens", p.num_tokens, "must be >= 0");
  if (p.num_topk < 1 || p.num_topk > 1024) return InvalidValue("num_topk", p.num_topk, "must be in [1, 1024]");
  if (p.num_ranks < 1 || p.num_ranks > kMaxLayoutRanks)
    return InvalidValue("num_ranks", p.num_ranks, "must be in [1, 64]");
  if (p.num_experts < p.num_ranks || p.num_experts % p.num_ranks != 0 || p.num_experts > kMaxLayoutExperts) {
    return InvalidValue("num_experts", p.num_experts, "must be a multiple of num_ranks, at most 8192");
  }
  if (p.num_tokens > 0 && p.topk_idx == nullptr) return MissingPointer("topk_idx", "when num_tokens > 0");
  if (p.num_tokens_per_rank == nullptr) return MissingPointer("num_tokens_per_rank", "always");
  if (p.num_tokens_per_expert == nullptr) return MissingPointer("num_tokens_per_expert", "always");
  if (p.num_tokens > 0 && p.is_token_in_rank == nullptr)
    return MissingPointer("is_token_in_rank", "when num_tokens > 0");
  return absl::OkStatus();
}

absl::Status CheckNotify(const IntranodeGroup& group, const IntranodeNotifyParams& p) {
  EPF_RETURN_IF_ERROR(CheckNumTokens("num_tokens", p.num_tokens, group.config.max_tokens_per_rank));
  if (p.num_experts != group.config.num_experts) {
    return InvalidValue("num_experts", p.num_experts, "must equal config.num_experts");
  }
  if (p.expert_alignment < 1) return InvalidValue("expert_alignment", p.expert_alignment, "must be >= 1");
  if (p.num_tokens_per_rank == nullptr) return MissingPointer("num_tokens_per_rank", "always");
  if (p.num_tokens_per_expert == nullptr) return MissingPointer("num_tokens_per_expert", "always");
  if (p.rank_prefix_matrix == nullptr) return MissingPointer("rank_prefix_matrix", "always");
  if ((p.host_num_recv_tokens == nullptr) != (p.host_num_recv_tokens_per_expert == nullptr)) {
    return absl::InvalidArgumentError("host_num_recv_tokens and host_num_recv_tokens_per_expert go together");
  }
  return absl::OkStatus();
}

absl::Status CheckDispatch(const IntranodeGroup& group, const IntranodeDispatchParams& p, const IntranodeHandle* handle,
                           Backend backend) {
  const IntranodeRegionConfig& c = group.config;
  if (handle == nullptr) return MissingPointer("handle", "always");
  const IntranodeHandle& h = *handle;
  if (h.num_tokens < 0 || h.num_tokens > c.max_tokens_per_rank) {
    return InvalidValue("handle.num_tokens", h.num_tokens, "must be in [0, config.max_tokens_per_rank]");
  }
  EPF_RETURN_IF_ERROR(CheckDispatchDType("x_dtype", p.x_dtype));
  const bool fp8 = p.x_dtype == DType::kFP8E4M3;
  EPF_RETURN_IF_ERROR(CheckDispatchHidden("hidden", p.hidden, p.x_dtype, c.max_hidden));
  if (fp8 && h.num_tokens > 0 && p.x_scales == nullptr) return MissingPointer("x_scales", "for fp8 x");
  if (!fp8 && p.x_scales != nullptr) return absl::InvalidArgumentError("x_scales given for bf16 x");
  // The staging pools hold hidden / 128 words per token (ComputeIntranodeRegionLayout).
  if (fp8 && (p.num_scales < 0 || p.num_scales > p.hidden / kFp8ScaleBlock)) {
    return InvalidValue("num_scales", p.num_scales, "must be in [0, hidden / 128] (0: hidden / 128)");
  }
  if (h.num_tokens > 0 && p.x == nullptr) return MissingPointer("x", "when num_tokens > 0");
  if (backend == Backend::kCuda && (!Aligned16(p.x) || !Aligned16(p.recv_x))) {
    return absl::InvalidArgumentError("x and recv_x must be 16-byte aligned");
  }
  if (p.topk_idx != nullptr) {
    if (p.num_topk < 1 || p.num_topk > c.max_topk || p.num_topk > kMaxTopk) {
      return InvalidValue("num_topk", p.num_topk, "must be in [1, config.max_topk] (at most 32) with topk_idx");
    }
    if (p.recv_topk_idx == nullptr) return MissingPointer("recv_topk_idx", "with topk_idx");
  }
  if (p.topk_weights != nullptr) {
    if (p.topk_idx == nullptr) return MissingPointer("topk_idx", "with topk_weights");
    if (p.recv_topk_weights == nullptr) return MissingPointer("recv_topk_weights", "with topk_weights");
  }
  if (p.num_experts != c.num_experts)
    return InvalidValue("num_experts", p.num_experts, "must equal config.num_experts");
  if (p.num_sms < 1 || p.num_sms > c.max_channels) {
    return InvalidValue("num_sms", p.num_sms, "must be in [1, config.max_channels]");
  }
  // Worst-case mode may allocate more rows than any rank can receive (DeepEP's num_worst_tokens is the caller's).
  if (p.recv_capacity < 0) return InvalidValue("recv_capacity", p.recv_capacity, "must be >= 0");
  if (h.num_recv_tokens > p.recv_capacity) {
    return InvalidValue("handle.num_recv_tokens", h.num_recv_tokens, "exceeds recv_capacity");
  }
  if (p.recv_capacity > 0) {
    if (p.recv_x == nullptr) return MissingPointer("recv_x", "when recv_capacity > 0");
    if (fp8 && p.recv_x_scales == nullptr) return MissingPointer("recv_x_scales", "for fp8 x");
    if (h.recv_src_idx == nullptr) return MissingPointer("handle.recv_src_idx", "when recv_capacity > 0");
  }
  if (h.num_tokens > 0 && h.is_token_in_rank == nullptr)
    return MissingPointer("handle.is_token_in_rank", "num_tokens > 0");
  if (h.rank_prefix_matrix == nullptr) return MissingPointer("handle.rank_prefix_matrix", "always");
  if (h.recv_channel_prefix == nullptr) return MissingPointer("handle.recv_channel_prefix", "always");
  if (h.num_tokens > 0 && h.send_slot == nullptr) return MissingPointer("handle.send_slot", "when num_tokens > 0");
  return absl::OkStatus();
}

absl::Status CheckCombine(const IntranodeGroup& group, const IntranodeCombineParams& p, const IntranodeHandle& h,
                          Backend backend) {
  const IntranodeRegionConfig& c = group.config;
  if (h.num_tokens < 0 || h.num_tokens > c.max_tokens_per_rank) {
    return InvalidValue("handle.num_tokens", h.num_tokens, "must be in [0, config.max_tokens_per_rank]");
  }
  // The rows of x: the received count, or after a worst-case dispatch the rows it allocated (possibly more than any
  // rank can receive); the kernels read only the rows the prefix matrix gives.
  if (h.num_recv_tokens < 0) return InvalidValue("handle.num_recv_tokens", h.num_recv_tokens, "must be >= 0");
  if (h.num_channels < 1 || h.num_channels > c.max_channels) {
    return InvalidValue("handle.num_channels", h.num_channels,
                        "must be in [1, config.max_channels] (run dispatch first)");
  }
  EPF_RETURN_IF_ERROR(CheckCombineHidden("hidden", p.hidden, c.max_hidden));
  if (h.num_recv_tokens > 0 && p.x == nullptr) return MissingPointer("x", "when handle.num_recv_tokens > 0");
  if (h.num_tokens > 0 && p.combined_x == nullptr) return MissingPointer("combined_x", "when handle.num_tokens > 0");
  if (backend == Backend::kCuda &&
      (!Aligned16(p.x) || !Aligned16(p.combined_x) || !Aligned16(p.bias_0) || !Aligned16(p.bias_1))) {
    return absl::InvalidArgumentError("x, combined_x and biases must be 16-byte aligned");
  }
  if (p.topk_weights != nullptr) {
    if (p.num_topk < 1 || p.num_topk > c.max_topk) {
      return InvalidValue("num_topk", p.num_topk, "must be in [1, config.max_topk] with topk_weights");
    }
    if (h.num_tokens > 0 && p.combined_topk_weights == nullptr) {
      return MissingPointer("combined_topk_weights", "with topk_weights");
    }
  }
  if (h.rank_prefix_matrix == nullptr) return MissingPointer("handle.rank_prefix_matrix", "always");
  if (h.recv_channel_prefix == nullptr) return MissingPointer("handle.recv_channel_prefix", "always");
  if (h.num_tokens > 0 && h.send_slot == nullptr) return MissingPointer("handle.send_slot", "when num_tokens > 0");
  return absl::OkStatus();
}

}  // namespace epfabric::kernels::intranode_checks
