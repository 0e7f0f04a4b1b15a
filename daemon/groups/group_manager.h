// EP groups (tenants): the coordinator's fabric-wide registry, each member's regions, and client leases.
//
// CreateGroup reaches the coordinator (any daemon forwards it). The coordinator reserves the name, asks every
// member to Prepare (allocate its regions and describe them), then Commits the gathered descriptors to all
// members; if any member fails, the prepared ones Release and the caller gets that member's error. The token is
// a random 128-bit secret compared in constant time. A group with a member that went down (or restarted: its
// regions died with it) is DEGRADED for good: delete it and create it again.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "epfabric/common/fd_passing.h"
#include "epfabric/v1/control.pb.h"
#include "epfabric/v1/ops.pb.h"
#include "epfabric/v1/peer.pb.h"
#include "fabric/membership.h"
#include "fabric/peer_links.h"
#include "memory/region.h"

namespace epfabric::daemon::groups {

// Largest region a CreateGroup may ask for, whatever the daemons' limits (catches unit mistakes).
inline constexpr uint64_t kMaxRegionBytes = 1ull << 40;

// Trailing-metadata key the coordinator sets on its ProposeGroup/RetireGroup answers, so that a forwarding daemon can
// tell the coordinator's own errors (passed through) from a coordinator it could not reach.
inline constexpr char kAnsweredByCoordinator[] = "epf-answered-by-coordinator";

// Checks a CreateGroup request on its own (name, ranks, sizes, sharing). Errors name the field and value.
absl::Status ValidateCreateGroup(const v1::CreateGroupRequest& request, int world_size);

// True when a and b are equal, in time that depends only on their lengths.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

// Who is calling over the client socket (SO_PEERCRED); -1 when unknown.
struct ClientIdentity {
  int64_t pid = -1;
  int64_t uid = -1;
};

struct LeaseLimits {
  absl::Duration default_ttl = absl::Seconds(10);
  absl::Duration min_ttl = absl::Seconds(1);
  absl::Duration max_ttl = absl::Minutes(5);
};

class GroupManager {
 public:
  GroupManager(fabric::Membership* membership, fabric::PeerLinks* links, memory::RegionAllocator* allocator,
               LeaseLimits lease_limits);

  // ---- Control service (any daemon) ----
  absl::StatusOr<v1::CreateGroupResponse> CreateGroup(const v1::CreateGroupRequest& request);
  absl::Status DeleteGroup(const v1::DeleteGroupRequest& request);
  // Groups this daemon is a member of (the coordinator also lists groups it only registers).
  v1::ListGroupsResponse ListGroups() const;
  absl::StatusOr<v1::AttachResponse> Attach(const v1::AttachRequest& request, const ClientIdentity& client);
  absl::Status Detach(const v1::DetachRequest& request);
  absl::StatusOr<v1::KeepAliveResponse> KeepAlive(const v1::KeepAliveRequest& request);
  std::vector<v1::ClientInfo> Clients() const;
  // Ends leases whose TTL passed (cleaning their regions). Called periodically.
  void ExpireLeases(absl::Time now);

  // ---- fd side channel (services/fd_channel.h) ----
  // This daemon's region of `kind` for (group, group_rank), after checking `token` in constant time: NotFound
  // (unknown group, or no region of that kind), PermissionDenied (wrong token), InvalidArgument (rank outside
  // the group), FailedPrecondition (that rank is served by another daemon). `fd` is a duplicate of a POSIX_FD
  // region's descriptor, owned by the caller, so that it stays valid even if the group is released meanwhile.
  struct SharedRegion {
    v1::RegionDescriptor descriptor;  // fd_socket filled
    common::UniqueFd fd;              // -1 unless POSIX_FD
  };
  absl::StatusOr<SharedRegion> ShareRegion(const std::string& group, int group_rank, v1::RegionDescriptor::Kind kind,
                                           const std::string& token) const;
  // The live lease `lease_id` (group, rank, pid and uid of the process that attached); NotFound otherwise.
  absl::StatusOr<v1::ClientInfo> LeaseInfo(const std::string& lease_id) const;
  // Ends the lease as Detach does (regions zeroed), logging `reason`; NotFound when it is not live (any more).
  absl::Status EndLease(const std::string& lease_id, const std::string& reason);

  // ---- Peer service, coordinator side ----
  absl::StatusOr<v1::CreateGroupResponse> Propose(const v1::CreateGroupRequest& request);
  absl::Status Retire(const v1::RetireGroupRequest& request);
  // Registers the groups a (re)joining member holds, so that a restarted coordinator knows them again.
  void Adopt(const v1::JoinRequest& request);

  // ---- Peer service, member side ----
  absl::StatusOr<v1::PrepareGroupResponse> Prepare(const v1::PrepareGroupRequest& request);
  absl::Status Commit(const v1::CommitGroupRequest& request);
  absl::Status Release(const v1::ReleaseGroupRequest& request);

  // Groups held here, reported when joining.
  std::vector<v1::GroupRecord> LocalRecords() const;
  // Marks groups with a member that is not UP, or not the incarnation that committed, DEGRADED.
  void OnMembership(const v1::Membership& view);

 private:
  struct LocalGroup {
    v1::GroupInfo info;
    std::string token;
    int group_rank = -1;
    std::unique_ptr<memory::Region> nvl;
    std::unique_ptr<memory::Region> rdma;
    std::vector<v1::PrepareGroupResponse> members;  // by group rank, after Commit
    std::vector<uint64_t> incarnations;             // of the members at Commit
  };
  struct RegistryEntry {
    v1::GroupInfo info;
    std::string token;
    std::vector<uint64_t> incarnations;
  };
  struct Lease {
    v1::ClientInfo info;
    absl::Duration ttl;
    absl::Time expires;
  };

  // Ends a lease: zeroes the rank's regions so the next client starts clean. Requires mutex_.
  void EndLeaseLocked(const std::string& lease_id, const char* why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // The status a forwarded call ends with: the coordinator's own error as it is, or UNAVAILABLE naming an
  // unreachable coordinator when the call never got an answer from it.
  absl::Status ForwardedStatus(const grpc::ClientContext& context, const grpc::Status& status) const;

  fabric::Membership* const membership_;
  fabric::PeerLinks* const links_;
  memory::RegionAllocator* const allocator_;
  const LeaseLimits lease_limits_;

  mutable absl::Mutex mutex_;
  std::map<std::string, LocalGroup> local_ ABSL_GUARDED_BY(mutex_);
  std::map<std::string, RegistryEntry> registry_ ABSL_GUARDED_BY(mutex_);  // coordinator only
  std::map<std::string, Lease> leases_ ABSL_GUARDED_BY(mutex_);            // by lease id
};

}  // namespace epfabric::daemon::groups
