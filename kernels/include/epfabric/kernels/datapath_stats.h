// The data path's counters, published without any RPC: each rank's lease holder writes them into a small host page
// that its daemon owns (RegionDescriptor::KIND_STATS, a sealed memfd mapped by both), and the daemon reads them when
// it is scraped (docs/operations.md, "Data-path metrics"). One writer (the client's Buffer, under its own
// serialisation), one reader; every field is a 64-bit word updated and read with relaxed atomics, so a scrape sees
// each counter whole, if not all of them from the same instant. The daemon treats the page as untrusted input: a
// client can only misreport its own group's numbers.
#pragma once

#include <cstddef>
#include <cstdint>

#include "epfabric/kernels/status_word.h"

namespace epfabric::kernels {

// "EFSTATS2", little endian. Version 2 split the per-expert counts by mode (a low-latency group may serve both); the
// daemon skips a page of another version (a client library of another release): no data-path metrics for it.
inline constexpr uint64_t kDataPathStatsMagic = 0x3253'5441'5453'4645ull;

// Local experts whose received tokens are counted one by one (more are counted in the last slot's total only).
inline constexpr int kDataPathStatsMaxExperts = 512;

// Ranks whose mask entry is published.
inline constexpr int kDataPathStatsMaxRanks = 256;

enum DataPathOp : int {
  kOpDispatch = 0,
  kOpCombine = 1,
  kOpLowLatencyDispatch = 2,
  kOpLowLatencyCombine = 3,
  kNumDataPathOps = 4,
};

struct DataPathStats {
  uint64_t magic;              // kDataPathStatsMagic once a Buffer wrote here
  uint64_t num_local_experts;  // of the last Buffer; <= kDataPathStatsMaxExperts
  uint64_t calls[kNumDataPathOps];
  uint64_t tokens_sent;      // tokens given to dispatch (normal and low latency)
  uint64_t tokens_received;  // rows normal dispatch received
  uint64_t bytes_sent;       // bytes of x given to dispatch
  uint64_t bytes_received;   // bytes of recv_x normal dispatch returned
  uint64_t timeouts;         // calls (or Check) that reported DeadlineExceeded
  uint64_t errors;           // other failed calls: bad input, degraded group, ...
  // Tokens received per local expert, by mode (the daemon reports their sum): normal dispatch adds every call's
  // counts to expert_tokens; low latency accumulates on the device and copies its totals into ll_expert_tokens every
  // kLowLatencyStatsPeriod calls and at Check(). Two arrays, so that one lease's two Buffers (normal and low latency)
  // never overwrite each other's counts.
  uint64_t expert_tokens[kDataPathStatsMaxExperts];
  uint64_t ll_expert_tokens[kDataPathStatsMaxExperts];
  // Low latency: the Buffer's rank mask (nonzero = masked: by the caller, after a timed-out wait, or a lost member),
  // copied with the expert totals; num_ranks entries are meaningful.
  uint64_t num_ranks;
  int32_t rank_mask[kDataPathStatsMaxRanks];
};

inline constexpr size_t kDataPathStatsBytes = 16384;
static_assert(sizeof(DataPathStats) <= kDataPathStatsBytes);

// The one part of the page the daemon writes and the client reads: the group's lost ranks (status_word.h,
// kLostRankWords words, bit r = group rank r), set when a rank's lease ends or its daemon goes down and cleared
// when it is back. The Buffer hands their address to the kernels and host waits (device address for cuda).
inline constexpr size_t kLostRanksOffset = 12288;
static_assert(sizeof(DataPathStats) <= kLostRanksOffset);
static_assert(kLostRanksOffset + kLostRankWords * sizeof(uint64_t) <= kDataPathStatsBytes);
// The same bits indexed by the lease holder's same-host ranks (Attach's nvl_ranks, in that order): what the inner
// (this-host) stage of a group across hosts polls, whose waits name ranks by their index on the host.
inline constexpr size_t kLostLocalRanksOffset = kLostRanksOffset + kLostRankWords * sizeof(uint64_t);
static_assert(kLostLocalRanksOffset + kLostRankWords * sizeof(uint64_t) <= kDataPathStatsBytes);
// The lease serial of every group rank (uint64 [kMaxLostRanks], written by the daemon like the lost ranks): 0 while
// the rank has no client, else the number its daemon gave that client's lease when it attached (the sequence of the
// NotifyLease that announced it), new for every attach. A Buffer digests them into the group's generation
// (docs/data-layout.md, "Generations"): every rank sees the same serials once every attach has been announced, and
// a rank whose client changes changes the generation.
inline constexpr size_t kLeaseSerialsOffset = kLostLocalRanksOffset + kLostRankWords * sizeof(uint64_t);
static_assert(kLeaseSerialsOffset + kMaxLostRanks * sizeof(uint64_t) <= kDataPathStatsBytes);
inline constexpr int kLowLatencyStatsPeriod = 64;

inline void StatsAdd(uint64_t* word, uint64_t value) {
  __atomic_store_n(word, __atomic_load_n(word, __ATOMIC_RELAXED) + value, __ATOMIC_RELAXED);  // one writer
}
inline void StatsStore(uint64_t* word, uint64_t value) { __atomic_store_n(word, value, __ATOMIC_RELAXED); }
inline uint64_t StatsLoad(const uint64_t* word) { return __atomic_load_n(word, __ATOMIC_RELAXED); }

}  // namespace epfabric::kernels
