// EP groups (tenants), as the services see them: a thin facade over three parts, each with its own lock.
//
//   Registry     (registry.h)      the coordinator's fabric-wide registry: Propose, Retire, Adopt
//   LocalGroups  (local_groups.h)  this daemon's groups and regions: Prepare, Commit, ShareRegion, records
//   Leases       (leases.h)        client leases: Attach, Detach, KeepAlive, expiry, the fd channel's lease checks
//
// CreateGroup reaches the coordinator (any daemon forwards it). The coordinator reserves the name, asks every
// member to Prepare (allocate its regions and describe them), then Commits the gathered descriptors to all
// members; if any member fails, the prepared ones Release and the caller gets that member's error. The token is
// a random 128-bit secret compared in constant time. A group with a member that went down (or restarted: its
// regions died with it) is DEGRADED for good: delete it and create it again.
//
// Lock order: Leases::mutex_ before LocalGroups::mutex_; Registry::mutex_ is a leaf, never held with another.
// GroupManager has no lock of its own and holds none while it calls the parts. No region is zeroed or freed and
// no RPC is made under any of these locks.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "epfabric/v1/control.pb.h"
#include "epfabric/v1/ops.pb.h"
#include "epfabric/v1/peer.pb.h"
#include "fabric/membership.h"
#include "fabric/peer_links.h"
#include "groups/group_checks.h"
#include "groups/lease_notifications.h"
#include "groups/leases.h"
#include "groups/local_groups.h"
#include "groups/registry.h"
#include "memory/region.h"

namespace epfabric::daemon::groups {

// Trailing-metadata key the coordinator sets on its ProposeGroup/RetireGroup answers, so that a forwarding daemon can
// tell the coordinator's own errors (passed through) from a coordinator it could not reach.
inline constexpr char kAnsweredByCoordinator[] = "epf-answered-by-coordinator";

class GroupManager {
 public:
  GroupManager(fabric::Membership* membership, fabric::PeerLinks* links, memory::RegionAllocator* allocator,
               LeaseLimits lease_limits, GroupLimits group_limits = {}, transport::Transport* transport = nullptr,
               ClientQuotas client_quotas = {});

  // ---- Control service (any daemon) ----
  // All or nothing for the caller: the create finishes before `deadline` (the caller's) or is rolled back everywhere.
  // `client` names the caller for the coordinator's per-client quotas (ProposeGroupRequest.client).
  absl::StatusOr<v1::CreateGroupResponse> CreateGroup(const v1::CreateGroupRequest& request,
                                                      absl::Time deadline = absl::InfiniteFuture(),
                                                      const std::string& client = {});
  // With request.force(): no token; the caller (the control service) has checked the right to force.
  absl::Status DeleteGroup(const v1::DeleteGroupRequest& request);
  // Groups this daemon is a member of (the coordinator also lists groups it only registers).
  v1::ListGroupsResponse ListGroups() const;
  absl::StatusOr<v1::AttachResponse> Attach(const v1::AttachRequest& request, const ClientIdentity& client) {
    return leases_.Attach(request, client);
  }
  absl::Status Detach(const v1::DetachRequest& request, std::optional<ClientIdentity> caller = std::nullopt) {
    return leases_.Detach(request, caller);
  }
  absl::StatusOr<v1::KeepAliveResponse> KeepAlive(const v1::KeepAliveRequest& request,
                                                  std::optional<ClientIdentity> caller = std::nullopt) {
    return leases_.KeepAlive(request, caller);
  }
  std::vector<v1::ClientInfo> Clients() const { return leases_.Clients(); }
  // Transport command counters of this daemon's rings, summed per group.
  std::map<std::string, transport::RingCounters> TransportCounters() const { return local_.TransportCounters(); }
  std::vector<GroupDataPathStats> DataPathStats() const { return local_.DataPathStats(); }
  // Ends leases whose TTL passed (cleaning their regions). Called periodically.
  void ExpireLeases(absl::Time now) { leases_.ExpireLeases(now); }
  // Housekeeping for failed creates: the coordinator retries releases that did not reach a member; every member
  // releases groups it prepared that were never committed (the coordinator gave up on them).
  void CleanUpFailedCreates(absl::Time now);
  // Sends again the lease notifications that did not reach a member (lease_notifications.h). Called periodically.
  void RetryLeaseNotifications(absl::Time now);
  std::vector<std::pair<std::string, int>> PendingReleases() const { return registry_.PendingReleases(); }

