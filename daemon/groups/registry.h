// The coordinator's fabric-wide group registry (rank 0 only): names, tokens and states of every group, and the
// two-phase creation and the deletion that run on the members.
//
// Propose reserves the name, asks every member to Prepare (allocate its regions and describe them), then Commits
// the gathered descriptors to all members; if any member fails, the prepared ones Release and the caller gets that
// member's error. Retire releases on every live member, then forgets the name.
//
// Locking: `mutex_` is a leaf. Nothing else is locked while it is held, and the calls to members (which may be
// this daemon itself, whose member side takes its own locks) are made without it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "epfabric/v1/control.pb.h"
#include "epfabric/v1/peer.pb.h"
#include "fabric/membership.h"
#include "fabric/peer_links.h"
#include "groups/fan_out.h"

namespace epfabric::daemon::groups {

class Registry {
 public:
  Registry(fabric::Membership* membership, fabric::PeerLinks* links) : membership_(membership), links_(links) {}

  // CreateGroup on the coordinator: checks, reserves the name, Prepare then Commit on every member.
  absl::StatusOr<v1::CreateGroupResponse> Propose(const v1::CreateGroupRequest& request) ABSL_LOCKS_EXCLUDED(mutex_);
  // DeleteGroup on the coordinator: checks the token, Release on every live member, forgets the name.
  absl::Status Retire(const v1::RetireGroupRequest& request) ABSL_LOCKS_EXCLUDED(mutex_);
  // Registers the groups a (re)joining member holds, so that a restarted coordinator knows them again.
  void Adopt(const v1::JoinRequest& request) ABSL_LOCKS_EXCLUDED(mutex_);
  // Marks READY groups with a member that is not UP, or not the incarnation that committed, DEGRADED.
  void OnMembership(const v1::Membership& view) ABSL_LOCKS_EXCLUDED(mutex_);
  // Every registered group, by name (never tokens).
  std::map<std::string, v1::GroupInfo> Groups() const ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  struct Entry {
    v1::GroupInfo info;
    std::string token_sha256;            // the coordinator keeps only the token's digest
    std::vector<uint64_t> incarnations;  // of the members at Commit, by group rank
  };

  // Forgets a name whose creation failed.
  void Forget(const std::string& name) ABSL_LOCKS_EXCLUDED(mutex_);
  // Asks the members at `addresses` (empty: skipped) to release group `name`, waiting for all of them.
  std::vector<MemberReply<v1::ReleaseGroupResponse>> ReleaseOn(const std::vector<std::string>& addresses,
                                                               const std::string& name, const std::string& reason);

  fabric::Membership* const membership_;
  fabric::PeerLinks* const links_;

  mutable absl::Mutex mutex_;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace epfabric::daemon::groups
