// The choice of the data path for a lease's group (one place), the region checks it makes first, and the sizes the
// regions need (RequiredRegionBytes, RequiredGroupBytes: the paths' layouts).
#include "data_path/data_path.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "data_path/internode/internode_path.h"
#include "data_path/kernel_path.h"
#include "epfabric/client/client.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/kernels/internode.h"

namespace epfabric::client {
namespace {

using kernels::InvalidValue;

const char* BoolName(bool value) { return value ? "true" : "false"; }

// The part of every rank's regions that a Buffer of one mode uses: the whole regions, or in a low-latency group that
// serves both modes (GroupInfo.num_normal_bytes, and num_normal_rdma_bytes across hosts) the normal parts at their
// starts or the low-latency parts after them.
struct RegionPart {
  uint64_t offset = 0;
  uint64_t limit = UINT64_MAX;  // at most this many bytes from `offset` (besides the region's own size)
  const char* name = "region";
};
struct ModeParts {
  RegionPart nvl;
  RegionPart rdma;
};

absl::StatusOr<ModeParts> PartFor(const Lease& lease, const BufferConfig& config) {
  const v1::GroupInfo& group = lease.group();
  if (config.low_latency && !group.low_latency()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "config.low_latency = true but group '%s' was created with low_latency = false", lease.group_name()));
  }
  if (!group.low_latency() || (config.low_latency && group.num_normal_bytes() == 0)) return ModeParts{};
  if (group.num_normal_bytes() == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "config.low_latency = false but group '%s' was created with low_latency = true and no normal-mode part "
        "(CreateGroup's num_normal_bytes = 0)",
        lease.group_name()));
  }
  // The daemons check that a group with an RDMA region splits it too (num_normal_rdma_bytes).
  if (config.low_latency) {
    return ModeParts{.nvl = {.offset = group.num_normal_bytes(), .name = "low-latency part"},
                     .rdma = {.offset = group.num_normal_rdma_bytes(), .name = "low-latency part of the RDMA region"}};
  }
  return ModeParts{.nvl = {.limit = group.num_normal_bytes(), .name = "normal-mode part"},
                   .rdma = {.limit = group.num_normal_rdma_bytes(), .name = "normal-mode part of the RDMA region"}};
}

// Every rank in `ranks` has its region mapped, with at least `required` bytes in `part`.
absl::Status CheckRegions(const Lease& lease, const BufferConfig& config, const std::vector<int>& ranks,
                          uint64_t required, const RegionPart& part = {}) {
  for (int r : ranks) {
    if (lease.region(r) == nullptr) {
      return absl::FailedPreconditionError(absl::StrFormat("region of rank %d is not mapped", r));
    }
    const uint64_t size = lease.region_bytes(r);
    const uint64_t available = size <= part.offset ? 0 : std::min(size - part.offset, part.limit);
    if (available < required) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s of rank %d has %d bytes; config (max_tokens_per_rank %d, hidden %d, max_topk %d, num_experts %d, "
          "num_sms %d, low_latency %s) needs RequiredRegionBytes = %d (across hosts: RequiredGroupBytes)",
          part.name, r, available, config.max_tokens_per_rank, config.hidden, config.max_topk, config.num_experts,
          config.num_sms, BoolName(config.low_latency), required));
    }
  }
  return absl::OkStatus();
}

