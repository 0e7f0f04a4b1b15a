// The data-path API a serving process uses, mirroring DeepEP's Buffer so that users can switch: layout, normal
// dispatch/combine (with cached dispatch), low-latency dispatch/combine with FP8 and receive hooks. A Buffer sits
// on a Lease (client.h): the regions of every same-host rank are already mapped; the Buffer only launches work
// against them — CUDA kernels on the caller's stream (cuda backend) or the host backend's C++ on the calling
// thread (host backend: streams are ignored). Nothing goes through gRPC.
//
// Memory: every TensorView is contiguous row-major, device memory on the cuda backend and host memory on the host
// backend. Outputs are allocated through the Buffer's Allocator (default: stream-ordered cudaMallocAsync, or
// aligned host memory), so a framework binding can hand out its own tensors without copies.
//
// Errors: bad input (dtype, shape, alignment, expert index out of range, more tokens than the regions were sized
// for) is refused with InvalidArgument before anything is launched, and the next valid call still works. A peer
// that does not answer within BufferConfig::timeout gives DeadlineExceeded naming it; then every rank calls Reset()
// before the next operation. A degraded group (Lease::Healthy) fails fast with Unavailable.
//
//   BufferConfig config{.max_tokens_per_rank = 4096, .hidden = 7168, .max_topk = 8, .num_experts = 256};
//   // CreateGroup(num_nvl_bytes = *RequiredRegionBytes(config, 8)) was done by whoever set the group up.
//   auto buffer = Buffer::Create(lease.get(), config);
//   auto layout = (*buffer)->GetDispatchLayout(topk_idx, stream);
//   auto recv = (*buffer)->Dispatch({.x = x, .topk_idx = topk_idx, .topk_weights = w, .layout = &*layout}, stream);
//   ... experts on recv->recv_x ...
//   auto out = (*buffer)->Combine({.x = expert_out, .handle = recv->handle}, stream);
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "epfabric/kernels/common.h"
#include "epfabric/kernels/intranode.h"
#include "epfabric/kernels/low_latency.h"

namespace epfabric::client {
class Lease;  // epfabric/client/client.h
namespace internal {
struct InternodeHandle;
}

// Where a Buffer's data lives and its work runs (the lease's backend): cuda (device memory, kernels on the caller's
// stream) or host (host memory, the host backend on the calling thread).
enum class Backend { kCuda, kHost };

// A contiguous row-major tensor: pointer, element type, shape. An empty view (data == nullptr and no shape) means
// "not given". A view with a shape and no elements (a rank with 0 tokens) is given even when data is null: every
// rank of a group must agree on which optional tensors are given.
struct TensorView {
  void* data = nullptr;
  kernels::DType dtype = kernels::DType::kBF16;
  std::vector<int64_t> shape;

