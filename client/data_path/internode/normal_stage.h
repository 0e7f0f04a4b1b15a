// Internal: the RDMA stage of normal mode across hosts (internode_path.h; docs/internode-dispatch.md). It moves rows
// between hosts through this rank's RDMA region and the transport rings, and runs the NVLink stage (the internode
// path's kernel path over this host's ranks) between its steps, on either backend:
//   dispatch: pack per destination host -> put to the same local index on that host -> the gateway concatenates
//             what arrived -> intranode dispatch within the host;
//   combine:  intranode combine within the host -> put each source host's rows back -> the source sums per host.
// All waits are bounded by BufferConfig::timeout and name the rank waited for. In worst-case mode (num_worst_tokens)
// the RDMA stage's rows sit at fixed places and, on cuda, its puts and waits are kernels: nothing waits on the host,
// so the calls can be captured into CUDA graphs (normal_worst.cc).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "data_path/internode/internode_path.h"
#include "data_path/kernel_path.h"
#include "data_path/lost_ranks.h"
#include "epfabric/client/buffer.h"
#include "epfabric/client/client.h"
#include "epfabric/kernels/internode.h"
#include "epfabric/kernels/status_word.h"
#include "epfabric/kernels/transport/issuer.h"

namespace epfabric::client::internal {

// FailedPrecondition while `stream` is being captured (cuda backend): calls of a group that spans hosts that
// synchronise with the host between their stages (normal mode; low latency relayed) cannot be captured into a CUDA
// graph. The message says what to use instead.
absl::Status RefuseCaptureAcrossHosts(Backend backend, cudaStream_t stream, bool low_latency = false);

// The transport channels (command rings) each mode issues on (decision 84). In a group that serves both modes with two
// or more channels the last one is low latency's alone: its device-side issuer keeps its ring index in device memory
// and must not share a ring with the normal path's host-side issuers. Otherwise each mode has them all.
struct ChannelRange {
  int first = 0;
  int count = 0;
};
ChannelRange NormalModeChannels(const Lease& lease);
ChannelRange LowLatencyChannels(const Lease& lease);

// What an internode dispatch records for combine and cached dispatch (DispatchHandle::internode).
struct InternodeHandle {
  // Worst-case mode (num_worst_tokens; normal_worst.cc): nothing was read back to the host. The counts are only in
  // the tensors below (send_tokens' first H entries, recv_counts_tensor), and the NVLink stage ran on H *
  // max_tokens_per_rank rows, host h's at h * max_tokens_per_rank.
  bool padded = false;
  std::vector<int32_t> send_counts;             // [H] rows this rank sent to each host (not padded)
  std::vector<int32_t> recv_counts;             // [H] rows this rank (as gateway) received from each host (not padded)
  Tensor send_tokens;                           // int32 [H + H * max_tokens_per_rank]: counts, then each host's tokens
  Tensor send_slot;                             // int32 [num_tokens, H]: the token's row in host h's slabs, or -1
  Tensor recv_counts_tensor;                    // padded: int32 [H], the gather's recv_counts
  std::shared_ptr<const DispatchHandle> inner;  // the intranode stage's handle
};

// What one forwarded row of a dispatch carries (the Buffer checked the tensors).
struct InternodeRowShape {
  int row_bytes = 0;   // x: BF16 2 * hidden, FP8 hidden
  int num_scales = 0;  // 4-byte scale words: float per 128 channels, or DeepEP's packed UE8M0 int32 (per 512)
  kernels::DType scales_dtype = kernels::DType::kFloat32;
  int num_topk = 0;
  bool has_weights = false;
  static InternodeRowShape Of(const DispatchArgs& args);
};

// Most 64-bit words one RegionAccess::ReadWords / WriteWords call moves.
inline constexpr int kRegionAccessMaxWords = 8192;

// Backend-specific moves of bytes and words in this rank's RDMA region (host memory or device memory).
class RegionAccess {
 public:
  virtual ~RegionAccess() = default;
  // Copies inside this process' memory (region or tensors), stream-ordered on cuda.
  virtual absl::Status Copy(void* dst, const void* src, size_t bytes, cudaStream_t stream) = 0;
  virtual absl::Status Zero(void* dst, size_t bytes, cudaStream_t stream) = 0;
  // Waits for `stream`'s work (cuda); nothing on the host.
  virtual absl::Status Sync(cudaStream_t stream) = 0;
  // Reads / writes 64-bit words of the region now (cuda: on a private stream, not ordered with the caller's).
  virtual absl::Status ReadWords(const void* src, uint64_t* out, int count) = 0;
  virtual absl::Status WriteWords(void* dst, const uint64_t* in, int count) = 0;
  // Host copies for host-side planning (cuda: device -> host).
  virtual absl::Status ToHost(void* dst, const void* src, size_t bytes, cudaStream_t stream) = 0;
  virtual absl::Status FromHost(void* dst, const void* src, size_t bytes, cudaStream_t stream) = 0;
  virtual absl::Status Pack(const kernels::InternodePackParams& p, cudaStream_t stream) = 0;
  virtual absl::Status Reduce(const kernels::InternodeReduceParams& p, cudaStream_t stream) = 0;
  virtual absl::Status Plan(const kernels::InternodePlanParams& p, cudaStream_t stream) = 0;
  virtual absl::Status Gather(const kernels::InternodeGatherParams& p, cudaStream_t stream) = 0;
  virtual absl::Status Scatter(const kernels::InternodeScatterParams& p, cudaStream_t stream) = 0;
};

absl::StatusOr<std::unique_ptr<RegionAccess>> NewRegionAccess(Backend backend);

class NormalRdmaStage {
 public:
  ~NormalRdmaStage();
  // `nvlink` is the NVLink stage (a normal-mode kernel path over this host's ranks, InnerBufferConfig), owned by the
  // internode path with this stage; `lease` must outlive this. The layout starts at the RDMA region's start and may
  // take at most `rdma_limit` bytes of it (the normal-mode part of a group that serves both modes).
  static absl::StatusOr<std::unique_ptr<NormalRdmaStage>> Create(Lease* lease, const BufferConfig& config,
                                                                 const InternodeGroupShape& shape, KernelPath* nvlink,
                                                                 std::shared_ptr<Allocator> allocator,
                                                                 uint64_t rdma_limit = UINT64_MAX);

