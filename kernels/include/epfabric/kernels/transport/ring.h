// The transport's command rings: the one contract between the issuers (device code, the host backend) that write
// commands and the daemon's proxy threads that execute them on a wire. Device-safe: fixed-width integers only, so
// that .cu files, the host backend and the daemon include the same definitions. docs/internode.md explains the model.
//
// Memory: one "command region" per (group, rank), owned by the rank's daemon (a sealed host memfd, handed only to the
// holder of that rank's lease, mapped by the client and registered with CUDA there so that kernels can write it). It
// holds `num_channels` rings back to back; ring c is [c * RingBytes(slots), (c + 1) * RingBytes(slots)).
//
// One ring: a RingControl block, then `slots` Command slots (a power of two).
//  - Issuers (any number of threads or GPU warps) take an index from `reserved` once its slot is free (index -
//    consumed < slots, bounded), write the command's fields, then publish it by storing the stamp (index + 1, low 32
//    bits) last, with release semantics at system scope. Issuers (host and device) reserve with a compare-and-swap
//    only when the slot is free, so a timeout reserves nothing and the ring goes on once the daemon drains it.
//  - The daemon's proxy reads slot (consumed % slots) once its stamp equals consumed + 1, copies it, validates it,
//    executes it, then advances `consumed` (the slot is free again) and later `completed`.
//  - `completed` counts a contiguous prefix of commands whose effect is in place at the destination and whose
//    source may be reused: quiet = wait until completed >= every index this issuer reserved.
//  - A command the daemon refuses (out of bounds, unknown rank, bad opcode) or cannot deliver (peer lost) is not
//    executed; the daemon records the first such failure in `error` and keeps draining: every later command of the
//    ring is skipped (counted complete, not executed) until the lease ends, so an issuer's quiet ends at once and
//    reports the error.
//
// Everything in this memory is written by the client, so the daemon treats every field as untrusted, and the daemon's
// own words (consumed, completed, error) are copies of state it keeps privately.
#pragma once

#include <cstdint>

namespace epfabric::kernels::transport {

inline constexpr uint32_t kRingMagic = 0x45504652;  // "EPFR", written by the daemon into RingControl::magic
inline constexpr int kMaxChannels = 32;
inline constexpr uint32_t kMinRingSlots = 16;
inline constexpr uint32_t kMaxRingSlots = 1u << 16;
inline constexpr uint32_t kDefaultRingSlots = 1024;
inline constexpr int kDefaultChannels = 4;

enum class Opcode : uint8_t {
  kInvalid = 0,
  // Copies `arg` bytes from the issuer's RDMA region at src_offset to dst_rank's RDMA region at dst_offset.
  kPut = 1,
  // Adds `arg` (two's complement int64) to the 8-byte word at dst_offset of dst_rank's RDMA region (8-aligned),
  // atomically with respect to other signal adds. Visible only after every earlier put of this ring to dst_rank.
  kSignalAdd = 2,
};

// One command: 32 bytes, one slot.
struct Command {
  uint32_t stamp;       // low 32 bits of (ring index + 1); stored last (release, system scope)
  uint8_t opcode;       // Opcode
  uint8_t reserved;     // 0
  uint16_t dst_rank;    // group rank of the destination (may be the issuer itself)
  uint64_t dst_offset;  // bytes into the destination's RDMA region
  uint64_t src_offset;  // kPut: bytes into the issuer's RDMA region; otherwise 0
  uint64_t arg;         // kPut: bytes (1 .. region size); kSignalAdd: the value to add
};
static_assert(sizeof(Command) == 32, "a command is one 32-byte slot");

// Why a ring stopped executing commands (RingError::code). Values are stable: they appear in messages and counters.
enum class RingErrorCode : int32_t {
  kOk = 0,
  kBadOpcode = 1,         // opcode not one of Opcode
  kBadRank = 2,           // dst_rank is not a rank of the group
  kSourceOutOfRange = 3,  // [src_offset, src_offset + bytes) not inside the issuer's RDMA region
  kDestOutOfRange = 4,    // [dst_offset, dst_offset + bytes) not inside the destination's RDMA region
  kBadSize = 5,           // put of 0 bytes
  kMisaligned = 6,        // signal word not 8-byte aligned
  kBadStamp = 7,          // a slot's stamp is neither the expected index nor an older one (a corrupted ring)
  kPeerLost = 8,          // the destination's daemon is unreachable (connection lost, member down)
  kWireError = 9,         // the wire failed (completion error, refused connection)
  kLeaseEnded = 10,       // the lease ended; the ring is being cleaned
};

// Written by the daemon. 64-byte lines so that issuer- and daemon-written words never share a cache line.
struct alignas(64) RingControl {
  // Line 0, host issuers: the next index to reserve (compare-and-swap; device issuers keep theirs in device memory).
  uint64_t reserved;
  uint64_t pad0[7];
  // Line 1, daemon: commands taken off the ring (their slots are free).
  uint64_t consumed;
  uint64_t pad1[7];
  // Line 2, daemon: commands complete (a contiguous prefix).
  uint64_t completed;
  uint64_t pad2[7];
  // Line 3, daemon: the first failure, then frozen. `code` is written last (release).
  int32_t error_code;    // RingErrorCode
  int32_t error_rank;    // the destination rank concerned (-1 when none)
  uint64_t error_index;  // ring index of the command concerned
  uint64_t error_value;  // the offending value (offset, size, opcode, stamp), when there is one
  uint32_t magic;        // kRingMagic once the daemon initialised the ring
  uint32_t slots;        // the ring's slot count (a copy: issuers use the value they were configured with)
  int32_t waiting_rank;  // the destination of the oldest incomplete command (-1: none): who a quiet waits on
  int32_t pad3[7];
};
static_assert(sizeof(RingControl) == 256, "four cache lines");

inline constexpr uint64_t RingBytes(uint32_t slots) {
  return sizeof(RingControl) + static_cast<uint64_t>(slots) * sizeof(Command);
}
inline constexpr uint64_t CommandRegionBytes(int channels, uint32_t slots) {
  return static_cast<uint64_t>(channels) * RingBytes(slots);
}
inline constexpr bool ValidRingSlots(uint32_t slots) {
  return slots >= kMinRingSlots && slots <= kMaxRingSlots && (slots & (slots - 1)) == 0;
}

}  // namespace epfabric::kernels::transport
