// Device-side pieces shared by the low-latency dispatch and combine kernels: region addressing, rank masks, the
// launch shape (cooperative: every block must be resident because blocks wait for work done by other blocks).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "api/launch.h"
#include "bounded_wait.cuh"
#include "epfabric/kernels/device/ptx.cuh"
#include "epfabric/kernels/low_latency_layout.h"
#include "launch.cuh"
#include "profile.cuh"

namespace epfabric::kernels::low_latency {

inline constexpr int kThreadsPerBlock = 512;
inline constexpr int kWarpsPerBlock = kThreadsPerBlock / 32;
// Receive/combine-send work items are (local expert, source rank) pairs; up to this many warps share one.
inline constexpr int kMaxWarpsPerItem = 8;

// The kernels come in two instantiations (kWide): one NVLink domain of at most kMaxNvlPeers ranks (32-bit rank sets in
// registers, region addresses in the launch parameters, no outboxes: the code as lean as before groups spanned hosts),
// and any group (across hosts or past kMaxNvlPeers ranks, up to kMaxLowLatencyRanks: region addresses from a device
// table, the masked ranks in shared memory, outboxes for ranks on other hosts). WideGroup says which a group needs.
inline bool WideGroup(const GroupView& g) { return !g.remote.empty() || g.num_ranks > kMaxNvlPeers; }
static_assert(kMaxLowLatencyRanks <= kThreadsPerBlock, "the per-rank signal loops take one thread per rank");
static_assert(kMaxLowLatencyRanks <= 32 * kWarpsPerBlock, "read_masked_ranks takes one warp per 32 ranks");

// Rank r's region: from the launch parameters (one NVLink domain) or the device table (wide).
template <bool kWide>
__device__ __forceinline__ uint8_t* region(const GroupView& g, int r) {
  if constexpr (kWide) {
    return reinterpret_cast<uint8_t*>(__ldg(reinterpret_cast<const unsigned long long*>(g.region_table) + r));
  } else {
    return g.regions[r];
  }
}
// Addressing the double buffer of rank r (GroupView, api/launch.h) and the phases of the call.
template <bool kWide>
__device__ __forceinline__ uint8_t* half_base(const GroupView& g, int r) {
  return region<kWide>(g, r) + g.layout.half_bytes * g.half;
}
__device__ __forceinline__ uint8_t* own_half(const GroupView& g) { return g.self + g.layout.half_bytes * g.half; }
__device__ __forceinline__ uint8_t* own_other_half(const GroupView& g) {
  return g.self + g.layout.half_bytes * (g.half ^ 1);
}
// Where what rank s sent this rank lies: this rank's own half, or the inbox when s is on another host.
__device__ __forceinline__ bool is_remote(const GroupView& g, int r) { return g.remote.has(r); }
template <bool kWide>
__device__ __forceinline__ const uint8_t* in_half(const GroupView& g, int s) {
  const uint8_t* base = kWide && is_remote(g, s) ? g.inbox : g.self;
  return base + g.layout.half_bytes * g.half;
}

// Where this rank writes its slots of rank r's half in this call: r's region (same host), or this rank's outbox for
// r (another host: the slots are then compact, and an issuer puts them into r's inbox). Each field picks its offset
// by value: a pointer to one of the two slot structs would make the compiler copy them out of the parameter space.
struct DstHalf {
  const GroupView& g;
  uint8_t* base;
  bool remote;