  // The Buffer has checked `args` against the global group (shapes, dtypes, layout), and the internode path the
  // layout's expert indices, before calling these. A call that fails tells the ranks that wait for this one, on other
  // hosts and on this one (LeaveCall), so that their waits end at once; every rank then resets. A refused call (bad
  // arguments, checked before anything is sent) tells nobody.
  absl::StatusOr<DispatchResult> Dispatch(const DispatchArgs& args, cudaStream_t stream);
  absl::StatusOr<CombineResult> Combine(const CombineArgs& args, cudaStream_t stream);
  absl::Status Check(cudaStream_t stream);
  absl::Status Reset(cudaStream_t stream);
  // After a failed call: marks its arrival at this host's ranks' NVLink-stage barriers (KernelPath::AbandonCall) and
  // every word it writes at its peers on other hosts (arrivals of rows, releases of slabs), so that their waits for
  // it end with UNAVAILABLE naming it, and waits (bounded) until the marks landed.
  void LeaveCall();

 private:
  NormalRdmaStage() = default;

  // What LeaveCall adds to each word it owes a peer: far above any count of calls, so a waiting peer tells it apart.
  static constexpr uint64_t kLeftCallWord = kernels::kInternodeLeftCallWord;
  static constexpr int kDispatchCall = 0, kCombineCall = 1;  // the layout's `calls` words

