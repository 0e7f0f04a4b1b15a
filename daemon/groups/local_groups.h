// This daemon's side of its groups (every daemon): the regions it allocated for each (Prepare), every member's
// descriptors (Commit), their state, and handing the regions out to the fd side channel and to Attach.
//
// Locking: `mutex_` guards the map of groups. It may be taken while Leases' mutex is held (Leases::mutex_ is
// acquired before LocalGroups::mutex_), never the other way round, and nothing else is locked under it. No region
// is allocated, zeroed or freed under it: Prepare allocates before inserting, Remove hands the group to the caller
// to destroy, and Regions hands out shared references for zeroing outside the lock.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "epfabric/common/fd_passing.h"
#include "epfabric/kernels/datapath_stats.h"
#include "epfabric/v1/control.pb.h"
#include "epfabric/v1/peer.pb.h"
#include "fabric/membership.h"
#include "groups/group_checks.h"
#include "memory/region.h"
#include "transport/transport.h"

namespace epfabric::daemon::groups {

// One group as this daemon holds it.
struct LocalGroup {
  v1::GroupInfo info;
  // Of the token, never the token (security/group_secrets.h): its SHA-256 (hex), which Attach and the fd side
  // channel compare the client's token with, and the deletion key (reported in Joins).
  std::string token_sha256;
  std::string deletion_key;
  int group_rank = -1;
  // Shared so that a lease that ends can zero them outside the lock; the group's Release waits for that to finish,
  // so that the memory is freed when the released group is destroyed.
  std::shared_ptr<memory::Region> nvl;
  std::shared_ptr<memory::Region> rdma;
  // Groups with an RDMA region: the command rings and the link to the other members. Declared after the regions so
  // that it goes first (its proxying and connections stop before the memory they use is freed).
  std::unique_ptr<transport::GroupTransport> transport;
  // The lease holder's data-path counters (kernels/datapath_stats.h), host memory; kept across leases.
  std::shared_ptr<memory::Region> stats;
  std::vector<v1::PrepareGroupResponse> members;  // by group rank, after Commit
  std::vector<uint64_t> incarnations;             // of the members at Commit
  // By group rank: the member serving it said its client's lease ended (NotifyLease) and no new one started. With
  // the members that are down or restarted, these ranks are published as lost in `stats` (kLostRanksOffset).
  std::vector<bool> lease_lost;
  std::vector<uint64_t> lease_sequence;  // by group rank: the NotifyLease sequence last applied
  // By group rank: the serial of the rank's current lease (kernels::kLeaseSerialsOffset), 0 while it has none.
  std::vector<uint64_t> lease_serial;
  absl::Time prepared_at;
  uint64_t coordinator_incarnation = 0;  // of fabric rank 0 when it sent the Prepare
};

// One group's data-path counters as its lease holder published them (untrusted numbers).
struct GroupDataPathStats {
  std::string group;
  int group_rank = -1;
  kernels::DataPathStats stats{};
};

// A region handed to the fd side channel.
struct SharedRegion {
  v1::RegionDescriptor descriptor;  // fd_socket filled
  common::UniqueFd fd;              // -1 unless the region is shared as an fd (POSIX_FD, host memfds)
};

class LocalGroups {
 public:
  // `transport` may be null (then groups with an RDMA region are refused).
  LocalGroups(fabric::Membership* membership, memory::RegionAllocator* allocator, GroupLimits limits = {},
              transport::Transport* transport = nullptr)
      : membership_(membership),
        allocator_(allocator),
        limits_(limits),
        transport_(transport),
        // Labelled like the daemon's other memfds ("epf.<fabric>.d<rank>.stats..."), so that leak checks see them.
        stats_allocator_(memory::MakeHostAllocator(
            absl::StrCat(membership->config().fabric_id, ".d", membership->config().rank, ".stats"), 0)) {}

  // Peer service, member side. Prepare allocates this daemon's regions (outside the lock) and describes them.
  // `deadline`: the coordinator's (from the call); a Prepare that finishes after it frees what it allocated and
  // refuses, because the coordinator has given up on this create.
  absl::StatusOr<v1::PrepareGroupResponse> Prepare(const v1::PrepareGroupRequest& request,
                                                   absl::Time deadline = absl::InfiniteFuture())
      ABSL_LOCKS_EXCLUDED(mutex_);
  // Groups prepared before `before` and still not committed.
  std::vector<std::string> UncommittedSince(absl::Time before) const ABSL_LOCKS_EXCLUDED(mutex_);
  // Groups still CREATING that a coordinator of another incarnation than `coordinator_incarnation` prepared: it
  // restarted since, and a restarted coordinator never commits what its predecessor prepared.
  std::vector<std::string> UncommittedOfAnotherCoordinator(uint64_t coordinator_incarnation) const
      ABSL_LOCKS_EXCLUDED(mutex_);
  // Every member's descriptors; the group is READY.
  absl::Status Commit(const v1::CommitGroupRequest& request) ABSL_LOCKS_EXCLUDED(mutex_);
  // Takes group `name` out (nullopt when it is not held here). Destroying the result frees its regions: do that
  // outside every lock. Release goes through Leases::ReleaseGroup, which also ends the group's leases.
  std::optional<LocalGroup> Remove(const std::string& name) ABSL_LOCKS_EXCLUDED(mutex_);

