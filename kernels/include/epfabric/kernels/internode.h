// Normal-mode dispatch/combine across hosts (issue #12): the RDMA region's layout and the two data steps that are
// not intranode ones. docs/internode-dispatch.md has the whole algorithm; in short, for a group of H hosts x L ranks
// (rank = host * L + local index):
//   dispatch: a rank packs, per destination host, the rows of its tokens that go to any rank of that host (top-k
//     entries rewritten to that host's expert numbering, -1 elsewhere) into the RDMA region, and puts them over the
//     transport to the rank with the same local index there (its "gateway"). The gateway concatenates what every
//     host sent it and dispatches that within its host over NVLink with the intranode kernels.
//   combine: the intranode combine reduces within the host (to BF16), the gateway puts each source host's rows back,
//     and the source sums the per-host partial rows (InternodeReduce).
// Every rank's RDMA region has the same layout (ComputeInternodeRdmaLayout), so offsets name the same place on all.
// Plain C++ (the client library includes it without nvcc); the CUDA and host implementations take the same params.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epfabric/kernels/internode_layout.h"

namespace epfabric::kernels {

absl::StatusOr<InternodeRdmaLayout> ComputeInternodeRdmaLayout(const InternodeShape& shape);

absl::Status ValidateInternodePack(const InternodePackParams& p);
absl::Status ValidateInternodeReduce(const InternodeReduceParams& p);
absl::Status ValidateInternodePlan(const InternodePlanParams& p);
absl::Status ValidateInternodeGather(const InternodeGatherParams& p);
absl::Status ValidateInternodeScatter(const InternodeScatterParams& p);

// CUDA: launched on `stream` (device pointers; the region as mapped on the device). The pack also stores each host's
// count into the region's send_count words (the source of the count puts).
absl::Status InternodePack(const InternodePackParams& p, cudaStream_t stream);
absl::Status InternodeReduce(const InternodeReduceParams& p, cudaStream_t stream);
absl::Status InternodePlan(const InternodePlanParams& p, cudaStream_t stream);
absl::Status InternodeGather(const InternodeGatherParams& p, cudaStream_t stream);
absl::Status InternodeScatter(const InternodeScatterParams& p, cudaStream_t stream);
// The worst-case mode's transport steps on the device (one block each; bounded waits recorded in p.status; a ring
// whose daemon recorded a failure gets no more commands, and the caller reads why from its RingControl).
absl::Status InternodeIssue(const InternodeIssueParams& p, cudaStream_t stream);
absl::Status InternodeWait(const InternodeWaitParams& p, cudaStream_t stream);

namespace host_backend {
// The same on the calling thread (host pointers). The gather returns DataLoss for a bad count instead of recording
// it.
absl::Status InternodePack(const InternodePackParams& p);
absl::Status InternodeReduce(const InternodeReduceParams& p);
absl::Status InternodePlan(const InternodePlanParams& p);
absl::Status InternodeGather(const InternodeGatherParams& p);
absl::Status InternodeScatter(const InternodeScatterParams& p);
}  // namespace host_backend

}  // namespace epfabric::kernels
