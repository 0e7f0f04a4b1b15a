// Low-latency (decoding) expert-parallel dispatch and combine over NVLink, in the style of DeepEP's
// low_latency_dispatch / low_latency_combine. Plain C++: raw device pointers, sizes and a cudaStream_t, so that the
// client library and tests include it without nvcc. docs/low-latency-kernels.md describes the algorithm and the
// exact output layout.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epfabric/kernels/common.h"
#include "epfabric/kernels/low_latency_layout.h"
#include "epfabric/kernels/status_word.h"

namespace epfabric::kernels {

// Validates the shape and computes the layout. Errors name the offending field and value.
absl::StatusOr<LowLatencyLayout> MakeLowLatencyLayout(int max_tokens_per_rank, int hidden, int num_ranks,
                                                      int num_experts);

// Source rank `src`'s slots in a full half of `layout` (a rank's region or an inbox).
LowLatencySlots LowLatencySourceSlots(const LowLatencyLayout& layout, int src);

// Bytes of one rank's region (what the daemon allocates per rank for a low-latency group).
absl::StatusOr<size_t> LowLatencyRegionBytes(int max_tokens_per_rank, int hidden, int num_ranks, int num_experts);

// Groups across hosts (host backend only, docs/internode-dispatch.md): called after this rank wrote `bytes` at
// `src_offset` of peer_regions[dst_rank] (its outbox for a rank on another host) so that the range is sent to
// `dst_offset` of dst_rank's inbox (the same slots in the full layout). Returns false when the send could not be
// queued (the caller records why).
using LowLatencyRemotePut = bool (*)(void* arg, int dst_rank, size_t src_offset, size_t dst_offset, size_t bytes);

// What a rank's kernels need to reach the group: its own and its peers' regions, the failure controls.
struct LowLatencyContext {
  int rank = 0;
  int num_ranks = 1;
  // Base of every rank's region as mapped in this process (index = rank; peer_regions[rank] is this rank's own).
  // Each region is one contiguous allocation of layout.total_bytes, zeroed before first use.
  void* peer_regions[kMaxLowLatencyRanks] = {};
  // CUDA, groups the kernels treat as wide (LowLatencyWideGroup: across hosts or past kMaxNvlPeers ranks): device
  // memory holding peer_regions[0 .. num_ranks), where the kernels read the addresses (their launch parameters hold
  // kMaxNvlPeers). LowLatencyRegionTable makes one. Not used by the host backend.
  void* const* peer_region_table = nullptr;
  LowLatencyLayout layout;
  // Optional device int32[num_ranks]: a nonzero entry masks that rank (no data is sent to it, nothing is awaited
  // from it, its expert outputs count as zero). A kernel that times out waiting for a rank sets its entry.
  int32_t* rank_mask = nullptr;
  // Device memory for the status word (required): a timed-out wait records who it waited for here.
  KernelStatus* status = nullptr;
  uint64_t timeout_ns = kDefaultWaitTimeoutNs;
  // Blocks per launch; 0 = the device's SM count.
  int num_blocks = 0;
  uint64_t* profile_ns = nullptr;  // benchmarks only: kernel timeline (see kProfileSlotsPerBlock in status_word.h)
  // Optional kLostRankWords words the daemon writes (status_word.h): a wait on a rank published as lost ends at once
  // and masks the rank (as a timeout does, but without failing the call). Device-readable for CUDA.
  const uint64_t* lost_ranks = nullptr;
  uint64_t lost_ignore[kLostRankWords] = {};  // see IntranodeGroup::lost_ignore
  // Across hosts: remote_ranks holds the ranks on other hosts. For such a rank r, peer_regions[r] is this rank's
  // outbox for it (two halves of layout.outbox_half_bytes) in its RDMA region, and what r sends this rank is read from
  // remote_inbox (the full layout, halves only) instead of peer_regions[rank]. The host backend calls remote_put (when
  // set) after every write into an outbox; without it the calling thread (cuda's relay) or an issue kernel sends the
  // staged bytes after each step.
  LowLatencyRankSet remote_ranks;
  void* remote_inbox = nullptr;
  LowLatencyRemotePut remote_put = nullptr;
  void* remote_put_arg = nullptr;
};

// Whether the kernels take `ctx`'s group as wide (their second instantiation: ranks on other hosts, or more than
// kMaxNvlPeers ranks), which needs ctx.peer_region_table on CUDA.
bool LowLatencyWideGroup(const LowLatencyContext& ctx);

// Device memory holding a context's peer_regions (LowLatencyContext::peer_region_table), freed with this object.
class LowLatencyRegionTable {
 public:
  // On the current device: `ctx.peer_regions[0 .. ctx.num_ranks)` as they are now, copied on `stream` (waited for;
  // a non-blocking stream keeps the copy from waiting for other streams' kernels, e.g. another rank's in this process).
  static absl::StatusOr<LowLatencyRegionTable> Create(const LowLatencyContext& ctx, cudaStream_t stream);
  LowLatencyRegionTable() = default;
  LowLatencyRegionTable(LowLatencyRegionTable&& other) noexcept : table_(other.table_) { other.table_ = nullptr; }
  LowLatencyRegionTable& operator=(LowLatencyRegionTable&& other) noexcept;
  LowLatencyRegionTable(const LowLatencyRegionTable&) = delete;
  LowLatencyRegionTable& operator=(const LowLatencyRegionTable&) = delete;
  ~LowLatencyRegionTable();
  void* const* get() const { return table_; }

