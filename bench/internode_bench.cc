// Internode normal-mode benchmark (issue #12): 4 epfabricd (host backend) acting as 2 hosts x 2 ranks (--host_id),
// the transport's socket wire on loopback, and one epfabric_worker per rank running checked dispatch + combine
// rounds (DeepSeek-like shape: hidden 7168, top-8 of 32 experts). On this wire the figures show that the machinery
// works and what it moves, not what a NIC would give: per-phase times (dispatch, combine; median of the rounds,
// slowest rank), bytes per host pair per direction, and transport messages per token (one per token and remote host;
// docs/internode-dispatch.md compares this with DeepEP on paper).
// Prints a table and writes <out>/internode-cpu-<UTC time>.json.
//
// --worst: the dispatches in worst-case mode (num_worst_tokens = ranks x tokens: the gateways forward their rows at
// fixed places, padding included, and on cuda the RDMA stage would run on the device; decision 88).
//
// Usage: internode_bench [--out DIR] [--tokens N] [--rounds N] [--worst]
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/report.h"
#include "epfabric/v1/control.grpc.pb.h"
#include "integration/fabric_under_test.h"
#include "integration/subprocess.h"

namespace epfabric::bench {
namespace {

using testing::FabricUnderTest;
using testing::Subprocess;

constexpr int kHosts = 2, kPerHost = 2, kRanks = kHosts * kPerHost;
constexpr int kHidden = 7168, kTopk = 8, kExperts = 32;

std::string WorkerBinary() {
  const char* env = std::getenv("EPF_WORKER_BINARY");
  if (env != nullptr && *env != '\0') return env;
  std::error_code ec;
  const auto sibling = std::filesystem::read_symlink("/proc/self/exe", ec).parent_path() / "epfabric_worker";
  if (!ec && std::filesystem::exists(sibling, ec)) return sibling.string();
  return EPF_WORKER_BINARY;
}

std::string CpuModel() {
  std::ifstream file("/proc/cpuinfo");
  std::string line;
  while (std::getline(file, line)) {
    if (absl::StartsWith(line, "model name")) {
      return std::string(absl::StripAsciiWhitespace(line.substr(line.find(':') + 1)));
    }
  }
  return "unknown CPU";
}

// key=value fields of a worker's EPF_RESULT line.
std::map<std::string, std::string> ResultFields(const std::string& out) {
  std::map<std::string, std::string> fields;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (!absl::ConsumePrefix(&line, "EPF_RESULT ")) continue;
    for (absl::string_view part : absl::StrSplit(line, ' ')) {
      std::pair<std::string, std::string> kv = absl::StrSplit(part, absl::MaxSplits('=', 1));
      fields[kv.first] = kv.second;
    }
  }
  return fields;
}

double Number(const std::map<std::string, std::string>& f, const std::string& key) {
  double v = -1;
  return f.count(key) && absl::SimpleAtod(f.at(key), &v) ? v : -1;
}

int Run(const std::string& out, int tokens, int rounds, bool worst) {
  const std::string worker = WorkerBinary();
  const int worst_tokens = worst ? kRanks * tokens : 0;
  std::vector<std::string> scenario = {"--mode=normal",
                                       absl::StrCat("--tokens=", tokens),
                                       "--fixed_tokens",
                                       absl::StrCat("--hidden=", kHidden),
                                       absl::StrCat("--topk=", kTopk),
                                       absl::StrCat("--experts=", kExperts),
                                       absl::StrCat("--repeats=", rounds),
                                       "--seed=3",
                                       "--timeout_ms=60000"};
  if (worst) scenario.push_back(absl::StrCat("--worst_tokens=", worst_tokens));
  std::vector<std::string> argv = {worker, "--region_bytes", absl::StrCat("--ranks=", kPerHost),
                                   absl::StrCat("--hosts=", kHosts)};
  argv.insert(argv.end(), scenario.begin(), scenario.end());
  testing::RunResult sizes = testing::RunBinary(argv);
  std::vector<std::string> parts = absl::StrSplit(absl::StripAsciiWhitespace(sizes.out), ' ');
  uint64_t nvl = 0, rdma = 0;
  if (sizes.exit_code != 0 || parts.size() != 2 || !absl::SimpleAtoi(parts[0], &nvl) ||
      !absl::SimpleAtoi(parts[1], &rdma)) {
    std::fprintf(stderr, "--region_bytes: %d %s%s\n", sizes.exit_code, sizes.out.c_str(), sizes.err.c_str());
    return 1;
  }
  std::map<int, std::vector<std::string>> hosts;
  for (int r = 0; r < kRanks; ++r) hosts[r] = {absl::StrCat("--host_id=host-", r / kPerHost)};
  auto fabric = FabricUnderTest::Start(
      kRanks, {"--transport=socket", "--log_level=warn", "--heartbeat_ms=200", "--heartbeat_misses=10"}, hosts);
  if (!fabric.ok() || !(*fabric)->WaitComplete().ok()) {
    std::fprintf(stderr, "the fabric did not form\n");
    return 1;
  }
  FabricUnderTest& f = **fabric;
  v1::CreateGroupRequest request;
  request.set_name("internode-bench");
  for (int r = 0; r < kRanks; ++r) request.add_ranks(r);
  request.set_num_nvl_bytes(nvl);
  request.set_num_rdma_bytes(rdma);
  grpc::ClientContext context;
  v1::CreateGroupResponse created;
  if (grpc::Status s = f.Control(0)->CreateGroup(&context, request, &created); !s.ok()) {
    std::fprintf(stderr, "CreateGroup: %s\n", s.error_message().c_str());
    return 1;
  }
  std::vector<Subprocess> workers;
  for (int r = 0; r < kRanks; ++r) {
    std::vector<std::string> w = {worker, "--socket=" + f.daemon(r).socket(), "--group=internode-bench",
                                  absl::StrCat("--rank=", r), "--token=" + created.token()};
    w.insert(w.end(), scenario.begin(), scenario.end());
    auto started = Subprocess::Start(w);
    if (!started.ok()) return 1;
    workers.push_back(std::move(*started));
  }
  double dispatch_ms = 0, combine_ms = 0, remote_rows = 0, total_tokens = 0;
  for (int r = 0; r < kRanks; ++r) {
    auto code = workers[r].Wait(absl::Seconds(600));
    const auto fields = ResultFields(workers[r].Stdout());
    if (!code.ok() || *code != 0 || !fields.count("ok") || fields.at("ok") != "1") {
      std::fprintf(stderr, "worker %d failed:\n%s%s\n", r, workers[r].Stdout().c_str(), workers[r].Stderr().c_str());
      return 1;
    }
    dispatch_ms = std::max(dispatch_ms, Number(fields, "dispatch_ms"));
    combine_ms = std::max(combine_ms, Number(fields, "combine_ms"));
    remote_rows += Number(fields, "remote_rows_total");
    total_tokens += Number(fields, "tokens_total");
  }
  const double row_bytes = kHidden * 2.0;  // BF16 x; top-k ids and weights add 96 B per row
  const double pairs = kHosts * (kHosts - 1);
  const double rows_per_pair = remote_rows / rounds / pairs;
  const double per_pair_mb = rows_per_pair * (row_bytes + kTopk * 12.0) / 1e6;

  Report report("internode-cpu");
  report.SetDevice(absl::StrCat("CPU host-backend run (", CpuModel(), ", ", sysconf(_SC_NPROCESSORS_ONLN), " cores)"));
  report.SetConfig("transport", std::string("socket (loopback TCP), 4 daemons as 2 hosts x 2 ranks"));
  report.SetConfig("hosts", static_cast<double>(kHosts));
  report.SetConfig("ranks_per_host", static_cast<double>(kPerHost));
  report.SetConfig("tokens_per_rank", static_cast<double>(tokens));
  report.SetConfig("hidden", static_cast<double>(kHidden));
  report.SetConfig("topk", static_cast<double>(kTopk));
  report.SetConfig("experts", static_cast<double>(kExperts));
  report.SetConfig("dtype", std::string("bf16"));
  report.SetConfig("rounds", static_cast<double>(rounds));
  report.SetConfig("path", std::string(worst ? "worst-case (rows at fixed places, padding forwarded)" : "host-driven"));
  report.SetConfig("num_worst_tokens", static_cast<double>(worst_tokens));
  report.SetConfig("statistic", std::string("median of the rounds, slowest rank; every round checked"));
  report.SetResult("dispatch_ms", dispatch_ms);
  report.SetResult("combine_ms", combine_ms);
  report.SetResult("rows_per_host_pair_per_direction", rows_per_pair);
  report.SetResult("dispatch_mb_per_host_pair_per_direction", per_pair_mb);
  report.SetResult("combine_mb_per_host_pair_per_direction", rows_per_pair * (row_bytes + kTopk * 4.0) / 1e6);
  report.SetResult("transport_messages_per_token", remote_rows / total_tokens);

  std::printf(
      "internode bench (host backend, socket wire, 2 hosts x 2 ranks, %d tokens/rank, hidden %d, top-%d of %d%s)\n",
      tokens, kHidden, kTopk, kExperts, worst ? ", worst-case mode" : "");
  std::printf("%-48s %12.2f\n", "dispatch (ms, median, slowest rank)", dispatch_ms);
  std::printf("%-48s %12.2f\n", "combine (ms, median, slowest rank)", combine_ms);
  std::printf("%-48s %12.1f\n", "rows per host pair per direction", rows_per_pair);
  std::printf("%-48s %12.2f\n", "dispatch MB per host pair per direction", per_pair_mb);
  std::printf("%-48s %12.3f\n", "transport messages (rows) per token", remote_rows / total_tokens);
  std::error_code ec;
  std::filesystem::create_directories(out, ec);
  auto path = report.WriteTo(out);
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
  std::string out = "bench/results";
  int tokens = 512, rounds = 10;
  bool worst = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--out" && i + 1 < argc) {
      out = argv[++i];
    } else if (absl::StartsWith(arg, "--tokens=")) {
      tokens = std::atoi(arg.c_str() + 9);
    } else if (absl::StartsWith(arg, "--rounds=")) {
      rounds = std::atoi(arg.c_str() + 9);
    } else if (arg == "--worst") {
      worst = true;
    } else if (arg == "--quick") {
      tokens = 128;
      rounds = 3;
    } else {
      std::fprintf(stderr, "usage: internode_bench [--out DIR] [--tokens=N] [--rounds=N] [--worst] [--quick]\n");
      return 2;
    }
  }
  if (tokens < 1 || rounds < 1) return 2;
  return epfabric::bench::Run(out, tokens, rounds, worst);
}