  absl::StatusOr<DispatchResult> RunDispatch(const DispatchArgs& args, cudaStream_t stream);
  absl::StatusOr<CombineResult> RunCombine(const CombineArgs& args, cudaStream_t stream);
  // Dispatch's NVLink stage: its layout (unless cached) and dispatch of the forwarded rows, and the
  // call's handle. `recorded` (not cached) is what combine and a cached dispatch need; the inner handle is added.
  struct ForwardedRows {
    Tensor x, x_scales, topk_idx, topk_weights;
  };
  absl::StatusOr<DispatchResult> NvlinkDispatch(const DispatchArgs& args, const ForwardedRows& fwd,
                                                std::shared_ptr<InternodeHandle> recorded, cudaStream_t stream);
  // Combine's NVLink stage (its combine of the forwarded tokens) and its last step (the sum over
  // hosts of the rows that came back, InternodeReduce).
  absl::StatusOr<CombineResult> InnerCombine(const CombineArgs& args, cudaStream_t stream);
  absl::StatusOr<CombineResult> SumHosts(const CombineArgs& args, const InternodeHandle& plan, cudaStream_t stream);
  // After a failed call: LeaveCall, once the call's device steps ended (cuda; nothing while capturing).
  void FailCall(cudaStream_t stream);
  // Worst-case mode (normal_worst.cc): the RDMA stage with no host wait on cuda, its rows at fixed places.
  absl::StatusOr<DispatchResult> RunPaddedDispatch(const DispatchArgs& args, cudaStream_t stream);
  absl::StatusOr<CombineResult> RunPaddedCombine(const CombineArgs& args, cudaStream_t stream);
  bool device_steps() const { return status_ != nullptr; }  // cuda: the padded calls' transport steps are kernels
  // A padded call's transport steps: kernels on cuda, the host path's code on the host backend. Begin counts the
  // call, waits for `words` (the slabs' release) and for every put so far to complete.
  absl::Status StepBegin(int call, kernels::InternodeWaitWords words, cudaStream_t stream);
  absl::Status StepWait(int call, kernels::InternodeWaitWords words, bool quiet, cudaStream_t stream);
  absl::Status StepIssue(kernels::InternodeIssueStep step, const Tensor& counts, const InternodeRowShape& rows,
                         cudaStream_t stream);
  kernels::InternodeWaitParams WaitParams(int call, kernels::InternodeWaitWords words);
  // cuda: after the RDMA stage of a padded call, LeaveCall's marks made on the device if a step failed.
  absl::Status StepLeaveIfFailed(const InternodeRowShape& rows, cudaStream_t stream);
  // Counts this call in the region's `calls` word (after the stream's work, so that calls replayed from graphs
  // count) and returns the new count: the target of the call's waits.
  absl::StatusOr<uint64_t> BeginCall(int call, cudaStream_t stream);
  // The host path's sends: per other host its rows (counts[h] each), the count word and the arrival signal; the
  // release of every other host's slabs; the combine's rows back.
  absl::Status IssueDispatchRows(const int32_t* counts, int row_bytes, int num_scales, int num_topk, bool has_weights);
  absl::Status IssueSlabFree();
  absl::Status IssueCombineRows(const int32_t* counts, int hidden, int num_topk);
  // After a host-issued combine's sum: every other host may put the next combine's rows into our receive slabs.
  absl::Status IssueCombineFree();
  kernels::InternodePackParams PackParams(const DispatchArgs& args, const InternodeHandle& plan, int row_bytes,
                                          int num_scales, int num_topk) const;
  int PeerRank(int host) const { return host * shape_.ranks_per_host + shape_.local_rank; }
  uint8_t* region() const { return static_cast<uint8_t*>(region_); }
  kernels::transport::RingIssuer& RingFor(int host) { return rings_[host % rings_.size()]; }
  // Waits until word[h] of the section at `offset` reaches `target` for every host but this one. Ends early with
  // UNAVAILABLE when the daemon publishes the rank that writes a missing word as lost.
  absl::Status WaitWords(size_t offset, uint64_t target, const char* what);
  absl::Status QuietAll();
  // The NVLink stage's errors name ranks by their index on this host: say so, with the group rank of index 0.
  absl::Status Annotate(absl::Status status) const;
  template <typename T>
  absl::StatusOr<T> Stage(absl::StatusOr<T> result) const {
    if (result.ok()) return result;
    return Annotate(result.status());
  }
  absl::StatusOr<std::shared_ptr<InternodeHandle>> Plan(const DispatchArgs& args, int num_tokens, cudaStream_t stream);
  absl::Status SendRows(const DispatchArgs& args, const InternodeHandle& plan, uint64_t call, int row_bytes,
                        int num_scales, int num_topk, cudaStream_t stream);
  absl::StatusOr<Tensor> NewTensor(kernels::DType dtype, std::vector<int64_t> shape, cudaStream_t stream);

  Lease* lease_ = nullptr;
  BufferConfig config_;
  InternodeGroupShape shape_;
  KernelPath* nvlink_ = nullptr;  // the NVLink stage: a failed call leaves it too (AbandonCall)
  std::shared_ptr<Allocator> allocator_;
  std::unique_ptr<RegionAccess> access_;
  void* region_ = nullptr;
  kernels::InternodeRdmaLayout layout_;
  std::vector<kernels::transport::RingIssuer> rings_;
  // cuda: the padded calls' status word (device memory, read by Check) and the rings as the device maps them.
  kernels::KernelStatus* status_ = nullptr;
  kernels::InternodeRing device_rings_[kernels::kMaxInternodeRings] = {};
  int num_device_rings_ = 0;
  const uint64_t* lost_ranks_device_ = nullptr;
  uint64_t host_call_ = 0;  // host backend: the current padded call's count (BeginCall's)
  // Host-issued combines this rank finished since the path was made or reset: the next one waits until every other
  // host freed its receive slab of the previous one (combine_free), so back-to-back combines never overwrite rows a
  // peer is still summing. Every rank issues the same sequence of calls, so the counts agree.
  uint64_t host_combines_ = 0;
  bool last_call_device_ = false;  // the last call ran its RDMA stage on the device (Check leaves after its errors)
  bool leave_launched_ = false;    // this call's device leave step was launched (FailCall does not mark again)
  // The daemon's lost-ranks words (group order; null without a counters page), and the ranks already lost when this
  // path was made, which are awaited rather than reported until their bit clears (as IntranodeGroup::lost_ignore).
  const uint64_t* lost_ranks_ = nullptr;
  uint64_t lost_ignore_[kernels::kLostRankWords] = {};
};

}  // namespace epfabric::client::internal