  bool empty() const { return data == nullptr && shape.empty(); }
  int64_t numel() const;
  size_t bytes() const;
};

// An output: a view plus the allocation that owns it (freed through the allocator when the last copy goes).
struct Tensor {
  TensorView view;
  std::shared_ptr<void> storage;
};

// Where outputs come from.
class Allocator {
 public:
  virtual ~Allocator() = default;
  // `bytes` of memory usable in stream order on `stream` (cuda) or by the host (host backend).
  virtual absl::StatusOr<void*> Allocate(size_t bytes, cudaStream_t stream) = 0;
  // The memory of one output tensor of `dtype` and `shape` (`bytes` = its size, 0 when it has no elements; the
  // pointer must still be non-null and 16-byte aligned then), freed with Free. A framework binding returns its own
  // tensor of that type and shape, so that each output is one allocation and needs no view. Default: Allocate of at
  // least 256 bytes.
  virtual absl::StatusOr<void*> AllocateTensor(kernels::DType dtype, const std::vector<int64_t>& shape, size_t bytes,
                                               cudaStream_t stream);
  virtual void Free(void* ptr, cudaStream_t stream) = 0;
};

// cuda: cudaMallocAsync / cudaFreeAsync on the call's stream; host: 256-byte aligned host memory.
std::shared_ptr<Allocator> DefaultAllocator(Backend backend);

// What a Buffer is sized for. Every rank of the group uses the same; the group's regions (CreateGroup's
// num_nvl_bytes; in a group that serves both modes, the mode's part) must be at least RequiredRegionBytes(config,
// number of same-host ranks).
struct BufferConfig {
  int max_tokens_per_rank = 0;  // normal: most tokens one rank dispatches per call; low latency: exactly that bound
  int hidden = 0;               // normal: the widest hidden size; low latency: the hidden size
  int max_topk = 0;
  int num_experts = 0;  // a multiple of the number of ranks
  int num_sms = 20;     // normal mode: SMs (= channels) per dispatch/combine
  // Low-latency mode: blocks per launch, 0 = one per SM (DeepEP's choice). Ranks that share a GPU inside one
  // process need a share each (SMs / ranks on that GPU): a kernel that spins on every SM starves its peer's.
  int low_latency_sms = 0;
  // Low-latency calls (the group must have GroupInfo.low_latency), else normal-mode calls: on a normal-mode group, or
  // on a low-latency group that also serves normal mode (GroupInfo.num_normal_bytes > 0; across hosts also
  // num_normal_rdma_bytes). There each mode has its own part of the regions, so a lease may hold one Buffer of each
  // mode at once (SGLang's auto mode).
  bool low_latency = false;
  absl::Duration timeout = absl::Seconds(5);  // bound of every wait on a peer
  // Low latency: a rank that is lost (its client's lease ended or changed, its daemon went down) or that does not
  // answer within `timeout` is masked, and the calls go on without it (DeepEP's enable_shrink; LowLatencyRankMask
  // says which ranks are masked). Without it, a call that meets such a rank fails (UNAVAILABLE when it is lost,
  // DEADLINE_EXCEEDED when it is silent) naming it, and no rank returns data that depends on it.
  bool enable_shrink = false;
  // Normal mode: run a one-host group through the internode path (RDMA stage included; needs num_rdma_bytes of
  // RequiredGroupBytes with num_hosts = 1 computed as for two). For tests: the outputs must equal the intranode
  // path's bit for bit.
  bool force_internode = false;
  // Low latency across hosts on the host backend: relay the staged bytes between steps from the calling thread, as
  // the cuda backend always does (instead of sending each write as it is made). For tests: the relay's logic then
  // runs without a GPU.
  bool low_latency_relay = false;
  // Low latency across hosts on cuda: who puts the bytes for ranks on other hosts (decision 84). kDevice: a kernel
  // after each step, and the kernels wait on the device (capturable into a CUDA graph). kRelay: the calling thread
  // between launches, waiting on the host (never a kernel spinning while the daemon lands bytes on the same GPU; not
  // capturable). kAuto: kDevice on the verbs wire, kRelay on the socket wire, unless the environment variable
  // EPF_LOW_LATENCY_ISSUE says `device` or `relay`.
  enum class LowLatencyIssue { kAuto, kRelay, kDevice };
  LowLatencyIssue low_latency_issue = LowLatencyIssue::kAuto;
};

// `num_nvl_ranks`: the ranks of one NVLink domain (at most 8); in low-latency mode the region holds the layout over
// the whole group, so the group's ranks (at most kMaxLowLatencyRanks, 256, across hosts).
absl::StatusOr<uint64_t> RequiredRegionBytes(const BufferConfig& config, int num_nvl_ranks);

// A normal-mode group over `num_hosts` hosts of `ranks_per_host` ranks each (rank = host * ranks_per_host + local
// index): CreateGroup's num_nvl_bytes and num_rdma_bytes. With one host, rdma is 0 and nvl is RequiredRegionBytes.
struct GroupBytes {
  uint64_t nvl = 0;
  uint64_t rdma = 0;
};
absl::StatusOr<GroupBytes> RequiredGroupBytes(const BufferConfig& config, int num_hosts, int ranks_per_host);

// ---- normal mode ----

struct DispatchLayout {
  Tensor num_tokens_per_rank;    // int32 [num_ranks]
  Tensor num_tokens_per_expert;  // int32 [num_experts]
  Tensor is_token_in_rank;       // bool [num_tokens, num_ranks]
  // int32 [1]: top-k entries outside [-1, num_experts) (the layout treats them as -1). cuda: mapped host memory the
  // layout kernel writes; Dispatch waits for it (bounded) and refuses the call before notify when it is not 0.
  // Host backend: GetDispatchLayout refuses such input itself, so this is always 0. May be left empty by callers
  // that build their own layout (cuda Dispatch then copies topk_idx to the host to check it).
  Tensor num_invalid_topk;
};

// What dispatch records for combine and for cached dispatch (DeepEP's handle). Keep it until the combine.
struct DispatchHandle {
  kernels::IntranodeHandle raw;  // points into the tensors below
  Tensor is_token_in_rank, rank_prefix_matrix, recv_channel_prefix, send_slot, recv_src_idx;
  int num_tokens = 0;
  int num_recv_tokens = 0;  // rows of the dispatch's outputs: the received count, or num_worst_tokens (worst_case)
  int hidden = 0;
  // The outputs were sized without waiting for the count (num_worst_tokens): rows past the received ones are padding.
  bool worst_case = false;
  // Groups that span hosts: the RDMA stage's record (the fields above are then the NVLink stage's, except
  // num_tokens, hidden and is_token_in_rank, which are this rank's).
  std::shared_ptr<const internal::InternodeHandle> internode;
};

struct DispatchArgs {
  TensorView x;  // bf16 [num_tokens, hidden], or fp8_e4m3 with x_scales
  // fp8 only: float [num_tokens, hidden / 128], or DeepEP's packed UE8M0 int32 [num_tokens, hidden / 512] (4
  // exponent bytes per word); recv_x_scales has the same dtype and width.
  TensorView x_scales;
  TensorView topk_idx;                           // int64 [num_tokens, num_topk], -1 = none; optional (no recv_topk_*)
  TensorView topk_weights;                       // float [num_tokens, num_topk]; optional
  const DispatchLayout* layout = nullptr;        // from GetDispatchLayout; required unless `cached`
  std::shared_ptr<const DispatchHandle> cached;  // cached mode: reuse a handle, no notify
  int expert_alignment = 1;                      // per-expert receive counts rounded up to a multiple of this
  // > 0: DeepEP's num_worst_tokens. The host does not wait for the received count, so the call is CUDA-graph
  // capturable: every output has exactly this many rows, rows past the received ones have recv_topk_idx -1 and
  // recv_topk_weights 0 (recv_x and its scales there are unspecified), num_recv_tokens_per_expert is empty and the
  // handle's num_recv_tokens is this (combine's x has this many rows; the padding rows are ignored). On cuda, top-k
  // entries outside [-1, num_experts) are not refused (that needs a wait): they count as -1. A rank that receives
  // more rows moves nothing: ResourceExhausted (host: from Dispatch; cuda: from Check), its peers DeadlineExceeded,
  // then every rank calls Reset. Across hosts the same: the RDMA stage's rows sit at fixed places and, on cuda, its
  // puts and waits run on the device (its errors come from Check), so the call is capturable there too (decision 88).
  int num_worst_tokens = 0;
};

struct DispatchResult {
  Tensor recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights;  // rows in the received order
  std::vector<int32_t> num_recv_tokens_per_expert;                 // host copy, per local expert
  std::shared_ptr<const DispatchHandle> handle;
};

struct CombineArgs {
  TensorView x;               // bf16 [num_recv_tokens, hidden], rows in the received order
  TensorView topk_weights;    // float [num_recv_tokens, num_topk]; optional
  TensorView bias_0, bias_1;  // bf16 [num_tokens, hidden]; optional
  std::shared_ptr<const DispatchHandle> handle;
};

struct CombineResult {
  Tensor combined_x;             // bf16 [num_tokens, hidden]
  Tensor combined_topk_weights;  // float [num_tokens, num_topk] when topk_weights were given
};

// ---- low-latency mode ----

struct LowLatencyHandle {
  kernels::LowLatencyHandle raw;  // points into the tensors below
  Tensor src_info, layout_range, topk_slot, token_map;
  int buffer_half = 0;  // the half the dispatch used
};

struct LowLatencyDispatchArgs {
  TensorView x;         // bf16 [num_tokens, hidden], num_tokens <= max_tokens_per_rank
  TensorView topk_idx;  // int64 [num_tokens, num_topk]
  bool use_fp8 = true;
  bool round_scale = false;
  bool use_ue8m0 = false;
  TensorView cumulative_stats;  // int32 [num_local_experts], added to; optional
  bool return_recv_hook = false;
  // int64 [num_ranks], added to; optional (DeepEP's dispatch_wait_recv_cost_stats): per source rank, the nanoseconds
  // the receive phase waited for its data, at least 1 per wait (one wait per local expert and source).
  TensorView wait_recv_cost_stats;
};

struct LowLatencyDispatchResult {
  Tensor packed_recv_x;  // fp8 or bf16 [L, R*M, hidden]
  // fp8: float, shape [L, G, R*M] (DeepEP's [L, R*M, G] transposed: token-minor), or packed ue8m0 int32, shape
  // [L, G/4, R*M]; G = hidden / 128. docs/data-layout.md.
  Tensor packed_recv_x_scales;
  Tensor packed_recv_count;         // int32 [L]
  Tensor packed_recv_src_info;      // int32 [L, R*M]
  Tensor packed_recv_layout_range;  // int64 [L, R]
  std::shared_ptr<const LowLatencyHandle> handle;
  // With return_recv_hook: launches the receive phase; call it once, before using the outputs and before the next
  // low-latency call (which is refused with FailedPrecondition until then). The Buffer must outlive it. Otherwise
  // empty.
  std::function<absl::Status(cudaStream_t)> recv_hook;
};

struct LowLatencyCombineArgs {
  TensorView x;             // bf16 [L, R*M, hidden] expert outputs (ignored with zero_copy)
  TensorView topk_idx;      // int64 [num_tokens, num_topk], the dispatch's
  TensorView topk_weights;  // float [num_tokens, num_topk]
  std::shared_ptr<const LowLatencyHandle> handle;
  bool zero_copy = false;  // outputs were written into NextLowLatencyCombineBuffer()
  bool return_recv_hook = false;
  // bf16 [num_tokens, hidden]: write the combined rows here (DeepEP's `out=`) instead of a new tensor; optional.
  TensorView out;
  // int64 [num_ranks], added to; optional (DeepEP's combine_wait_recv_cost_stats): per rank, the nanoseconds the
  // receive phase waited for its partial rows, at least 1 per wait (one wait per call).
  TensorView wait_recv_cost_stats;
};

struct LowLatencyCombineResult {
  Tensor combined_x;  // bf16 [num_tokens, hidden]
  std::function<absl::Status(cudaStream_t)> recv_hook;
};

class Buffer {
 public:
  // `lease` must outlive the Buffer. Checks that the regions are large enough for `config`.
  static absl::StatusOr<std::unique_ptr<Buffer>> Create(Lease* lease, BufferConfig config,
                                                        std::shared_ptr<Allocator> allocator = nullptr);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  int rank() const;
  int num_ranks() const;
  Backend backend() const;
  const BufferConfig& config() const;