  __device__ __forceinline__ size_t pick(size_t outbox, size_t own) const { return remote ? outbox : own; }
  __device__ __forceinline__ uint8_t* msg(int t, size_t msg_bytes) const {
    return base + pick(g.layout.outbox.msgs, g.own.msgs) + t * msg_bytes;
  }
  __device__ __forceinline__ int32_t* table(int local) const {
    return reinterpret_cast<int32_t*>(base + pick(g.layout.outbox.table, g.own.table) +
                                      local * pick(g.layout.outbox.table_stride, g.own.table_stride));
  }
  __device__ __forceinline__ int64_t* count(int local) const {
    return reinterpret_cast<int64_t*>(base + pick(g.layout.outbox.count, g.own.count) +
                                      local * pick(g.layout.outbox.count_stride, g.own.count_stride));
  }
  __device__ __forceinline__ float* weights(int t) const {
    return reinterpret_cast<float*>(base + pick(g.layout.outbox.weights, g.own.weights)) +
           static_cast<size_t>(t) * kLowLatencyMaxTopk;
  }
  __device__ __forceinline__ int32_t* weights_flag() const {
    return reinterpret_cast<int32_t*>(base + pick(g.layout.outbox.weights_flag, g.own.weights_flag));
  }
  __device__ __forceinline__ int32_t* combine_flag() const {
    return reinterpret_cast<int32_t*>(base + pick(g.layout.outbox.combine_flag, g.own.combine_flag));
  }
  __device__ __forceinline__ uint8_t* recv_row(int t) const {
    return base + pick(g.layout.outbox.recv, g.own.recv) + t * pick(g.layout.outbox.recv_stride, g.own.recv_stride);
  }
};
// Within one NVLink domain (!kWide) `remote` is false at compile time and every field is the own slots' (no choice
// at run time, which would make the compiler read the slot offsets through generic pointers).
template <bool kWide>
__device__ __forceinline__ DstHalf dst_half(const GroupView& g, int r) {
  if (kWide && is_remote(g, r)) return DstHalf{g, region<kWide>(g, r) + g.layout.outbox_half_bytes * g.half, true};
  return DstHalf{g, half_base<kWide>(g, r), false};
}

__device__ __forceinline__ bool sends(const GroupView& g) { return (g.phases & 1) != 0; }
__device__ __forceinline__ bool receives(const GroupView& g) { return (g.phases & 2) != 0; }
// Combine across hosts (LowLatencyPhases): a launch that only cleans and publishes the weights, and a send phase
// whose weights a launch like that already published.
__device__ __forceinline__ bool weights_only(const GroupView& g) { return g.phases == 4; }
__device__ __forceinline__ bool weights_published(const GroupView& g) { return (g.phases & 8) != 0; }

// The ranks a kernel skips (masked: set in rank_mask, or given up on during this launch), read at kernel start.
// One NVLink domain: a register per thread. Wide: one bit per rank in shared memory, shared by the block.
template <bool kWide>
struct MaskedRanks;
template <>
struct MaskedRanks<false> {
  unsigned int bits;
  __device__ __forceinline__ bool has(int r) const { return ((bits >> r) & 1u) != 0; }
  __device__ __forceinline__ void add(int r) { bits |= 1u << r; }
};
template <>
struct MaskedRanks<true> {
  uint32_t* words;  // shared memory, kMaxLowLatencyRanks / 32
  __device__ __forceinline__ bool has(int r) const { return ((words[r >> 5] >> (r & 31)) & 1u) != 0; }
  __device__ __forceinline__ void add(int r) { atomicOr(words + (r >> 5), 1u << (r & 31)); }
};

// Reads g.rank_mask (nonzero = masked). Wide: every thread of the block must call it (a block barrier).
template <bool kWide>
__device__ __forceinline__ MaskedRanks<kWide> read_masked_ranks(const GroupView& g) {
  if constexpr (kWide) {
    __shared__ uint32_t words[kMaxLowLatencyRanks / 32];
    const int warp = threadIdx.x / 32, r = warp * 32 + threadIdx.x % 32;
    if (warp < kMaxLowLatencyRanks / 32) {
      const bool masked = g.rank_mask != nullptr && r < g.num_ranks && g.rank_mask[r] != 0;
      const uint32_t bits = __ballot_sync(0xffffffffu, masked);
      if (threadIdx.x % 32 == 0) words[warp] = bits;
    }
    __syncthreads();
    return MaskedRanks<true>{words};
  } else {
    unsigned int bits = 0;
    if (g.rank_mask == nullptr) return MaskedRanks<false>{bits};
    // Eight loads in flight at once (the whole domain).
    int32_t values[kMaxNvlPeers];
#pragma unroll
    for (int i = 0; i < kMaxNvlPeers; ++i) values[i] = i < g.num_ranks ? g.rank_mask[i] : 0;
#pragma unroll
    for (int i = 0; i < kMaxNvlPeers; ++i) bits |= values[i] != 0 ? 1u << i : 0u;
    return MaskedRanks<false>{bits};
  }
}

// The distinct ranks among a warp's lanes' `r` (-1: none), minus the masked ones, taken in increasing order by next()
// (-1 when none is left). The whole warp calls next() together. One NVLink domain: a 32-bit set; wide: each lane
// keeps its own rank and next() takes the minimum over the warp.
template <bool kWide>
struct TokenRanks;
template <>
struct TokenRanks<false> {
  unsigned int bits;
  __device__ __forceinline__ int next() {
    if (bits == 0) return -1;
    const int r = __ffs(static_cast<int>(bits)) - 1;
    bits &= bits - 1;
    return r;
  }
};
template <>
struct TokenRanks<true> {
  unsigned int r;  // this lane's rank, or UINT_MAX
  __device__ __forceinline__ int next() {
    const unsigned int lowest = __reduce_min_sync(0xffffffffu, r);
    if (lowest == 0xffffffffu) return -1;
    if (r == lowest) r = 0xffffffffu;
    return static_cast<int>(lowest);
  }
};
template <bool kWide>
__device__ __forceinline__ TokenRanks<kWide> token_ranks(int r, const MaskedRanks<kWide>& masked) {
  if constexpr (kWide) {
    return TokenRanks<true>{r >= 0 && !masked.has(r) ? static_cast<unsigned int>(r) : 0xffffffffu};
  } else {
    return TokenRanks<false>{__reduce_or_sync(0xffffffffu, r >= 0 ? 1u << r : 0u) & ~masked.bits};
  }
}

// After a timeout waiting for `peer`, later calls skip it (Mooncake EP's rank masking).
__device__ __forceinline__ void mask_rank(const GroupView& g, int peer) {
  if (g.rank_mask != nullptr) atomicExch(g.rank_mask + peer, 1);
}

// Whether rank r is masked now, including by a wait of this launch that gave up on it (mask_rank). Read after the
// local work counter was acquired, which orders the masking warps' writes before this read.
__device__ __forceinline__ bool masked_now(const GroupView& g, int r) {
  return g.rank_mask != nullptr && ptx::ld_volatile_global(g.rank_mask + r) != 0;
}

// Whether this rank may still raise signals. A Buffer that masks lost ranks (rank_mask set) goes on without the ranks
// it gave up on. One that does not must fail the call on every rank: after any recorded failure (this launch's or an
// earlier one's not yet reported) it raises no signal, so no peer returns data that depends on what this rank
// skipped; the peers' waits end in their own error.
__device__ __forceinline__ bool may_signal(const GroupView& g) {
  return g.rank_mask != nullptr || !status_failed(g.status);
}

// Zeroes the signals of the half the previous call used (and the next call will use). Called by every block at the
// start of a send phase; block `cleaning_block` does the work (a block that is otherwise idle or not on the critical
// path), and its completion is counted into `done_counter` so that no signal leaves this rank before the cleaning is
// visible (peers may write into the cleaned half as soon as they see this call's signals). A GPU-scope release is
// enough for the count: the signals that follow leave with a system-scope release by a thread that acquired it, and
// causality is transitive (a system-scope release here cost block 0 about 2 us, 2 x H100).
// `fill`/`fill_count` (optional) is another local array that must be set to -1 before this call's receive phase.
template <bool kWide>
__device__ __forceinline__ void clean_other_half_signals(const GroupView& g, int32_t* done_counter,
                                                         int32_t* fill = nullptr, int fill_count = 0,
                                                         int cleaning_block = 0) {
  if (static_cast<int>(blockIdx.x) != cleaning_block) return;
  int32_t* signals = reinterpret_cast<int32_t*>(own_other_half(g));
  const int num_ints = static_cast<int>(g.layout.signal_bytes / sizeof(int32_t));
  for (int i = threadIdx.x; i < num_ints; i += blockDim.x) signals[i] = 0;
  // Across hosts: the inbox's other half, and that of every outbox (an issuer sends an outbox's signal only when it
  // is nonzero, so a stale one from two calls ago must not survive).
  if (kWide && !g.remote.empty()) {
    int32_t* inbox = reinterpret_cast<int32_t*>(g.inbox + g.layout.half_bytes * (g.half ^ 1));
    for (int i = threadIdx.x; i < num_ints; i += blockDim.x) inbox[i] = 0;
    const int outbox_ints = static_cast<int>(g.layout.outbox_signal_bytes / sizeof(int32_t));
    for (int r = 0; r < g.num_ranks; ++r) {
      if (!is_remote(g, r)) continue;
      int32_t* outbox = reinterpret_cast<int32_t*>(region<kWide>(g, r) + g.layout.outbox_half_bytes * (g.half ^ 1));
      for (int i = threadIdx.x; i < outbox_ints; i += blockDim.x) outbox[i] = 0;
    }
  }
  for (int i = threadIdx.x; i < fill_count; i += blockDim.x) fill[i] = -1;
  __syncthreads();
  if (threadIdx.x == 0) ptx::red_add_release_gpu_global(done_counter, 1);
}

// Waits (bounded) until the call's local work counter `done` reaches `target`. The counter lives in this rank's region,
// which peers can write: a value past `target` (the call's exact total) or negative is stale or corrupt and would
// release the wait early, so it is recorded. Returns 1 when reached, 0 on timeout (recorded), -1 for a bad counter:
// the caller then sends no signal (a peer waiting for it times out instead of reading data that may be incomplete).
__device__ __forceinline__ int wait_local_done(const GroupView& g, const int32_t* done, int target, WaitSite site,
                                               int channel) {
  int32_t value = 0;
  const bool reached = bounded_wait(
      [&] {
        value = ptx::ld_acquire_gpu_global(done);
        return value >= target || value < 0;
      },
      g.timeout_ns, g.status, site, g.rank, g.rank, channel);
  if (!reached) return 0;
  return check_peer_value(g.status, PeerDataField::kLowLatencyDoneCounter, g.rank, g.rank, -1, value, target, target)
             ? 1
             : -1;
}

// DeepEP's wait-cost statistics: adds the nanoseconds since `start` (%globaltimer), at least 1 so that every wait on
// a rank shows even when its data was already there (the timer may tick coarser than a short wait).
__device__ __forceinline__ void add_wait_cost(int64_t* cost, uint64_t start) {
  const uint64_t waited = ptx::global_timer_ns() - start;
  atomicAdd(reinterpret_cast<unsigned long long*>(cost), static_cast<unsigned long long>(waited > 0 ? waited : 1));
}

// Copies `num_int4` 16-byte words from local memory that peers wrote (volatile: never a stale L1 line), with
// kBatch loads in flight per lane.
template <int kBatch = 16>
__device__ __forceinline__ void warp_copy_volatile(int4* dst, const int4* src, int num_int4, int lane) {
  for (int base = 0; base < num_int4; base += 32 * kBatch) {
    int4 v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * 32 + lane;
      if (i < num_int4) v[u] = ptx::ld_volatile_global(src + i);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * 32 + lane;
      if (i < num_int4) ptx::st_na_global(dst + i, v[u]);
    }
  }
}

__device__ __forceinline__ float bf16_bits_to_float(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

// Round-to-nearest-even float -> bf16 bits (same as host::FloatToBf16 for finite values and NaN).
__device__ __forceinline__ uint32_t float_to_bf16_bits(float v) {
  const uint32_t bits = __float_as_uint(v);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (bits >> 16) | 0x40u;
  return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
}

// Benchmarks' timeline: the latest time a warp of this block reached `step` (nothing when profiling is off).
__device__ __forceinline__ void mark_step(const GroupView& g, LowLatencyStep step) {
  profile_latest(g.profile, static_cast<int>(step));
}
static_assert(static_cast<int>(LowLatencyStep::kDispatchDataStored) >= 2 + kWarpsPerBlock,
              "the step slots follow the warps' end slots");

// One cooperative grid of `num_blocks` x kThreadsPerBlock.
inline LaunchShape cooperative_shape(int num_blocks) {
  return LaunchShape{.blocks = num_blocks, .threads = kThreadsPerBlock, .cooperative = true};
}

}  // namespace epfabric::kernels::low_latency
