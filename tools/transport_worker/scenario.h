// The transport conformance scenarios' shared model: the region layout, the deterministic source pattern and the
// command streams. Issuers execute a stream; receivers regenerate every source's stream to know what must arrive.
#pragma once

#include <cstdint>
#include <vector>

namespace epfabric::tools {

struct Layout {
  int world = 0;
  int channels = 0;
  uint64_t source_bytes = 2ull << 20;   // S: the source area
  uint64_t slice_bytes = 256ull << 10;  // I: one inbox slice per (source rank, channel)
  uint64_t log_records = 256;           // L: log records per (source rank, channel)
  uint64_t big_bytes = 0;               // B: the big-sweep inbox

  static constexpr uint64_t kSignals = 64ull << 10;
  static constexpr uint64_t kRecord = 64;
  uint64_t Done(int source) const { return 64ull * source; }
  uint64_t LogCount(int source, int channel) const { return 4096 + 8ull * (source * channels + channel); }
  uint64_t BigRound(int source) const { return 24576 + 8ull * source; }
  uint64_t BigAck(int source) const { return 32768 + 8ull * source; }
  uint64_t Source() const { return kSignals; }
  uint64_t Inbox(int source, int channel) const {
    return kSignals + source_bytes + slice_bytes * (source * channels + channel);
  }
  uint64_t Log(int source, int channel) const {
    return Inbox(world, 0) + log_records * kRecord * (source * channels + channel);
  }
  uint64_t Big() const { return Log(world, 0); }
  uint64_t RegionBytes() const { return Big() + big_bytes; }
};

// Byte `offset` of rank `rank`'s source area.
uint8_t PatternByte(int rank, uint64_t offset);
void FillPattern(int rank, uint64_t offset, uint64_t n, uint8_t* out);

struct Op {
  bool log = false;  // a 64-byte log record followed by a signal of its count
  int dst = 0;
  uint64_t bytes = 0;
  uint64_t dst_offset = 0;  // within the destination's slice (put) or the record index (log)
  uint64_t src_offset = 0;  // within the source area
};

// The stream of source `source` on `channel`: `count` ops, sizes mostly small (1..512 B), some to 64 KiB, a few to
// the slice size; unaligned offsets; ~15% log records.
std::vector<Op> GenerateStream(uint64_t seed, int source, int channel, int count, const Layout& layout);

}  // namespace epfabric::tools
