// The chaos test's instruments (tests/integration/chaos_test.cc, docs/reliability.md): its configuration from the
// environment, what it reads from the daemons (groups, leases, health, file descriptors, /dev/shm) and what it
// counts for the reliability report. Nothing here injects a fault.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "epfabric/v1/ops.grpc.pb.h"
#include "integration/fabric_under_test.h"
#include "integration/subprocess.h"

namespace epfabric::testing::chaos {

// From the environment: EPF_CHAOS_SEED, EPF_CHAOS_ITERATIONS, EPF_CHAOS_LONG=1 (2000 iterations and no time box),
// EPF_CHAOS_ITERATION=N (replay: iteration 0, which calibrates, then N alone), EPF_CHAOS_TIME_BOX_S,
// EPF_RELIABILITY_JSON_DIR.
struct Config {
  uint64_t seed = 20261124;
  int iterations = 200;
  int only_iteration = -1;  // -1: every iteration
  bool long_run = false;
  absl::Duration time_box = absl::Seconds(170);
  std::string json_dir;  // empty: no report
  static Config FromEnvironment();
};

// The bounds every call and every recovery step is held to (docs/reliability.md explains each one).
struct Bounds {
  int heartbeat_ms = 100;
  int heartbeat_misses = 5;
  int lease_ttl_ms = 1000;                    // --lease_ttl_ms (the daemon's minimum)
  int worker_timeout_ms = 1000;               // BufferConfig.timeout of every worker call
  int control_deadline_ms = 3000;             // epctl --timeout_ms of CreateGroup / DeleteGroup
  absl::Duration slack = absl::Seconds(1.5);  // process start and exit, scheduling on 2 busy cores
  // A killed or stopped daemon is shown down by every survivor's health within this.
  absl::Duration Down() const { return absl::Milliseconds(heartbeat_ms * heartbeat_misses) + absl::Milliseconds(300); }
  // A control call (epctl) ends within its deadline, plus the time its own process was stopped.
  absl::Duration Control(absl::Duration paused) const {
    return absl::Milliseconds(control_deadline_ms) + paused + slack;
  }
  int client_timeout_ms = 5000;  // ClientOptions.timeout: Connect and every Control call of a worker
  // A worker that fails reports its error within one call's timeout of the fault (or of the end of the pause): a
  // data-path call (BufferConfig.timeout) when a peer worker is gone, a Control call or Connect when its daemon is.
  absl::Duration Error(absl::Duration paused, bool daemon_fault) const {
    return absl::Milliseconds(daemon_fault ? client_timeout_ms : worker_timeout_ms) + paused + 2 * slack;
  }
  // A worker process with no fault: connect, attach (retries of "already attached" up to 3 s), rounds.
  absl::Duration Worker(absl::Duration paused) const { return absl::Seconds(8) + paused; }
  // After the faults: fabric complete again, registries agree, restored/degraded states visible.
  absl::Duration Settle() const { return absl::Seconds(6); }
  // A lease whose process is gone is over (connection close; TTL + housekeeping for an unbound one).
  absl::Duration LeaseEnd() const { return absl::Milliseconds(lease_ttl_ms) + absl::Seconds(1); }
};

// name -> fabric rank -> the group as that live daemon's GetFabric lists it.
using GroupsByRank = std::map<std::string, std::map<int, v1::GroupInfo>>;
absl::StatusOr<GroupsByRank> GroupsEverywhere(FabricUnderTest& fabric);

// Why the live daemons' registries do not agree on `name` (empty when they do): every daemon that lists it has the
// same state, `expected_state` (UNSPECIFIED: any), and every member that did not restart, and the coordinator, list it.
std::string Disagreement(const GroupsByRank& groups, const std::string& name, const std::set<int>& restarted,
                         v1::GroupState expected_state);

absl::StatusOr<v1::HealthReport> Health(const std::string& socket, absl::Duration timeout = absl::Seconds(2));
// The report says that `rank` is down: PEER_DOWN for it, or COORDINATOR_UNREACHABLE for rank 0.
bool ShowsDown(const v1::HealthReport& report, int rank);
std::string Describe(const v1::HealthReport& report);

// What `epctl --json create-group|delete-group ARGS` does, made from this process (no process to start when no fault
// is meant for the caller): exit code 0 or 1, the token as `"token": "<hex>"` in `out`, the error in `err`.
RunResult ControlInProcess(const std::string& socket, const std::vector<std::string>& args, absl::Duration deadline);

// Leases the daemon lists for `group` (all groups when empty).
absl::StatusOr<int> Leases(const std::string& socket, const std::string& group = "");

// Open descriptors of a process (/proc/<pid>/fd), and the memfds among them; -1 when it cannot be read.
int OpenFds(pid_t pid);
// /dev/shm entries whose name contains `needle` (everything when empty).
int ShmEntries(const std::string& needle = "");

// Per fault kind, per phase: how often, and what came of it; the longest time from a fault to an error it caused.
struct Tally {
  std::map<std::string, int> faults;  // "kill_daemon", ..., "none"
  std::map<std::string, int> by_phase;
  int iterations = 0;
  int daemon_restarts = 0;
  int worker_errors = 0;
  int control_errors = 0;
  int forced_deletes = 0;
  int leaks = 0;    // memfds, /dev/shm entries, descriptors or leases left after an iteration's clean-up
  int orphans = 0;  // groups left where the documented recovery says there is none
  int disagreements = 0;
  int degraded_health_checks = 0;  // DEGRADED groups whose holder's health was checked for GROUP_DEGRADED
  int bound_violations = 0;
  int wrong_results = 0;            // a worker whose outputs differ, or that failed with no fault in its phase
  double longest_error_ms = 0;      // fault -> a call or process reporting the error it caused
  double longest_detection_ms = 0;  // fault -> every survivor's health shows the daemon down
  double longest_settle_ms = 0;
  absl::Duration elapsed;
  void NoteError(absl::Duration after_fault) {
    longest_error_ms = std::max(longest_error_ms, absl::ToDoubleMilliseconds(after_fault));
  }
};

// Writes <dir>/reliability-<UTC date>.json (bench/common/report.h) and returns its path.
absl::StatusOr<std::string> WriteReport(const Config& config, const Bounds& bounds, const Tally& tally);

}  // namespace epfabric::testing::chaos