  absl::StatusOr<DispatchLayout> GetDispatchLayout(const TensorView& topk_idx, cudaStream_t stream = nullptr);
  // Normal dispatch waits on the host for the received size (as DeepEP does), unless `cached` or num_worst_tokens.
  absl::StatusOr<DispatchResult> Dispatch(const DispatchArgs& args, cudaStream_t stream = nullptr);
  absl::StatusOr<CombineResult> Combine(const CombineArgs& args, cudaStream_t stream = nullptr);

  absl::StatusOr<LowLatencyDispatchResult> LowLatencyDispatch(const LowLatencyDispatchArgs& args,
                                                              cudaStream_t stream = nullptr);
  absl::StatusOr<LowLatencyCombineResult> LowLatencyCombine(const LowLatencyCombineArgs& args,
                                                            cudaStream_t stream = nullptr);
  // DeepEP's get_next_low_latency_combine_buffer: where expert outputs go for a zero-copy combine,
  // bf16 [L, R*M, hidden], inside this rank's region.
  TensorView NextLowLatencyCombineBuffer() const;
  // Low latency: the rank mask, int32 [num_ranks], nonzero = masked: nothing is sent to that rank, nothing awaited
  // from it, its expert outputs count as zero. A wait that times out sets its rank's entry; callers may set and
  // clear entries in stream order (DeepEP's mask-buffer calls, elastic EP). Device memory on cuda. Empty in normal
  // mode.
  TensorView LowLatencyRankMask() const;

