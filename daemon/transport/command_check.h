// The daemon's check of every command it reads from a client's ring: a client can never make the daemon read or write
// outside its own group's regions. Pure functions over a copy of the command (the ring is client memory).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "epfabric/kernels/transport/ring.h"

namespace epfabric::daemon::transport {

using kernels::transport::Command;
using kernels::transport::Opcode;
using kernels::transport::RingErrorCode;

// What commands of one issuer are checked against.
struct CommandBounds {
  int self_rank = -1;                  // the issuer's group rank
  std::vector<uint64_t> region_bytes;  // every member's RDMA region size, by group rank
};

struct CommandFault {
  RingErrorCode code = RingErrorCode::kOk;
  int rank = -1;       // the destination concerned (-1 when the rank itself is bad)
  uint64_t value = 0;  // the offending value (opcode, rank, range end, offset)
};

// nullopt when `command` may be executed: a known opcode; a destination that is a rank of the group; kPut:
// 1 <= bytes, [src_offset, src_offset + bytes) inside the issuer's region, [dst_offset, dst_offset + bytes) inside the
// destination's (no overflow); kSignalAdd: dst_offset 8-aligned and [dst_offset, dst_offset + 8) inside the
// destination's region.
std::optional<CommandFault> CheckCommand(const Command& command, const CommandBounds& bounds);

}  // namespace epfabric::daemon::transport
