// epfabric_transport_worker: one client process = one rank of a group with an RDMA region, driving the daemon's
// transport through its command rings and checking what arrives (issue #11's conformance suite; the integration test
// tests/integration/transport_test.cc starts one per rank, over daemons acting as separate hosts).
//
// Scenarios (--scenario):
//   conformance  every channel at once (a thread each): --commands random puts and log records per channel
//                (scenario.h), then done signals; each rank checks, while the others still send, that every log
//                record counted by a signal is already in place (signal-after-puts ordering), and at the end its
//                inbox slices byte for byte against the model of every source's stream.
//   big          puts of 1 B .. --big_max bytes (unaligned) to the next rank, each checked by the receiver, with
//                signals both ways between rounds.
//   stream       64 KiB puts to --target with a quiet every 16, until an error (printed with its time) or
//                --duration_ms; for the fault tests.
//   bad          one refused command (--bad=dest_range|src_range|rank|misaligned|zero_size), expecting the error;
//                then a good command on another channel still completes.
//   zero         checks that the whole RDMA region is zero (nobody wrote it).
//   bench        the transport benchmark's measurements (bench_scenario.h; bench/transport_bench.cc).
//   flood, signals  fairness between groups on one daemon (fairness_scenario.h).
// Output: `EPF_RESULT ok=1 ...` and exit 0 when everything matched; ok=0 with the reason and exit 1 otherwise;
// `stream` exits 3 after a transport error. --issue_from=device issues the conformance commands from a CUDA kernel.
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "bench_scenario.h"
#include "epfabric/client/client.h"
#include "fairness_scenario.h"
#include "issue.h"
#include "region_access.h"
#include "scenario.h"

ABSL_FLAG(std::string, socket, "", "Unix socket of this rank's daemon.");
ABSL_FLAG(std::string, group, "", "Group name.");
ABSL_FLAG(int, rank, -1, "Group rank.");
ABSL_FLAG(std::string, token, "", "The group's token.");
ABSL_FLAG(std::string, scenario, "conformance", "conformance, big, stream, bad, zero or bench.");
ABSL_FLAG(int, commands, 2000, "conformance: commands per channel.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the streams.");
ABSL_FLAG(uint64_t, big_max, 64ull << 20, "big: the largest put.");
ABSL_FLAG(int, target, 1, "stream: destination rank.");
ABSL_FLAG(int, duration_ms, 10000, "stream: how long to stream without an error.");
ABSL_FLAG(int, timeout_ms, 20000, "Bound of every wait.");
ABSL_FLAG(std::string, bad, "dest_range", "bad: which refused command.");
ABSL_FLAG(std::string, issue_from, "host", "host or device (cuda backend).");
ABSL_FLAG(int, device, -1, "CUDA device of this process (cuda backend): its daemon's GPU; -1 = rank mod GPUs.");
ABSL_FLAG(uint64_t, flood_bytes, 64ull << 20, "flood: bytes of each local put.");
ABSL_FLAG(int, signals, 100, "signals: how many to time.");
ABSL_FLAG(int, signal_gap_ms, 5, "signals: pause between two.");
ABSL_FLAG(bool, print_region_bytes, false, "Print the RDMA region size the scenario needs (--world, --channels).");
ABSL_FLAG(int, world, 4, "--print_region_bytes: ranks.");
ABSL_FLAG(int, channels, 4, "--print_region_bytes: channels.");

