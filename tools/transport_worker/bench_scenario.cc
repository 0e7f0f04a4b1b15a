#include "bench_scenario.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "epfabric/client/client.h"
#include "epfabric/kernels/transport/issuer.h"
#include "issue.h"
#include "region_access.h"

ABSL_DECLARE_FLAG(std::string, socket);
ABSL_DECLARE_FLAG(std::string, group);
ABSL_DECLARE_FLAG(int, rank);
ABSL_DECLARE_FLAG(int, device);
ABSL_DECLARE_FLAG(std::string, token);
ABSL_DECLARE_FLAG(std::string, issue_from);
ABSL_DECLARE_FLAG(int, timeout_ms);
ABSL_DECLARE_FLAG(bool, print_region_bytes);
ABSL_DECLARE_FLAG(int, channels);

ABSL_FLAG(int, bench_latency_samples, 10000, "bench: pickup-latency samples, idle and warm each.");
ABSL_FLAG(int, bench_idle_samples, -1, "bench: idle pickup-latency samples (-1: --bench_latency_samples).");
ABSL_FLAG(int, bench_idle_gap_us, 3000, "bench: pause before each idle sample (longer than --proxy_spin_us).");
ABSL_FLAG(int, bench_rtt_samples, 10000, "bench: signal round trips.");
ABSL_FLAG(std::string, bench_sizes, "4096,65536,1048576,16777216", "bench: put sizes in bytes.");
ABSL_FLAG(uint64_t, bench_max_bytes, 16ull << 20, "bench: the largest put (sizes the region).");
ABSL_FLAG(uint64_t, bench_bytes_per_rep, 256ull << 20, "bench: bytes moved per bandwidth repetition.");
ABSL_FLAG(int, bench_reps, 5, "bench: bandwidth repetitions per size and channel count.");
ABSL_FLAG(std::string, bench_daemon_pids, "", "bench: pids of the sending and receiving daemons (a,b).");

