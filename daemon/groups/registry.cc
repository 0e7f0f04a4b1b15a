#include "groups/registry.h"

#include <algorithm>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "epfabric/common/peer_auth.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/kernels/transport/ring.h"
#include "groups/group_checks.h"
#include "logging.h"

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

absl::StatusOr<v1::CreateGroupResponse> Registry::Propose(const v1::CreateGroupRequest& request) {
  const fabric::FabricConfig& config = membership_->config();
  if (!membership_->is_coordinator()) return NotTheCoordinator(config.rank);
  EPF_RETURN_IF_ERROR(ValidateCreateGroup(request, config.world_size));
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
  info.set_state(v1::GROUP_STATE_CREATING);
  info.set_memory_sharing(request.memory_sharing());
  if (request.num_rdma_bytes() > 0) {
    info.set_transport_channels(request.transport_channels() != 0 ? request.transport_channels()
                                                                  : kernels::transport::kDefaultChannels);
    info.set_ring_slots(request.ring_slots() != 0 ? request.ring_slots() : kernels::transport::kDefaultRingSlots);
  }
  const std::string token = RandomHex128();
  {
    absl::MutexLock lock(&mutex_);
    if (entries_.count(request.name()) != 0) {
      return absl::AlreadyExistsError(absl::StrCat("name: a group named '", request.name(), "' exists"));
    }
    entries_[request.name()] = Entry{info, common::Sha256Hex(token), {}};
  }
  std::vector<std::string> addresses;
  for (int rank : request.ranks()) addresses.push_back(view.members(rank).peer_address());

  // Phase 1: every member allocates.
  v1::PrepareGroupRequest prepare;
  prepare.set_fabric_id(config.fabric_id);
  *prepare.mutable_group() = info;
  prepare.set_token(token);
  prepare.set_epoch(view.epoch());
  auto prepared = CallMembers(*links_, addresses, prepare, &StartPrepare);
  for (size_t i = 0; i < prepared.size(); ++i) {
    if (prepared[i].status.ok()) continue;
    const int rank = request.ranks(static_cast<int>(i));
    Logger("groups")->warn("create '{}' failed on rank {}: {}; rolling back", request.name(), rank,
                           prepared[i].status.error_message());
    std::vector<std::string> prepared_addresses = addresses;
    for (size_t j = 0; j < prepared.size(); ++j) {
      if (!prepared[j].status.ok()) prepared_addresses[j].clear();
    }
    ReleaseOn(prepared_addresses, request.name(), absl::StrCat("rollback: rank ", rank, " failed"));
    Forget(request.name());
    return absl::Status(static_cast<absl::StatusCode>(prepared[i].status.error_code()),
                        absl::StrCat("rank ", rank, ": ", prepared[i].status.error_message()));
  }

  // Phase 2: every member learns every descriptor; the group is READY.
  v1::CommitGroupRequest commit;
  commit.set_fabric_id(config.fabric_id);
  commit.set_name(request.name());
  commit.set_epoch(view.epoch());
  for (MemberReply<v1::PrepareGroupResponse>& p : prepared) *commit.add_members() = std::move(p.response);
  const auto committed = CallMembers(*links_, addresses, commit, &StartCommit);
  for (size_t i = 0; i < committed.size(); ++i) {
    if (committed[i].status.ok()) continue;
    const int rank = request.ranks(static_cast<int>(i));
    ReleaseOn(addresses, request.name(), absl::StrCat("rollback: commit failed on rank ", rank));
    Forget(request.name());
    return absl::UnavailableError(
        absl::StrCat("rank ", rank, ": commit failed: ", committed[i].status.error_message()));
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
  {
    absl::MutexLock lock(&mutex_);
    auto it = entries_.find(request.name());
    if (it == entries_.end()) return absl::NotFoundError(absl::StrCat("no group named '", request.name(), "'"));
    if (!ConstantTimeEquals(it->second.token_sha256, common::Sha256Hex(request.token()))) {
      return absl::PermissionDeniedError(absl::StrCat("wrong token for group '", request.name(), "'"));
    }
    if (it->second.info.state() == v1::GROUP_STATE_CREATING || it->second.info.state() == v1::GROUP_STATE_DELETING) {
      return absl::FailedPreconditionError(
          absl::StrCat("group '", request.name(), "' is ", v1::GroupState_Name(it->second.info.state())));
    }
    it->second.info.set_state(v1::GROUP_STATE_DELETING);
    info = it->second.info;
  }
  // Release on every member that is up; a member that is down lost the memory with its process.
  const v1::Membership view = membership_->View();
  std::vector<std::string> addresses;
  for (int rank : info.ranks()) {
    const v1::MemberInfo& member = view.members(rank);
    addresses.push_back(member.state() == v1::MEMBER_STATE_UP ? member.peer_address() : std::string());
  }
  const auto released = ReleaseOn(addresses, request.name(), "deleted");
  for (size_t i = 0; i < released.size(); ++i) {
    if (!released[i].status.ok()) {
      Logger("groups")->warn("delete '{}': rank {} did not release: {}", request.name(),
                             info.ranks(static_cast<int>(i)), released[i].status.error_message());
    }
  }
  absl::MutexLock lock(&mutex_);
  entries_.erase(request.name());
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

void Registry::Forget(const std::string& name) {
  absl::MutexLock lock(&mutex_);
  entries_.erase(name);
}

void Registry::Adopt(const v1::JoinRequest& request) {
  absl::MutexLock lock(&mutex_);
  const int world_size = membership_->config().world_size;
  for (const v1::GroupRecord& record : request.groups()) {
    if (entries_.count(record.group().name()) != 0) continue;
    // A member reports only groups it belongs to, with valid ranks and a token of the right shape; anything else
    // is dropped, never indexed with.
    const auto& ranks = record.group().ranks();
    if (absl::Status valid = ValidateGroupInfo(record.group(), world_size);
        !valid.ok() || std::find(ranks.begin(), ranks.end(), request.member().rank()) == ranks.end() ||
        record.token_sha256().size() != 64) {
      Logger("groups")->warn("rank {} reported group '{}' that does not check out; ignored", request.member().rank(),
                             Clip(record.group().name()));
      continue;
    }
    Entry entry{record.group(), record.token_sha256(), {}};
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
