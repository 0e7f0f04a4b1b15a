#include "integration/chaos_harness.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/report.h"
#include "epfabric/v1/control.grpc.pb.h"
#include "integration/subprocess.h"

namespace epfabric::testing::chaos {
namespace {

std::string Env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : "";
}

std::chrono::system_clock::time_point In(absl::Duration timeout) { return absl::ToChronoTime(absl::Now() + timeout); }

// "host, N cores, <CPU model>" for the report's machine field.
std::string Machine() {
  std::string model;
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (absl::StartsWith(line, "model name")) {
      model = std::string(absl::StripAsciiWhitespace(line.substr(line.find(':') + 1)));
      break;
    }
  }
  char hostname[256] = {};
  gethostname(hostname, sizeof(hostname) - 1);
  return absl::StrCat("host backend, ", std::thread::hardware_concurrency(), " cores, ", model.empty() ? "?" : model,
                      " (", hostname, ")");
}

}  // namespace

Config Config::FromEnvironment() {
  Config config;
  uint64_t seed = 0;
  if (absl::SimpleAtoi(Env("EPF_CHAOS_SEED"), &seed)) config.seed = seed;
  config.long_run = Env("EPF_CHAOS_LONG") == "1";
  if (config.long_run) {
    config.iterations = 2000;
    config.time_box = absl::InfiniteDuration();
  }
  int iterations = 0;
  if (absl::SimpleAtoi(Env("EPF_CHAOS_ITERATIONS"), &iterations) && iterations > 0) config.iterations = iterations;
  int only = 0;
  if (absl::SimpleAtoi(Env("EPF_CHAOS_ITERATION"), &only) && only > 0) {
    config.only_iteration = only;
    config.iterations = std::max(config.iterations, only + 1);
  }
  int seconds = 0;
  if (absl::SimpleAtoi(Env("EPF_CHAOS_TIME_BOX_S"), &seconds) && seconds > 0) config.time_box = absl::Seconds(seconds);
  config.json_dir = Env("EPF_RELIABILITY_JSON_DIR");
  return config;
}

absl::StatusOr<GroupsByRank> GroupsEverywhere(FabricUnderTest& fabric) {
  GroupsByRank groups;
  for (int rank = 0; rank < fabric.world_size(); ++rank) {
    if (!fabric.alive(rank)) continue;
    auto view = fabric.Fabric(rank);
    if (!view.ok()) return absl::UnavailableError(absl::StrCat("rank ", rank, ": ", view.status().message()));
    for (const v1::GroupInfo& group : view->groups()) groups[group.name()][rank] = group;
  }
  return groups;
}

std::string Disagreement(const GroupsByRank& groups, const std::string& name, const std::set<int>& restarted,
                         v1::GroupState expected_state) {
  auto it = groups.find(name);
  if (it == groups.end()) return "";
  const std::map<int, v1::GroupInfo>& holders = it->second;
  std::vector<std::string> problems;
  std::set<int> must_hold = {0};
  for (int rank : holders.begin()->second.ranks()) {
    if (restarted.count(rank) == 0) must_hold.insert(rank);
  }
  for (int rank : must_hold) {
    if (holders.count(rank) == 0) problems.push_back(absl::StrCat("rank ", rank, " does not list it"));
  }
  for (const auto& [rank, info] : holders) {
    if (info.state() != holders.begin()->second.state() ||
        (expected_state != v1::GROUP_STATE_UNSPECIFIED && info.state() != expected_state)) {
      problems.push_back(absl::StrCat("rank ", rank, " says ", v1::GroupState_Name(info.state())));
    }
  }
  if (problems.empty()) return "";
  std::vector<std::string> states;
  for (const auto& [rank, info] : holders) states.push_back(absl::StrCat(rank, ":", v1::GroupState_Name(info.state())));
  return absl::StrCat("group '", name, "' (holders ", absl::StrJoin(states, " "), ", expected ",
                      v1::GroupState_Name(expected_state), "): ", absl::StrJoin(problems, "; "));
}

absl::StatusOr<v1::HealthReport> Health(const std::string& socket, absl::Duration timeout) {
  auto stub = v1::Ops::NewStub(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(In(timeout));
  v1::HealthReport report;
  const grpc::Status status = stub->GetHealth(&context, v1::GetHealthRequest(), &report);
  if (!status.ok()) return absl::UnavailableError(status.error_message());
  return report;
}

bool ShowsDown(const v1::HealthReport& report, int rank) {
  for (const auto& incident : report.incidents()) {
    if (incident.code() == "PEER_DOWN" && incident.entity() == absl::StrCat("rank ", rank)) return true;
    if (rank == 0 && incident.code() == "COORDINATOR_UNREACHABLE") return true;
  }
  return false;
}

std::string Describe(const v1::HealthReport& report) {
  std::vector<std::string> parts = {v1::HealthReport::Verdict_Name(report.overall())};
  for (const auto& incident : report.incidents()) parts.push_back(incident.code() + "(" + incident.entity() + ")");
  return absl::StrJoin(parts, " ");
}

RunResult ControlInProcess(const std::string& socket, const std::vector<std::string>& args, absl::Duration deadline) {
  std::map<std::string, std::string> flags;
  for (size_t i = 1; i < args.size(); ++i) {
    const size_t eq = args[i].find('=');
    flags[args[i].substr(2, eq == std::string::npos ? std::string::npos : eq - 2)] =
        eq == std::string::npos ? "true" : args[i].substr(eq + 1);
  }
  auto stub = v1::Control::NewStub(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(In(deadline));
  grpc::Status status;
  RunResult result;
  if (args[0] == "create-group") {
    v1::CreateGroupRequest request;
    request.set_name(flags["group"]);
    for (absl::string_view rank : absl::StrSplit(flags["ranks"], ',')) {
      int value = 0;
      if (absl::SimpleAtoi(rank, &value)) request.add_ranks(value);
    }
    uint64_t bytes = 0;
    (void)absl::SimpleAtoi(flags["nvl_bytes"], &bytes);
    request.set_num_nvl_bytes(bytes);
    request.set_low_latency(flags.count("low_latency") != 0);
    v1::CreateGroupResponse response;
    status = stub->CreateGroup(&context, request, &response);
    if (status.ok()) result.out = absl::StrCat("{\"token\": \"", response.token(), "\"}\n");
  } else {
    v1::DeleteGroupRequest request;
    request.set_name(flags["group"]);
    request.set_token(flags["token"]);
    v1::DeleteGroupResponse response;
    status = stub->DeleteGroup(&context, request, &response);
  }
  result.exit_code = status.ok() ? 0 : 1;
  if (!status.ok()) {
    result.err = absl::StrCat(args[0], " on ", socket,
                              " failed: ", absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())),
                              ": ", status.error_message());
  }
  return result;
}

