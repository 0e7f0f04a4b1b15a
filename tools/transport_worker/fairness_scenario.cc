#include "fairness_scenario.h"

#include <algorithm>
#include <atomic>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace epfabric::tools {
namespace {

using kernels::transport::Command;
using kernels::transport::Opcode;

int Failed(const std::string& why) {
  std::cout << "EPF_RESULT ok=0 reason=\"" << why << "\"" << std::endl;
  return 1;
}

}  // namespace

int FloodScenario(client::Lease& lease, Issuers& issuers, uint64_t flood_bytes, absl::Duration duration) {
  const uint64_t half = lease.rdma_region_bytes() / 2;
  if (flood_bytes == 0 || flood_bytes > half) {
    return Failed(absl::StrCat("--flood_bytes ", flood_bytes, " must be in 1..", half, " (half the region)"));
  }
  Command put = {};
  put.opcode = static_cast<uint8_t>(Opcode::kPut);
  put.dst_rank = static_cast<uint16_t>(lease.rank());
  put.dst_offset = half;
  put.src_offset = 0;
  put.arg = flood_bytes;
  const int channels = static_cast<int>(lease.group().transport_channels());
  const absl::Time end = absl::Now() + duration;
  std::atomic<uint64_t> puts{0};
  std::mutex mutex;
  std::string error;
  std::vector<std::thread> threads;
  std::once_flag announced;
  for (int c = 0; c < channels; ++c) {
    threads.emplace_back([&, c] {
      while (absl::Now() < end) {
        std::call_once(announced, [] { std::cout << "EPF_FLOODING" << std::endl; });
        const absl::Status status = issuers.Run(c, std::vector<Command>(4, put), true);
        if (!status.ok()) {
          std::lock_guard<std::mutex> lock(mutex);
          error = absl::StrCat("channel ", c, ": ", status.ToString());
          return;
        }
        puts += 4;
      }
    });
  }
  for (auto& t : threads) t.join();
  if (!error.empty()) return Failed(error);
  std::cout << "EPF_RESULT ok=1 scenario=flood puts=" << puts.load() << " bytes_each=" << flood_bytes << std::endl;
  return 0;
}

int SignalLatencyScenario(client::Lease& lease, RegionAccess& region, Issuers& issuers, int count, absl::Duration gap) {
  Command signal = {};
  signal.opcode = static_cast<uint8_t>(Opcode::kSignalAdd);
  signal.dst_rank = static_cast<uint16_t>(lease.rank());
  signal.dst_offset = 0;
  signal.arg = 1;
  const int64_t before = region.Load(0);
  std::vector<double> micros;
  for (int i = 0; i < count; ++i) {
    const absl::Time start = absl::Now();
    if (absl::Status status = issuers.Run(0, {signal}, true); !status.ok()) {
      return Failed(absl::StrCat("signal ", i, ": ", status.ToString()));
    }
    micros.push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
    absl::SleepFor(gap);
  }
  if (region.Load(0) != before + count) {
    return Failed(absl::StrCat("the signal word is ", region.Load(0), ", expected ", before + count));
  }
  std::sort(micros.begin(), micros.end());
  std::cout << "EPF_LATENCY median_us=" << micros[micros.size() / 2] << " p90_us=" << micros[micros.size() * 9 / 10]
            << " max_us=" << micros.back() << std::endl;
  std::cout << "EPF_RESULT ok=1 scenario=signals count=" << count << std::endl;
  return 0;
}

}  // namespace epfabric::tools
