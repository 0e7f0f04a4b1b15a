// The chaos test's faults (tests/integration/chaos_test.cc): what to inject, where, the thread that injects it, and
// what the test knows of a call's outcome and of the workers' shapes.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "integration/chaos_harness.h"

namespace epfabric::testing::chaos {

enum class Kind { kNone, kKillDaemon, kStopDaemon, kKillClient, kStopClient };
enum class Phase { kCreate, kAttach, kData, kDelete };
inline const char* Name(Kind k) {
  static const char* names[] = {"none", "kill_daemon", "stop_daemon", "kill_client", "stop_client"};
  return names[static_cast<int>(k)];
}
inline const char* Name(Phase p) {
  static const char* names[] = {"create", "attach", "data", "delete"};
  return names[static_cast<int>(p)];
}
inline bool OnDaemon(Kind k) { return k == Kind::kKillDaemon || k == Kind::kStopDaemon; }
inline bool OnClient(Kind k) { return k == Kind::kKillClient || k == Kind::kStopClient; }
inline bool Stops(Kind k) { return k == Kind::kStopDaemon || k == Kind::kStopClient; }

struct Fault {
  Kind kind = Kind::kNone;
  Phase phase = Phase::kCreate;
  int target = 0;  // fabric rank of the daemon, or of the worker; create/delete: the epctl process
  absl::Duration delay, pause;
  absl::Duration Paused() const { return Stops(kind) ? pause : absl::ZeroDuration(); }
  std::string Describe() const {
    return absl::StrCat(Name(kind), " in ", Name(phase), " target=", target,
                        " delay_ms=", absl::ToInt64Milliseconds(delay), " pause_ms=", absl::ToInt64Milliseconds(pause));
  }
};

// One fault, from its own thread: `delay` after Start, SIGKILL or SIGSTOP (SIGCONT `pause` later) of `pid`. For a
// daemon it also polls the survivors' health until every one of them shows the daemon down (while it is stopped, or
// for up to twice the bound after a kill).
class Injector {
 public:
  Injector(const Fault& fault, pid_t pid, std::map<int, std::string> survivors, const Bounds& bounds)
      : fault_(fault), pid_(pid), survivors_(std::move(survivors)), bounds_(bounds) {}
  ~Injector() { Join(); }
  void Start() {
    thread_ = std::thread([this] { Run(); });
  }
  void Join() {
    if (thread_.joinable()) thread_.join();
  }
  // Waits until the signal was sent (a client is not reaped before: its pid cannot be reused meanwhile).
  void WaitFired() const {
    while (!fired_.load()) absl::SleepFor(absl::Milliseconds(1));
  }
  bool fired() const { return fired_.load(); }
  absl::Time fired_at() const { return fired_at_; }
  absl::Time resumed_at() const { return resumed_at_; }
  std::optional<absl::Duration> detected() const { return detected_; }
  const std::string& last_health() const { return last_health_; }

 private:
  void Run() {
    absl::SleepFor(fault_.delay);
    fired_at_ = absl::Now();
    ::kill(pid_, Stops(fault_.kind) ? SIGSTOP : SIGKILL);
    fired_.store(true);
    if (OnDaemon(fault_.kind)) {
      const absl::Time until = Stops(fault_.kind) ? fired_at_ + fault_.pause : fired_at_ + 2 * bounds_.Down();
      std::set<int> shown;
      while (shown.size() < survivors_.size() && absl::Now() < until) {
        for (const auto& [rank, socket] : survivors_) {
          if (shown.count(rank) != 0) continue;
          auto report = Health(socket, absl::Milliseconds(500));
          if (report.ok() && ShowsDown(*report, fault_.target)) shown.insert(rank);
          if (report.ok()) last_health_ = absl::StrCat("rank ", rank, ": ", Describe(*report));
        }
        if (shown.size() == survivors_.size()) detected_ = absl::Now() - fired_at_;
        absl::SleepFor(absl::Milliseconds(10));
      }
    }
    if (Stops(fault_.kind)) {
      absl::SleepFor(fired_at_ + fault_.pause - absl::Now());
      ::kill(pid_, SIGCONT);
      resumed_at_ = absl::Now();
    }
  }

  const Fault fault_;
  const pid_t pid_;
  const std::map<int, std::string> survivors_;
  const Bounds bounds_;
  std::thread thread_;
  std::atomic<bool> fired_{false};
  absl::Time fired_at_, resumed_at_;
  std::optional<absl::Duration> detected_;
  std::string last_health_;
};

inline const char* WorkerBinary() {
  const char* env = std::getenv("EPF_WORKER_BINARY");
  return env != nullptr && *env != '\0' ? env : EPF_WORKER_BINARY;
}

enum class Outcome { kOk, kError, kUnknown, kNotRun };  // kUnknown: the caller was killed before it learned the answer

struct Shape {
  std::vector<std::string> args;
  uint64_t region_bytes = 0;
  bool low_latency = false;
};

}  // namespace epfabric::testing::chaos