namespace epfabric::tools {
namespace {

using kernels::transport::Command;
using kernels::transport::Opcode;
using kernels::transport::RingAt;
using kernels::transport::RingControl;
using kernels::transport::RingIssuer;
using Clock = std::chrono::steady_clock;

// The bench's region: signal words, the source, one inbox per ring.
struct BenchLayout {
  int channels = 1;
  uint64_t max_bytes = 0;
  static constexpr uint64_t kSignals = 64 << 10;
  static uint64_t Barrier(int from) { return 64ull * from; }
  static constexpr uint64_t kPing = 4096;
  static constexpr uint64_t kPong = 4096 + 64;
  static constexpr uint64_t kSelf = 8192;
  static uint64_t Source() { return kSignals; }
  uint64_t Inbox(int channel) const { return kSignals + max_bytes * (1 + channel); }
  uint64_t RegionBytes() const { return Inbox(channels); }
};

int Fail(const std::string& why) {
  std::cout << "EPF_RESULT ok=0 reason=\"" << why << "\"" << std::endl;
  return 1;
}

void Pause() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// A spin-wait step that lets the daemons' threads run on a machine with few cores: a yield every 256 pauses (a
// few microseconds; it returns at once when nothing else is runnable).
void SpinOnce(int spins) {
  if ((spins & 255) == 0) {
    std::this_thread::yield();
  } else {
    Pause();
  }
}

uint64_t LoadAcquire(const uint64_t& word) {
  return std::atomic_ref<const uint64_t>(word).load(std::memory_order_acquire);
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

void Emit(const std::string& key, double value) { std::cout << "EPF_BENCH " << key << "=" << value << std::endl; }

// utime + stime of `pid`, in seconds (-1 when unreadable).
double CpuSeconds(int pid) {
  std::ifstream file(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(file, line)) return -1;
  const size_t paren = line.rfind(')');
  if (paren == std::string::npos) return -1;
  std::istringstream rest(line.substr(paren + 2));
  std::string field;
  uint64_t utime = 0, stime = 0;
  for (int i = 0; i <= 12 && rest >> field; ++i) {  // field 3 (state) is i = 0; utime is field 14, stime 15
    if (i == 11) utime = std::stoull(field);
    if (i == 12) stime = std::stoull(field);
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// CPU-seconds per second of the daemons in `pids` over a phase.
class CpuMeter {
 public:
  explicit CpuMeter(const std::vector<int>& pids) : pids_(pids), start_(Clock::now()) {
    for (int pid : pids_) before_.push_back(CpuSeconds(pid));
  }
  void Emit(const std::string& phase) const {
    const double wall = std::chrono::duration<double>(Clock::now() - start_).count();
    const char* role[] = {"sender", "receiver"};
    for (size_t i = 0; i < pids_.size() && i < 2; ++i) {
      tools::Emit(absl::StrCat("cpu_", phase, "_", role[i], "_cores"), (CpuSeconds(pids_[i]) - before_[i]) / wall);
    }
  }

 private:
  std::vector<int> pids_;
  std::vector<double> before_;
  Clock::time_point start_;
};

class Bench {
 public:
  Bench(client::Lease& lease, RegionAccess& region, Issuers& issuers, const BenchLayout& layout, uint32_t slots)
      : region_(region), issuers_(issuers), layout_(layout), self_(lease.rank()), peer_(1 - self_) {
    for (int c = 0; c < layout.channels; ++c) {
      rings_.push_back(static_cast<RingControl*>(RingAt(lease.commands_region(), c, slots)));
      host_.push_back(*RingIssuer::Create(rings_.back(), c, slots));
    }
    timeout_ = absl::Milliseconds(absl::GetFlag(FLAGS_timeout_ms));
  }

  // Both ranks reach barrier `k` (1, 2, ...).
  absl::Status Barrier(int64_t k) {
    if (absl::Status s = host_[0].SignalAdd(peer_, BenchLayout::Barrier(self_), 1, timeout_); !s.ok()) return s;
    if (absl::Status s = host_[0].Quiet(timeout_); !s.ok()) return s;
    const absl::Time deadline = absl::Now() + timeout_;
    while (region_.Load(BenchLayout::Barrier(peer_)) < k) {
      if (absl::Now() > deadline) return absl::DeadlineExceededError(absl::StrCat("barrier ", k, ": rank ", peer_));
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return absl::OkStatus();
  }

  // Phase 1 (rank 0): publish → consumed, in microseconds.
  absl::Status PickupLatency(const std::string& name, int samples, absl::Duration gap) {
    RingIssuer& ring = host_[0];
    const uint64_t& consumed = rings_[0]->consumed;
    std::vector<double> us;
    us.reserve(samples);
    for (int i = 0; i < samples; ++i) {
      if (gap > absl::ZeroDuration()) absl::SleepFor(gap);
      const uint64_t index = ring.issued();
      const Clock::time_point t0 = Clock::now();
      if (absl::Status s = ring.Put(self_, BenchLayout::kSelf, BenchLayout::Source(), 8, timeout_); !s.ok()) return s;
      for (int spins = 1; LoadAcquire(consumed) <= index; ++spins) SpinOnce(spins);
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      if (absl::Status s = ring.Quiet(timeout_); !s.ok()) return s;
    }
    Emit(absl::StrCat("pickup_", name, "_median_us"), Percentile(us, 0.5));
    Emit(absl::StrCat("pickup_", name, "_p99_us"), Percentile(us, 0.99));
    Emit(absl::StrCat("pickup_", name, "_samples"), samples);
    return absl::OkStatus();
  }

  // Phase 2 (both ranks): signal ping-pong, in microseconds per round trip.
  absl::Status RoundTrip(int samples) {
    RingIssuer& ring = host_[0];
    const uint64_t mine = self_ == 0 ? BenchLayout::kPong : BenchLayout::kPing;
    const uint64_t theirs = self_ == 0 ? BenchLayout::kPing : BenchLayout::kPong;
    const int warmup = std::min(100, samples);
    std::vector<double> us;
    us.reserve(samples);
    for (int i = 1; i <= samples + warmup; ++i) {
      const absl::Time deadline = absl::Now() + timeout_;
      const Clock::time_point t0 = Clock::now();
      if (self_ == 0) {
        if (absl::Status s = ring.SignalAdd(peer_, theirs, 1, timeout_); !s.ok()) return s;
      }
      for (int spins = 0; region_.Load(mine) < i; ++spins) {
        if ((spins & 1023) == 0 && absl::Now() > deadline) return absl::DeadlineExceededError("ping-pong");
        SpinOnce(spins);
      }
      if (self_ == 1) {
        if (absl::Status s = ring.SignalAdd(peer_, theirs, 1, timeout_); !s.ok()) return s;
      }
      if (i > warmup) us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    if (absl::Status s = ring.Quiet(timeout_); !s.ok()) return s;
    if (self_ == 0) {
      Emit("signal_rtt_median_us", Percentile(us, 0.5));
      Emit("signal_rtt_p99_us", Percentile(us, 0.99));
      Emit("signal_rtt_samples", samples);
    }
    return absl::OkStatus();
  }

  // Phase 3 (rank 0): GB/s of puts of `bytes` to the peer on `channels` rings at once; the median of `reps`.
  absl::StatusOr<double> Bandwidth(uint64_t bytes, int channels, uint64_t bytes_per_rep, int reps) {
    const uint64_t per_channel = std::max<uint64_t>(1, bytes_per_rep / bytes / channels);
    std::vector<std::vector<Command>> commands(channels);
    for (int c = 0; c < channels; ++c) {
      Command put = {};
      put.opcode = static_cast<uint8_t>(Opcode::kPut);
      put.dst_rank = static_cast<uint16_t>(peer_);
      put.dst_offset = layout_.Inbox(c);
      put.src_offset = BenchLayout::Source();
      put.arg = bytes;
      commands[c].assign(per_channel, put);
    }
    std::vector<double> gbps;
    for (int r = 0; r < reps; ++r) {
      std::vector<absl::Status> results(channels);
      std::vector<std::thread> threads;
      std::atomic<int> ready{0};
      std::atomic<bool> go{false};
      for (int c = 0; c < channels; ++c) {
        threads.emplace_back([&, c] {
          ready.fetch_add(1);
          while (!go.load(std::memory_order_acquire)) Pause();
          results[c] = issuers_.Run(c, commands[c], /*quiet=*/true);
        });
      }
      while (ready.load() < channels) Pause();
      const Clock::time_point t0 = Clock::now();
      go.store(true, std::memory_order_release);
      for (auto& t : threads) t.join();
      const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      for (const absl::Status& s : results) {
        if (!s.ok()) return s;
      }
      gbps.push_back(static_cast<double>(per_channel * channels * bytes) / seconds / 1e9);
    }
    return Percentile(gbps, 0.5);
  }

 private:
  RegionAccess& region_;
  Issuers& issuers_;
  const BenchLayout layout_;
  const int self_;
  const int peer_;
  std::vector<RingControl*> rings_;
  std::vector<RingIssuer> host_;
  absl::Duration timeout_;
};

std::vector<int> ParseList(const std::string& text) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (absl::SimpleAtoi(part, &v)) out.push_back(static_cast<int>(v));
  }
  return out;
}

#define EPF_BENCH_CHECK(expr)                         \
  do {                                                \
    const absl::Status check_ = (expr);               \
    if (!check_.ok()) return Fail(check_.ToString()); \
  } while (false)

int Measure(client::Lease& lease, RegionAccess& region, Issuers& issuers, const BenchLayout& layout) {
  Bench bench(lease, region, issuers, layout, lease.group().ring_slots());
  const bool leader = lease.rank() == 0;
  const int samples = absl::GetFlag(FLAGS_bench_latency_samples);
  const int idle_samples =
      absl::GetFlag(FLAGS_bench_idle_samples) < 0 ? samples : absl::GetFlag(FLAGS_bench_idle_samples);
  std::vector<char> source(std::min<uint64_t>(layout.max_bytes, 4 << 20), 0x5a);
  for (uint64_t done = 0; done < layout.max_bytes; done += source.size()) {
    region.Write(BenchLayout::Source() + done, source.data(),
                 std::min<uint64_t>(source.size(), layout.max_bytes - done));
  }
  EPF_BENCH_CHECK(bench.Barrier(1));
  if (leader) {
    std::cout << "EPF_BENCH_INFO backend=" << (lease.backend() == v1::BACKEND_CUDA ? "cuda" : "host")
              << " issue_from=" << absl::GetFlag(FLAGS_issue_from) << " channels=" << layout.channels
              << " ring_slots=" << lease.group().ring_slots() << std::endl;
    EPF_BENCH_CHECK(
        bench.PickupLatency("idle", idle_samples, absl::Microseconds(absl::GetFlag(FLAGS_bench_idle_gap_us))));
    EPF_BENCH_CHECK(bench.PickupLatency("warm", samples, absl::ZeroDuration()));
  }
  EPF_BENCH_CHECK(bench.Barrier(2));
  EPF_BENCH_CHECK(bench.RoundTrip(absl::GetFlag(FLAGS_bench_rtt_samples)));
  EPF_BENCH_CHECK(bench.Barrier(3));
  if (leader) {
    const std::vector<int> pids = ParseList(absl::GetFlag(FLAGS_bench_daemon_pids));
    const uint64_t per_rep = absl::GetFlag(FLAGS_bench_bytes_per_rep);
    const int reps = absl::GetFlag(FLAGS_bench_reps);
    for (int channels : {1, layout.channels}) {
      CpuMeter cpu(pids);
      for (int size : ParseList(absl::GetFlag(FLAGS_bench_sizes))) {
        if (size <= 0 || static_cast<uint64_t>(size) > layout.max_bytes) continue;
        auto gbps = bench.Bandwidth(static_cast<uint64_t>(size), channels, per_rep, reps);
        if (!gbps.ok())
          return Fail(absl::StrCat("bandwidth ", size, " B x ", channels, ": ", gbps.status().ToString()));
        Emit(absl::StrCat("put_", size, "_", channels == 1 ? "1ch" : "allch", "_gbps"), *gbps);
      }
      cpu.Emit(channels == 1 ? "bw_1ch" : "bw_allch");
      if (layout.channels == 1) break;
    }
  }
  EPF_BENCH_CHECK(bench.Barrier(4));
  std::cout << "EPF_RESULT ok=1 scenario=bench rank=" << lease.rank() << std::endl;
  return 0;
}

}  // namespace

int BenchMain() {
  BenchLayout layout;
  layout.max_bytes = absl::GetFlag(FLAGS_bench_max_bytes);
  if (absl::GetFlag(FLAGS_print_region_bytes)) {
    layout.channels = absl::GetFlag(FLAGS_channels);
    std::cout << layout.RegionBytes() << std::endl;
    return 0;
  }
  auto attached = AttachRank(absl::GetFlag(FLAGS_socket), absl::GetFlag(FLAGS_group), absl::GetFlag(FLAGS_rank),
                             absl::GetFlag(FLAGS_token), absl::GetFlag(FLAGS_device));
  if (!attached.ok()) return Fail(attached.status().ToString());
  client::Lease& l = *attached->lease;
  if (l.world_size() != 2) return Fail("the bench scenario needs a group of 2 ranks");
  layout.channels = static_cast<int>(l.group().transport_channels());
  RegionAccess region(l.rdma_region(), l.rdma_region_bytes(), l.backend() == v1::BACKEND_CUDA);
  if (region.bytes() < layout.RegionBytes()) {
    return Fail(absl::StrCat("the RDMA region has ", region.bytes(), " bytes; the bench needs ", layout.RegionBytes()));
  }
  auto issuers = Issuers::Create(l, absl::GetFlag(FLAGS_issue_from) == "device",
                                 absl::Milliseconds(absl::GetFlag(FLAGS_timeout_ms)));
  if (!issuers.ok()) return Fail(issuers.status().ToString());
  return Measure(l, region, **issuers, layout);
}

}  // namespace epfabric::tools
