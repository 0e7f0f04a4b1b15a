// The internode normal mode's RDMA layout, the checks of its two data steps, and their CUDA launches.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "api/internode_launch.h"
#include "api/launch_error.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/kernels/common.h"
#include "epfabric/kernels/internode.h"
#include "epfabric/kernels/transport/ring.h"

namespace epfabric::kernels {
namespace {

constexpr size_t kAlign = 256;

size_t AlignUp(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// Places `count` sections of `bytes` each (256-aligned) from `*cursor`; returns the first.
size_t Place(size_t* cursor, size_t bytes) {
  const size_t at = *cursor;
  *cursor += AlignUp(bytes);
  return at;
}

absl::Status CheckSlabs(const InternodeRdmaLayout& l, int max_rows, int num_hosts) {
  if (max_rows < 1) return InvalidValue("max_rows", max_rows, "must be >= 1");
  if (num_hosts < 1 || num_hosts > kMaxInternodeHosts) {
    return InvalidValue("num_hosts", num_hosts, absl::StrCat("must be in [1, ", kMaxInternodeHosts, "]"));
  }
  if (l.total_bytes == 0)
    return absl::InvalidArgumentError("layout is empty: compute it with ComputeInternodeRdmaLayout");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<InternodeRdmaLayout> ComputeInternodeRdmaLayout(const InternodeShape& s) {
  if (s.num_hosts < 1 || s.num_hosts > kMaxInternodeHosts) {
    return InvalidValue("num_hosts", s.num_hosts, absl::StrCat("must be in [1, ", kMaxInternodeHosts, "]"));
  }
  if (s.ranks_per_host < 1 || s.ranks_per_host > kMaxNvlPeers) {
    return InvalidValue("ranks_per_host", s.ranks_per_host, absl::StrCat("must be in [1, ", kMaxNvlPeers, "]"));
  }
  if (s.max_tokens_per_rank < 1) return InvalidValue("max_tokens_per_rank", s.max_tokens_per_rank, "must be >= 1");
  if (s.max_hidden < 1) return InvalidValue("max_hidden", s.max_hidden, "must be >= 1");
  if (s.max_topk < 1) return InvalidValue("max_topk", s.max_topk, "must be >= 1");
  const size_t H = s.num_hosts, M = s.max_tokens_per_rank;
  InternodeRdmaLayout l;
  size_t cursor = 0;
  l.dispatch_count = Place(&cursor, H * 8);
  l.dispatch_arrived = Place(&cursor, H * 8);
  l.slab_free = Place(&cursor, H * 8);
  l.combine_arrived = Place(&cursor, H * 8);
  l.combine_free = Place(&cursor, H * 8);
  l.send_count = Place(&cursor, H * 8);
  l.calls = Place(&cursor, 2 * 8);
  l.signal_bytes = cursor;
  l.x_slab_bytes = AlignUp(M * s.max_hidden * 2);
  l.scales_slab_bytes = AlignUp(M * ((s.max_hidden + 127) / 128) * sizeof(float));
  l.topk_idx_slab_bytes = AlignUp(M * s.max_topk * sizeof(int64_t));
  l.topk_weights_slab_bytes = AlignUp(M * s.max_topk * sizeof(float));
  l.combine_x_slab_bytes = AlignUp(M * s.max_hidden * 2);
  l.combine_weights_slab_bytes = AlignUp(M * s.max_topk * sizeof(float));
  l.send_x = Place(&cursor, H * l.x_slab_bytes);
  l.recv_x = Place(&cursor, H * l.x_slab_bytes);
  l.send_scales = Place(&cursor, H * l.scales_slab_bytes);
  l.recv_scales = Place(&cursor, H * l.scales_slab_bytes);
  l.send_topk_idx = Place(&cursor, H * l.topk_idx_slab_bytes);
  l.recv_topk_idx = Place(&cursor, H * l.topk_idx_slab_bytes);
  l.send_topk_weights = Place(&cursor, H * l.topk_weights_slab_bytes);
  l.recv_topk_weights = Place(&cursor, H * l.topk_weights_slab_bytes);
  l.combine_send_x = Place(&cursor, H * l.combine_x_slab_bytes);
  l.combine_recv_x = Place(&cursor, H * l.combine_x_slab_bytes);
  l.combine_send_weights = Place(&cursor, H * l.combine_weights_slab_bytes);
  l.combine_recv_weights = Place(&cursor, H * l.combine_weights_slab_bytes);
  l.total_bytes = cursor;
  return l;
}

absl::Status ValidateInternodePack(const InternodePackParams& p) {
  EPF_RETURN_IF_ERROR(CheckSlabs(p.layout, p.max_rows, p.num_hosts));
  if (p.region == nullptr) return MissingPointer("region", "always");
  if (p.self_host < 0 || p.self_host >= p.num_hosts)
    return InvalidValue("self_host", p.self_host, "must be in [0, num_hosts)");
  if (p.num_tokens < 0 || p.num_tokens > p.max_rows)
    return InvalidValue("num_tokens", p.num_tokens, "must be in [0, max_rows]");
  if (p.row_bytes < 16 || p.row_bytes % 16 != 0 ||
      static_cast<size_t>(p.row_bytes) * p.max_rows > p.layout.x_slab_bytes) {
    return InvalidValue("row_bytes", p.row_bytes, "must be a multiple of 16 that fits the x slab");
  }
  if (p.num_tokens > 0 && p.x == nullptr) return MissingPointer("x", "with num_tokens > 0");
  if (reinterpret_cast<uintptr_t>(p.x) % 16 != 0) return absl::InvalidArgumentError("x must be 16-byte aligned");
  if (p.num_scales < 0 || static_cast<size_t>(p.num_scales) * sizeof(float) * p.max_rows > p.layout.scales_slab_bytes) {
    return InvalidValue("num_scales", p.num_scales, "must fit the scales slab");
  }
  if (p.num_scales > 0 && p.num_tokens > 0 && p.x_scales == nullptr)
    return MissingPointer("x_scales", "with num_scales > 0");
  if (p.num_topk < 0 || static_cast<size_t>(p.num_topk) * sizeof(int64_t) * p.max_rows > p.layout.topk_idx_slab_bytes) {
    return InvalidValue("num_topk", p.num_topk, "must fit the top-k slab");
  }
  if (p.topk_weights != nullptr && p.topk_idx == nullptr) return MissingPointer("topk_idx", "with topk_weights");
  if (p.num_topk > 0 && p.num_tokens > 0 && p.topk_idx == nullptr)
    return MissingPointer("topk_idx", "with num_topk > 0");
  if (p.experts_per_host < 1) return InvalidValue("experts_per_host", p.experts_per_host, "must be >= 1");
  if (p.send_tokens == nullptr || p.send_counts == nullptr) return MissingPointer("send_tokens/send_counts", "always");
  return absl::OkStatus();
}

absl::Status ValidateInternodeReduce(const InternodeReduceParams& p) {
  if (p.num_hosts < 1 || p.num_hosts > kMaxInternodeHosts) {
    return InvalidValue("num_hosts", p.num_hosts, absl::StrCat("must be in [1, ", kMaxInternodeHosts, "]"));
  }
  if (p.layout.total_bytes == 0) return absl::InvalidArgumentError("layout is empty");
  if (p.num_tokens < 0) return InvalidValue("num_tokens", p.num_tokens, "must be >= 0");
  if (p.hidden < 8 || p.hidden % 8 != 0 || static_cast<size_t>(p.hidden) * 2 > p.layout.combine_x_slab_bytes) {
    return InvalidValue("hidden", p.hidden, "must be a multiple of 8 that fits the combine slab");
  }
  if (p.num_topk < 0) return InvalidValue("num_topk", p.num_topk, "must be >= 0");
  if (p.num_tokens > 0) {
    if (p.region == nullptr) return MissingPointer("region", "with num_tokens > 0");
    if (p.send_slot == nullptr) return MissingPointer("send_slot", "with num_tokens > 0");
    if (p.combined_x == nullptr) return MissingPointer("combined_x", "with num_tokens > 0");
    if (p.num_topk > 0 && p.combined_topk_weights == nullptr) {
      return MissingPointer("combined_topk_weights", "with num_topk > 0");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateInternodePlan(const InternodePlanParams& p) {
  if (p.num_hosts < 1 || p.num_hosts > kMaxInternodeHosts) {
    return InvalidValue("num_hosts", p.num_hosts, absl::StrCat("must be in [1, ", kMaxInternodeHosts, "]"));
  }
  if (p.ranks_per_host < 1 || p.ranks_per_host > kMaxNvlPeers) {
    return InvalidValue("ranks_per_host", p.ranks_per_host, absl::StrCat("must be in [1, ", kMaxNvlPeers, "]"));
  }
  if (p.max_rows < 1) return InvalidValue("max_rows", p.max_rows, "must be >= 1");
  if (p.num_tokens < 0 || p.num_tokens > p.max_rows) {
    return InvalidValue("num_tokens", p.num_tokens, "must be in [0, max_rows]");
  }
  if (p.send_plan == nullptr) return MissingPointer("send_plan", "always");
  if (p.num_tokens > 0 && (p.is_token_in_rank == nullptr || p.send_slot == nullptr)) {
    return MissingPointer("is_token_in_rank/send_slot", "with num_tokens > 0");
  }
  return absl::OkStatus();
}

absl::Status ValidateInternodeGather(const InternodeGatherParams& p) {
  EPF_RETURN_IF_ERROR(CheckSlabs(p.layout, p.max_rows, p.num_hosts));
  if (p.region == nullptr) return MissingPointer("region", "always");
  if (p.self_host < 0 || p.self_host >= p.num_hosts) {
    return InvalidValue("self_host", p.self_host, "must be in [0, num_hosts)");
  }
  if (p.send_counts == nullptr || p.recv_counts == nullptr) {
    return MissingPointer("send_counts/recv_counts", "always");
  }
  if (p.row_bytes < 16 || p.row_bytes % 16 != 0 ||
      static_cast<size_t>(p.row_bytes) * p.max_rows > p.layout.x_slab_bytes) {
    return InvalidValue("row_bytes", p.row_bytes, "must be a multiple of 16 that fits the x slab");
  }
  if (p.num_scales < 0 || static_cast<size_t>(p.num_scales) * sizeof(float) * p.max_rows > p.layout.scales_slab_bytes) {
    return InvalidValue("num_scales", p.num_scales, "must fit the scales slab");
  }
  if (p.num_topk < 0 || static_cast<size_t>(p.num_topk) * sizeof(int64_t) * p.max_rows > p.layout.topk_idx_slab_bytes) {
    return InvalidValue("num_topk", p.num_topk, "must fit the top-k slab");
  }
  if (p.x == nullptr) return MissingPointer("x", "always");
  if (reinterpret_cast<uintptr_t>(p.x) % 16 != 0) return absl::InvalidArgumentError("x must be 16-byte aligned");
  if (p.num_scales > 0 && p.x_scales == nullptr) return MissingPointer("x_scales", "with num_scales > 0");
  if (p.num_topk > 0 && p.topk_idx == nullptr) return MissingPointer("topk_idx", "with num_topk > 0");
  return absl::OkStatus();
}

absl::Status ValidateInternodeScatter(const InternodeScatterParams& p) {
  EPF_RETURN_IF_ERROR(CheckSlabs(p.layout, p.max_rows, p.num_hosts));
  if (p.region == nullptr || p.x == nullptr || p.recv_counts == nullptr) {
    return MissingPointer("region/x/recv_counts", "always");
  }
  if (p.self_host < 0 || p.self_host >= p.num_hosts) {
    return InvalidValue("self_host", p.self_host, "must be in [0, num_hosts)");
  }
  if (p.hidden < 8 || p.hidden % 8 != 0 ||
      static_cast<size_t>(p.hidden) * 2 * p.max_rows > p.layout.combine_x_slab_bytes) {
    return InvalidValue("hidden", p.hidden, "must be a multiple of 8 that fits the combine slab");
  }
  if (p.num_topk < 0 ||
      static_cast<size_t>(p.num_topk) * sizeof(float) * p.max_rows > p.layout.combine_weights_slab_bytes) {
    return InvalidValue("num_topk", p.num_topk, "must fit the combine weights slab");
  }
  if (p.num_topk > 0 && p.topk_weights == nullptr) return MissingPointer("topk_weights", "with num_topk > 0");
  return absl::OkStatus();
}

namespace {

absl::Status CheckRings(const InternodeRing* rings, int num_rings, bool needed) {
  if (num_rings < (needed ? 1 : 0) || num_rings > kMaxInternodeRings) {
    return InvalidValue("num_rings", num_rings, absl::StrCat("must be in [1, ", kMaxInternodeRings, "]"));
  }
  for (int c = 0; c < num_rings; ++c) {
    if (rings[c].control == nullptr || !transport::ValidRingSlots(rings[c].slots)) {
      return absl::InvalidArgumentError(absl::StrCat("internode ring ", c, " without memory or a valid slot count"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckHosts(int num_hosts, int self_host, int ranks_per_host, int local_rank) {
  if (num_hosts < 1 || num_hosts > kMaxInternodeHosts) {
    return InvalidValue("num_hosts", num_hosts, absl::StrCat("must be in [1, ", kMaxInternodeHosts, "]"));
  }
  if (self_host < 0 || self_host >= num_hosts) return InvalidValue("self_host", self_host, "must be in [0, num_hosts)");
  if (ranks_per_host < 1 || ranks_per_host > kMaxNvlPeers || local_rank < 0 || local_rank >= ranks_per_host) {
    return InvalidValue("local_rank", local_rank, "must be in [0, ranks_per_host), ranks_per_host in [1, 8]");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status InternodePlan(const InternodePlanParams& p, cudaStream_t stream) {
  EPF_RETURN_IF_ERROR(ValidateInternodePlan(p));
  return LaunchError(internode::LaunchPlan(p, stream), "internode plan");
}

absl::Status InternodeGather(const InternodeGatherParams& p, cudaStream_t stream) {
  EPF_RETURN_IF_ERROR(ValidateInternodeGather(p));
  return LaunchError(internode::LaunchGather(p, stream), "internode gather");
}

absl::Status InternodeScatter(const InternodeScatterParams& p, cudaStream_t stream) {
  EPF_RETURN_IF_ERROR(ValidateInternodeScatter(p));
  return LaunchError(internode::LaunchScatter(p, stream), "internode scatter");
}

absl::Status InternodeIssue(const InternodeIssueParams& p, cudaStream_t stream) {
  EPF_RETURN_IF_ERROR(CheckHosts(p.num_hosts, p.self_host, p.ranks_per_host, p.local_rank));
  EPF_RETURN_IF_ERROR(CheckRings(p.rings, p.num_rings, /*needed=*/true));
  EPF_RETURN_IF_ERROR(CheckSlabs(p.layout, p.max_rows, p.num_hosts));
  const bool rows = p.step == InternodeIssueStep::kDispatchRows || p.step == InternodeIssueStep::kCombineRows;
  if (rows && p.counts == nullptr) return MissingPointer("counts", "for the steps that send rows");
  if (p.row_bytes < 0 || p.num_scales < 0 || p.num_topk < 0) {
    return absl::InvalidArgumentError("internode issue: negative row size");
  }
  if (p.status == nullptr) return MissingPointer("status", "always");
  return LaunchError(internode::LaunchIssue(p, stream), "internode issue");
}

absl::Status InternodeWait(const InternodeWaitParams& p, cudaStream_t stream) {
  EPF_RETURN_IF_ERROR(CheckHosts(p.num_hosts, p.self_host, p.ranks_per_host, p.local_rank));
  EPF_RETURN_IF_ERROR(CheckRings(p.rings, p.num_rings, p.quiet));
  if (p.region == nullptr || p.layout.total_bytes == 0) return MissingPointer("region/layout", "always");
  if (p.call != 0 && p.call != 1) return InvalidValue("call", p.call, "must be 0 (dispatch) or 1 (combine)");
  if (p.status == nullptr) return MissingPointer("status", "always");
  return LaunchError(internode::LaunchWait(p, stream), "internode wait");
}

absl::Status InternodePack(const InternodePackParams& p, cudaStream_t stream) {
  EPF_RETURN_IF_ERROR(ValidateInternodePack(p));
  return LaunchError(internode::LaunchPack(p, stream), "internode pack");
}

absl::Status InternodeReduce(const InternodeReduceParams& p, cudaStream_t stream) {
  EPF_RETURN_IF_ERROR(ValidateInternodeReduce(p));
  if (p.num_tokens == 0) return absl::OkStatus();
  return LaunchError(internode::LaunchReduce(p, stream), "internode reduce");
}

}  // namespace epfabric::kernels