// One host: the cuda or host path over every rank of the group.
absl::StatusOr<std::unique_ptr<internal::DataPath>> NewSameHostPath(Lease* lease, const BufferConfig& config,
                                                                    Backend backend,
                                                                    std::shared_ptr<Allocator> allocator,
                                                                    const RegionPart& part) {
  const int world = lease->world_size();
  if (world > kernels::kMaxNvlPeers) {
    return InvalidValue("world_size", world, absl::StrCat("at most ", kernels::kMaxNvlPeers, " same-host ranks"));
  }
  EPF_ASSIGN_OR_RETURN(const uint64_t required, RequiredRegionBytes(config, world));
  std::vector<int> ranks(world);
  for (int r = 0; r < world; ++r) ranks[r] = r;
  EPF_RETURN_IF_ERROR(CheckRegions(*lease, config, ranks, required, part));
  internal::KernelPathConfig path{.config = config,
                                  .rank = lease->rank(),
                                  .num_ranks = world,
                                  .experts_per_rank = config.num_experts / world,
                                  .allocator = std::move(allocator)};
  for (int r = 0; r < world; ++r) path.peer_regions[r] = static_cast<char*>(lease->region(r)) + part.offset;
  path.lost_ranks = lease->lost_ranks_words(backend == Backend::kCuda);
  path.lost_ranks_host = lease->lost_ranks_words(/*device=*/false);
  EPF_ASSIGN_OR_RETURN(std::unique_ptr<internal::KernelPath> kernel_path, internal::KernelPath::Create(backend, path));
  return std::unique_ptr<internal::DataPath>(std::move(kernel_path));
}

}  // namespace

namespace internal {

absl::StatusOr<Backend> BackendOf(const Lease& lease) {
  switch (lease.backend()) {
    case v1::BACKEND_CUDA:
      return Backend::kCuda;
    case v1::BACKEND_HOST:
      return Backend::kHost;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("lease backend = ", v1::Backend_Name(lease.backend()), ": not supported"));
  }
}

absl::StatusOr<std::unique_ptr<DataPath>> NewDataPath(Lease* lease, const BufferConfig& config,
                                                      std::shared_ptr<Allocator> allocator) {
  EPF_ASSIGN_OR_RETURN(const ModeParts parts, PartFor(*lease, config));
  EPF_ASSIGN_OR_RETURN(const Backend backend, BackendOf(*lease));
  const int world = lease->world_size();
  if (static_cast<int>(lease->nvl_ranks().size()) == world && !config.force_internode) {
    return NewSameHostPath(lease, config, backend, std::move(allocator), parts.nvl);
  }
  if (config.low_latency && world > kernels::kMaxLowLatencyRanks) {
    return InvalidValue(
        "world_size", world,
        absl::StrCat("at most ", kernels::kMaxLowLatencyRanks, " ranks in low-latency mode across hosts"));
  }
  EPF_ASSIGN_OR_RETURN(const InternodeGroupShape shape, InternodeShapeOf(*lease));
  EPF_ASSIGN_OR_RETURN(const GroupBytes bytes, RequiredGroupBytes(config, shape.num_hosts, shape.ranks_per_host));
  if (config.low_latency) {
    const uint64_t nvl_offset = parts.nvl.offset;
    EPF_RETURN_IF_ERROR(CheckRegions(*lease, config, lease->nvl_ranks(), bytes.nvl,
                                     {.offset = nvl_offset, .name = nvl_offset == 0 ? "region" : "low-latency part"}));
    return NewLowLatencyInternodePath(lease, config, std::move(allocator), nvl_offset, parts.rdma.offset);
  }
  const uint64_t nvl_limit = parts.nvl.limit;
  EPF_RETURN_IF_ERROR(
      CheckRegions(*lease, InnerBufferConfig(config, shape), lease->nvl_ranks(), bytes.nvl,
                   {.limit = nvl_limit, .name = nvl_limit == UINT64_MAX ? "region" : "normal-mode part"}));
  return NewNormalInternodePath(lease, config, shape, std::move(allocator), parts.rdma.limit);
}

}  // namespace internal

// ---- sizes (buffer.h) ----

