#include "groups/registry.h"

#include <algorithm>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/kernels/transport/ring.h"
#include "groups/group_checks.h"
#include "logging.h"
#include "security/group_secrets.h"

namespace epfabric::daemon::groups {
namespace {

void StartPrepare(v1::Peer::Stub* stub, grpc::ClientContext* context, const v1::PrepareGroupRequest* request,
                  v1::PrepareGroupResponse* response, std::function<void(grpc::Status)> done) {
  stub->async()->PrepareGroup(context, request, response, std::move(done));
}

void StartCommit(v1::Peer::Stub* stub, grpc::ClientContext* context, const v1::CommitGroupRequest* request,
                 v1::CommitGroupResponse* response, std::function<void(grpc::Status)> done) {
  stub->async()->CommitGroup(context, request, response, std::move(done));
}

void StartRelease(v1::Peer::Stub* stub, grpc::ClientContext* context, const v1::ReleaseGroupRequest* request,
                  v1::ReleaseGroupResponse* response, std::function<void(grpc::Status)> done) {
  stub->async()->ReleaseGroup(context, request, response, std::move(done));
}

absl::Status NotTheCoordinator(int rank) {
  return absl::FailedPreconditionError(absl::StrCat("rank ", rank, " is not the coordinator"));
}

}  // namespace

absl::Status Registry::CheckQuotaLocked(const std::string& client, const v1::GroupInfo& info) const {
  if (client.empty()) return absl::OkStatus();
  size_t groups = 0;
  std::map<int, uint64_t> bytes_on;  // fabric rank -> bytes of the client's groups there
  for (const auto& [name, entry] : entries_) {
    if (entry.client != client) continue;
    ++groups;
    for (int rank : entry.info.ranks()) bytes_on[rank] += MemberRegionBytes(entry.info);
  }
  if (quotas_.max_groups != 0 && groups >= quotas_.max_groups) {
    return absl::ResourceExhaustedError(absl::StrCat("client ", client, " holds ", groups, " groups (limit ",
                                                     quotas_.max_groups, " per client, --max_groups_per_client)"));
  }
  if (quotas_.max_region_bytes != 0) {
    for (int rank : info.ranks()) {
      if (bytes_on[rank] + MemberRegionBytes(info) > quotas_.max_region_bytes) {
        return absl::ResourceExhaustedError(
            absl::StrCat("client ", client, " holds ", bytes_on[rank], " bytes of regions on rank ", rank, "; ",
                         MemberRegionBytes(info), " more would pass its limit of ", quotas_.max_region_bytes,
                         " per client and member (--max_region_bytes_per_client)"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::CreateGroupResponse> Registry::Propose(const v1::CreateGroupRequest& request, absl::Time deadline,
                                                          const std::string& client) {
  if (deadline == absl::InfiniteFuture()) deadline = absl::Now() + kPeerCallDeadline;
  const fabric::FabricConfig& config = membership_->config();
  if (!membership_->is_coordinator()) return NotTheCoordinator(config.rank);
  EPF_RETURN_IF_ERROR(ValidateCreateGroup(request, config.world_size));
  if (client.size() > 256) {
    return absl::InvalidArgumentError(absl::StrCat("client: ", client.size(), " bytes (at most 256)"));
  }
  const v1::Membership view = membership_->View();
  const v1::Backend backend = view.members(request.ranks(0)).backend();
  for (int rank : request.ranks()) {
    const v1::MemberInfo& member = view.members(rank);
    if (member.state() != v1::MEMBER_STATE_UP) {
      return absl::UnavailableError(absl::StrCat("rank ", rank, " is ", v1::MemberState_Name(member.state()),
                                                 ": a group can only be created when all its members are up"));
    }
    if (member.backend() != backend) {
      return absl::FailedPreconditionError(absl::StrCat("ranks: rank ", rank, " runs backend ",
                                                        v1::Backend_Name(member.backend()), ", rank ", request.ranks(0),
                                                        " runs ", v1::Backend_Name(backend)));
    }
  }
  if (!SharingFitsBackend(request.memory_sharing(), backend)) {
    return absl::InvalidArgumentError(absl::StrCat("memory_sharing: ", v1::MemorySharing_Name(request.memory_sharing()),
                                                   " does not fit backend ", v1::Backend_Name(backend)));
  }

  v1::GroupInfo info;
  info.set_name(request.name());
  *info.mutable_ranks() = request.ranks();
  info.set_num_nvl_bytes(request.num_nvl_bytes());
  info.set_num_rdma_bytes(request.num_rdma_bytes());
  info.set_low_latency(request.low_latency());
  info.set_num_normal_bytes(request.num_normal_bytes());
  info.set_num_normal_rdma_bytes(request.num_normal_rdma_bytes());
  info.set_state(v1::GROUP_STATE_CREATING);
  info.set_memory_sharing(request.memory_sharing());
  if (request.num_rdma_bytes() > 0) {
    info.set_transport_channels(request.transport_channels() != 0 ? request.transport_channels()
                                                                  : kernels::transport::kDefaultChannels);
    info.set_ring_slots(request.ring_slots() != 0 ? request.ring_slots() : kernels::transport::kDefaultRingSlots);
  }
  const std::string token = RandomHex128();
  // A rolled-back create of the same name that has not reached every member yet: try now, else refuse.
  bool pending = false;
  {
    absl::MutexLock lock(&mutex_);
    pending = pending_releases_.count(request.name()) != 0;
  }
  if (pending) RetryPendingReleases();
  {
    absl::MutexLock lock(&mutex_);
    if (auto it = pending_releases_.find(request.name()); it != pending_releases_.end()) {
      // Pending after a rolled-back create or after a delete: say neither, both happen.
      return absl::UnavailableError(absl::StrCat("name: an earlier group '", request.name(),
                                                 "' (deleted, or a create that was rolled back) has not been released "
                                                 "by rank ",
                                                 *it->second.begin(), " yet (it is unreachable); retry when it is up"));
    }
    if (entries_.count(request.name()) != 0) {
      return absl::AlreadyExistsError(absl::StrCat("name: a group named '", request.name(), "' exists"));
    }
    EPF_RETURN_IF_ERROR(CheckQuotaLocked(client, info));
    entries_[request.name()] = Entry{info, security::TokenDigest(token), security::DeletionKey(token), {}, client};
  }
  std::vector<std::string> addresses;
  for (int rank : request.ranks()) addresses.push_back(view.members(rank).peer_address());

  // Phase 1: every member allocates.
  v1::PrepareGroupRequest prepare;
  prepare.set_fabric_id(config.fabric_id);
  *prepare.mutable_group() = info;
  // What members need of the token, not the token (security/group_secrets.h).
  prepare.set_token_sha256(security::TokenDigest(token));
  prepare.set_data_key(security::DataKey(token));
  prepare.set_deletion_key(security::DeletionKey(token));
  prepare.set_epoch(view.epoch());
  std::vector<int> ranks(request.ranks().begin(), request.ranks().end());
  // A member's answers count only with its proof: whoever holds a dead member's port cannot take part in the create.
  auto prepared = CallMembers(*links_, addresses, prepare, &StartPrepare, deadline, "/epfabric.v1.Peer/PrepareGroup");
  for (size_t i = 0; i < prepared.size(); ++i) {
    if (prepared[i].status.ok()) continue;
    const int rank = request.ranks(static_cast<int>(i));
    Logger("groups")->warn("create '{}' failed on rank {}: {}; rolling back", request.name(), rank,
                           prepared[i].status.error_message());
    // Release wherever the group may exist: members that prepared, and members whose answer did not come (a stopped
    // or slow member may still prepare it). Not where the member said it allocated nothing (refusals), and never
    // where it answered ALREADY_EXISTS: that memory is not this attempt's.
    std::vector<std::string> release = addresses;
    for (size_t j = 0; j < prepared.size(); ++j) {
      const grpc::StatusCode code = prepared[j].status.error_code();
      const bool maybe_held = prepared[j].status.ok() || code == grpc::StatusCode::DEADLINE_EXCEEDED ||
                              code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::CANCELLED;
      if (!maybe_held) release[j].clear();
    }
    RollBack(ranks, release, request.name(), absl::StrCat("rank ", rank, " failed"), deadline);
    const grpc::StatusCode code = prepared[i].status.error_code();
    if (code == grpc::StatusCode::DEADLINE_EXCEEDED) {
      return absl::DeadlineExceededError(absl::StrCat("rank ", rank, " did not prepare group '", request.name(),
                                                      "' in time (", prepared[i].status.error_message(),
                                                      "); the create was rolled back everywhere"));
    }
    return absl::Status(static_cast<absl::StatusCode>(code),
                        absl::StrCat("rank ", rank, ": ", prepared[i].status.error_message()));
  }

  // Phase 2: every member learns every descriptor; the group is READY.
  v1::CommitGroupRequest commit;
  commit.set_fabric_id(config.fabric_id);
  commit.set_name(request.name());
  commit.set_epoch(view.epoch());
  for (MemberReply<v1::PrepareGroupResponse>& p : prepared) *commit.add_members() = std::move(p.response);
  const auto committed =
      CallMembers(*links_, addresses, commit, &StartCommit, deadline, "/epfabric.v1.Peer/CommitGroup");
  for (size_t i = 0; i < committed.size(); ++i) {
    if (committed[i].status.ok()) continue;
    const int rank = request.ranks(static_cast<int>(i));
    RollBack(ranks, addresses, request.name(), absl::StrCat("commit failed on rank ", rank), deadline);
    return absl::UnavailableError(
        absl::StrCat("rank ", rank, ": commit failed: ", committed[i].status.error_message()));
  }
  if (absl::Now() > deadline) {
    // Every member committed, but the caller has given up: it will never learn the token.
    RollBack(ranks, addresses, request.name(), "ready only after the caller's deadline", deadline);
    return absl::DeadlineExceededError(
        absl::StrCat("group '", request.name(), "' was ready only after the caller's deadline; rolled back"));
  }

  v1::CreateGroupResponse response;
  {
    absl::MutexLock lock(&mutex_);
    Entry& entry = entries_[request.name()];
    entry.info.set_state(v1::GROUP_STATE_READY);
    entry.info.set_created_epoch(view.epoch());
    for (int rank : request.ranks()) entry.incarnations.push_back(view.members(rank).incarnation());
    *response.mutable_group() = entry.info;
  }
  response.set_token(token);
  Logger("groups")->info("group '{}' ready on ranks [{}]: {} NVL bytes, {} RDMA bytes per member", request.name(),
                         absl::StrJoin(request.ranks(), ","), request.num_nvl_bytes(), request.num_rdma_bytes());
  return response;
}

absl::Status Registry::Retire(const v1::RetireGroupRequest& request) {
  const fabric::FabricConfig& config = membership_->config();
  if (!membership_->is_coordinator()) return NotTheCoordinator(config.rank);
  v1::GroupInfo info;
  std::string token_sha256;  // empty for a forced delete of a name the registry does not know
  bool unknown = false;
  {
    absl::MutexLock lock(&mutex_);
    auto it = entries_.find(request.name());
    unknown = it == entries_.end();
    if (unknown && request.force()) {
      // Not registered (e.g. a member holds a leftover the registry never saw): every member that is up releases.
      for (int rank = 0; rank < config.world_size; ++rank) info.add_ranks(rank);
    } else if (unknown) {
      return absl::NotFoundError(absl::StrCat("no group named '", request.name(), "'"));
    } else if (!request.force() && it->second.deletion_key.empty()) {
      return absl::PermissionDeniedError(absl::StrCat(
          "group '", request.name(),
          "' was reported by a member that did not send its deletion key; only a forced delete removes it"));
    } else if (!request.force() && !security::RetireProofMatches(it->second.deletion_key, request.name(),
                                                                 request.nonce(), request.proof())) {
      return absl::PermissionDeniedError(absl::StrCat("wrong token for group '", request.name(), "'"));
    } else if (!request.force() && (it->second.info.state() == v1::GROUP_STATE_CREATING ||
                                    it->second.info.state() == v1::GROUP_STATE_DELETING)) {
      return absl::FailedPreconditionError(
          absl::StrCat("group '", request.name(), "' is ", v1::GroupState_Name(it->second.info.state())));
    } else {
      it->second.info.set_state(v1::GROUP_STATE_DELETING);
      info = it->second.info;
      token_sha256 = it->second.token_sha256;
    }
    // A forced delete also ends a pending rollback of the name (its members are asked again below).
    if (request.force()) pending_releases_.erase(request.name());
  }
  if (request.force()) {
    Logger("groups")->warn("forced delete of group '{}'{}", request.name(),
                           unknown ? " (not registered: asking every member that is up)" : "");
  }
  // Release on every member that is up. A member that is down may only be paused or cut off (same incarnation, its
  // regions intact), as may one that does not answer now: both are released when they answer again, like the
  // members of a rolled-back create (RetryPendingReleases; a restarted member holds nothing and answers OK), and the
  // name stays taken until then.
  const v1::Membership view = membership_->View();
  std::vector<std::string> addresses;
  for (int rank : info.ranks()) {
    const v1::MemberInfo& member = view.members(rank);
    addresses.push_back(member.state() == v1::MEMBER_STATE_UP ? member.peer_address() : std::string());
  }
  const auto released = ReleaseOn(addresses, request.name(), "deleted");
  std::vector<int> pending;
  for (size_t i = 0; i < released.size(); ++i) {
    const int rank = info.ranks(static_cast<int>(i));
    if (released[i].called && released[i].status.ok()) continue;
    pending.push_back(rank);
    Logger("groups")->warn("delete '{}': rank {} did not release ({}); released when it answers", request.name(), rank,
                           released[i].called ? released[i].status.error_message() : "it is down");
  }
  absl::MutexLock lock(&mutex_);
  entries_.erase(request.name());
  RetiredLocked(request.name(), token_sha256, absl::Now());
  if (!pending.empty()) pending_releases_[request.name()].insert(pending.begin(), pending.end());
  Logger("groups")->info("group '{}' deleted", request.name());
  return absl::OkStatus();
}

std::vector<MemberReply<v1::ReleaseGroupResponse>> Registry::ReleaseOn(const std::vector<std::string>& addresses,
                                                                       const std::string& name,
                                                                       const std::string& reason) {
  v1::ReleaseGroupRequest release;
  release.set_fabric_id(membership_->config().fabric_id);
  release.set_name(name);
  release.set_reason(reason);
  return CallMembers(*links_, addresses, release, &StartRelease);
}

void Registry::RollBack(const std::vector<int>& ranks, const std::vector<std::string>& addresses,
                        const std::string& name, const std::string& reason, absl::Time deadline) {
  // Members that answer release now, within what is left of the caller's deadline (at least 200 ms, at most 2 s),
  // so that the caller's next look finds nothing; the others (stopped, unreachable) are released by
  // RetryPendingReleases once they answer, and the name stays taken until then.
  const absl::Time now = absl::Now();
  const absl::Time release_by = std::clamp(deadline, now + absl::Milliseconds(200), now + absl::Seconds(2));
  v1::ReleaseGroupRequest release;
  release.set_fabric_id(membership_->config().fabric_id);
  release.set_name(name);
  release.set_reason(reason);
  const auto released = CallMembers(*links_, addresses, release, &StartRelease, release_by);
  absl::MutexLock lock(&mutex_);
  for (size_t i = 0; i < released.size(); ++i) {
    if (!released[i].called || released[i].status.ok()) continue;
    pending_releases_[name].insert(ranks[i]);
    Logger("groups")->warn("rollback of '{}': rank {} did not answer ({}); released when it does", name, ranks[i],
                           released[i].status.error_message());
  }
  if (auto it = entries_.find(name); it != entries_.end()) {
    // A create rolled back after its Commit reached members leaves them READY until they release it.
    RetiredLocked(name, it->second.token_sha256, absl::Now());
    entries_.erase(it);
  }
  Logger("groups")->warn("create of '{}' rolled back ({})", name, reason);
}

void Registry::RetryPendingReleases() {
  std::map<std::string, std::vector<int>> work;
  {
    absl::MutexLock lock(&mutex_);
    for (const auto& [name, ranks] : pending_releases_) work[name].assign(ranks.begin(), ranks.end());
  }
  if (work.empty() || !membership_->is_coordinator()) return;
  const v1::Membership view = membership_->View();
  for (const auto& [name, ranks] : work) {
    // Every member of one name at once, each call bounded; a member that is down is tried again once it is up (a
    // restarted one answers OK: it holds nothing).
    std::vector<std::string> addresses;
    for (int rank : ranks) {
      const bool up = rank < view.members_size() && view.members(rank).state() == v1::MEMBER_STATE_UP;
      addresses.push_back(up ? view.members(rank).peer_address() : std::string());
    }
    v1::ReleaseGroupRequest release;
    release.set_fabric_id(membership_->config().fabric_id);
    release.set_name(name);
    release.set_reason("rollback of a failed create");
    const auto released = CallMembers(*links_, addresses, release, &StartRelease, absl::Now() + absl::Seconds(2));
    absl::MutexLock lock(&mutex_);
    auto it = pending_releases_.find(name);
    if (it == pending_releases_.end()) continue;
    for (size_t i = 0; i < released.size(); ++i) {
      if (!released[i].called || !released[i].status.ok()) continue;
      it->second.erase(ranks[i]);
    }
    if (it->second.empty()) {
      pending_releases_.erase(it);
      Logger("groups")->info("rollback of '{}' complete on every member", name);
    }
  }
}

std::vector<std::pair<std::string, int>> Registry::PendingReleases() const {
  std::vector<std::pair<std::string, int>> pending;
  absl::MutexLock lock(&mutex_);
  for (const auto& [name, ranks] : pending_releases_) {
    for (int rank : ranks) pending.emplace_back(name, rank);
  }
  return pending;
}

void Registry::Forget(const std::string& name) {
  absl::MutexLock lock(&mutex_);
  entries_.erase(name);
}

void Registry::RetiredLocked(const std::string& name, const std::string& token_sha256, absl::Time now) {
  const absl::Time forget_before = now - kRetiredMemory;
  for (auto* retired : {&retired_tokens_, &retired_names_}) {
    std::erase_if(*retired, [forget_before](const auto& entry) { return entry.second < forget_before; });
  }
  if (token_sha256.empty()) {
    retired_names_[name] = now;
  } else {
    retired_tokens_[token_sha256] = now;
  }
}

bool Registry::WasRetiredLocked(const v1::GroupRecord& record) const {
  const absl::Time forget_before = absl::Now() - kRetiredMemory;
  auto recent = [forget_before](const std::map<std::string, absl::Time>& retired, const std::string& key) {
    auto it = retired.find(key);
    return it != retired.end() && it->second >= forget_before;
  };
  return recent(retired_tokens_, record.token_sha256()) || recent(retired_names_, record.group().name());
}

void Registry::Adopt(const v1::JoinRequest& request) {
  absl::MutexLock lock(&mutex_);
  const int world_size = membership_->config().world_size;
  for (const v1::GroupRecord& record : request.groups()) {
    if (entries_.count(record.group().name()) != 0) continue;
    // Deleted or rolled back while this member was away: its release is on the way (RetryPendingReleases).
    if (pending_releases_.count(record.group().name()) != 0) continue;
    // Deleted or rolled back, and released by this member, after it took the snapshot this Join carries.
    if (WasRetiredLocked(record)) {
      Logger("groups")->info("rank {} reported group '{}', deleted since: not adopted", request.member().rank(),
                             Clip(record.group().name()));
      continue;
    }
    // A member reports only groups it belongs to, with valid ranks and a token of the right shape; anything else
    // is dropped, never indexed with.
    const auto& ranks = record.group().ranks();
    if (absl::Status valid = ValidateGroupInfo(record.group(), world_size);
        !valid.ok() || std::find(ranks.begin(), ranks.end(), request.member().rank()) == ranks.end() ||
        record.token_sha256().size() != 64 || (!record.deletion_key().empty() && record.deletion_key().size() != 64)) {
      Logger("groups")->warn("rank {} reported group '{}' that does not check out; ignored", request.member().rank(),
                             Clip(record.group().name()));
      continue;
    }
    Entry entry{record.group(), record.token_sha256(), record.deletion_key(), {}, /*client=*/{}};
    // A group adopted after a coordinator restart cannot be checked against committed incarnations.
    entry.info.set_state(v1::GROUP_STATE_DEGRADED);
    entries_[record.group().name()] = std::move(entry);
    Logger("groups")->info("adopted group '{}' reported by rank {}", record.group().name(), request.member().rank());
  }
}

void Registry::OnMembership(const v1::Membership& view) {
  absl::MutexLock lock(&mutex_);
  for (auto& [name, entry] : entries_) {
    if (entry.info.state() == v1::GROUP_STATE_READY && LostAMember(entry.info, entry.incarnations, view)) {
      entry.info.set_state(v1::GROUP_STATE_DEGRADED);
    } else if (entry.info.state() == v1::GROUP_STATE_DEGRADED && CanRestore(entry.info, entry.incarnations, view)) {
      entry.info.set_state(v1::GROUP_STATE_READY);
    }
  }
}

std::map<std::string, v1::GroupInfo> Registry::Groups() const {
  std::map<std::string, v1::GroupInfo> groups;
  absl::MutexLock lock(&mutex_);
  for (const auto& [name, entry] : entries_) groups[name] = entry.info;
  return groups;
}

}  // namespace epfabric::daemon::groups