  // cuda: synchronises `stream` and turns a kernel's timeout record into DeadlineExceeded naming the rank waited
  // for (then clears it). The asynchronous calls (combine, low latency) report timeouts here. Host: returns OK.
  absl::Status Check(cudaStream_t stream = nullptr);
  // After DeadlineExceeded: every rank calls Reset (no call of the group in flight) before the next operation.
  absl::Status Reset(cudaStream_t stream = nullptr);

  // ---- elastic EP (low latency; docs/elastic.md) ----
  // The ranks whose client attached after this Buffer's generation was taken (a replacement of a client that left):
  // they are ready to serve, and Rejoin brings them in. Ascending; empty when none (or before the first call, or in
  // normal mode). Reads the lease serials the daemon publishes; no daemon call.
  std::vector<int> RanksWaitingToRejoin() const;
  // Low latency: a new generation of the group with every rank's current client, taken at a call boundary that the
  // serving engine chose: EVERY rank calls it at the same point of its call sequence (the survivors between a
  // combine and the next dispatch; a replacement after Buffer::Create, before its first call). The masked ranks
  // that now have a client are unmasked, the call count starts again (the tags of the new generation), and the
  // next call routes to them. Nothing is re-allocated or zeroed and nothing waits on the peers: the tags keep every
  // earlier word from being read, and the double-buffer order is kept (the survivors' next call uses half 0, as a
  // fresh Buffer's first does). Waits (up to config.timeout) until every rank has a client; UNAVAILABLE naming those
  // that have none. A Buffer that made no call yet (the replacement's) also waits until every other rank began the
  // new generation's first dispatch (its peers must be done with the previous generation before it writes to them;
  // DEADLINE_EXCEEDED naming those that did not): so it is for joining running peers, never for ranks that all start
  // together. No rank waiting (the generation is unchanged): OK, nothing changes. FailedPrecondition in normal mode
  // (there every rank calls Reset), with a receive hook pending, or between a dispatch and its combine. The
  // replacement's side is implemented on the host backend within one host (UNIMPLEMENTED on cuda and across hosts
  // for now; the survivors' side works on every path).
  absl::Status Rejoin(cudaStream_t stream = nullptr);
  // Low latency: per rank 1 when it takes part in this Buffer's calls, 0 when it is masked (Mooncake EP's
  // active_ranks). A host copy of LowLatencyRankMask (cuda: after the calls queued on `stream`).
  absl::StatusOr<std::vector<int32_t>> ActiveRanks(cudaStream_t stream = nullptr) const;

  struct State;

 private:
  explicit Buffer(std::unique_ptr<State> state);
  // The calls without the data-path counters (buffer_stats.h), which the public ones add around them.
  absl::StatusOr<DispatchResult> DispatchUncounted(const DispatchArgs& args, cudaStream_t stream);
  absl::StatusOr<CombineResult> CombineUncounted(const CombineArgs& args, cudaStream_t stream);
  absl::StatusOr<LowLatencyDispatchResult> LowLatencyDispatchUncounted(const LowLatencyDispatchArgs& args,
                                                                       cudaStream_t stream);
  absl::StatusOr<LowLatencyCombineResult> LowLatencyCombineUncounted(const LowLatencyCombineArgs& args,
                                                                     cudaStream_t stream);
  // Starts counting into the lease's counters page (the outermost Buffer of a lease only).
  absl::Status CountInto(Lease* lease);
  std::unique_ptr<State> state_;
};

}  // namespace epfabric::client