absl::StatusOr<uint64_t> RequiredRegionBytes(const BufferConfig& config, int num_nvl_ranks) {
  // A low-latency region holds the layout over every rank of the group, across hosts too (DeepEP's size hint takes
  // the whole group): up to kMaxLowLatencyRanks. Normal mode's spans one NVLink domain.
  const int max_ranks = config.low_latency ? kernels::kMaxLowLatencyRanks : kernels::kMaxNvlPeers;
  if (num_nvl_ranks < 1 || num_nvl_ranks > max_ranks) {
    return InvalidValue("num_nvl_ranks", num_nvl_ranks, absl::StrCat("must be in [1, ", max_ranks, "]"));
  }
  if (config.max_tokens_per_rank < 1) {
    return InvalidValue("config.max_tokens_per_rank", config.max_tokens_per_rank, "must be >= 1");
  }
  if (config.hidden < 1) return InvalidValue("config.hidden", config.hidden, "must be >= 1");
  if (config.max_topk < 1) return InvalidValue("config.max_topk", config.max_topk, "must be >= 1");
  if (config.num_experts < 1 || config.num_experts % num_nvl_ranks != 0) {
    return InvalidValue("config.num_experts", config.num_experts,
                        absl::StrCat("must be a positive multiple of the number of ranks (", num_nvl_ranks, ")"));
  }
  if (config.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.timeout = ", absl::FormatDuration(config.timeout), ": must be positive"));
  }
  if (config.low_latency) {
    if (config.max_topk > kernels::kLowLatencyMaxTopk) {
      return InvalidValue("config.max_topk", config.max_topk,
                          absl::StrCat("must be at most ", kernels::kLowLatencyMaxTopk, " in low-latency mode"));
    }
    EPF_ASSIGN_OR_RETURN(const size_t bytes, kernels::LowLatencyRegionBytes(config.max_tokens_per_rank, config.hidden,
                                                                            num_nvl_ranks, config.num_experts));
    return static_cast<uint64_t>(bytes);
  }
  if (config.num_sms < 1) return InvalidValue("config.num_sms", config.num_sms, "must be >= 1");
  kernels::IntranodeRegionConfig region{.num_ranks = num_nvl_ranks,
                                        .max_tokens_per_rank = config.max_tokens_per_rank,
                                        .max_hidden = config.hidden,
                                        .max_topk = config.max_topk,
                                        .num_experts = config.num_experts,
                                        .max_channels = config.num_sms};
  EPF_ASSIGN_OR_RETURN(const size_t bytes, kernels::IntranodeRegionBytes(region));
  return static_cast<uint64_t>(bytes);
}

absl::StatusOr<GroupBytes> RequiredGroupBytes(const BufferConfig& config, int num_hosts, int ranks_per_host) {
  if (num_hosts < 1 || num_hosts > kernels::kMaxInternodeHosts) {
    return InvalidValue("num_hosts", num_hosts, absl::StrCat("must be in [1, ", kernels::kMaxInternodeHosts, "]"));
  }
  if (config.num_experts % (num_hosts * std::max(ranks_per_host, 1)) != 0) {
    return InvalidValue("config.num_experts", config.num_experts,
                        absl::StrCat("must be a multiple of the number of ranks (", num_hosts * ranks_per_host, ")"));
  }
  GroupBytes bytes;
  if (num_hosts == 1 && !config.force_internode) {
    EPF_ASSIGN_OR_RETURN(bytes.nvl, RequiredRegionBytes(config, ranks_per_host));
    return bytes;
  }
  if (config.low_latency) {
    const int world = num_hosts * ranks_per_host;
    EPF_ASSIGN_OR_RETURN(
        const kernels::LowLatencyLayout layout,
        kernels::MakeLowLatencyLayout(config.max_tokens_per_rank, config.hidden, world, config.num_experts));
    bytes.nvl = layout.total_bytes;
    bytes.rdma = internal::LowLatencyInternodeRdmaBytes(layout);
    return bytes;
  }

  const internal::InternodeGroupShape shape{.num_hosts = num_hosts, .ranks_per_host = ranks_per_host};
  EPF_ASSIGN_OR_RETURN(bytes.nvl, RequiredRegionBytes(internal::InnerBufferConfig(config, shape), ranks_per_host));
  EPF_ASSIGN_OR_RETURN(const kernels::InternodeRdmaLayout layout,
                       kernels::ComputeInternodeRdmaLayout({.num_hosts = num_hosts,
                                                            .ranks_per_host = ranks_per_host,
                                                            .max_tokens_per_rank = config.max_tokens_per_rank,
                                                            .max_hidden = config.hidden,
                                                            .max_topk = config.max_topk}));
  bytes.rdma = layout.total_bytes;
  return bytes;
}

}  // namespace epfabric::client
