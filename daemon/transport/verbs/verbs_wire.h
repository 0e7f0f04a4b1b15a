// The verbs wire (TRANSPORT_VERBS): the group's RDMA region registered with the NIC, one RC queue pair per (peer,
// channel), puts as RDMA WRITE and signals as fenced 8-byte fetch-and-add, completions turned into
// CompletionSink::Complete by one thread per group. docs/internode-verbs.md describes it.
//
// Where GPU-initiated networking would plug in: a later IBGDA wire keeps this Open/Connect (the same endpoint, the
// same registration, the same QP state machine), but creates the queue pairs with mlx5dv (mlx5dv_create_qp with
// the work queue and doorbell in GPU-visible memory) and hands their buffers to the kernels through the group's
// descriptors instead of the proxy calling Put/SignalAdd; the command ring and the proxy then stay for the socket
// wire only.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "transport/verbs/verbs_probe.h"
#include "transport/wire.h"

namespace epfabric::daemon::transport::verbs {

// Opens the device and port the options select (ChoosePort) and its protection domain, shared by every group of
// this wire. FailedPrecondition with ProbeVerbs' one-line message when there is no usable device.
absl::StatusOr<std::unique_ptr<Wire>> MakeVerbsWire(const VerbsOptions& options);

}  // namespace epfabric::daemon::transport::verbs
