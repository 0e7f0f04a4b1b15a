#include "intranode_checks.h"

#include <cstdint>

#include "absl/strings/str_format.h"

namespace epfabric::kernels::intranode_checks {
namespace {

absl::Status Invalid(const char* field, int64_t value, const char* requirement) {
  return absl::InvalidArgumentError(absl::StrFormat("%s = %d: %s", field, value, requirement));
}

absl::Status Missing(const char* field, const char* when) {
  return absl::InvalidArgumentError(absl::StrFormat("%s is null: required %s", field, when));
}

bool Aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

}  // namespace

absl::StatusOr<IntranodeRegionLayout> CheckGroup(const IntranodeGroup& group, Backend backend) {
  absl::StatusOr<IntranodeRegionLayout> layout = ComputeIntranodeRegionLayout(group.config);
  if (!layout.ok()) return layout.status();
  const int num_ranks = group.config.num_ranks;
  if (group.rank < 0 || group.rank >= num_ranks) return Invalid("group.rank", group.rank, "must be in [0, num_ranks)");
  for (int r = 0; r < num_ranks; ++r) {
    if (group.peer_regions[r] == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat("group.peer_regions[%d] is null", r));
    }
    if (!Aligned16(group.peer_regions[r])) {
      return absl::InvalidArgumentError(absl::StrFormat("group.peer_regions[%d] is not 16-byte aligned", r));
    }
  }
  if (backend == Backend::kCuda && group.status == nullptr) {
    return Missing("group.status", "always (timeouts are reported there)");
  }
  if (group.timeout_ns == 0) return Invalid("group.timeout_ns", 0, "must be positive");
  return layout;
}

absl::Status CheckLayout(const DispatchLayoutParams& p) {
  if (p.num_tokens < 0) return Invalid("num_tokens", p.num_tokens, "must be >= 0");
  if (p.num_topk < 1 || p.num_topk > 1024) return Invalid("num_topk", p.num_topk, "must be in [1, 1024]");
  if (p.num_ranks < 1 || p.num_ranks > kMaxLayoutRanks) return Invalid("num_ranks", p.num_ranks, "must be in [1, 64]");
  if (p.num_experts < p.num_ranks || p.num_experts % p.num_ranks != 0 || p.num_experts > kMaxLayoutExperts) {
    return Invalid("num_experts", p.num_experts, "must be a multiple of num_ranks, at most 8192");
  }
  if (p.num_tokens > 0 && p.topk_idx == nullptr) return Missing("topk_idx", "when num_tokens > 0");
  if (p.num_tokens_per_rank == nullptr) return Missing("num_tokens_per_rank", "always");
  if (p.num_tokens_per_expert == nullptr) return Missing("num_tokens_per_expert", "always");
  if (p.num_tokens > 0 && p.is_token_in_rank == nullptr) return Missing("is_token_in_rank", "when num_tokens > 0");
  return absl::OkStatus();
}

absl::Status CheckNotify(const IntranodeGroup& group, const IntranodeNotifyParams& p) {
  if (p.num_tokens < 0 || p.num_tokens > group.config.max_tokens_per_rank) {
    return Invalid("num_tokens", p.num_tokens, "must be in [0, config.max_tokens_per_rank]");
  }
  if (p.num_experts != group.config.num_experts) {
    return Invalid("num_experts", p.num_experts, "must equal config.num_experts");
  }
  if (p.expert_alignment < 1) return Invalid("expert_alignment", p.expert_alignment, "must be >= 1");
  if (p.num_tokens_per_rank == nullptr) return Missing("num_tokens_per_rank", "always");
  if (p.num_tokens_per_expert == nullptr) return Missing("num_tokens_per_expert", "always");
  if (p.rank_prefix_matrix == nullptr) return Missing("rank_prefix_matrix", "always");
  if ((p.host_num_recv_tokens == nullptr) != (p.host_num_recv_tokens_per_expert == nullptr)) {
    return absl::InvalidArgumentError("host_num_recv_tokens and host_num_recv_tokens_per_expert go together");
  }
  return absl::OkStatus();
}

