// A fabric of real epfabricd processes on loopback: rank 0 first, then the others pointed at it. Each fabric gets
// its own --fabric_id unless the test asks for one. Nothing needs cleaning up after the daemons: host regions are
// memfds, which go with the process (even one killed with SIGKILL).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "epfabric/v1/control.grpc.pb.h"
#include "epfabric/v1/ops.grpc.pb.h"
#include "integration/daemon_under_test.h"
#include "support/sanitizers.h"

namespace epfabric::testing {

// Heartbeat flags of a fabric whose tests move data and never kill a daemon: a member is marked down after 1 s of
// silence (5 s under sanitizers). Many daemons and workers on CI's 2 cores under ASan starve a daemon for more than
// 1 s, and a false "down" degrades every group on it.
inline std::vector<std::string> DataPathHeartbeatFlags() {
  return {"--heartbeat_ms=100", absl::StrCat("--heartbeat_misses=", static_cast<int>(10 * kSanitizerSlowdown))};
}

class FabricUnderTest {
 public:
  // Starts `world_size` daemons (host backend) with `flags` plus `rank_flags[rank]`, as fabric `fabric_id` (empty:
  // a UniqueFabricId()).
  static absl::StatusOr<std::unique_ptr<FabricUnderTest>> Start(
      int world_size, const std::vector<std::string>& flags = {},
      const std::map<int, std::vector<std::string>>& rank_flags = {}, const std::string& fabric_id = {});
  ~FabricUnderTest();

  // Every live daemon sees every rank UP with the same epoch.
  absl::Status WaitComplete(absl::Duration timeout = absl::Seconds(20));
  // Polls `rank`'s view until `predicate` holds; returns the view, or DeadlineExceeded with the last one.
  absl::StatusOr<v1::FabricView> WaitView(int rank, const std::function<bool(const v1::FabricView&)>& predicate,
                                          absl::Duration timeout);

  DaemonUnderTest& daemon(int rank) { return *daemons_.at(rank); }
  bool alive(int rank) const { return daemons_.count(rank) != 0 && daemons_.at(rank) != nullptr; }
  int world_size() const { return world_size_; }
  const std::string& fabric_id() const { return fabric_id_; }
  const std::string& coordinator() const { return coordinator_; }

  // SIGKILL, no clean-up: what a crash or an OOM kill does.
  void Kill(int rank);
  // Starts (again) the daemon of `rank` with the fabric's flags plus `extra`.
  absl::Status Restart(int rank, const std::vector<std::string>& extra = {});
  // The flags a daemon of `rank` gets.
  std::vector<std::string> FlagsFor(int rank) const;

  absl::StatusOr<v1::FabricView> Fabric(int rank);
  std::unique_ptr<v1::Control::Stub> Control(int rank);
  std::unique_ptr<v1::Ops::Stub> Ops(int rank);

  // Host regions the live daemons hold: their open memfds labelled "epf.<fabric_id>." (/proc/<pid>/fd).
  int MemfdRegions();

 private:
  int world_size_ = 0;
  std::string fabric_id_;
  std::string coordinator_;
  std::vector<std::string> flags_;
  std::map<int, std::vector<std::string>> rank_flags_;
  std::map<int, std::unique_ptr<DaemonUnderTest>> daemons_;
};

// A fabric id no other test (or earlier run) uses.
std::string UniqueFabricId();

}  // namespace epfabric::testing
