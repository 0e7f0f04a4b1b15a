#include "scenario.h"

#include <algorithm>
#include <random>

namespace epfabric::tools {
namespace {

uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

uint8_t PatternByte(int rank, uint64_t offset) {
  return static_cast<uint8_t>(SplitMix((static_cast<uint64_t>(rank) << 40) ^ (offset / 8)) >> ((offset % 8) * 8));
}

void FillPattern(int rank, uint64_t offset, uint64_t n, uint8_t* out) {
  for (uint64_t i = 0; i < n; ++i) out[i] = PatternByte(rank, offset + i);
}

std::vector<Op> GenerateStream(uint64_t seed, int source, int channel, int count, const Layout& layout) {
  std::mt19937_64 rng(SplitMix(seed * 1000003ull + static_cast<uint64_t>(source) * 131ull + channel));
  std::vector<Op> ops;
  std::vector<uint64_t> records(static_cast<size_t>(layout.world), 0);
  auto uniform = [&rng](uint64_t lo, uint64_t hi) { return lo + rng() % (hi - lo + 1); };  // [lo, hi]
  for (int i = 0; i < count; ++i) {
    Op op;
    op.dst = static_cast<int>(uniform(0, layout.world - 1));
    if (uniform(0, 99) < 15 && records[op.dst] < layout.log_records) {
      op.log = true;
      op.bytes = Layout::kRecord;
      op.dst_offset = records[op.dst]++;
      op.src_offset = uniform(0, layout.source_bytes - Layout::kRecord);
      ops.push_back(op);
      continue;
    }
    const uint64_t pick = uniform(0, 999);
    const uint64_t max = pick < 900 ? 512 : (pick < 990 ? 64 << 10 : layout.slice_bytes);
    op.bytes = uniform(1, std::min({max, layout.slice_bytes, layout.source_bytes}));
    op.dst_offset = uniform(0, layout.slice_bytes - op.bytes);
    op.src_offset = uniform(0, layout.source_bytes - op.bytes);
    ops.push_back(op);
  }
  return ops;
}

}  // namespace epfabric::tools
