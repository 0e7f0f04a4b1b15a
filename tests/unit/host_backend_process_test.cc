// The host backend across processes: the regions are POSIX shared memory (shm_open + mmap), each rank is a child
// process (posix_spawn of this test binary in a helper mode, so no fork of a threaded process), every child maps
// all regions of the group at addresses of its own, runs its rank's sequence of calls and checks its results
// against the host reference (each child computes it from the same seeded inputs).
//
// Helper mode: the child runs the single test HostBackendChild.DISABLED_Rank (disabled: CI runs only the parent side)
// with EPF_HOST_BACKEND_CHILD set to
// "<scenario> <rank> <shm name prefix>"; it exits with kChildPassed only when it ran and every check passed, so that
// a child that skipped or crashed cannot look like a pass.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "host_backend_scenarios.h"

extern char** environ;

namespace epfabric::kernels::host_backend_test {
namespace {

constexpr int kChildPassed = 42;
constexpr char kChildEnv[] = "EPF_HOST_BACKEND_CHILD";
constexpr uint64_t kWaitTimeoutNs = 20ull * 1000 * 1000 * 1000;
constexpr uint64_t kShortTimeoutNs = 100ull * 1000 * 1000;

// The scenarios a child can run, by number (the parent and the children build the same cases from it).
enum Scenario : int {
  kIntranode2 = 0,
  kIntranode4 = 1,
  kLowLatency2 = 2,
  kLowLatency4 = 3,
  kIntranodeMissingPeer = 4,  // only rank 0 of 2 runs: it must time out naming rank 1
};

std::vector<IntranodeCase> IntranodeCases(int scenario) {
  auto make = [](std::vector<int> tokens, int hidden, bool fp8, uint64_t seed) {
    IntranodeCase c;
    c.num_tokens = std::move(tokens);
    c.hidden = hidden;
    c.num_topk = 6;
    c.num_experts = 32;
    c.fp8 = fp8;
    c.num_channels = 3;
    c.bias = true;
    c.seed = seed;
    return c;
  };
  if (scenario == kIntranode2) return {make({300, 211}, 2048, false, 1), make({0, 64}, 2048, true, 2)};
  if (scenario == kIntranodeMissingPeer) return {make({8, 8}, 256, false, 3)};
  IntranodeCase silent = make({64, 0, 100, 5}, 7168, false, 5);
  silent.routing.silent_rank = 3;
  return {make({120, 64, 99, 1}, 7168, true, 4), silent};
}

LowLatencyCase LowLatencyCaseFor(int scenario) {
  LowLatencyCase c;
  c.num_ranks = scenario == kLowLatency2 ? 2 : 4;
  c.max_tokens = 32;
  c.hidden = scenario == kLowLatency2 ? 2048 : 7168;
  c.num_experts = 16;
  c.num_topk = 6;
  c.iterations = 6;
  c.hook = scenario == kLowLatency4;
  c.zero_copy = scenario == kLowLatency2;
  c.round_scale = true;
  c.ue8m0 = scenario == kLowLatency4;
  c.routing.allow_duplicates = true;
  c.seed = 60 + scenario;
  return c;
}

bool IsIntranode(int scenario) {
  return scenario == kIntranode2 || scenario == kIntranode4 || scenario == kIntranodeMissingPeer;
}

int NumRanks(int scenario) {
  if (IsIntranode(scenario)) return IntranodeCases(scenario).front().num_ranks();
  return LowLatencyCaseFor(scenario).num_ranks;
}

size_t RegionBytes(int scenario) {
  if (IsIntranode(scenario)) return IntranodeRegionBytes(IntranodeConfigFor(IntranodeCases(scenario))).value();
  const LowLatencyCase c = LowLatencyCaseFor(scenario);
  return LowLatencyRegionBytes(c.max_tokens, c.hidden, c.num_ranks, c.num_experts).value();
}

std::string ShmName(const std::string& prefix, int rank) { return prefix + "." + std::to_string(rank); }

// One rank's region, created (and zeroed, by ftruncate) by the parent, opened by the children.
class SharedRegion {
 public:
  static SharedRegion Create(const std::string& name, size_t bytes) {
    SharedRegion r;
    r.name_ = name;
    r.owner_ = true;
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      if (fd >= 0) close(fd);
      return r;
    }
    r.Map(fd, bytes);
    return r;
  }
  static SharedRegion Open(const std::string& name, size_t bytes) {
    SharedRegion r;
    r.name_ = name;
    const int fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd >= 0) r.Map(fd, bytes);
    return r;
  }
  SharedRegion() = default;
  SharedRegion(SharedRegion&& o) noexcept { *this = std::move(o); }
  SharedRegion& operator=(SharedRegion&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    std::swap(name_, o.name_);
    std::swap(owner_, o.owner_);
    return *this;
  }
  ~SharedRegion() {
    if (data_ != nullptr) munmap(data_, bytes_);
    if (owner_) shm_unlink(name_.c_str());
  }
  void* data() const { return data_; }

