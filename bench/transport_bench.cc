// Transport benchmark (issue #11): 2 epfabricd acting as separate hosts (--host_id=host-a / host-b, socket wire), a
// group of 2 ranks with an RDMA region, and one `epfabric_transport_worker --scenario=bench` per rank
// (tools/transport_worker/bench_scenario.h has the phases). Measures:
//   - command post → proxy pickup (publish until RingControl::consumed passes it), idle (a pause before each command:
//     the proxy has gone from spinning to sleeping) and warm (back to back); both depend on the daemons'
//     --proxy_spin_us (default 1000 µs) and the proxy's sleep backoff (10 µs doubling to 1 ms);
//   - socket-wire put bandwidth to the other host for 4 KiB .. 16 MiB, on one ring and on all rings at once;
//   - signal round trip (ping-pong of signal_add, each rank spinning on its own region's word);
//   - the daemons' CPU use (utime + stime from /proc/<pid>/stat): idle for 2 s, and during the bandwidth phases.
// Prints a table and writes <out>/transport-<UTC time>.json (transport-cpu-... for a host-backend run).
//
// Usage: transport_bench [--out DIR] [--backend auto|host|cuda] [--issue_from host|device] [--quick]
//                        [--channels N] [--proxy_spin_us N] [--proxy_threads N]
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/report.h"
#include "epfabric/v1/control.grpc.pb.h"
#include "integration/fabric_under_test.h"
#include "integration/subprocess.h"