  // ---- fd side channel (services/fd_channel.h) ----
  using SharedRegion = groups::SharedRegion;
  // See LocalGroups::ShareRegion.
  absl::StatusOr<SharedRegion> ShareRegion(const std::string& group, int group_rank, v1::RegionDescriptor::Kind kind,
                                           const std::string& token) const {
    return local_.ShareRegion(group, group_rank, kind, token);
  }
  // The live lease `lease_id` (group, rank, pid and uid of the process that attached); NotFound otherwise.
  absl::StatusOr<v1::ClientInfo> LeaseInfo(const std::string& lease_id) const { return leases_.LeaseInfo(lease_id); }
  // Ends the lease as Detach does (regions zeroed), logging `reason`; NotFound when it is not live (any more).
  absl::Status EndLease(const std::string& lease_id, const std::string& reason) {
    return leases_.EndLease(lease_id, reason);
  }

  // ---- Peer service, coordinator side ----
  absl::StatusOr<v1::CreateGroupResponse> Propose(const v1::CreateGroupRequest& request,
                                                  absl::Time deadline = absl::InfiniteFuture(),
                                                  const std::string& client = {}) {
    return registry_.Propose(request, deadline, client);
  }
  absl::Status Retire(const v1::RetireGroupRequest& request) { return registry_.Retire(request); }
  // Registers the groups a (re)joining member holds, so that a restarted coordinator knows them again.
  void Adopt(const v1::JoinRequest& request) { registry_.Adopt(request); }

  // ---- Peer service, member side ----
  absl::StatusOr<v1::PrepareGroupResponse> Prepare(const v1::PrepareGroupRequest& request,
                                                   absl::Time deadline = absl::InfiniteFuture()) {
    return local_.Prepare(request, deadline);
  }
  absl::Status Commit(const v1::CommitGroupRequest& request) { return local_.Commit(request); }
  // Ends the group's leases and frees its regions (outside every lock); OK when the group is not held here.
  absl::Status Release(const v1::ReleaseGroupRequest& request);

  // Groups held here, reported when joining.
  std::vector<v1::GroupRecord> LocalRecords() const { return local_.LocalRecords(); }
  // Marks groups with a member that is not UP, or not the incarnation that committed, DEGRADED.
  void OnMembership(const v1::Membership& view);
  // NotifyLease from another member (authenticated as request.sender_rank()): publishes or clears that rank as lost.
  absl::Status OnPeerLease(const v1::NotifyLeaseRequest& request) {
    return local_.SetLeaseLost(request.group(), request.group_rank(), request.sender_rank(), !request.attached(),
                               request.sequence(), membership_->View());
  }

 private:
  // A lease of this daemon's rank of `group` started or is ending: tells the other members (NotifyLease), fire and
  // forget, so that their clients' waits on the rank end at once (issue #14).
  void NotifyMembers(const std::string& group, int rank, bool attached);
  // The status a forwarded call ends with: the coordinator's own error as it is, or UNAVAILABLE naming an
  // unreachable coordinator when the call never got an answer from it.
  absl::Status ForwardedStatus(const grpc::ClientContext& context, const grpc::Status& status) const;

  fabric::Membership* const membership_;
  fabric::PeerLinks* const links_;
  Registry registry_;
  LocalGroups local_;
  Leases leases_;  // after local_, which it uses
  // NotifyLeaseRequest.sequence of the last notification sent; starts at the clock so that it also grows across a
  // restart of this daemon.
  std::atomic<uint64_t> lease_sequence_{static_cast<uint64_t>(absl::GetCurrentTimeNanos())};
  // Shared with the callbacks of notifications in flight, which may finish after this object is gone.
  std::shared_ptr<LeaseNotificationRetries> retries_ = std::make_shared<LeaseNotificationRetries>();
};

}  // namespace epfabric::daemon::groups
