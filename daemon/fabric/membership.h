// Fabric membership: who is in the fabric, who is alive, and the epoch that counts changes.
//
// Rank 0 is the coordinator. Other ranks Join it (retrying with backoff until it answers) and then beat it every
// heartbeat interval. The coordinator marks a rank DOWN when it has been silent for `heartbeat_misses` intervals,
// or earlier when a probe of a late rank finds its peer port refusing connections (a dead process). Every change
// increases the epoch and is pushed to all live members (and piggybacked on heartbeat answers). A restarted
// daemon rejoins with the same rank and a new incarnation; a second daemon claiming a rank whose holder still
// answers is refused. If the coordinator dies, members keep their view, report the fabric degraded, and rejoin
// the next coordinator, which continues the epoch above what members have seen. With a fabric secret a member takes
// a Join or heartbeat answer only when it carries the coordinator's proof (PeerLinks::VerifyAnswer): a process
// without the secret on rank 0's port cannot hand out views (fd socket paths, peer addresses).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "epfabric/v1/peer.pb.h"
#include "fabric/peer_links.h"

namespace epfabric::daemon::fabric {

// Epochs count membership changes; one far above any real count (a forged 2^64-1 would pin a fabric for good) is
// refused in joins and publishes.
inline constexpr uint64_t kMaxEpoch = 1ull << 48;

struct FabricConfig {
  std::string fabric_id = "epfabric";
  int rank = 0;
  int world_size = 1;
  std::string coordinator;  // rank 0's peer address; unused by rank 0 itself
  absl::Duration heartbeat_interval = absl::Seconds(1);
  int heartbeat_misses = 3;
};

class Membership {
 public:
  // Called, outside any lock, with the new view after every change of this daemon's view.
  using ChangeListener = std::function<void(const v1::Membership& view, bool degraded)>;
  // Coordinator: called for every accepted Join (to adopt the groups the member reports).
  using JoinObserver = std::function<void(const v1::JoinRequest& request)>;
  // Member: the groups to report when (re)joining.
  using LocalGroups = std::function<std::vector<v1::GroupRecord>()>;

  Membership(FabricConfig config, v1::MemberInfo self, PeerLinks* links);
  ~Membership();

  void SetChangeListener(ChangeListener listener);
  void SetJoinObserver(JoinObserver observer);
  void SetLocalGroups(LocalGroups groups);

  // The peer address becomes known once the peer server listens (port 0 picks one); set it before Start().
  void SetPeerAddress(const std::string& address);

  // Starts the background thread (joining/beating, or monitoring on the coordinator).
  void Start();
  void Stop();

  // Peer RPCs.
  absl::StatusOr<v1::JoinResponse> HandleJoin(const v1::JoinRequest& request);
  absl::StatusOr<v1::HeartbeatResponse> HandleHeartbeat(const v1::HeartbeatRequest& request);
  absl::Status HandlePublish(const v1::PublishMembershipRequest& request);

  // FAILED_PRECONDITION unless `fabric_id` is ours.
  absl::Status CheckFabricId(const std::string& fabric_id) const;

  v1::Membership View() const;
  // True when the coordinator is unreachable or some rank is not UP.
  bool Degraded() const;
  bool CoordinatorReachable() const;
  // The coordinator's last refusal of this daemon's Join (empty after a successful join, or while it is silent).
  std::string JoinRefusal() const;
  // Why the last answer on the coordinator's port was refused as not the coordinator's (fabric secret: no valid
  // proof); empty once a proven answer arrives.
  std::string CoordinatorUnverified() const;
  bool is_coordinator() const { return config_.rank == 0; }
  const FabricConfig& config() const { return config_; }
  v1::MemberInfo self() const;
  // The coordinator's peer address as this daemon knows it.
  std::string CoordinatorAddress() const;
  // metrics (daemon/metrics): member: heartbeats to the coordinator that failed; coordinator: times a rank was found
  // silent for more than 1.5 intervals.
  uint64_t HeartbeatsMissed() const { return heartbeats_missed_.load(std::memory_order_relaxed); }

 private:
  void Run();
  void RunCoordinatorStep();
  void RunMemberStep();
  // Member: records that the answer on the coordinator's port did not prove the secret (logged once per reason).
  void RefuseUnverified(const absl::Status& why) ABSL_LOCKS_EXCLUDED(mutex_);
  // Coordinator: records a change (epoch + 1) and schedules a push. Requires mutex_.
  void ChangedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void PushMembership(const v1::Membership& view);
  void ProbeAsync(int rank, const std::string& address, uint64_t incarnation);
  // Calls the change listener with the current view if a change is pending, outside mutex_.
  void Notify() ABSL_LOCKS_EXCLUDED(notify_mutex_, mutex_);
  bool DegradedLocked() const ABSL_SHARED_LOCKS_REQUIRED(mutex_);
  // Applies a membership received from the coordinator if it is newer. Requires mutex_.
  bool ApplyLocked(const v1::Membership& membership) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  const FabricConfig config_;
  const uint64_t incarnation_;
  PeerLinks* const links_;

  // Serialises listener calls so that they see views in order; taken before mutex_, never while holding it.
  absl::Mutex notify_mutex_ ABSL_ACQUIRED_BEFORE(mutex_);
  mutable absl::Mutex mutex_;
  v1::MemberInfo self_ ABSL_GUARDED_BY(mutex_);
  v1::Membership view_ ABSL_GUARDED_BY(mutex_);
  // Coordinator: when each rank last beat, and whether a probe of it is in flight.
  std::vector<absl::Time> last_beat_ ABSL_GUARDED_BY(mutex_);
  // The coordinator's previous step: a gap much longer than its tick means this process was stopped or starved, and
  // the members' silence during that gap is not theirs.
  absl::Time last_step_ ABSL_GUARDED_BY(mutex_) = absl::InfinitePast();
  std::vector<bool> probing_ ABSL_GUARDED_BY(mutex_);
  bool push_pending_ ABSL_GUARDED_BY(mutex_) = false;
  // Member: joined the current coordinator, and when it last answered.
  bool joined_ ABSL_GUARDED_BY(mutex_) = false;
  std::string join_refusal_ ABSL_GUARDED_BY(mutex_);
  std::string coordinator_unverified_ ABSL_GUARDED_BY(mutex_);
  bool coordinator_reachable_ ABSL_GUARDED_BY(mutex_) = false;
  absl::Time last_contact_ ABSL_GUARDED_BY(mutex_);
  bool notify_pending_ ABSL_GUARDED_BY(mutex_) = false;
  int probes_in_flight_ ABSL_GUARDED_BY(mutex_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::atomic<uint64_t> heartbeats_missed_{0};  // metrics hook: see HeartbeatsMissed()

  ChangeListener change_listener_;
  JoinObserver join_observer_;
  LocalGroups local_groups_;
  std::thread thread_;
};

}  // namespace epfabric::daemon::fabric