namespace epfabric::bench {
namespace {

using testing::FabricUnderTest;
using testing::Subprocess;

struct Options {
  std::string out = "bench/results";
  std::string backend = "auto";
  std::string issue_from = "host";
  bool quick = false;
  int channels = 4;
  int proxy_spin_us = -1;  // -1: the daemon's default
  int proxy_threads = -1;
};

// $EPF_TRANSPORT_WORKER_BINARY, else the worker next to this binary (a device bundle), else the build tree's.
std::string WorkerBinary() {
  const char* env = std::getenv("EPF_TRANSPORT_WORKER_BINARY");
  if (env != nullptr && *env != '\0') return env;
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const auto sibling = self.parent_path() / "epfabric_transport_worker";
    if (std::filesystem::exists(sibling, ec)) return sibling.string();
  }
  return EPF_TRANSPORT_WORKER_BINARY;
}

double CpuSeconds(int pid) {
  std::ifstream file(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(file, line) || line.rfind(')') == std::string::npos) return -1;
  std::istringstream rest(line.substr(line.rfind(')') + 2));
  std::string field;
  double ticks = 0;
  for (int i = 0; i <= 12 && rest >> field; ++i) {  // field 3 (state) is i = 0; utime is field 14, stime 15
    if (i == 11 || i == 12) ticks += std::stod(field);
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

std::string GitCommit() {
  FILE* pipe = popen("git rev-parse --short HEAD 2>/dev/null", "r");
  if (pipe == nullptr) return "unknown";
  char buffer[64] = {};
  const bool read = std::fgets(buffer, sizeof(buffer), pipe) != nullptr;
  pclose(pipe);
  const std::string commit(absl::StripAsciiWhitespace(buffer));
  return read && !commit.empty() ? commit : "unknown";
}

std::string CpuModel() {
  std::ifstream file("/proc/cpuinfo");
  std::string line;
  while (std::getline(file, line)) {
    if (absl::StartsWith(line, "model name"))
      return std::string(absl::StripAsciiWhitespace(line.substr(line.find(':') + 1)));
  }
  return "unknown CPU";
}

// `EPF_BENCH key=value` lines of a worker's output.
std::map<std::string, double> ParseResults(const std::string& out, std::string* info) {
  std::map<std::string, double> results;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (absl::ConsumePrefix(&line, "EPF_BENCH_INFO ")) {
      *info = std::string(line);
    } else if (absl::ConsumePrefix(&line, "EPF_BENCH ")) {
      std::pair<std::string, std::string> kv = absl::StrSplit(line, absl::MaxSplits('=', 1));
      double value = 0;
      if (absl::SimpleAtod(kv.second, &value)) results[kv.first] = value;
    }
  }
  return results;
}

std::string InfoField(const std::string& info, const std::string& key) {
  for (absl::string_view part : absl::StrSplit(info, ' ')) {
    if (absl::ConsumePrefix(&part, key + "=")) return std::string(part);
  }
  return "";
}

int Run(const Options& o) {
  const std::string worker = WorkerBinary();
  const std::vector<std::string> bench_flags =
      o.quick ? std::vector<std::string>{"--bench_latency_samples=2000", "--bench_idle_samples=300",
                                         "--bench_rtt_samples=2000", "--bench_bytes_per_rep=33554432", "--bench_reps=3"}
              : std::vector<std::string>{};
  auto bytes_run =
      testing::RunBinary({worker, "--scenario=bench", "--print_region_bytes", absl::StrCat("--channels=", o.channels)});
  uint64_t region_bytes = 0;
  if (bytes_run.exit_code != 0 || !absl::SimpleAtoi(absl::StripAsciiWhitespace(bytes_run.out), &region_bytes)) {
    std::fprintf(stderr, "%s --print_region_bytes: %d %s%s\n", worker.c_str(), bytes_run.exit_code,
                 bytes_run.out.c_str(), bytes_run.err.c_str());
    return 1;
  }

  std::vector<std::string> daemon_flags = {"--backend=" + o.backend, "--transport=socket", "--log_level=warn",
                                           "--heartbeat_ms=200", "--heartbeat_misses=10"};
  if (o.proxy_spin_us >= 0) daemon_flags.push_back(absl::StrCat("--proxy_spin_us=", o.proxy_spin_us));
  if (o.proxy_threads > 0) daemon_flags.push_back(absl::StrCat("--proxy_threads=", o.proxy_threads));
  auto fabric = FabricUnderTest::Start(2, daemon_flags, {{0, {"--host_id=host-a"}}, {1, {"--host_id=host-b"}}});
  if (!fabric.ok() || !(*fabric)->WaitComplete().ok()) {
    std::fprintf(stderr, "the 2-daemon fabric did not form: %s\n",
                 fabric.ok() ? "WaitComplete" : fabric.status().ToString().c_str());
    return 1;
  }
  FabricUnderTest& f = **fabric;
  v1::CreateGroupRequest request;
  request.set_name("transport-bench");
  request.add_ranks(0);
  request.add_ranks(1);
  request.set_num_nvl_bytes(4096);
  request.set_num_rdma_bytes(region_bytes);
  request.set_transport_channels(o.channels);
  grpc::ClientContext context;
  v1::CreateGroupResponse created;
  if (grpc::Status s = f.Control(0)->CreateGroup(&context, request, &created); !s.ok()) {
    std::fprintf(stderr, "CreateGroup: %s\n", s.error_message().c_str());
    return 1;
  }
  const int pids[2] = {f.daemon(0).process().pid(), f.daemon(1).process().pid()};

  // Idle: the group exists and its rings are being proxied, nobody issues.
  const double idle_seconds = 2.0;
  double before[2] = {CpuSeconds(pids[0]), CpuSeconds(pids[1])};
  const absl::Time idle_start = absl::Now();
  absl::SleepFor(absl::Seconds(idle_seconds));
  const double idle_wall = absl::ToDoubleSeconds(absl::Now() - idle_start);
  std::map<std::string, double> results;
  results["cpu_idle_sender_cores"] = (CpuSeconds(pids[0]) - before[0]) / idle_wall;
  results["cpu_idle_receiver_cores"] = (CpuSeconds(pids[1]) - before[1]) / idle_wall;

  std::vector<Subprocess> workers;
  for (int r = 0; r < 2; ++r) {
    std::vector<std::string> argv = {worker,
                                     "--scenario=bench",
                                     "--socket=" + f.daemon(r).socket(),
                                     "--group=transport-bench",
                                     absl::StrCat("--rank=", r),
                                     "--token=" + created.token(),
                                     "--issue_from=" + o.issue_from,
                                     "--timeout_ms=60000",
                                     absl::StrCat("--bench_daemon_pids=", pids[0], ",", pids[1])};
    argv.insert(argv.end(), bench_flags.begin(), bench_flags.end());
    auto started = Subprocess::Start(argv);
    if (!started.ok()) {
      std::fprintf(stderr, "worker %d: %s\n", r, started.status().ToString().c_str());
      return 1;
    }
    workers.push_back(std::move(*started));
  }
  for (int r = 0; r < 2; ++r) {
    auto code = workers[r].Wait(absl::Seconds(480));
    if (!code.ok() || *code != 0) {
      std::fprintf(stderr, "worker %d failed (%s):\n%s%s\n", r, code.ok() ? absl::StrCat(*code).c_str() : "timeout",
                   workers[r].Stdout().c_str(), workers[r].Stderr().c_str());
      return 1;
    }
  }
  std::string info;
  for (const auto& [key, value] : ParseResults(workers[0].Stdout(), &info)) results[key] = value;
  const std::string backend = InfoField(info, "backend");
  const bool cpu_run = backend != "cuda";

  Report report(cpu_run ? "transport-cpu" : "transport");
  report.SetDevice(
      cpu_run ? absl::StrCat("CPU host-backend run (", CpuModel(), ", ", sysconf(_SC_NPROCESSORS_ONLN), " cores)")
              : CudaDeviceName());
  report.SetConfig("backend", backend);
  report.SetConfig("transport", std::string("socket (loopback TCP, 2 daemons as hosts host-a/host-b)"));
  report.SetConfig("issue_from", o.issue_from);
  report.SetConfig("latency_issue_from", std::string("host"));
  report.SetConfig("channels", static_cast<double>(o.channels));
  report.SetConfig("ring_slots", static_cast<double>(std::atoi(InfoField(info, "ring_slots").c_str())));
  report.SetConfig("proxy_spin_us",
                   o.proxy_spin_us >= 0 ? absl::StrCat(o.proxy_spin_us) : std::string("daemon default (1000)"));
  report.SetConfig("proxy_threads",
                   o.proxy_threads > 0 ? absl::StrCat(o.proxy_threads) : std::string("daemon default (2)"));
  report.SetConfig("quick", o.quick ? std::string("yes") : std::string("no"));
  report.SetConfig("idle_gap_us", 3000.0);
  report.SetConfig("statistic", std::string("latency: median and p99 of samples; bandwidth: median of repetitions"));
  for (const auto& [key, value] : results) report.SetResult(key, value);

  auto get = [&](const std::string& key) { return results.count(key) ? results.at(key) : -1.0; };
  std::printf("transport bench: backend %s, issue_from %s, %d channels, proxy_spin_us %s%s\n", backend.c_str(),
              o.issue_from.c_str(), o.channels,
              o.proxy_spin_us >= 0 ? absl::StrCat(o.proxy_spin_us).c_str() : "default (1000)",
              o.quick ? ", --quick" : "");
  std::printf("%-44s %12s %12s\n", "latency (host-issued)", "median us", "p99 us");
  std::printf("%-44s %12.2f %12.2f\n", "post -> pickup, idle (3 ms gap, proxy asleep)", get("pickup_idle_median_us"),
              get("pickup_idle_p99_us"));
  std::printf("%-44s %12.2f %12.2f\n", "post -> pickup, warm (back to back)", get("pickup_warm_median_us"),
              get("pickup_warm_p99_us"));
  std::printf("%-44s %12.2f %12.2f\n", "signal_add round trip (ping-pong)", get("signal_rtt_median_us"),
              get("signal_rtt_p99_us"));
  std::printf("%-44s %12s %12s\n", "put bandwidth to the other host (GB/s)", "1 channel",
              absl::StrCat(o.channels, " channels").c_str());
  for (const char* size : {"4096", "65536", "1048576", "16777216"}) {
    std::printf("%-44s %12.3f %12.3f\n", absl::StrCat(size, " B").c_str(), get(absl::StrCat("put_", size, "_1ch_gbps")),
                get(absl::StrCat("put_", size, "_allch_gbps")));
  }
  std::printf("%-44s %12s %12s\n", "daemon CPU (cores = CPU-s per s)", "sender", "receiver");
  for (const char* phase : {"idle", "bw_1ch", "bw_allch"}) {
    std::printf("%-44s %12.3f %12.3f\n", phase, get(absl::StrCat("cpu_", phase, "_sender_cores")),
                get(absl::StrCat("cpu_", phase, "_receiver_cores")));
  }
  std::error_code mkdir_error;
  std::filesystem::create_directories(o.out, mkdir_error);
  auto path = report.WriteTo(o.out);
  if (!path.ok()) {
    std::fprintf(stderr, "%s\n", path.status().ToString().c_str());
    return 1;
  }
  std::printf("wrote %s\n", path->c_str());
  return 0;
}

}  // namespace
}  // namespace epfabric::bench

