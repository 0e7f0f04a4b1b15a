// Internal: the data path of a group that spans hosts (docs/internode-dispatch.md), a DataPath composed of two stages:
//   the NVLink stage: a kernel path (cuda or host) over this host's ranks in normal mode; in low latency over every
//                     rank of the group, the ranks on other hosts written into outboxes in this rank's RDMA region;
//   the RDMA stage:   the transport rings the daemon serves. Normal mode (normal_stage.h): dispatch packs per
//                     destination host, puts to the same local index there, and the gateway runs the NVLink stage on
//                     what arrived; combine runs the NVLink stage, puts each source host's rows back, and the source
//                     sums per host. Low latency (low_latency_stage.h): every range written into an outbox is put into
//                     the same slots of its rank's inbox (as written on the host backend; by an issue kernel or by the
//                     calling thread between the steps on cuda).
// The Buffer sees the DataPath interface only.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "data_path/data_path.h"
#include "epfabric/client/buffer.h"
#include "epfabric/kernels/low_latency_layout.h"

namespace epfabric::client::internal {

// The group's shape: host h holds ranks [h * ranks_per_host, (h + 1) * ranks_per_host).
struct InternodeGroupShape {
  int num_hosts = 0;
  int ranks_per_host = 0;
  int host = 0;        // this rank's host
  int local_rank = 0;  // this rank's index on its host
};

// The shape of `lease`'s group, or InvalidArgument when its ranks are not grouped by host that way.
absl::StatusOr<InternodeGroupShape> InternodeShapeOf(const Lease& lease);

// What the NVLink stage of a normal-mode group across hosts is configured with: max_tokens_per_rank = hosts * the
// outer bound (a gateway forwards what every host sent it), the host's experts, the host's ranks.
BufferConfig InnerBufferConfig(const BufferConfig& outer, const InternodeGroupShape& shape);

// Bytes of the RDMA region for low latency across hosts with `layout` (a low-latency layout over all ranks).
uint64_t LowLatencyInternodeRdmaBytes(const kernels::LowLatencyLayout& layout);

// Normal mode across hosts. The caller checked the NVL regions (of this host's ranks, for InnerBufferConfig); the RDMA
// stage's layout starts at the RDMA region's start and may take at most `rdma_limit` bytes of it (the normal-mode part
// of a group that serves both modes). `lease` must outlive the path.
absl::StatusOr<std::unique_ptr<DataPath>> NewNormalInternodePath(Lease* lease, const BufferConfig& config,
                                                                 const InternodeGroupShape& shape,
                                                                 std::shared_ptr<Allocator> allocator,
                                                                 uint64_t rdma_limit);

// Low latency across hosts. The caller checked this host's NVL regions; the low-latency parts start at `nvl_offset`
// of each NVL region and `rdma_offset` of the RDMA region (after a normal-mode part in a group that serves both modes).
// Who puts the bytes for ranks on other hosts follows BufferConfig::low_latency_issue (decision 84).
absl::StatusOr<std::unique_ptr<DataPath>> NewLowLatencyInternodePath(Lease* lease, const BufferConfig& config,
                                                                     std::shared_ptr<Allocator> allocator,
                                                                     uint64_t nvl_offset, uint64_t rdma_offset);

}  // namespace epfabric::client::internal