absl::Status CheckDispatch(const IntranodeGroup& group, const IntranodeDispatchParams& p, const IntranodeHandle* handle,
                           Backend backend) {
  const IntranodeRegionConfig& c = group.config;
  if (handle == nullptr) return Missing("handle", "always");
  const IntranodeHandle& h = *handle;
  if (h.num_tokens < 0 || h.num_tokens > c.max_tokens_per_rank) {
    return Invalid("handle.num_tokens", h.num_tokens, "must be in [0, config.max_tokens_per_rank]");
  }
  if (p.x_dtype != DType::kBF16 && p.x_dtype != DType::kFP8E4M3) {
    return absl::InvalidArgumentError(
        absl::StrFormat("x_dtype = %s: dispatch takes bf16 or fp8_e4m3", DTypeName(p.x_dtype)));
  }
  const bool fp8 = p.x_dtype == DType::kFP8E4M3;
  if (p.hidden < 1 || p.hidden > c.max_hidden) return Invalid("hidden", p.hidden, "must be in [1, config.max_hidden]");
  if (fp8 ? p.hidden % kFp8ScaleBlock != 0 : p.hidden % 8 != 0) {
    return Invalid("hidden", p.hidden, fp8 ? "must be a multiple of 128 for fp8" : "must be a multiple of 8");
  }
  if (fp8 && h.num_tokens > 0 && p.x_scales == nullptr) return Missing("x_scales", "for fp8 x");
  if (!fp8 && p.x_scales != nullptr) return absl::InvalidArgumentError("x_scales given for bf16 x");
  if (h.num_tokens > 0 && p.x == nullptr) return Missing("x", "when num_tokens > 0");
  if (backend == Backend::kCuda && (!Aligned16(p.x) || !Aligned16(p.recv_x))) {
    return absl::InvalidArgumentError("x and recv_x must be 16-byte aligned");
  }
  if (p.topk_idx != nullptr) {
    if (p.num_topk < 1 || p.num_topk > c.max_topk || p.num_topk > kMaxTopk) {
      return Invalid("num_topk", p.num_topk, "must be in [1, config.max_topk] (at most 32) with topk_idx");
    }
    if (p.recv_topk_idx == nullptr) return Missing("recv_topk_idx", "with topk_idx");
  }
  if (p.topk_weights != nullptr) {
    if (p.topk_idx == nullptr) return Missing("topk_idx", "with topk_weights");
    if (p.recv_topk_weights == nullptr) return Missing("recv_topk_weights", "with topk_weights");
  }
  if (p.num_experts != c.num_experts) return Invalid("num_experts", p.num_experts, "must equal config.num_experts");
  if (p.num_sms < 1 || p.num_sms > c.max_channels) {
    return Invalid("num_sms", p.num_sms, "must be in [1, config.max_channels]");
  }
  if (p.recv_capacity < 0 || p.recv_capacity > IntranodeWorstCaseRecvTokens(c)) {
    return Invalid("recv_capacity", p.recv_capacity, "must be in [0, num_ranks * max_tokens_per_rank]");
  }
  if (h.num_recv_tokens > p.recv_capacity) {
    return Invalid("handle.num_recv_tokens", h.num_recv_tokens, "exceeds recv_capacity");
  }
  if (p.recv_capacity > 0) {
    if (p.recv_x == nullptr) return Missing("recv_x", "when recv_capacity > 0");
    if (fp8 && p.recv_x_scales == nullptr) return Missing("recv_x_scales", "for fp8 x");
    if (h.recv_src_idx == nullptr) return Missing("handle.recv_src_idx", "when recv_capacity > 0");
  }
  if (h.num_tokens > 0 && h.is_token_in_rank == nullptr) return Missing("handle.is_token_in_rank", "num_tokens > 0");
  if (h.rank_prefix_matrix == nullptr) return Missing("handle.rank_prefix_matrix", "always");
  if (h.recv_channel_prefix == nullptr) return Missing("handle.recv_channel_prefix", "always");
  if (h.num_tokens > 0 && h.send_slot == nullptr) return Missing("handle.send_slot", "when num_tokens > 0");
  return absl::OkStatus();
}

absl::Status CheckCombine(const IntranodeGroup& group, const IntranodeCombineParams& p, const IntranodeHandle& h,
                          Backend backend) {
  const IntranodeRegionConfig& c = group.config;
  if (h.num_tokens < 0 || h.num_tokens > c.max_tokens_per_rank) {
    return Invalid("handle.num_tokens", h.num_tokens, "must be in [0, config.max_tokens_per_rank]");
  }
  if (h.num_recv_tokens < 0 || h.num_recv_tokens > IntranodeWorstCaseRecvTokens(c)) {
    return Invalid("handle.num_recv_tokens", h.num_recv_tokens, "must be in [0, num_ranks * max_tokens_per_rank]");
  }
  if (h.num_channels < 1 || h.num_channels > c.max_channels) {
    return Invalid("handle.num_channels", h.num_channels, "must be in [1, config.max_channels] (run dispatch first)");
  }
  if (p.hidden < 8 || p.hidden > c.max_hidden || p.hidden % 8 != 0) {
    return Invalid("hidden", p.hidden, "must be a multiple of 8 in [8, config.max_hidden]");
  }
  if (h.num_recv_tokens > 0 && p.x == nullptr) return Missing("x", "when handle.num_recv_tokens > 0");
  if (h.num_tokens > 0 && p.combined_x == nullptr) return Missing("combined_x", "when handle.num_tokens > 0");
  if (backend == Backend::kCuda &&
      (!Aligned16(p.x) || !Aligned16(p.combined_x) || !Aligned16(p.bias_0) || !Aligned16(p.bias_1))) {
    return absl::InvalidArgumentError("x, combined_x and biases must be 16-byte aligned");
  }
  if (p.topk_weights != nullptr) {
    if (p.num_topk < 1 || p.num_topk > c.max_topk) {
      return Invalid("num_topk", p.num_topk, "must be in [1, config.max_topk] with topk_weights");
    }
    if (h.num_tokens > 0 && p.combined_topk_weights == nullptr) {
      return Missing("combined_topk_weights", "with topk_weights");
    }
  }
  if (h.rank_prefix_matrix == nullptr) return Missing("handle.rank_prefix_matrix", "always");
  if (h.recv_channel_prefix == nullptr) return Missing("handle.recv_channel_prefix", "always");
  if (h.num_tokens > 0 && h.send_slot == nullptr) return Missing("handle.send_slot", "when num_tokens > 0");
  return absl::OkStatus();
}

}  // namespace epfabric::kernels::intranode_checks
