// The host backend's thread tests: ranks as threads of one process over malloc'ed regions (host_backend_test,
// host_backend_untrusted_test, host_backend_throughput_test.cc).
#pragma once

#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "host_backend_scenarios.h"

namespace epfabric::kernels::host_backend_test {

inline constexpr uint64_t kTestTimeoutNs = 20ull * 1000 * 1000 * 1000;  // a hang fails the test instead of blocking CI

// Runs `body(rank)` on one thread per rank and returns the mismatches of all ranks.
inline std::string RunRanks(int num_ranks, const std::function<void(int, Mismatches*)>& body) {
  std::vector<Mismatches> results(num_ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < num_ranks; ++r) threads.emplace_back([&, r] { body(r, &results[r]); });
  for (std::thread& t : threads) t.join();
  std::string all;
  for (const Mismatches& m : results) all += m.str();
  return all;
}

// The cases the tests build most: an intranode case of per-rank token counts, and a low-latency case (duplicate
// experts in a token's top-k allowed).
inline IntranodeCase Case(std::vector<int> tokens, int hidden, int topk, int experts, bool fp8, uint64_t seed) {
  IntranodeCase c;
  c.num_tokens = std::move(tokens);
  c.hidden = hidden;
  c.num_topk = topk;
  c.num_experts = experts;
  c.fp8 = fp8;
  c.seed = seed;
  return c;
}

inline LowLatencyCase LLCase(int ranks, int max_tokens, int hidden, int experts, int topk, uint64_t seed) {
  LowLatencyCase c;
  c.num_ranks = ranks;
  c.max_tokens = max_tokens;
  c.hidden = hidden;
  c.num_experts = experts;
  c.num_topk = topk;
  c.seed = seed;
  c.routing.allow_duplicates = true;
  return c;
}

// A group's regions in malloc'ed memory (zeroed), and each rank's view of them.
class IntranodeRegions {
 public:
  explicit IntranodeRegions(const IntranodeRegionConfig& config) : config_(config) {
    const absl::StatusOr<size_t> bytes = IntranodeRegionBytes(config);
    EXPECT_TRUE(bytes.ok()) << bytes.status();
    regions_.resize(config.num_ranks);
    for (AlignedBuffer& b : regions_) b.Resize(bytes.value_or(0));
  }
  IntranodeGroup Group(int rank, uint64_t timeout_ns = kTestTimeoutNs, KernelStatus* status = nullptr) const {
    IntranodeGroup g;
    g.config = config_;
    g.rank = rank;
    for (int r = 0; r < config_.num_ranks; ++r) g.peer_regions[r] = regions_[r].data;
    g.status = status;
    g.timeout_ns = timeout_ns;
    return g;
  }
  uint8_t* region(int rank) { return regions_[rank].data; }
  size_t region_bytes() const { return regions_.front().storage.size() - 64; }
  const IntranodeRegionConfig& config() const { return config_; }

 private:
  IntranodeRegionConfig config_;
  std::vector<AlignedBuffer> regions_;
};

// A low-latency group's regions in malloc'ed memory (zeroed), and each rank's context. With `ranks_per_host` > 0 the
// ranks form hosts of that many: a rank reaches the ranks of other hosts as across hosts (LowLatencyContext::
// remote_ranks), through an outbox per rank and an inbox, and the put copies from the outbox into the destination's
// inbox at once (a 4-byte put, a signal, with a release store, as the transport delivers a signal after its data).
class LowLatencyRegions {
 public:
  explicit LowLatencyRegions(const LowLatencyCase& c, int ranks_per_host = 0) : ranks_per_host_(ranks_per_host) {
    absl::StatusOr<LowLatencyLayout> layout = MakeLowLatencyLayout(c.max_tokens, c.hidden, c.num_ranks, c.num_experts);
    EXPECT_TRUE(layout.ok()) << layout.status();
    layout_ = layout.value_or(LowLatencyLayout{});
    regions_.resize(c.num_ranks);
    for (AlignedBuffer& b : regions_) b.Resize(layout_.total_bytes);
    if (ranks_per_host_ > 0) {
      remote_.resize(c.num_ranks);
      for (int r = 0; r < c.num_ranks; ++r) {
        remote_[r].group = this;
        remote_[r].rank = r;
        remote_[r].memory.Resize(2 * layout_.half_bytes + 2 * c.num_ranks * layout_.outbox_half_bytes);
      }
    }
  }
  LowLatencyContext Context(int rank, uint64_t timeout_ns = kTestTimeoutNs, KernelStatus* status = nullptr,
                            int32_t* rank_mask = nullptr) const {
    LowLatencyContext ctx;
    ctx.rank = rank;
    ctx.num_ranks = layout_.num_ranks;
    for (int r = 0; r < layout_.num_ranks; ++r) ctx.peer_regions[r] = regions_[r].data;
    ctx.layout = layout_;
    ctx.status = status;
    ctx.rank_mask = rank_mask;
    ctx.timeout_ns = timeout_ns;
    if (ranks_per_host_ > 0) {
      for (int r = 0; r < layout_.num_ranks; ++r) {
        if (r / ranks_per_host_ == rank / ranks_per_host_) continue;
        ctx.remote_ranks.add(r);
        ctx.peer_regions[r] = remote_[rank].Outbox(r);
      }
      ctx.remote_inbox = remote_[rank].memory.data;
      ctx.remote_put = &LowLatencyRegions::Put;
      ctx.remote_put_arg = const_cast<RankMemory*>(&remote_[rank]);
    }
    return ctx;
  }
  uint8_t* region(int rank) { return regions_[rank].data; }
  const LowLatencyLayout& layout() const { return layout_; }

 private:
  // A rank's RDMA memory across hosts: [inbox: 2 halves][an outbox for every rank: 2 outbox halves each].
  struct RankMemory {
    LowLatencyRegions* group = nullptr;
    int rank = 0;
    AlignedBuffer memory;
    uint8_t* Outbox(int r) const {
      const LowLatencyLayout& l = group->layout_;
      return memory.data + 2 * l.half_bytes + 2 * static_cast<size_t>(r) * l.outbox_half_bytes;
    }
  };
  static bool Put(void* arg, int dst_rank, size_t outbox_offset, size_t inbox_offset, size_t bytes) {
    const auto* from = static_cast<const RankMemory*>(arg);
    const uint8_t* src = from->Outbox(dst_rank) + outbox_offset;
    uint8_t* dst = from->group->remote_[dst_rank].memory.data + inbox_offset;
    if (bytes == sizeof(int32_t)) {
      __atomic_store_n(reinterpret_cast<int32_t*>(dst), *reinterpret_cast<const int32_t*>(src), __ATOMIC_RELEASE);
    } else {
      std::memcpy(dst, src, bytes);
    }
    return true;
  }

  int ranks_per_host_ = 0;
  LowLatencyLayout layout_;
  std::vector<AlignedBuffer> regions_;
  std::vector<RankMemory> remote_;
};

}  // namespace epfabric::kernels::host_backend_test
