// Client leases: at most one client attached per (group, rank) of the groups this daemon holds. A lease ends on
// Detach, on expiry, when the fd side-channel connection that holds it closes, or when its group is released.
// When it ends (other than by release) the rank's regions are zeroed before anyone can attach to that rank again.
//
// Detach and a closed side channel end a lease at once and leave the zeroing to the cleaner thread: the caller does
// not wait for a whole region to be cleared (an Attach of that rank does, and so does ReleaseGroup).
//
// Locking: `mutex_` guards the leases; `cleaner_mutex_` the cleaner's queue (never held with another lock). Lock order:
// Leases::mutex_ before LocalGroups::mutex_ (Attach, KeepAlive and ReleaseGroup read or change the groups while holding
// it; LocalGroups never calls back). Regions are zeroed and freed outside both: an ending lease stays in the map,
// marked `ending`, until its regions are zeroed, so that an Attach of the same rank waits for it (and lookups by lease
// id no longer see it).
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "epfabric/v1/control.pb.h"
#include "epfabric/v1/ops.pb.h"
#include "fabric/membership.h"
#include "groups/local_groups.h"

namespace epfabric::daemon::groups {

// Who is calling over the client socket (SO_PEERCRED); -1 when unknown.
struct ClientIdentity {
  int64_t pid = -1;
  int64_t uid = -1;
};

struct LeaseLimits {
  absl::Duration default_ttl = absl::Seconds(10);
  absl::Duration min_ttl = absl::Seconds(1);
  absl::Duration max_ttl = absl::Minutes(5);
  // How long Attach waits for a DEGRADED group to be READY again before it refuses: a member that missed heartbeats
  // (a starved or paused daemon) comes back with the same incarnation and the group is restored by itself.
  absl::Duration degraded_attach_wait = absl::Seconds(3);
};

class Leases {
 public:
  Leases(fabric::Membership* membership, LocalGroups* local, LeaseLimits limits)
      : membership_(membership), local_(local), limits_(limits) {}
  // Finishes the endings still queued for the cleaner (their regions are zeroed), then stops it.
  ~Leases();
  Leases(const Leases&) = delete;
  Leases& operator=(const Leases&) = delete;

  // Told, outside every lock, when a client attached to a rank of a group (`attached`) or its lease starts ending
  // (before its regions are zeroed), so that the other members stop waiting for that rank (issue #14). Set it once,
  // before the first Attach.
  using Observer = std::function<void(const std::string& group, int rank, bool attached)>;
  void SetObserver(Observer observer) { observer_ = std::move(observer); }

  absl::StatusOr<v1::AttachResponse> Attach(const v1::AttachRequest& request, const ClientIdentity& client)
      ABSL_LOCKS_EXCLUDED(mutex_);
  // Only the holder (the pid and uid that attached, by SO_PEERCRED) may detach or keep alive its lease: a lease id
  // is not a credential. `caller` is nullopt for in-process callers (tests), which are not checked.
  absl::Status Detach(const v1::DetachRequest& request, std::optional<ClientIdentity> caller = std::nullopt)
      ABSL_LOCKS_EXCLUDED(mutex_);
  absl::StatusOr<v1::KeepAliveResponse> KeepAlive(const v1::KeepAliveRequest& request,
                                                  std::optional<ClientIdentity> caller = std::nullopt)
      ABSL_LOCKS_EXCLUDED(mutex_);
  // Ends leases whose TTL passed (cleaning their regions). Called periodically.
  void ExpireLeases(absl::Time now) ABSL_LOCKS_EXCLUDED(mutex_);
  // Ends the lease as Detach does, logging `reason`; NotFound when it is not live (any more). Returns once the lease
  // is no longer live; its regions are zeroed by the cleaner thread, before the rank can be attached again.
  absl::Status EndLease(const std::string& lease_id, const std::string& reason) ABSL_LOCKS_EXCLUDED(mutex_);
  // The live lease `lease_id` (group, rank, pid and uid of the process that attached); NotFound otherwise.
  absl::StatusOr<v1::ClientInfo> LeaseInfo(const std::string& lease_id) const ABSL_LOCKS_EXCLUDED(mutex_);
  // Every live lease.
  std::vector<v1::ClientInfo> Clients() const ABSL_LOCKS_EXCLUDED(mutex_);
  // The ranks with a live lease, by group name.
  std::map<std::string, std::vector<int>> AttachedRanks() const ABSL_LOCKS_EXCLUDED(mutex_);

  // Release of group `name` on this daemon: waits until no lease of the group is being cleaned, then takes the group
  // out of LocalGroups and drops its leases (the memory goes away with the group, nothing is zeroed), in one step
  // for Attach. Destroying the result frees the regions: do that outside every lock. nullopt when not held here.
  std::optional<LocalGroup> ReleaseGroup(const std::string& name) ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  // Attach, without telling the observer.
  absl::StatusOr<v1::AttachResponse> StartLease(const v1::AttachRequest& request, const ClientIdentity& client)
      ABSL_LOCKS_EXCLUDED(mutex_);

  struct Lease {
    v1::ClientInfo info;
    absl::Duration ttl;
    absl::Time expires;
    bool ending = false;  // being cleaned: no longer live, but its rank cannot be attached yet
  };

  // The live (not ending) lease `lease_id`, or null.
  Lease* FindLiveLocked(const std::string& lease_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  const Lease* FindLiveLocked(const std::string& lease_id) const ABSL_SHARED_LOCKS_REQUIRED(mutex_);
  // Whether a lease of (group, rank) is ending; rank -1: of any rank of the group.
  bool EndingLocked(const std::string& group, int rank) const ABSL_SHARED_LOCKS_REQUIRED(mutex_);
  // Second half of ending lease `lease_id` (marked `ending` by the caller): zeroes the regions of its group
  // outside every lock, then removes the lease and wakes those waiting for its rank.
  void FinishEnding(const std::string& lease_id, const std::string& group, int rank, const std::string& why)
      ABSL_LOCKS_EXCLUDED(mutex_);
  // FinishEnding without telling the observer (EndLease told it already): what the cleaner thread runs. It uses
  // only this object and `local_`, so the destructor can drain the queue after the owner's later members are gone.
  void ZeroAndRemove(const std::string& lease_id, const std::string& group, int rank, const std::string& why)
      ABSL_LOCKS_EXCLUDED(mutex_);

  // Hands ZeroAndRemove to the cleaner thread (started on first use).
  void FinishEndingLater(std::string lease_id, std::string group, int rank, std::string why)
      ABSL_LOCKS_EXCLUDED(cleaner_mutex_);
  void CleanerLoop() ABSL_LOCKS_EXCLUDED(cleaner_mutex_);

  fabric::Membership* const membership_;
  LocalGroups* const local_;
  const LeaseLimits limits_;
  Observer observer_;  // set before use, then only read

  mutable absl::Mutex mutex_ ABSL_ACQUIRED_BEFORE(local_->mutex_);
  absl::CondVar ended_;                                          // signalled when an ending lease is removed
  std::map<std::string, Lease> leases_ ABSL_GUARDED_BY(mutex_);  // by lease id

  struct PendingEnding {
    std::string lease_id, group;
    int rank = -1;
    std::string why;
  };
  absl::Mutex cleaner_mutex_;
  std::deque<PendingEnding> cleaner_queue_ ABSL_GUARDED_BY(cleaner_mutex_);
  bool cleaner_stopping_ ABSL_GUARDED_BY(cleaner_mutex_) = false;
  std::thread cleaner_ ABSL_GUARDED_BY(cleaner_mutex_);
};

}  // namespace epfabric::daemon::groups