 private:
  void Map(int fd, size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return;
    data_ = p;
    bytes_ = bytes;
  }
  void* data_ = nullptr;
  size_t bytes_ = 0;
  std::string name_;
  bool owner_ = false;
};

// ---------------------------------------------------------------------------------------------------------------
// Child side.

int RunChild(int scenario, int rank, const std::string& prefix) {
  const int num_ranks = NumRanks(scenario);
  const size_t bytes = RegionBytes(scenario);
  std::vector<SharedRegion> regions;
  for (int r = 0; r < num_ranks; ++r) {
    regions.push_back(SharedRegion::Open(ShmName(prefix, r), bytes));
    if (regions.back().data() == nullptr) {
      std::fprintf(stderr, "rank %d: cannot map %s\n", rank, ShmName(prefix, r).c_str());
      return 1;
    }
  }
  Mismatches m;
  if (IsIntranode(scenario)) {
    const std::vector<IntranodeCase> cases = IntranodeCases(scenario);
    IntranodeGroup group;
    group.config = IntranodeConfigFor(cases);
    group.rank = rank;
    for (int r = 0; r < num_ranks; ++r) group.peer_regions[r] = regions[r].data();
    group.timeout_ns = scenario == kIntranodeMissingPeer ? kShortTimeoutNs : kWaitTimeoutNs;
    if (scenario == kIntranodeMissingPeer) {
      // Rank 0 alone: its first wait must time out naming rank 1.
      const IntranodeExpected x = MakeIntranodeExpected(cases.front());
      int32_t prefix_matrix[4];
      IntranodeNotifyParams np;
      np.num_tokens_per_rank = x.dispatched[0].layout.num_tokens_per_rank.data();
      np.num_tokens_per_expert = x.dispatched[0].layout.num_tokens_per_expert.data();
      np.num_tokens = 8;
      np.num_experts = 32;
      np.rank_prefix_matrix = prefix_matrix;
      const absl::Status s = host_backend::IntranodeNotify(group, np);
      if (s.message() != "rank 0 timed out waiting for barrier from rank 1 (channel 0)") {
        std::fprintf(stderr, "unexpected status: %s\n", s.ToString().c_str());
        return 1;
      }
      return kChildPassed;
    }
    for (const IntranodeCase& c : cases) RunIntranodeCase(group, MakeIntranodeExpected(c), &m);
  } else {
    const LowLatencyCase c = LowLatencyCaseFor(scenario);
    LowLatencyContext ctx;
    ctx.rank = rank;
    ctx.num_ranks = num_ranks;
    for (int r = 0; r < num_ranks; ++r) ctx.peer_regions[r] = regions[r].data();
    ctx.layout = MakeLowLatencyLayout(c.max_tokens, c.hidden, c.num_ranks, c.num_experts).value();
    ctx.timeout_ns = kWaitTimeoutNs;
    RunLowLatencyCase(ctx, c, MakeLowLatencyExpected(c), &m);
  }
  if (!m.empty()) {
    std::fprintf(stderr, "%s", m.str().c_str());
    return 1;
  }
  return kChildPassed;
}