 private:
  void** table_ = nullptr;
};

// Which phases a launch runs. kSendAndRecv is the ordinary call; with a receive hook the caller launches kSend,
// which returns as soon as everything is issued, and later kRecv (the hook), so that no SM waits in between.
// Dispatch's send phase waits for nothing remote. Combine's send phase waits (bounded) for the peers' top-k weights,
// which each rank publishes at the start of its own combine send phase: launch the combine send phases of all ranks
// close together. Rule of the double buffer: a call's receive phase must have run before the next call's send
// phase on the same rank (the next call cleans the half this call used).
//
// Across hosts on the cuda backend the calling thread relays each step's bytes between launches
// (client/internode_low_latency_cuda.cc), so combine's send phase is split in two: kCombineWeights cleans the other
// half and publishes the weights only; kSendWeightsPublished is the rest of the send phase (it neither cleans nor
// publishes). Dispatch and the host backend take only kSend, kRecv and kSendAndRecv.
enum class LowLatencyPhases : int32_t {
  kSend = 1,
  kRecv = 2,
  kSendAndRecv = 3,
  kCombineWeights = 4,
  kSendWeightsPublished = 9,  // kSend | 8
};
// Whether a call with these phases sends (kSend, kSendAndRecv, kSendWeightsPublished) or receives.
constexpr bool LowLatencySends(LowLatencyPhases phases) {
  return (static_cast<int32_t>(phases) & static_cast<int32_t>(LowLatencyPhases::kSend)) != 0;
}
constexpr bool LowLatencyReceives(LowLatencyPhases phases) {
  return (static_cast<int32_t>(phases) & static_cast<int32_t>(LowLatencyPhases::kRecv)) != 0;
}

// The double-buffer half a call uses. Consecutive low-latency calls (dispatch or combine) of a group must alternate
// halves on every rank in the same order; LowLatencyBufferCursor does that.
// The tag of the call with index `call_index` (0 for the first call after a Buffer was made or reset) in a group whose
// members agreed on `generation` (a digest of every rank's lease serial): a 32-bit mix, never 0.
uint32_t LowLatencyCallTag(uint64_t generation, uint64_t call_index);

class LowLatencyBufferCursor {
 public:
  int Next() {
    const int half = next_;
    next_ ^= 1;
    return half;
  }
  int Peek() const { return next_; }

 private:
  int next_ = 0;
};

// What combine needs from the dispatch it follows (all device memory written by dispatch's receive phase).
struct LowLatencyHandle {
  const int32_t* packed_recv_src_info = nullptr;      // [L][R*M] source token index
  const int64_t* packed_recv_layout_range = nullptr;  // [L][R] (begin << 32) | count
  const int32_t* packed_recv_topk_slot = nullptr;     // [L][R*M] first top-k position of the expert in the token
  const int32_t* packed_recv_token_map = nullptr;     // [R][M][kLowLatencyMaxTopk] packed slot or -1
  int num_tokens = 0;                                 // tokens this rank dispatched
};

struct LowLatencyDispatchArgs {
  const void* x = nullptr;            // bf16 [num_tokens, hidden]
  const int64_t* topk_idx = nullptr;  // int64 [num_tokens, num_topk]; -1 = no expert
  int num_tokens = 0;
  int num_topk = 0;
  int hidden = 0;
  int max_tokens_per_rank = 0;
  int num_experts = 0;
  bool use_fp8 = true;
  bool round_scale = false;             // scales rounded up to powers of two
  bool use_ue8m0 = false;               // scales as packed 8-bit exponents (needs round_scale and hidden % 512 == 0)
  int32_t* cumulative_stats = nullptr;  // optional int32 [num_local_experts], received counts are added
  // Optional uint64 [num_local_experts], received counts are added too: the Buffer's own totals for the daemon's
  // expert-load metrics (kernels/datapath_stats.h), device memory (cuda) or host memory (host backend).
  uint64_t* expert_load = nullptr;
  // Optional int64 [num_ranks] (DeepEP's dispatch_wait_recv_cost_stats), added to: per source rank, the nanoseconds
  // (%globaltimer; steady_clock on the host backend) the receive phase waited for that rank's count, one wait per
  // (local expert, source rank), each at least 1 ns. Masked ranks add nothing; a timed-out wait adds its duration.
  int64_t* wait_recv_cost_ns = nullptr;