int main(int argc, char** argv) {
  epfabric::bench::Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const std::string& name) -> const char* {
      if (absl::StartsWith(arg, name + "=")) return argv[i] + name.size() + 1;
      if (arg == name && i + 1 < argc) return argv[++i];
      return nullptr;
    };
    if (arg == "--quick") {
      o.quick = true;
    } else if (const char* v = value("--out")) {
      o.out = v;
    } else if (const char* v = value("--backend")) {
      o.backend = v;
    } else if (const char* v = value("--issue_from")) {
      o.issue_from = v;
    } else if (const char* v = value("--channels")) {
      o.channels = std::atoi(v);
    } else if (const char* v = value("--proxy_spin_us")) {
      o.proxy_spin_us = std::atoi(v);
    } else if (const char* v = value("--proxy_threads")) {
      o.proxy_threads = std::atoi(v);
    } else {
      std::fprintf(stderr,
                   "usage: transport_bench [--out DIR] [--backend auto|host|cuda] [--issue_from host|device] [--quick]"
                   " [--channels N] [--proxy_spin_us N] [--proxy_threads N]\n");
      return 2;
    }
  }
  if (o.channels < 1 || o.channels > 32 || (o.issue_from != "host" && o.issue_from != "device")) {
    std::fprintf(stderr, "transport_bench: --channels must be 1..32, --issue_from host or device\n");
    return 2;
  }
  if (const char* commit = std::getenv("EPF_COMMIT"); commit == nullptr || *commit == '\0') {
    setenv("EPF_COMMIT", epfabric::bench::GitCommit().c_str(), 1);
  }
  return epfabric::bench::Run(o);
}