  // Groups held here, reported when joining.
  std::vector<v1::GroupRecord> LocalRecords() const ABSL_LOCKS_EXCLUDED(mutex_);
  // Marks READY groups with a member that is not UP, or not the incarnation that committed, DEGRADED (and back), and
  // publishes every group's lost ranks to its lease holder.
  void OnMembership(const v1::Membership& view) ABSL_LOCKS_EXCLUDED(mutex_);
  // NotifyLease from the member with fabric rank `sender`: the lease of `group_rank` ended (`lost`) or started. Only
  // the member serving that rank may say so (PermissionDenied otherwise); NotFound for a group not held here.
  // A notification older than the last one applied for that rank (`sequence`) is ignored.
  absl::Status SetLeaseLost(const std::string& name, int group_rank, int sender, bool lost, uint64_t sequence,
                            const v1::Membership& view) ABSL_LOCKS_EXCLUDED(mutex_);
  // This daemon's own rank of group `name` attached a client whose lease has `serial` (0: the lease ended), announced
  // to the members with the same number; published to the lease holder with the peers' serials. No-op for a group
  // not held here.
  void SetOwnLeaseSerial(const std::string& name, int group_rank, uint64_t serial, const v1::Membership& view)
      ABSL_LOCKS_EXCLUDED(mutex_);
  // The fabric ranks of the other members of group `name` (empty when it is not held here or not committed).
  std::vector<int> OtherMembers(const std::string& name) const ABSL_LOCKS_EXCLUDED(mutex_);
  // Every group held here, by name.
  std::map<std::string, v1::GroupInfo> Groups() const ABSL_LOCKS_EXCLUDED(mutex_);
  // The state of group `name`; UNSPECIFIED when it is not held here.
  v1::GroupState State(const std::string& name) const ABSL_LOCKS_EXCLUDED(mutex_);
  // DEGRADED groups: the group ranks lost (down or restarted); empty otherwise.
  std::vector<int> LostRanks(const std::string& name, const v1::Membership& view) const ABSL_LOCKS_EXCLUDED(mutex_);
  // This daemon's regions of group `name` (none when it is not held here), the command region included; the caller
  // keeps them alive while it uses them.
  std::vector<std::shared_ptr<memory::Region>> Regions(const std::string& name) const ABSL_LOCKS_EXCLUDED(mutex_);
  // Lease end, around the zeroing of Regions(name): stops the group's command rings (bounded wait for what is in
  // flight), then starts them afresh. No-ops for groups without a transport. The caller keeps the group from being
  // released meanwhile (Leases: an ending lease blocks ReleaseGroup).
  void StopTransport(const std::string& name) ABSL_LOCKS_EXCLUDED(mutex_);
  void ResetTransport(const std::string& name) ABSL_LOCKS_EXCLUDED(mutex_);
  // The transport of group `name` (null when none); valid while the group is held (see StopTransport).
  transport::GroupTransport* TransportOf(const std::string& name) const ABSL_LOCKS_EXCLUDED(mutex_);
  // The command counters of every group's rings, summed per group (groups with a transport only).
  std::map<std::string, transport::RingCounters> TransportCounters() const ABSL_LOCKS_EXCLUDED(mutex_);
  // A copy of every group's data-path counters page (read word by word: its writer is the client), for groups
  // whose page a Buffer has written.
  std::vector<GroupDataPathStats> DataPathStats() const ABSL_LOCKS_EXCLUDED(mutex_);

  // Attach's checks of the group: held here (NotFound), token (PermissionDenied), rank in the group
  // (InvalidArgument) and served here (FailedPrecondition), READY (Unavailable). Fills the response's group part:
  // group, rank, world size, backend, epoch, the same-host ranks and their region descriptors; not the lease.
  absl::StatusOr<v1::AttachResponse> DescribeForAttach(const v1::AttachRequest& request,
                                                       const v1::Membership& view) const ABSL_LOCKS_EXCLUDED(mutex_);

  // fd side channel: this daemon's region of `kind` for (group, group_rank), after checking `token` in constant
  // time: NotFound (unknown group, or no region of that kind), PermissionDenied (wrong token), InvalidArgument (rank
  // outside the group), FailedPrecondition (that rank is served by another daemon). `fd` is a duplicate of a
  // POSIX_FD region's descriptor, owned by the caller, so that it stays valid even if the group is released
  // meanwhile.
  absl::StatusOr<SharedRegion> ShareRegion(const std::string& group, int group_rank, v1::RegionDescriptor::Kind kind,
                                           const std::string& token) const ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  // Writes the group's lost ranks (down, restarted or lease ended) into its counters page for the lease holder.
  static void PublishLostLocked(LocalGroup& group, const v1::Membership& view);
  // RESOURCE_EXHAUSTED when one more group of `bytes` would pass the limits.
  absl::Status CheckQuotaLocked(uint64_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  friend class Leases;  // names mutex_ in its lock order

  fabric::Membership* const membership_;
  memory::RegionAllocator* const allocator_;
  const GroupLimits limits_;
  transport::Transport* const transport_;
  const std::unique_ptr<memory::RegionAllocator> stats_allocator_;  // host memfds for the counters pages

  mutable absl::Mutex mutex_;
  std::map<std::string, LocalGroup> groups_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace epfabric::daemon::groups