namespace epfabric::tools {
namespace {

using kernels::transport::Command;
using kernels::transport::Opcode;

int Fail(const std::string& why) {
  std::cout << "EPF_RESULT ok=0 reason=\"" << why << "\"" << std::endl;
  return 1;
}

#define EPF_CHECK_OK_OR_FAIL(expr)                    \
  do {                                                \
    const absl::Status check_ = (expr);               \
    if (!check_.ok()) return Fail(check_.ToString()); \
  } while (false)

Command MakePut(int dst, uint64_t dst_offset, uint64_t src_offset, uint64_t bytes) {
  Command c = {};
  c.opcode = static_cast<uint8_t>(Opcode::kPut);
  c.dst_rank = static_cast<uint16_t>(dst);
  c.dst_offset = dst_offset;
  c.src_offset = src_offset;
  c.arg = bytes;
  return c;
}

Command MakeSignal(int dst, uint64_t dst_offset, int64_t value) {
  Command c = {};
  c.opcode = static_cast<uint8_t>(Opcode::kSignalAdd);
  c.dst_rank = static_cast<uint16_t>(dst);
  c.dst_offset = dst_offset;
  c.arg = static_cast<uint64_t>(value);
  return c;
}

// Waits until the signal word at `offset` reaches `value`.
bool WaitSignal(const RegionAccess& region, uint64_t offset, int64_t value, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (region.Load(offset) < value) {
    if (absl::Now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return true;
}

void FillSource(RegionAccess& region, const Layout& layout, int rank, uint64_t bytes) {
  std::vector<uint8_t> chunk;
  for (uint64_t done = 0; done < bytes;) {
    const uint64_t n = std::min<uint64_t>(4 << 20, bytes - done);
    chunk.resize(n);
    FillPattern(rank, done, n, chunk.data());
    region.Write(layout.Source() + done, chunk.data(), n);
    done += n;
  }
}

// First byte where `got` differs from source `source`'s pattern at `src_offset`, or -1.
int64_t Mismatch(const std::vector<uint8_t>& got, int source, uint64_t src_offset) {
  for (uint64_t i = 0; i < got.size(); ++i) {
    if (got[i] != PatternByte(source, src_offset + i)) return static_cast<int64_t>(i);
  }
  return -1;
}

int Conformance(client::Lease& lease, RegionAccess& region, Issuers& issuers, const Layout& layout) {
  const int self = lease.rank();
  const int count = absl::GetFlag(FLAGS_commands);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const absl::Duration timeout = absl::Milliseconds(absl::GetFlag(FLAGS_timeout_ms));
  FillSource(region, layout, self, layout.source_bytes);

  // The model of what arrives here: every source's streams, regenerated.
  std::vector<std::vector<uint8_t>> expected(static_cast<size_t>(layout.world * layout.channels),
                                             std::vector<uint8_t>(layout.slice_bytes, 0));
  std::vector<std::vector<uint64_t>> records(static_cast<size_t>(layout.world * layout.channels));
  for (int s = 0; s < layout.world; ++s) {
    for (int c = 0; c < layout.channels; ++c) {
      for (const Op& op : GenerateStream(seed, s, c, count, layout)) {
        if (op.dst != self) continue;
        if (op.log) {
          records[s * layout.channels + c].push_back(op.src_offset);
        } else {
          FillPattern(s, op.src_offset, op.bytes, expected[s * layout.channels + c].data() + op.dst_offset);
        }
      }
    }
  }

  // Ordering, checked while the sources still send: a record counted by a signal must already be in place.
  std::atomic<bool> stop{false};
  std::string ordering_error;
  uint64_t records_checked = 0;
  std::thread checker([&] {
    std::vector<int64_t> seen(records.size(), 0);
    while (!stop.load() && ordering_error.empty()) {
      for (int s = 0; s < layout.world && ordering_error.empty(); ++s) {
        for (int c = 0; c < layout.channels; ++c) {
          const size_t k = s * layout.channels + c;
          const int64_t counted = region.Load(layout.LogCount(s, c));
          if (counted < 0 || counted > static_cast<int64_t>(records[k].size())) {
            ordering_error = absl::StrCat("log count of source ", s, " channel ", c, " is ", counted, ", at most ",
                                          records[k].size(), " expected");
            break;
          }
          for (int64_t i = seen[k]; i < counted; ++i) {
            const auto got = region.Read(layout.Log(s, c) + i * Layout::kRecord, Layout::kRecord);
            if (Mismatch(got, s, records[k][i]) >= 0) {
              ordering_error = absl::StrCat("record ", i, " of source ", s, " channel ", c,
                                            " was counted by a signal before its bytes arrived");
              break;
            }
            ++records_checked;
          }
          seen[k] = counted;
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });

  const absl::Time start = absl::Now();
  std::vector<absl::Status> results(static_cast<size_t>(layout.channels));
  std::vector<std::thread> senders;
  uint64_t bytes_sent = 0;
  for (int c = 0; c < layout.channels; ++c) {
    std::vector<Command> commands;
    for (const Op& op : GenerateStream(seed, self, c, count, layout)) {
      if (op.log) {
        commands.push_back(MakePut(op.dst, layout.Log(self, c) + op.dst_offset * Layout::kRecord,
                                   layout.Source() + op.src_offset, Layout::kRecord));
        commands.push_back(MakeSignal(op.dst, layout.LogCount(self, c), 1));
      } else {
        commands.push_back(
            MakePut(op.dst, layout.Inbox(self, c) + op.dst_offset, layout.Source() + op.src_offset, op.bytes));
      }
      bytes_sent += op.bytes;
    }
    senders.emplace_back([&, c, commands = std::move(commands)] { results[c] = issuers.Run(c, commands, true); });
  }
  for (auto& t : senders) t.join();
  for (int c = 0; c < layout.channels; ++c) {
    if (!results[c].ok()) {
      stop = true;
      checker.join();
      return Fail(absl::StrCat("channel ", c, ": ", results[c].ToString()));
    }
  }
  std::vector<Command> done;
  for (int d = 0; d < layout.world; ++d) done.push_back(MakeSignal(d, layout.Done(self), 1));
  if (absl::Status sent = issuers.Run(0, done, true); !sent.ok()) {
    stop = true;
    checker.join();
    return Fail(absl::StrCat("done signals: ", sent.ToString()));
  }
  for (int s = 0; s < layout.world; ++s) {
    if (!WaitSignal(region, layout.Done(s), 1, timeout)) {
      stop = true;
      checker.join();
      return Fail(absl::StrCat("rank ", s, " did not signal done within ", absl::FormatDuration(timeout)));
    }
  }
  const absl::Duration elapsed = absl::Now() - start;
  stop = true;
  checker.join();
  if (!ordering_error.empty()) return Fail(ordering_error);
  for (int s = 0; s < layout.world; ++s) {
    for (int c = 0; c < layout.channels; ++c) {
      const size_t k = s * layout.channels + c;
      const auto got = region.Read(layout.Inbox(s, c), layout.slice_bytes);
      for (uint64_t i = 0; i < got.size(); ++i) {
        if (got[i] != expected[k][i]) {
          return Fail(absl::StrCat("inbox of source ", s, " channel ", c, " byte ", i, ": got ", got[i], ", expected ",
                                   expected[k][i]));
        }
      }
      if (region.Load(layout.LogCount(s, c)) != static_cast<int64_t>(records[k].size())) {
        return Fail(absl::StrCat("log count of source ", s, " channel ", c, " is ", region.Load(layout.LogCount(s, c)),
                                 ", expected ", records[k].size()));
      }
      for (size_t i = 0; i < records[k].size(); ++i) {
        if (Mismatch(region.Read(layout.Log(s, c) + i * Layout::kRecord, Layout::kRecord), s, records[k][i]) >= 0) {
          return Fail(absl::StrCat("record ", i, " of source ", s, " channel ", c, " differs"));
        }
      }
    }
  }
  std::cout << "EPF_RESULT ok=1 scenario=conformance rank=" << self << " commands=" << count * layout.channels
            << " bytes=" << bytes_sent << " records_checked_in_flight=" << records_checked
            << " elapsed_ms=" << absl::ToDoubleMilliseconds(elapsed) << std::endl;
  return 0;
}

int Big(client::Lease& lease, RegionAccess& region, Issuers& issuers, const Layout& layout) {
  const int self = lease.rank();
  const int next = (self + 1) % layout.world;
  const int previous = (self + layout.world - 1) % layout.world;
  const absl::Duration timeout = absl::Milliseconds(absl::GetFlag(FLAGS_timeout_ms));
  FillSource(region, layout, self, layout.source_bytes);
  std::vector<uint64_t> sizes = {1, 7, 4096 + 3, (1ull << 20) + 1, 16ull << 20, 64ull << 20};
  sizes.erase(std::remove_if(sizes.begin(), sizes.end(), [&](uint64_t n) { return n + 64 > layout.big_bytes; }),
              sizes.end());
  for (size_t k = 0; k < sizes.size(); ++k) {
    const uint64_t n = sizes[k];
    const uint64_t src = (k * 13) % 61;
    const int channel = static_cast<int>(k) % layout.channels;
    const absl::Time start = absl::Now();
    EPF_CHECK_OK_OR_FAIL(issuers.Run(
        channel,
        {MakePut(next, layout.Big() + 5, layout.Source() + src, n), MakeSignal(next, layout.BigRound(self), 1)}, true));
    if (!WaitSignal(region, layout.BigRound(previous), static_cast<int64_t>(k + 1), timeout)) {
      return Fail(absl::StrCat("round ", k, ": no put from rank ", previous));
    }
    const int64_t bad = Mismatch(region.Read(layout.Big() + 5, n), previous, src);
    if (bad >= 0) return Fail(absl::StrCat("round ", k, " (", n, " bytes): byte ", bad, " differs"));
    EPF_CHECK_OK_OR_FAIL(issuers.Run(channel, {MakeSignal(previous, layout.BigAck(self), 1)}, true));
    if (!WaitSignal(region, layout.BigAck(next), static_cast<int64_t>(k + 1), timeout)) {
      return Fail(absl::StrCat("round ", k, ": no ack from rank ", next));
    }
    std::cout << "EPF_BIG bytes=" << n << " round_ms=" << absl::ToDoubleMilliseconds(absl::Now() - start) << std::endl;
  }
  std::cout << "EPF_RESULT ok=1 scenario=big rank=" << self << " rounds=" << sizes.size() << std::endl;
  return 0;
}

int Stream(client::Lease& lease, RegionAccess& region, Issuers& issuers, const Layout& layout) {
  const int target = absl::GetFlag(FLAGS_target);
  constexpr uint64_t kBytes = 64 << 10;
  FillSource(region, layout, lease.rank(), kBytes);
  const absl::Time start = absl::Now();
  const absl::Time end = start + absl::Milliseconds(absl::GetFlag(FLAGS_duration_ms));
  bool announced = false;
  uint64_t rounds = 0;
  while (absl::Now() < end) {
    std::vector<Command> batch(16, MakePut(target, layout.Inbox(lease.rank(), 0), layout.Source(), kBytes));
    absl::Status status = issuers.Run(0, batch, true);
    if (!status.ok()) {
      std::cout << "EPF_TRANSPORT_ERROR unix_ms=" << absl::ToUnixMillis(absl::Now())
                << " code=" << absl::StatusCodeToString(status.code()) << " message=\"" << status.message() << "\""
                << std::endl;
      return 3;
    }
    if (!announced) {
      std::cout << "EPF_STREAMING rank=" << lease.rank() << std::endl;
      announced = true;
    }
    ++rounds;
  }
  std::cout << "EPF_RESULT ok=1 scenario=stream rounds=" << rounds << std::endl;
  return 0;
}

int Bad(client::Lease& lease, Issuers& issuers, const Layout& layout) {
  const std::string bad = absl::GetFlag(FLAGS_bad);
  const uint64_t size = lease.rdma_region_bytes();
  const int other = (lease.rank() + 1) % layout.world;
  Command command;
  if (bad == "dest_range") {
    command = MakePut(other, size - 8, layout.Source(), 64);
  } else if (bad == "src_range") {
    command = MakePut(other, layout.Inbox(0, 0), size - 1, 2);
  } else if (bad == "rank") {
    command = MakePut(layout.world + 3, 0, layout.Source(), 8);
  } else if (bad == "misaligned") {
    command = MakeSignal(other, 12, 1);
  } else {
    command = MakePut(other, 0, 0, 0);
  }
  const absl::Status refused = issuers.Run(0, {command}, true);
  std::cout << "EPF_BAD code=" << absl::StatusCodeToString(refused.code()) << " message=\"" << refused.message() << "\""
            << std::endl;
  if (!absl::IsInvalidArgument(refused)) return Fail("the bad command was not refused with INVALID_ARGUMENT");
  const absl::Status again = issuers.Run(0, {MakePut(other, layout.Inbox(0, 0), layout.Source(), 8)}, true);
  if (again.ok()) return Fail("the ring went on executing after a refused command");
  if (layout.channels > 1) {
    const absl::Status good = issuers.Run(1, {MakePut(other, layout.Inbox(0, 1), layout.Source(), 8)}, true);
    if (!good.ok()) return Fail(absl::StrCat("another channel failed too: ", good.ToString()));
  }
  std::cout << "EPF_RESULT ok=1 scenario=bad" << std::endl;
  return 0;
}

int Zero(RegionAccess& region) {
  for (uint64_t done = 0; done < region.bytes();) {
    const uint64_t n = std::min<uint64_t>(4 << 20, region.bytes() - done);
    const auto got = region.Read(done, n);
    for (uint64_t i = 0; i < n; ++i) {
      if (got[i] != 0) return Fail(absl::StrCat("byte ", done + i, " of the RDMA region is ", got[i]));
    }
    done += n;
  }
  std::cout << "EPF_RESULT ok=1 scenario=zero bytes=" << region.bytes() << std::endl;
  return 0;
}

int Main() {
  if (absl::GetFlag(FLAGS_scenario) == "bench") return BenchMain();
  Layout layout;
  layout.big_bytes = absl::GetFlag(FLAGS_scenario) == "big" ? absl::GetFlag(FLAGS_big_max) + 64 : 0;
  if (absl::GetFlag(FLAGS_scenario) == "big") layout.source_bytes = absl::GetFlag(FLAGS_big_max) + 64;
  if (absl::GetFlag(FLAGS_print_region_bytes)) {
    layout.world = absl::GetFlag(FLAGS_world);
    layout.channels = absl::GetFlag(FLAGS_channels);
    std::cout << layout.RegionBytes() << std::endl;
    return 0;
  }
  auto attached = AttachRank(absl::GetFlag(FLAGS_socket), absl::GetFlag(FLAGS_group), absl::GetFlag(FLAGS_rank),
                             absl::GetFlag(FLAGS_token), absl::GetFlag(FLAGS_device));
  if (!attached.ok()) return Fail(attached.status().ToString());
  client::Lease& l = *attached->lease;
  layout.world = l.world_size();
  layout.channels = static_cast<int>(l.group().transport_channels());
  const bool device = l.backend() == v1::BACKEND_CUDA;
  RegionAccess region(l.rdma_region(), l.rdma_region_bytes(), device);
  const std::string scenario = absl::GetFlag(FLAGS_scenario);
  if (scenario == "flood" || scenario == "signals") {
    auto issuers = Issuers::Create(l, false, absl::Milliseconds(absl::GetFlag(FLAGS_timeout_ms)));
    if (!issuers.ok()) return Fail(issuers.status().ToString());
    if (scenario == "flood") {
      return FloodScenario(l, **issuers, absl::GetFlag(FLAGS_flood_bytes),
                           absl::Milliseconds(absl::GetFlag(FLAGS_duration_ms)));
    }
    return SignalLatencyScenario(l, region, **issuers, absl::GetFlag(FLAGS_signals),
                                 absl::Milliseconds(absl::GetFlag(FLAGS_signal_gap_ms)));
  }
  if (absl::GetFlag(FLAGS_scenario) != "zero" && absl::GetFlag(FLAGS_scenario) != "bad" &&
      region.bytes() < layout.RegionBytes()) {
    return Fail(
        absl::StrCat("the RDMA region has ", region.bytes(), " bytes; the scenario needs ", layout.RegionBytes()));
  }
  auto issuers = Issuers::Create(l, absl::GetFlag(FLAGS_issue_from) == "device",
                                 absl::Milliseconds(absl::GetFlag(FLAGS_timeout_ms)));
  if (!issuers.ok()) return Fail(issuers.status().ToString());
  if (scenario == "conformance") return Conformance(l, region, **issuers, layout);
  if (scenario == "big") return Big(l, region, **issuers, layout);
  if (scenario == "stream") return Stream(l, region, **issuers, layout);
  if (scenario == "bad") return Bad(l, **issuers, layout);
  if (scenario == "zero") return Zero(region);
  std::cerr << "--scenario: '" << scenario << "' is not conformance, big, stream, bad or zero" << std::endl;
  return 2;
}

}  // namespace
}  // namespace epfabric::tools

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return epfabric::tools::Main();
}
