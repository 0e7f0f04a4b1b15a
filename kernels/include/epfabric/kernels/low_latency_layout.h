// The low-latency region layout and its limits: plain structs and constants, device-safe (no absl), so that the
// kernels, the host-side launch code and the host backend share one description. MakeLowLatencyLayout
// (low_latency.h) fills it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace epfabric::kernels {

// Largest top-k a token may have: the combine receive area holds one slot per (token, top-k position).
inline constexpr int kLowLatencyMaxTopk = 16;
// FP8 quantisation groups: one scale per 128 channels of a token.
inline constexpr int kFp8GroupSize = 128;
// UE8M0 scales are packed four to an int32 (DeepGEMM's format).
inline constexpr int kUe8m0ScalesPerInt32 = 4;
// Every dispatch message starts with a 16-byte header (the source token index), so that the payload stays aligned.
inline constexpr size_t kLowLatencyMessageHeaderBytes = 16;
// Largest number of tokens per rank: routing entries pack the token index into 16 bits.
inline constexpr int kLowLatencyMaxTokensPerRank = 65535;
// Largest group in low-latency mode across hosts (within one host the NVLink domain, kMaxNvlPeers, is the limit): the
// daemon's lost-ranks words cover as many (kMaxLostRanks), and the kernels' per-rank signal loops take one thread per
// rank of a block.
inline constexpr int kMaxLowLatencyRanks = 256;

// A set of group ranks, for groups of up to kMaxLowLatencyRanks: bit r % 64 of words[r / 64]. Device-safe (the
// kernels' launch parameters carry one).
struct LowLatencyRankSet {
  uint64_t words[kMaxLowLatencyRanks / 64] = {};

  constexpr bool has(int r) const { return ((words[r >> 6] >> (r & 63)) & 1u) != 0; }
  constexpr void add(int r) { words[r >> 6] |= uint64_t{1} << (r & 63); }
  constexpr void remove(int r) { words[r >> 6] &= ~(uint64_t{1} << (r & 63)); }
  constexpr bool empty() const {
    for (uint64_t w : words) {
      if (w != 0) return false;
    }
    return true;
  }
};

// Where one source rank's slots lie inside a half, as offsets from the half's start: in a full half (a rank's region
// or an inbox, where every source has slots) for a given source, or in an outbox (one source only: this rank's part
// of what goes to one rank on another host; see LowLatencyLayout::outbox). Writers address through this, so the same
// code fills a peer's half over NVLink and an outbox that is put into the peer's inbox.
struct LowLatencySlots {
  size_t count = 0;  // uint64 count signal (LowLatencyCountSignal) of local expert e at count + e * count_stride
  size_t count_stride = 0;
  size_t weights_flag = 0;  // int32
  size_t combine_flag = 0;  // int32
  size_t table = 0;         // int32 token list of local expert e at table + e * table_stride
  size_t table_stride = 0;
  size_t msgs = 0;     // the message of source token t at msgs + t * dispatch_msg_bytes
  size_t weights = 0;  // float [max_tokens][kLowLatencyMaxTopk]
  size_t recv = 0;     // bf16 partial-sum row for source token t at recv + t * recv_stride
  size_t recv_stride = 0;
};

// Every signal a call reads carries the call's tag (LowLatencyDispatchArgs::call_tag: the group's lease generation
// mixed with the call's index, never 0), so that a value left by an earlier call, an earlier Buffer or an earlier
// client of any rank never passes for this call's (docs/data-layout.md, "Generations"). A count signal is one 64-bit
// word, the tag in the high half and count + 1 in the low half, stored and loaded whole; a flag is the tag itself.
inline constexpr uint64_t LowLatencyCountSignal(uint32_t tag, int count) {
  return (static_cast<uint64_t>(tag) << 32) | static_cast<uint32_t>(count + 1);
}
// The count in `signal` when it carries `tag`, else -1 (not this call's; a count past the caller's bound is the
// caller's to reject).
inline constexpr int64_t LowLatencyCountOf(uint64_t signal, uint32_t tag) {
  return static_cast<uint32_t>(signal >> 32) == tag ? static_cast<int64_t>(signal & 0xffffffffu) - 1 : -1;
}

// The one description of a rank's low-latency region. Every size the daemon must allocate and every offset the
// kernels carve come from MakeLowLatencyLayout, so the two cannot disagree. All offsets are in bytes, 128-byte
// aligned. The region is two halves (double buffering: consecutive calls alternate) followed by one zero-copy
// combine input buffer:
//
//   half h (h = 0, 1), at h * half_bytes:
//     signals (zeroed by the call that uses the other half, see docs):
//       dispatch_count   uint64 [num_local_experts][num_ranks] written by source rank s: LowLatencyCountSignal
//       combine_flag     int32 [num_ranks]                     written by expert rank r: the call's tag when r's
//                                                              outputs landed
//       weights_flag     int32 [num_ranks]                     written by source rank s: the call's tag when s's
//                                                              weights landed
//       dispatch_done    int32                                 local: send work items finished (this rank only)
//       combine_done     int32                                 local: send work items finished (this rank only)
//     dispatch_table     int32 [num_local_experts][num_ranks][max_tokens]  per (expert, source) the source token
//                        indices in increasing order, each `token | (first top-k position << 16)`
//     dispatch_msgs      [num_ranks][max_tokens][dispatch_msg_bytes]  one message per (source token, this rank):
//                        16-byte header, then FP8 data + float scales, or BF16 data
//     combine_weights    float [num_ranks][max_tokens][kLowLatencyMaxTopk]  written by source rank s: the weight
//                        of each top-k position of its tokens (duplicates of an expert summed into the first), then
//                        s raises weights_flag
//     combine_recv       bf16 [max_tokens][num_ranks][hidden]  per token of this rank, the partial sum that expert
//                        rank r computed over its own experts
//   combine_send at 2 * half_bytes: bf16 [num_local_experts][num_ranks * max_tokens][hidden] (zero-copy input)
//
// Across hosts a rank also has, per rank on another host, an outbox of two halves (outbox_half_bytes each) holding
// only its own slots of that rank's half, compact (`outbox`): counts [L], weights flag, combine flag (the first
// outbox_signal_bytes), token lists [L][M], messages [M], weights [M][kLowLatencyMaxTopk], partial-sum rows [M]. What
// is written there is put to the same slots of the destination's inbox, so the memory across hosts grows linearly
// with the ranks (docs/internode-dispatch.md).
struct LowLatencyLayout {
  int max_tokens_per_rank = 0;
  int hidden = 0;
  int num_ranks = 0;
  int num_experts = 0;
  int num_local_experts = 0;

  size_t dispatch_msg_bytes = 0;

  // Offsets inside one half.
  size_t dispatch_count_offset = 0;
  size_t combine_flag_offset = 0;
  size_t weights_flag_offset = 0;
  size_t dispatch_done_offset = 0;
  size_t combine_done_offset = 0;
  size_t signal_bytes = 0;  // the signals start at offset 0 of a half and span this many bytes
  size_t dispatch_table_offset = 0;
  size_t dispatch_msgs_offset = 0;
  size_t combine_weights_offset = 0;
  size_t combine_recv_offset = 0;
  size_t half_bytes = 0;

  // Offsets from the start of the region.
  size_t combine_send_offset = 0;
  size_t total_bytes = 0;

  // The outbox (across hosts), offsets inside one outbox half.
  LowLatencySlots outbox;
  size_t outbox_signal_bytes = 0;
  size_t outbox_half_bytes = 0;
};

}  // namespace epfabric::kernels