TEST(HostBackendChild, DISABLED_Rank) {
  const char* spec = std::getenv(kChildEnv);
  if (spec == nullptr) GTEST_SKIP() << "helper mode of the process tests (they run it with the environment set)";
  int scenario = -1, rank = -1;
  char prefix[128] = {};
  if (std::sscanf(spec, "%d %d %127s", &scenario, &rank, prefix) != 3) std::_Exit(2);
  std::fflush(stdout);
  std::_Exit(RunChild(scenario, rank, prefix));  // the exit code is the result; skip gtest's own reporting
}

// ---------------------------------------------------------------------------------------------------------------
// Parent side.

// Creates the regions, spawns one child per rank in `ranks`, waits (bounded) and returns a description of every
// child that did not pass (empty = all passed).
std::string RunScenario(int scenario, const std::vector<int>& ranks) {
  const int num_ranks = NumRanks(scenario);
  const std::string prefix = "/epf-hbtest-" + std::to_string(getpid()) + "-" + std::to_string(scenario);
  std::vector<SharedRegion> regions;
  for (int r = 0; r < num_ranks; ++r) {
    regions.push_back(SharedRegion::Create(ShmName(prefix, r), RegionBytes(scenario)));
    if (regions.back().data() == nullptr) return "cannot create shared memory " + ShmName(prefix, r);
  }
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0) return "cannot find the test binary";
  exe[n] = '\0';
  std::vector<pid_t> pids;
  std::string errors;
  for (int rank : ranks) {
    const std::string env =
        std::string(kChildEnv) + "=" + std::to_string(scenario) + " " + std::to_string(rank) + " " + prefix;
    std::vector<std::string> env_strings{env};
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::strncmp(*e, kChildEnv, sizeof(kChildEnv) - 1) != 0) env_strings.push_back(*e);
    }
    std::vector<char*> envp;
    for (std::string& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string filter = "--gtest_filter=HostBackendChild.DISABLED_Rank";
    std::string also_disabled = "--gtest_also_run_disabled_tests";
    char* argv[] = {exe, filter.data(), also_disabled.data(), nullptr};
    pid_t pid = -1;
    if (posix_spawn(&pid, exe, nullptr, nullptr, argv, envp.data()) != 0) {
      errors += "posix_spawn failed for rank " + std::to_string(rank) + "\n";
      continue;
    }
    pids.push_back(pid);
  }
  // Bounded wait for the children: a hang fails the test after 120 s instead of blocking CI.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  for (size_t i = 0; i < pids.size(); ++i) {
    int status = 0;
    while (true) {
      const pid_t done = waitpid(pids[i], &status, WNOHANG);
      if (done == pids[i]) break;
      if (std::chrono::steady_clock::now() > deadline) {
        kill(pids[i], SIGKILL);
        waitpid(pids[i], &status, 0);
        errors += "rank " + std::to_string(ranks[i]) + " did not finish in time\n";
        status = -1;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (status == -1) continue;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != kChildPassed) {
      errors += "rank " + std::to_string(ranks[i]) + " failed (" +
                (WIFEXITED(status) ? "exit code " + std::to_string(WEXITSTATUS(status))
                                   : "signal " + std::to_string(WTERMSIG(status))) +
                ")\n";
    }
  }
  return errors;
}

TEST(HostBackendProcesses, IntranodeTwoRanks) { EXPECT_EQ(RunScenario(kIntranode2, {0, 1}), ""); }

TEST(HostBackendProcesses, IntranodeFourRanksHidden7168) { EXPECT_EQ(RunScenario(kIntranode4, {0, 1, 2, 3}), ""); }

TEST(HostBackendProcesses, LowLatencyTwoRanksZeroCopy) { EXPECT_EQ(RunScenario(kLowLatency2, {0, 1}), ""); }

TEST(HostBackendProcesses, LowLatencyFourRanksHookUe8m0) { EXPECT_EQ(RunScenario(kLowLatency4, {0, 1, 2, 3}), ""); }

TEST(HostBackendProcesses, MissingPeerProcessTimesOutNamingIt) {
  EXPECT_EQ(RunScenario(kIntranodeMissingPeer, {0}), "");
}

}  // namespace
}  // namespace epfabric::kernels::host_backend_test
