// The status word that every bounded wait in a kernel reports into, and the other constants host and device code
// share. Device-safe: no absl, no std library beyond fixed-width integers, so that .cu files can include it.
#pragma once

#include <cstdint>

namespace epfabric::kernels {

// Default bound for every spin-wait in a kernel. A wait that runs longer records who it waited for in the
// KernelStatus and makes the kernel exit; the host turns that into absl::DeadlineExceededError.
inline constexpr uint64_t kDefaultWaitTimeoutNs = 5ull * 1000 * 1000 * 1000;

// The maximum number of same-host peers a kernel addresses through NVLink (DGX/HGX boxes have 8 GPUs).
inline constexpr int kMaxNvlPeers = 8;

// Kernel timelines for benchmarks (optional `profile_ns` of IntranodeGroup and LowLatencyContext): device memory of
// uint64 [blocks][kProfileSlotsPerBlock], %globaltimer nanoseconds. Per block: slot 0 = entry, slot 1 = end of the
// block's start-up (intranode: after the barrier and the slot scan; low latency: end of the send phase of the
// block's last warp, written by each warp that sends, so it is the latest), slot 2 + w = when warp w finished.
// Production leaves it null (the kernels then skip every mark).
inline constexpr int kProfileSlotsPerBlock = 34;
// The low-latency kernels have 16 warps per block and use the slots past their warps' for steps inside the kernel, each
// holding the latest time any warp of the block reached it (the benchmark prints them as the timeline's rows).
enum class LowLatencyStep : int {
  kDispatchDataStored = 18,  // a data warp stored its last message piece
  kDispatchTableWritten,     // a routing warp wrote its expert's token list
  kDispatchItemsCounted,     // a routing warp saw every data item of the call counted
  kDispatchCountSent,        // a routing warp published its expert's count
  kDispatchCountsArrived,    // a receiving warp holds every source's count for its expert
  kCombineWeightsSent,       // block 0 published its weights (across hosts: raised the weights flags)
  kCombineOwnRowsSent,       // a warp stored a partial row of one of this rank's own tokens
  kCombineWeightsArrived,    // a warp holds a peer token's weights (one NVLink domain) or saw the weights flag
  kCombinePeerRowsSent,      // a warp stored a partial row of a peer's token
  kCombineItemsCounted,      // block 0 saw every item of the call counted
  kCombineFlagsSent,         // block 0 raised the combine flags
  kCombineFlagsArrived,      // a block holds every rank's combine flag
  kCombineRowsGathered,      // a send warp holds an item's expert rows and weights (it starts summing)
  kEnd,
};
static_assert(static_cast<int>(LowLatencyStep::kEnd) <= kProfileSlotsPerBlock);

// Where a bounded wait timed out. Values are stable: they appear in logs and error messages.
enum class WaitSite : int32_t {
  kNone = 0,
  kBarrier = 1,            // cross-rank barrier signal
  kNotifyCounts = 2,       // notify: per-rank/per-expert counts from a peer
  kDispatchFifoSpace = 3,  // dispatch sender: room in the peer's FIFO (head not advanced)
  kDispatchFifoData = 4,   // dispatch receiver: data in the FIFO (tail not advanced)
  kCombineFifoSpace = 5,
  kCombineFifoData = 6,
  kLowLatencyRecvCount = 7,  // low-latency receive: per-expert count flag from a peer
  kLowLatencyCombineFlag = 8,
  kTransportRingSpace = 9,  // transport issuer: a free slot in the command ring (the daemon did not consume)
  kTransportQuiet = 10,     // transport quiet: completion of the ring's commands (peer_rank: waiting_rank)
  // Internode normal mode in worst-case mode (the RDMA stage's waits on the device); channel = the peer's host.
  kInternodeDispatchRows = 11,  // the rows a peer on another host put into this rank's slabs
  kInternodeSlabFree = 12,      // a gateway on another host copied out this rank's previous rows
  kInternodeCombineRows = 13,   // the reduced rows a gateway on another host put back
};

// A value read from peer-writable memory (a region any rank of the group can write) that lies outside its valid
// range: a stale peer (leftovers of an earlier run), a buggy or a malicious one. The reader never uses such a value
// as a size, index or offset: it records it (code kKernelStatusBadPeerData) and treats the item as empty. Values are
// stable: they appear in logs and error messages. docs/data-layout.md ("Untrusted values") lists every check.
enum class PeerDataField : int32_t {
  kNone = 0,
  kNotifyRankCount = 1,     // notify: tokens a source sends to a rank; index = destination rank
  kNotifyExpertCount = 2,   // notify: top-k entries of a source for a local expert; index = local expert
  kDispatchRangeBegin = 3,  // dispatch: first slot of a channel's range; index = channel
  kDispatchRangeEnd = 4,    // dispatch: end of a channel's range; index = channel
  kDispatchTail = 5,        // dispatch: rows a sender says it made visible; index = channel
  kDispatchSrcIdx = 6,      // dispatch: a received row's token index on its source; index = channel
  kDispatchTopkIdx = 7,     // dispatch: a received row's local expert id; index = channel
  kCombineTail = 8,         // combine: slot end a peer says it made visible; index = channel
  kCombineRange = 9,        // combine: a channel's slot range from the dispatch that filled the handle; index = channel
  kLowLatencyRecvCount = 10,      // low-latency dispatch: tokens of a source for a local expert; index = local expert
  kLowLatencyRoutingToken = 11,   // low-latency dispatch: token of a routing entry; index = local expert
  kLowLatencyRoutingTopk = 12,    // low-latency dispatch: top-k position of a routing entry; index = local expert
  kBarrierArrivals = 13,          // barrier: a peer's arrivals minus this rank's completed barriers; index = lane
  kLowLatencyDoneCounter = 14,    // low latency: the call's local work counter (in the own region); index = -1
  kInternodeRowCount = 15,        // internode worst-case dispatch: rows a peer on another host sent; index = its host
  kInternodeCachedRowCount = 16,  // the same, in a cached dispatch: must equal the cached handle's; index = host
};

// Written by a kernel when a bounded wait expires or when it reads a bad value from peer-writable memory. It lives
// in memory the host can read after the stream is synchronised (device memory copied back, or mapped pinned host
// memory). All fields are written by the first thread that fails (it claims `code` with an atomic
// compare-and-swap); later failures leave the record alone so that the root cause is reported, not its consequences.
struct KernelStatus {
  int32_t code;          // kKernelStatusOk, kKernelStatusTimeout, kKernelStatusBadPeerData, kKernelStatusRecvCapacity
  int32_t site;          // WaitSite (timeout), PeerDataField (bad peer data) or CapacitySite (recv capacity)
  int32_t waiting_rank;  // the rank whose kernel timed out / read the bad value / had too little room
  int32_t peer_rank;     // the rank it waited for / that wrote the value (-1 when not one rank)
  int32_t channel;       // channel / expert / block index, -1 when not meaningful (see PeerDataField)
  int32_t value;         // bad peer data: the value read (saturated to int32); recv capacity: rows received
  int32_t min_value;     // bad peer data: the valid range, inclusive
  int32_t max_value;     // recv capacity: the rows there is room for
};
static_assert(sizeof(KernelStatus) == 32);

inline constexpr int32_t kKernelStatusOk = 0;
inline constexpr int32_t kKernelStatusTimeout = 1;
inline constexpr int32_t kKernelStatusBadPeerData = 2;
// A bounded wait ended because the daemon published the awaited rank as lost (its lease ended or its daemon went
// down; see kMaxLostRanks): site, waiting_rank, peer_rank and channel as for a timeout.
inline constexpr int32_t kKernelStatusPeerLost = 3;

// The lost-ranks words (optional `lost_ranks` of IntranodeGroup and LowLatencyContext): bit r of word r / 64 set =
// group rank r is lost. The daemon writes them into memory the client maps (the rank's counters page, see
// datapath_stats.h) as soon as it learns of the loss, and clears the bit when the rank is back; bounded waits on a
// rank poll its bit alongside their timer, so a survivor stops waiting within about a millisecond of the daemon
// knowing instead of at its timeout. Ranks >= kMaxLostRanks are never reported.
inline constexpr int kMaxLostRanks = 256;
inline constexpr int kLostRankWords = kMaxLostRanks / 64;
// Worst-case (num_worst_tokens) mode: this rank receives more rows than its outputs were allocated for. The host did
// not wait for the count, so only the kernel can tell; it then moves nothing (absl::ResourceExhaustedError; its peers
// time out waiting for it, and every rank calls Reset, as after a timeout).
inline constexpr int32_t kKernelStatusRecvCapacity = 4;
// A bounded wait ended because the awaited rank left the call: its own call failed (e.g. in a group across hosts its
// wait for a lost rank on another host ended; its own error names the cause) and it will not arrive before every rank
// resets: site, waiting_rank, peer_rank and channel as for a timeout (IntranodeAbandonCall, both backends).
inline constexpr int32_t kKernelStatusPeerLeftCall = 5;
// What IntranodeAbandonCall adds to a rank's barrier arrival counters at its peers: far more arrivals than a live rank
// can be ahead (at most 2), so a waiting peer tells "left" from "arrived" and from a corrupt count.
inline constexpr int32_t kAbandonArrivals = 1 << 20;

// Which call found too little room (KernelStatus.site with kKernelStatusRecvCapacity).
enum class CapacitySite : int32_t {
  kDispatch = 1,  // the recv tensors (recv_capacity rows)
  kCombine = 2,   // x (the handle's num_recv_tokens rows)
};

// What notify writes into its mapped host counter (host_num_recv_tokens) instead of a count when it read a bad count
// from a peer: the host's wait (IntranodeWaitRecvCounts) ends at once, and the status word names the peer.
inline constexpr int32_t kRecvCountBadPeerData = -2;
// ... and this when its barrier failed (a timeout or a lost peer, recorded in the status word).
inline constexpr int32_t kRecvCountKernelFailed = -3;

}  // namespace epfabric::kernels
