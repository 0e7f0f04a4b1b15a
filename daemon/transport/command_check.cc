#include "transport/command_check.h"

namespace epfabric::daemon::transport {
namespace {

// True when [offset, offset + bytes) lies inside [0, size), without overflow.
bool Inside(uint64_t offset, uint64_t bytes, uint64_t size) { return offset <= size && bytes <= size - offset; }

// The end of a range for messages, saturated instead of wrapping.
uint64_t End(uint64_t offset, uint64_t bytes) { return bytes > UINT64_MAX - offset ? UINT64_MAX : offset + bytes; }

}  // namespace

std::optional<CommandFault> CheckCommand(const Command& command, const CommandBounds& bounds) {
  const auto opcode = static_cast<Opcode>(command.opcode);
  if (opcode != Opcode::kPut && opcode != Opcode::kSignalAdd) {
    return CommandFault{RingErrorCode::kBadOpcode, -1, command.opcode};
  }
  const int world = static_cast<int>(bounds.region_bytes.size());
  const int dst = command.dst_rank;
  if (dst >= world) return CommandFault{RingErrorCode::kBadRank, -1, command.dst_rank};
  const uint64_t dst_size = bounds.region_bytes[dst];
  if (opcode == Opcode::kSignalAdd) {
    if (command.dst_offset % 8 != 0) return CommandFault{RingErrorCode::kMisaligned, dst, command.dst_offset};
    if (!Inside(command.dst_offset, 8, dst_size)) {
      return CommandFault{RingErrorCode::kDestOutOfRange, dst, End(command.dst_offset, 8)};
    }
    return std::nullopt;
  }
  const uint64_t bytes = command.arg;
  if (bytes == 0) return CommandFault{RingErrorCode::kBadSize, dst, 0};
  if (bounds.self_rank < 0 || bounds.self_rank >= world ||
      !Inside(command.src_offset, bytes, bounds.region_bytes[bounds.self_rank])) {
    return CommandFault{RingErrorCode::kSourceOutOfRange, dst, End(command.src_offset, bytes)};
  }
  if (!Inside(command.dst_offset, bytes, dst_size)) {
    return CommandFault{RingErrorCode::kDestOutOfRange, dst, End(command.dst_offset, bytes)};
  }
  return std::nullopt;
}

}  // namespace epfabric::daemon::transport