absl::StatusOr<int> Leases(const std::string& socket, const std::string& group) {
  auto stub = v1::Ops::NewStub(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(2)));
  v1::ListClientsResponse response;
  const grpc::Status status = stub->ListClients(&context, v1::ListClientsRequest(), &response);
  if (!status.ok()) return absl::UnavailableError(status.error_message());
  int count = 0;
  for (const v1::ClientInfo& client : response.clients()) count += group.empty() || client.group() == group ? 1 : 0;
  return count;
}

int OpenFds(pid_t pid) {
  std::error_code ec;
  int count = 0;
  for (auto it = std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"), ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++count;
  }
  return ec ? -1 : count;
}

int ShmEntries(const std::string& needle) {
  std::error_code ec;
  int count = 0;
  for (auto it = std::filesystem::directory_iterator("/dev/shm", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    if (needle.empty() || absl::StrContains(it->path().filename().string(), needle)) ++count;
  }
  return count;
}

absl::StatusOr<std::string> WriteReport(const Config& config, const Bounds& bounds, const Tally& tally) {
  if (std::getenv("EPF_COMMIT") == nullptr) {
    // Outside scripts/epf: the commit of the tree the test was built from.
    RunResult git = RunBinary({"/usr/bin/git", "-C", EPF_SOURCE_DIR, "rev-parse", "--short", "HEAD"});
    setenv("EPF_COMMIT", git.exit_code == 0 ? std::string(absl::StripAsciiWhitespace(git.out)).c_str() : "unknown", 1);
  }
  bench::Report report("reliability");
  const std::string machine = Machine();
  report.SetDevice(machine);
  report.SetConfig("machine", machine);
  report.SetConfig("test", "chaos_test (tests/integration/chaos_test.cc)");
  report.SetConfig("seed", static_cast<double>(config.seed));
  report.SetConfig("iterations_asked", static_cast<double>(config.iterations));
  report.SetConfig("long_run", config.long_run ? "yes" : "no");
  report.SetConfig("daemons", static_cast<double>(4));
  report.SetConfig("backend", "host");
  report.SetConfig("heartbeat_ms", static_cast<double>(bounds.heartbeat_ms));
  report.SetConfig("heartbeat_misses", static_cast<double>(bounds.heartbeat_misses));
  report.SetConfig("lease_ttl_ms", static_cast<double>(bounds.lease_ttl_ms));
  report.SetConfig("worker_timeout_ms", static_cast<double>(bounds.worker_timeout_ms));
  report.SetConfig("control_deadline_ms", static_cast<double>(bounds.control_deadline_ms));
  report.SetConfig("down_bound_ms", absl::ToDoubleMilliseconds(bounds.Down()));
  report.SetResult("iterations", tally.iterations);
  int total = 0;
  for (const auto& [kind, count] : tally.faults) {
    report.SetResult("faults_" + kind, count);
    if (kind != "none") total += count;
  }
  for (const auto& [phase, count] : tally.by_phase) report.SetResult("faults_in_" + phase, count);
  report.SetResult("faults_total", total);
  report.SetResult("daemon_restarts", tally.daemon_restarts);
  report.SetResult("worker_errors", tally.worker_errors);
  report.SetResult("control_errors", tally.control_errors);
  report.SetResult("forced_deletes", tally.forced_deletes);
  report.SetResult("leaks", tally.leaks);
  report.SetResult("orphan_groups", tally.orphans);
  report.SetResult("registry_disagreements", tally.disagreements);
  report.SetResult("degraded_health_checks", tally.degraded_health_checks);
  report.SetResult("bound_violations", tally.bound_violations);
  report.SetResult("wrong_results", tally.wrong_results);
  report.SetResult("longest_time_to_error_ms", tally.longest_error_ms);
  report.SetResult("longest_down_detection_ms", tally.longest_detection_ms);
  report.SetResult("longest_settle_ms", tally.longest_settle_ms);
  report.SetResult("duration_s", absl::ToDoubleSeconds(tally.elapsed));
  std::filesystem::create_directories(config.json_dir);
  return report.WriteTo(config.json_dir);
}

}  // namespace epfabric::testing::chaos
