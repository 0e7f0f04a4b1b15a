// The coordinator's fabric-wide group registry (rank 0 only): names, tokens and states of every group, and the
// two-phase creation and the deletion that run on the members.
//
// Propose reserves the name, asks every member to Prepare (allocate its regions and describe them), then Commits
// the gathered descriptors to all members; if any member fails, the prepared ones Release and the caller gets that
// member's error. Retire releases on every live member, then forgets the name.
//
// Adopt takes groups from the members' Joins, for a coordinator that does not know them (it restarted). A Join
// carries a snapshot of the member's groups taken when it was sent, so it can name a group that the member released
// since: a Join that waited while the coordinator was stopped and is handled after a delete queued beside it, or one
// that crossed a delete. Such a group is not adopted again: the registry remembers the groups it deleted or rolled
// back for kRetiredMemory (by token digest; by name for a forced delete of a name it did not know).
//
// Locking: `mutex_` is a leaf. Nothing else is locked while it is held, and the calls to members (which may be
// this daemon itself, whose member side takes its own locks) are made without it.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "epfabric/v1/control.pb.h"
#include "epfabric/v1/peer.pb.h"
#include "fabric/membership.h"
#include "fabric/peer_links.h"
#include "groups/fan_out.h"
#include "groups/group_checks.h"

namespace epfabric::daemon::groups {

// How long the registry remembers a group it deleted or rolled back, so that no Join reporting it is adopted. A Join's
// snapshot is at most its deadline (1 s) plus scheduling older than its arrival; this is far beyond that.
inline constexpr absl::Duration kRetiredMemory = absl::Minutes(5);

class Registry {
 public:
  Registry(fabric::Membership* membership, fabric::PeerLinks* links, ClientQuotas quotas = {})
      : membership_(membership), links_(links), quotas_(quotas) {}

  // CreateGroup on the coordinator: checks, reserves the name, Prepare then Commit on every member, all before
  // `deadline` (the caller's). All or nothing: on any failure, or when the caller's deadline passed meanwhile, every
  // member that may hold the group releases it; members that cannot be reached then are released as soon as they
  // answer again (RetryPendingReleases), and the name is free once they are.
  // `client` names who asked (ProposeGroupRequest.client; empty: not counted): RESOURCE_EXHAUSTED naming the quota
  // when the client's groups would pass ClientQuotas.
  absl::StatusOr<v1::CreateGroupResponse> Propose(const v1::CreateGroupRequest& request,
                                                  absl::Time deadline = absl::InfiniteFuture(),
                                                  const std::string& client = {}) ABSL_LOCKS_EXCLUDED(mutex_);
  // DeleteGroup on the coordinator: checks the proof of the token (RetireGroupRequest.proof), Release on every live
  // member, forgets the name. Members that are down or do not answer are released when they answer again
  // (RetryPendingReleases); the name is free once they are.
  absl::Status Retire(const v1::RetireGroupRequest& request) ABSL_LOCKS_EXCLUDED(mutex_);
  // Registers the groups a (re)joining member holds, so that a restarted coordinator knows them again; never one this
  // registry deleted or rolled back in the last kRetiredMemory (the Join's snapshot predates its release).
  void Adopt(const v1::JoinRequest& request) ABSL_LOCKS_EXCLUDED(mutex_);
  // Marks READY groups with a member that is not UP, or not the incarnation that committed, DEGRADED.
  void OnMembership(const v1::Membership& view) ABSL_LOCKS_EXCLUDED(mutex_);
  // Every registered group, by name (never tokens).
  std::map<std::string, v1::GroupInfo> Groups() const ABSL_LOCKS_EXCLUDED(mutex_);
  // Releases of rolled-back creates that did not reach their member yet: retried for members that are UP. Called
  // periodically (the daemon's housekeeping); waits on the members it calls (short deadlines), so no lock is held.
  void RetryPendingReleases() ABSL_LOCKS_EXCLUDED(mutex_);
  // (group, fabric rank) pairs still to be released, for tests and ops.
  std::vector<std::pair<std::string, int>> PendingReleases() const ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  struct Entry {
    v1::GroupInfo info;
    std::string token_sha256;            // the coordinator keeps only the token's digest
    std::string deletion_key;            // and its deletion key (security::DeletionKey): checks RetireGroup's proof
    std::vector<uint64_t> incarnations;  // of the members at Commit, by group rank
    std::string client;                  // who created it (empty: adopted, or not known)
  };
  // OK when `client` may hold one more group like `info` (ClientQuotas).
  absl::Status CheckQuotaLocked(const std::string& client, const v1::GroupInfo& info) const
      ABSL_SHARED_LOCKS_REQUIRED(mutex_);

  // Forgets a name whose creation failed.
  void Forget(const std::string& name) ABSL_LOCKS_EXCLUDED(mutex_);
  // Rolls a failed create back: releases `name` on the members at `addresses` (empty: not asked), remembers those
  // that did not answer, forgets the name.
  void RollBack(const std::vector<int>& ranks, const std::vector<std::string>& addresses, const std::string& name,
                const std::string& reason, absl::Time deadline) ABSL_LOCKS_EXCLUDED(mutex_);
  // Remembers that the group `name` with token digest `token_sha256` (empty: whatever its token) was deleted or rolled
  // back at `now`, and forgets what is older than kRetiredMemory.
  void RetiredLocked(const std::string& name, const std::string& token_sha256, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // The group `record` names was deleted or rolled back by this registry in the last kRetiredMemory.
  bool WasRetiredLocked(const v1::GroupRecord& record) const ABSL_SHARED_LOCKS_REQUIRED(mutex_);
  // Asks the members at `addresses` (empty: skipped) to release group `name`, waiting for all of them.
  std::vector<MemberReply<v1::ReleaseGroupResponse>> ReleaseOn(const std::vector<std::string>& addresses,
                                                               const std::string& name, const std::string& reason);

  fabric::Membership* const membership_;
  fabric::PeerLinks* const links_;
  const ClientQuotas quotas_;

  mutable absl::Mutex mutex_;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mutex_);
  // Rolled-back creates and deleted groups whose release has not reached these fabric ranks yet; the name stays taken
  // until they have.
  std::map<std::string, std::set<int>> pending_releases_ ABSL_GUARDED_BY(mutex_);
  // Groups deleted or rolled back, with when: by token digest, and by name for forced deletes of unknown names.
  std::map<std::string, absl::Time> retired_tokens_ ABSL_GUARDED_BY(mutex_);
  std::map<std::string, absl::Time> retired_names_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace epfabric::daemon::groups
