// Elastic EP on the host backend (issue #36): the kill-and-replace scenario of tests/integration/elastic_scenario.h
// run N times on 4 real daemons (loopback) with one epfabric_worker process per rank, every round checked element by
// element. Per run:
//   survivor_next_call_ms: from the SIGKILL of rank 3's client to each survivor's first call that returned with rank 3
//     masked (every survivor's sample counts);
//   replacement_client_full_strength_ms: from the launch of the replacement process for rank 3 to the return of its
//     first dispatch at full strength (after Buffer::Rejoin). It includes the engine's choice of the step: the
//     survivors report the replacement waiting, the orchestrator picks a round --margin rounds ahead of the furthest
//     survivor, and the replacement waits for the survivors to get there;
//   replacement_attached_ms: from that launch to its Buffer made (connect, attach, Buffer::Create): ready to rejoin.
// Prints a table and writes bench/results/elastic-host-<date>.json (medians under `results`).
//
//   elastic_bench [--runs N] [--quick] [--margin ROUNDS] [--out DIR]
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/report.h"
#include "integration/e2e_fixture.h"
#include "integration/elastic_scenario.h"

namespace epfabric::bench {
namespace {

constexpr int kRanks = 4;

absl::StatusOr<std::string> CreateGroup(testing::FabricUnderTest& fabric, const std::string& name,
                                        const std::vector<std::string>& scenario) {
  std::vector<std::string> argv = {testing::WorkerBinary(), "--region_bytes", absl::StrCat("--ranks=", kRanks)};
  argv.insert(argv.end(), scenario.begin(), scenario.end());
  testing::RunResult sized = testing::RunBinary(argv);
  uint64_t bytes = 0;
  if (sized.exit_code != 0 || !absl::SimpleAtoi(absl::StripAsciiWhitespace(sized.out), &bytes)) {
    return absl::InternalError(absl::StrCat("--region_bytes: ", sized.out, sized.err));
  }
  v1::CreateGroupRequest request;
  request.set_name(name);
  for (int r = 0; r < kRanks; ++r) request.add_ranks(r);
  request.set_num_nvl_bytes(bytes);
  request.set_low_latency(true);
  grpc::ClientContext context;
  v1::CreateGroupResponse response;
  const grpc::Status status = fabric.Control(0)->CreateGroup(&context, request, &response);
  if (!status.ok()) return absl::InternalError(status.error_message());
  return response.token();
}

}  // namespace
}  // namespace epfabric::bench

int main(int argc, char** argv) {
  using namespace epfabric;
  namespace et = ::epfabric::testing;
  std::string out_dir = "bench/results";
  int runs = 10, margin = 10;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--out") == 0 && i + 1 < argc) {
      out_dir = argv[++i];
    } else if (std::strcmp(argv[i], "--runs") == 0 && i + 1 < argc) {
      runs = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--margin") == 0 && i + 1 < argc) {
      margin = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--quick") == 0) {
      runs = 5;
    } else {
      std::fprintf(stderr, "usage: elastic_bench [--runs N] [--quick] [--margin ROUNDS] [--out DIR]\n");
      return 2;
    }
  }
  auto fabric = et::FabricUnderTest::Start(bench::kRanks, et::kFast);
  if (!fabric.ok() || !(*fabric)->WaitComplete().ok()) {
    std::fprintf(stderr, "cannot form the 4-daemon fabric\n");
    return 1;
  }
  const std::vector<std::string> scenario =
      et::Shape("low_latency", 16, 256, 4, 16, /*fp8=*/true, 36, {"--timeout_ms=5000"});
  auto token = bench::CreateGroup(**fabric, "elastic-bench", scenario);
  if (!token.ok()) {
    std::fprintf(stderr, "CreateGroup: %s\n", token.status().ToString().c_str());
    return 1;
  }
  const et::ElasticOptions options{.victim = 3, .rounds_after = 5, .round_pause_ms = 2, .rejoin_margin = margin};
  std::vector<double> survivor_ms, full_strength_ms, attached_ms;
  for (int run = 0; run < runs; ++run) {
    const std::string dir = absl::StrCat(et::MakeTempDir(), "/elastic-", run);
    std::filesystem::create_directories(dir);
    auto start = [&](int rank, std::vector<std::string> extra) {
      std::vector<std::string> argv = {et::WorkerBinary(), "--socket=" + (*fabric)->daemon(rank).socket(),
                                       "--group=elastic-bench", absl::StrCat("--rank=", rank), "--token=" + *token};
      argv.insert(argv.end(), scenario.begin(), scenario.end());
      argv.insert(argv.end(), extra.begin(), extra.end());
      return et::Subprocess::Start(argv);
    };
    auto result = et::RunElasticScenario(start, bench::kRanks, dir, options, /*slowdown=*/1);
    if (!result.ok()) {
      std::fprintf(stderr, "run %d: %s\n", run, result.status().ToString().c_str());
      return 1;
    }
    for (const et::Finished& f : result->finished) {
      if (f.exit_code != 0 || !f.result.count("ok") || f.result.at("ok") != "1") {
        std::fprintf(stderr, "run %d: %s\n", run, f.Describe().c_str());
        return 1;
      }
    }
    survivor_ms.insert(survivor_ms.end(), result->survivor_next_call_ms.begin(), result->survivor_next_call_ms.end());
    full_strength_ms.push_back(result->replacement_client_full_strength_ms);
    attached_ms.push_back(result->replacement_attached_ms);
    std::filesystem::remove_all(dir);
  }
  bench::Report report("elastic-host");
  report.SetDevice("host");
  report.SetConfig("backend", std::string("host"));
  report.SetConfig("mode", std::string("low_latency, enable_shrink, one host (4 daemons on loopback)"));
  report.SetConfig("ranks", 4.0);
  report.SetConfig("tokens", 16.0);
  report.SetConfig("hidden", 256.0);
  report.SetConfig("topk", 4.0);
  report.SetConfig("experts", 16.0);
  report.SetConfig("fp8", std::string("true"));
  report.SetConfig("runs", static_cast<double>(runs));
  report.SetConfig("rejoin_margin_rounds", static_cast<double>(margin));
  report.SetConfig("round_pause_ms", 2.0);
  report.SetConfig("cpu_cores", static_cast<double>(sysconf(_SC_NPROCESSORS_ONLN)));
  std::printf("%-40s %10s %10s %10s %6s\n", "measure", "median", "p10", "p90", "count");
  auto row = [&](const std::string& key, const std::vector<double>& samples) {
    const bench::Summary s = bench::Summarize(samples);
    std::printf("%-40s %7.1f ms %7.1f ms %7.1f ms %6zu\n", key.c_str(), s.median, s.p10, s.p90, s.count);
    report.SetResult(key, s.median);
    report.SetResult(absl::StrCat(key.substr(0, key.size() - 3), "_p90_ms"), s.p90);
  };
  row("survivor_next_call_ms", survivor_ms);
  row("replacement_client_full_strength_ms", full_strength_ms);
  row("replacement_attached_ms", attached_ms);
  auto path = report.WriteTo(out_dir);
  if (!path.ok()) {
    std::fprintf(stderr, "%s\n", path.status().ToString().c_str());
    return 1;
  }
  std::printf("wrote %s\n", path->c_str());
  return 0;
}
