// The host backend: the intranode and low-latency data paths of epfabric run by the CPU over POSIX shared memory
// (or any memory that every rank of the group has mapped), with the same region layouts, the same params/args
// structs and the same signalling protocol as the CUDA kernels (docs/host-backend.md). It is the embedded default
// on machines without a GPU and the oracle the GPU results are compared with.
//
// Differences from the CUDA entry points of intranode.h / low_latency.h:
//  - every pointer in the params structs is a host pointer (regions: the group's shared memory as mapped in this
//    process); there is no stream: each function runs on the calling thread and returns when its work is done;
//  - a timed-out wait returns absl::DeadlineExceededError directly (same message as KernelStatusToStatus gives for
//    the GPU: "rank 0 timed out waiting for barrier from rank 1 (channel 0)"); it is also recorded in the status word
//    when one is given (optional here, required by the GPU functions);
//  - the caller's thread is the rank: ranks are processes (or threads) that run the same sequence of calls, and
//    every wait on a peer is bounded by the group's / context's timeout_ns.
// Everything is plain C++ (no CUDA compiler or device needed); the CUDA headers only provide the shared structs.
#pragma once

#include "absl/status/status.h"
#include "epfabric/kernels/intranode.h"
#include "epfabric/kernels/low_latency.h"

namespace epfabric::kernels::host_backend {

// ---------------------------------------------------------------------------------------------------------------
// Intranode (normal) mode. Same semantics and outputs as GetDispatchLayout / IntranodeNotify / IntranodeDispatch /
// IntranodeCombine; group.status may be null. All ranks of a group must issue the same sequence of calls.

absl::Status GetDispatchLayout(const DispatchLayoutParams& params);

// Zeroes the signal sections of this rank's region. Needed before first use if the memory is not known to be zero,
// and after any call returned DeadlineExceeded: every rank resets (with no call of the group in flight anywhere)
// before any rank issues the next call.
absl::Status IntranodeResetRegion(const IntranodeGroup& group);

// This rank's call failed outside this intranode stage (in a group across hosts: its RDMA stage) and it arrives at no
// barrier until every rank reset: the other ranks' barrier waits for it end at once with UNAVAILABLE
// (kKernelStatusPeerLeftCall) instead of at their timeout. Every rank then resets, as after a timeout.
absl::Status IntranodeAbandonCall(const IntranodeGroup& group);

// Exchanges the counts. Writes rank_prefix_matrix, recv_counts and the "host" counters (plain host memory here)
// before returning, so IntranodeWaitRecvCounts is not needed (it returns at once if called).
absl::Status IntranodeNotify(const IntranodeGroup& group, const IntranodeNotifyParams& params);

// Dispatch, also cached (a handle from an earlier dispatch). params.num_sms is the number of channels (it must match
// on all ranks, as on the GPU); the host runs them one after the other on the calling thread.
absl::Status IntranodeDispatch(const IntranodeGroup& group, const IntranodeDispatchParams& params,
                               IntranodeHandle* handle);

absl::Status IntranodeCombine(const IntranodeGroup& group, const IntranodeCombineParams& params,
                              const IntranodeHandle& handle);

// ---------------------------------------------------------------------------------------------------------------
// Low-latency mode. Same semantics, output layout and double-buffer rules as LowLatencyDispatch /
// LowLatencyCombine (LowLatencyBufferCursor, phases for hooks, LowLatencyCombineInputBuffer for zero copy);
// ctx.status may be null; ctx.rank_mask (host memory) masks ranks and a timed-out peer is masked there, as on the GPU.
// After a timeout the remaining work of the call is finished with the peer treated as masked, then the call returns
// DeadlineExceeded naming the first peer that did not answer.

absl::Status LowLatencyDispatch(const LowLatencyContext& ctx, const LowLatencyDispatchArgs& args);
absl::Status LowLatencyCombine(const LowLatencyContext& ctx, const LowLatencyCombineArgs& args);

// Zeroes the signals of both halves of this rank's region. Needed after a timeout (on every rank, before anyone's
// next call, with cursors restarted at half 0) and before first use if the memory is not known to be zero.
absl::Status LowLatencyResetRegion(const LowLatencyContext& ctx);

}  // namespace epfabric::kernels::host_backend