  // Outputs (device memory, caller-allocated). L = num_local_experts, R = num_ranks, M = max_tokens_per_rank,
  // G = hidden / 128.
  void* packed_recv_x = nullptr;         // fp8 or bf16 [L][R*M][hidden]
  void* packed_recv_x_scales = nullptr;  // fp8 only. float: [L][G][R*M] (logical [L, R*M, G], token-minor);
                                         // ue8m0: int32 [L][G/4][R*M] (4 exponent bytes per int32)
  int32_t* packed_recv_count = nullptr;  // [L]
  int32_t* packed_recv_src_info = nullptr;
  int64_t* packed_recv_layout_range = nullptr;
  int32_t* packed_recv_topk_slot = nullptr;
  // [R][M][kLowLatencyMaxTopk]: for source rank s, token t and top-k position k (first occurrence of an expert of
  // this rank), the packed index local_expert * R * M + slot; -1 elsewhere. Combine reduces through it.
  int32_t* packed_recv_token_map = nullptr;

  int buffer_half = 0;
  // The tag every signal of this call carries (low_latency_layout.h): the same on every rank for the same call, never
  // 0. LowLatencyCallTag makes it from the group's generation and the call's index.
  uint32_t call_tag = 1;
  LowLatencyPhases phases = LowLatencyPhases::kSendAndRecv;
  // DeepEP's traffic, kept to measure the design choice (docs/low-latency-kernels.md): the message of a token is
  // sent once per (token, expert) instead of once per (token, destination rank). The extra copies land in the same
  // slot, so every output is identical; only NVLink carries more bytes.
  bool message_per_expert = false;
};

struct LowLatencyCombineArgs {
  const void* x = nullptr;  // bf16 [L][R*M][hidden] expert outputs (ignored when zero_copy)
  const int64_t* topk_idx = nullptr;
  const float* topk_weights = nullptr;  // [num_tokens, num_topk]
  int num_tokens = 0;
  int num_topk = 0;
  int hidden = 0;
  int max_tokens_per_rank = 0;
  int num_experts = 0;
  LowLatencyHandle handle;
  // The expert outputs were written into LowLatencyCombineInputBuffer() instead of x.
  bool zero_copy = false;
  void* combined_x = nullptr;  // bf16 [num_tokens, hidden]
  // Optional int64 [num_ranks] (DeepEP's combine_wait_recv_cost_stats), added to: per rank, the nanoseconds the
  // receive phase waited for that rank's partial rows (its combine flag), one wait per call, at least 1 ns.
  int64_t* wait_recv_cost_ns = nullptr;
  int buffer_half = 0;
  // The tag every signal of this call carries (low_latency_layout.h): the same on every rank for the same call, never
  // 0. LowLatencyCallTag makes it from the group's generation and the call's index.
  uint32_t call_tag = 1;
  LowLatencyPhases phases = LowLatencyPhases::kSendAndRecv;
};

// Checks everything that can be checked without reading device memory. Returns InvalidArgumentError naming the
// field and its value. (Expert indices live on the device; out-of-range entries are treated as -1 by the kernels
// and by the host reference.)
// The scale options of a dispatch (also checked by callers before they launch anything): use_ue8m0 needs use_fp8 and
// round_scale, and a hidden size that is a multiple of 512 (4 scales per int32).
absl::Status CheckLowLatencyScaleOptions(bool use_fp8, bool round_scale, bool use_ue8m0, int hidden);
absl::Status ValidateLowLatencyDispatch(const LowLatencyContext& ctx, const LowLatencyDispatchArgs& args);
// Loads the low-latency kernels on the current device (see IntranodePreloadKernels, intranode.h).
absl::Status LowLatencyPreloadKernels();
absl::Status ValidateLowLatencyCombine(const LowLatencyContext& ctx, const LowLatencyCombineArgs& args);

// Launch on `stream`. No host synchronisation: capturable into a CUDA graph (the buffer half is baked into the
// captured launch, so capture an even number of calls or a fixed sequence). Wait-timeouts are reported through
// ctx.status after the stream completes, not through the returned status.
absl::Status LowLatencyDispatch(const LowLatencyContext& ctx, const LowLatencyDispatchArgs& args, cudaStream_t stream);
absl::Status LowLatencyCombine(const LowLatencyContext& ctx, const LowLatencyCombineArgs& args, cudaStream_t stream);

// DeepEP's get_next_low_latency_combine_buffer: where a caller writes expert outputs for a zero-copy combine,
// bf16 [L][R*M][hidden]. One buffer, not per half: combine reads it and writes straight into the peers.
void* LowLatencyCombineInputBuffer(const LowLatencyContext& ctx);

}  // namespace epfabric::kernels
