#include "groups/group_manager.h"

#include <fcntl.h>
#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/blocking_counter.h"
#include "logging.h"

namespace epfabric::daemon::groups {
namespace {

constexpr absl::Duration kPeerCallDeadline = absl::Seconds(30);

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

// 128 random bits from the kernel's CSPRNG, hex encoded.
std::string RandomHex128() {
  unsigned char bytes[16];
  size_t filled = 0;
  while (filled < sizeof(bytes)) {
    const ssize_t got = getrandom(bytes + filled, sizeof(bytes) - filled, 0);
    if (got > 0) filled += static_cast<size_t>(got);
  }
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

bool ValidGroupName(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-';
  });
}

bool SharingFitsBackend(v1::MemorySharing sharing, v1::Backend backend) {
  if (sharing == v1::MEMORY_SHARING_UNSPECIFIED) return true;
  if (backend == v1::BACKEND_HOST) return sharing == v1::MEMORY_SHARING_POSIX_SHM;
  return sharing == v1::MEMORY_SHARING_CUDA_IPC || sharing == v1::MEMORY_SHARING_POSIX_FD;
}

// Runs `call(rank_index)` for every index at once and waits for all; `call` must invoke `done` exactly once.
template <typename Call>
void ForEachInParallel(size_t count, Call call) {
  absl::BlockingCounter pending(static_cast<int>(count));
  for (size_t i = 0; i < count; ++i) call(i, [&pending] { pending.DecrementCount(); });
  pending.Wait();
}

}  // namespace

absl::Status ValidateCreateGroup(const v1::CreateGroupRequest& request, int world_size) {
  if (!ValidGroupName(request.name())) {
    return absl::InvalidArgumentError(
        absl::StrCat("name: '", request.name(), "' must be 1-64 characters of [A-Za-z0-9._-]"));
  }
  if (request.ranks().empty()) return absl::InvalidArgumentError("ranks: a group needs at least one rank");
  std::set<int> seen;
  for (int rank : request.ranks()) {
    if (rank < 0 || rank >= world_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("ranks: ", rank, " is outside the fabric (ranks 0..", world_size - 1, ")"));
    }
    if (!seen.insert(rank).second) return absl::InvalidArgumentError(absl::StrCat("ranks: ", rank, " appears twice"));
  }
  if (request.num_nvl_bytes() == 0) return absl::InvalidArgumentError("num_nvl_bytes: must be positive");
  for (auto [field, bytes] :
       {std::pair{"num_nvl_bytes", request.num_nvl_bytes()}, std::pair{"num_rdma_bytes", request.num_rdma_bytes()}}) {
    if (bytes > kMaxRegionBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", bytes, " bytes is over the limit of one region (", kMaxRegionBytes, ")"));
    }
  }
  if (!v1::MemorySharing_IsValid(request.memory_sharing())) {
    return absl::InvalidArgumentError(absl::StrCat("memory_sharing: ", request.memory_sharing(), " is not a value"));
  }
  return absl::OkStatus();
}

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  volatile unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff = static_cast<unsigned char>(diff | (a[i] ^ b[i]));
  return diff == 0;
}

GroupManager::GroupManager(fabric::Membership* membership, fabric::PeerLinks* links, memory::RegionAllocator* allocator,
                           LeaseLimits lease_limits)
    : membership_(membership), links_(links), allocator_(allocator), lease_limits_(lease_limits) {}

absl::Status GroupManager::ForwardedStatus(const grpc::ClientContext& context, const grpc::Status& status) const {
  if (status.ok()) return absl::OkStatus();
  if (context.GetServerTrailingMetadata().count(kAnsweredByCoordinator) != 0) return FromGrpc(status);
  return absl::UnavailableError(absl::StrCat("the coordinator (rank 0 at ", membership_->CoordinatorAddress(),
                                             ") is unreachable: groups cannot be created or deleted until it is back (",
                                             status.error_message(), ")"));
}

// ---------------------------------------------------------------- control

absl::StatusOr<v1::CreateGroupResponse> GroupManager::CreateGroup(const v1::CreateGroupRequest& request) {
  if (absl::Status valid = ValidateCreateGroup(request, membership_->config().world_size); !valid.ok()) return valid;
  if (membership_->is_coordinator()) return Propose(request);
  v1::ProposeGroupRequest forward;
  forward.set_fabric_id(membership_->config().fabric_id);
  *forward.mutable_request() = request;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kPeerCallDeadline));
  v1::CreateGroupResponse response;
  const grpc::Status status =
      links_->Stub(membership_->CoordinatorAddress())->ProposeGroup(&context, forward, &response);
  if (!status.ok()) return ForwardedStatus(context, status);
  return response;
}

absl::Status GroupManager::DeleteGroup(const v1::DeleteGroupRequest& request) {
  if (request.name().empty()) return absl::InvalidArgumentError("name: empty");
  if (request.token().empty()) return absl::InvalidArgumentError("token: empty");
  v1::RetireGroupRequest retire;
  retire.set_fabric_id(membership_->config().fabric_id);
  retire.set_name(request.name());
  retire.set_token(request.token());
  if (membership_->is_coordinator()) return Retire(retire);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kPeerCallDeadline));
  v1::RetireGroupResponse response;
  const grpc::Status status = links_->Stub(membership_->CoordinatorAddress())->RetireGroup(&context, retire, &response);
  return ForwardedStatus(context, status);
}

v1::ListGroupsResponse GroupManager::ListGroups() const {
  v1::ListGroupsResponse response;
  absl::MutexLock lock(&mutex_);
  std::set<std::string> listed;
  for (const auto& [name, group] : local_) {
    v1::GroupInfo* info = response.add_groups();
    *info = group.info;
    info->clear_attached_ranks();
    for (const auto& [id, lease] : leases_) {
      if (lease.info.group() == name) info->add_attached_ranks(lease.info.rank());
    }
    listed.insert(name);
  }
  for (const auto& [name, entry] : registry_) {
    if (listed.count(name) == 0) *response.add_groups() = entry.info;
  }
  return response;
}

// ---------------------------------------------------------------- coordinator

absl::StatusOr<v1::CreateGroupResponse> GroupManager::Propose(const v1::CreateGroupRequest& request) {
  const fabric::FabricConfig& config = membership_->config();
  if (!membership_->is_coordinator()) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", config.rank, " is not the coordinator"));
  }
  if (absl::Status valid = ValidateCreateGroup(request, config.world_size); !valid.ok()) return valid;
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
  const std::string token = RandomHex128();
  {
    absl::MutexLock lock(&mutex_);
    if (registry_.count(request.name()) != 0) {
      return absl::AlreadyExistsError(absl::StrCat("name: a group named '", request.name(), "' exists"));
    }
    registry_[request.name()] = RegistryEntry{info, token, {}};
  }
  auto forget = [this, &request] {
    absl::MutexLock lock(&mutex_);
    registry_.erase(request.name());
  };

  // Phase 1: every member allocates.
  const size_t size = static_cast<size_t>(request.ranks_size());
  std::vector<v1::PrepareGroupResponse> prepared(size);
  std::vector<grpc::Status> prepare_status(size);
  {
    std::vector<std::unique_ptr<grpc::ClientContext>> contexts(size);
    std::vector<std::shared_ptr<v1::Peer::Stub>> stubs(size);
    v1::PrepareGroupRequest prepare;
    prepare.set_fabric_id(config.fabric_id);
    *prepare.mutable_group() = info;
    prepare.set_token(token);
    prepare.set_epoch(view.epoch());
    ForEachInParallel(size, [&](size_t i, auto done) {
      contexts[i] = std::make_unique<grpc::ClientContext>();
      contexts[i]->set_deadline(absl::ToChronoTime(absl::Now() + kPeerCallDeadline));
      stubs[i] = links_->Stub(view.members(request.ranks(static_cast<int>(i))).peer_address());
      stubs[i]->async()->PrepareGroup(contexts[i].get(), &prepare, &prepared[i],
                                      [&prepare_status, i, done](grpc::Status s) {
                                        prepare_status[i] = std::move(s);
                                        done();
                                      });
    });
  }
  auto release_all = [&](const std::vector<bool>& which, const std::string& reason) {
    v1::ReleaseGroupRequest release;
    release.set_fabric_id(config.fabric_id);
    release.set_name(request.name());
    release.set_reason(reason);
    std::vector<std::unique_ptr<grpc::ClientContext>> contexts(size);
    std::vector<std::shared_ptr<v1::Peer::Stub>> stubs(size);
    std::vector<v1::ReleaseGroupResponse> responses(size);
    ForEachInParallel(size, [&](size_t i, auto done) {
      if (!which[i]) return done();
      contexts[i] = std::make_unique<grpc::ClientContext>();
      contexts[i]->set_deadline(absl::ToChronoTime(absl::Now() + kPeerCallDeadline));
      stubs[i] = links_->Stub(view.members(request.ranks(static_cast<int>(i))).peer_address());
      stubs[i]->async()->ReleaseGroup(contexts[i].get(), &release, &responses[i], [done](grpc::Status) { done(); });
    });
  };
  std::vector<bool> ok(size);
  for (size_t i = 0; i < size; ++i) ok[i] = prepare_status[i].ok();
  for (size_t i = 0; i < size; ++i) {
    if (ok[i]) continue;
    const int rank = request.ranks(static_cast<int>(i));
    Logger("groups")->warn("create '{}' failed on rank {}: {}; rolling back", request.name(), rank,
                           prepare_status[i].error_message());
    release_all(ok, absl::StrCat("rollback: rank ", rank, " failed"));
    forget();
    return absl::Status(static_cast<absl::StatusCode>(prepare_status[i].error_code()),
                        absl::StrCat("rank ", rank, ": ", prepare_status[i].error_message()));
  }

  // Phase 2: every member learns every descriptor; the group is READY.
  v1::CommitGroupRequest commit;
  commit.set_fabric_id(config.fabric_id);
  commit.set_name(request.name());
  commit.set_epoch(view.epoch());
  for (v1::PrepareGroupResponse& p : prepared) *commit.add_members() = std::move(p);
  std::vector<grpc::Status> commit_status(size);
  {
    std::vector<std::unique_ptr<grpc::ClientContext>> contexts(size);
    std::vector<std::shared_ptr<v1::Peer::Stub>> stubs(size);
    std::vector<v1::CommitGroupResponse> responses(size);
    ForEachInParallel(size, [&](size_t i, auto done) {
      contexts[i] = std::make_unique<grpc::ClientContext>();
      contexts[i]->set_deadline(absl::ToChronoTime(absl::Now() + kPeerCallDeadline));
      stubs[i] = links_->Stub(view.members(request.ranks(static_cast<int>(i))).peer_address());
      stubs[i]->async()->CommitGroup(contexts[i].get(), &commit, &responses[i],
                                     [&commit_status, i, done](grpc::Status s) {
                                       commit_status[i] = std::move(s);
                                       done();
                                     });
    });
  }
  for (size_t i = 0; i < size; ++i) {
    if (commit_status[i].ok()) continue;
    const int rank = request.ranks(static_cast<int>(i));
    release_all(std::vector<bool>(size, true), absl::StrCat("rollback: commit failed on rank ", rank));
    forget();
    return absl::UnavailableError(absl::StrCat("rank ", rank, ": commit failed: ", commit_status[i].error_message()));
  }

  v1::CreateGroupResponse response;
  {
    absl::MutexLock lock(&mutex_);
    RegistryEntry& entry = registry_[request.name()];
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

absl::Status GroupManager::Retire(const v1::RetireGroupRequest& request) {
  const fabric::FabricConfig& config = membership_->config();
  if (!membership_->is_coordinator()) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", config.rank, " is not the coordinator"));
  }
  v1::GroupInfo info;
  {
    absl::MutexLock lock(&mutex_);
    auto it = registry_.find(request.name());
    if (it == registry_.end()) return absl::NotFoundError(absl::StrCat("no group named '", request.name(), "'"));
    if (!ConstantTimeEquals(it->second.token, request.token())) {
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
  v1::ReleaseGroupRequest release;
  release.set_fabric_id(config.fabric_id);
  release.set_name(request.name());
  release.set_reason("deleted");
  const size_t size = static_cast<size_t>(info.ranks_size());
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts(size);
  std::vector<std::shared_ptr<v1::Peer::Stub>> stubs(size);
  std::vector<v1::ReleaseGroupResponse> responses(size);
  std::vector<grpc::Status> status(size);
  ForEachInParallel(size, [&](size_t i, auto done) {
    const v1::MemberInfo& member = view.members(info.ranks(static_cast<int>(i)));
    if (member.state() != v1::MEMBER_STATE_UP) return done();
    contexts[i] = std::make_unique<grpc::ClientContext>();
    contexts[i]->set_deadline(absl::ToChronoTime(absl::Now() + kPeerCallDeadline));
    stubs[i] = links_->Stub(member.peer_address());
    stubs[i]->async()->ReleaseGroup(contexts[i].get(), &release, &responses[i], [&status, i, done](grpc::Status s) {
      status[i] = std::move(s);
      done();
    });
  });
  for (size_t i = 0; i < size; ++i) {
    if (!status[i].ok()) {
      Logger("groups")->warn("delete '{}': rank {} did not release: {}", request.name(), info.ranks(i),
                             status[i].error_message());
    }
  }
  absl::MutexLock lock(&mutex_);
  registry_.erase(request.name());
  Logger("groups")->info("group '{}' deleted", request.name());
  return absl::OkStatus();
}

void GroupManager::Adopt(const v1::JoinRequest& request) {
  absl::MutexLock lock(&mutex_);
  for (const v1::GroupRecord& record : request.groups()) {
    if (registry_.count(record.group().name()) != 0) continue;
    RegistryEntry entry{record.group(), record.token(), {}};
    // A group adopted after a coordinator restart cannot be checked against committed incarnations.
    entry.info.set_state(v1::GROUP_STATE_DEGRADED);
    registry_[record.group().name()] = std::move(entry);
    Logger("groups")->info("adopted group '{}' reported by rank {}", record.group().name(), request.member().rank());
  }
}

// ---------------------------------------------------------------- member

absl::StatusOr<v1::PrepareGroupResponse> GroupManager::Prepare(const v1::PrepareGroupRequest& request) {
  const v1::GroupInfo& info = request.group();
  const int self = membership_->config().rank;
  const auto position = std::find(info.ranks().begin(), info.ranks().end(), self);
  if (position == info.ranks().end()) {
    return absl::InvalidArgumentError(absl::StrCat("group.ranks: rank ", self, " is not a member"));
  }
  if (!ValidGroupName(info.name())) return absl::InvalidArgumentError("group.name: invalid");
  if (info.num_nvl_bytes() == 0 || info.num_nvl_bytes() > kMaxRegionBytes || info.num_rdma_bytes() > kMaxRegionBytes) {
    return absl::InvalidArgumentError("group: region sizes out of range");
  }
  if (request.token().empty()) return absl::InvalidArgumentError("token: empty");
  const int group_rank = static_cast<int>(position - info.ranks().begin());
  {
    absl::MutexLock lock(&mutex_);
    if (local_.count(info.name()) != 0) {
      return absl::AlreadyExistsError(absl::StrCat("group '", info.name(), "' already exists on rank ", self));
    }
  }
  LocalGroup group;
  group.info = info;
  group.token = request.token();
  group.group_rank = group_rank;
  memory::RegionSpec spec;
  spec.group = info.name();
  spec.rank = group_rank;
  spec.sharing = info.memory_sharing();
  spec.bytes = info.num_nvl_bytes();
  spec.kind = v1::RegionDescriptor::KIND_NVL;
  auto nvl = allocator_->Allocate(spec);
  if (!nvl.ok()) return nvl.status();
  group.nvl = std::move(*nvl);
  if (info.num_rdma_bytes() > 0) {
    spec.bytes = info.num_rdma_bytes();
    spec.kind = v1::RegionDescriptor::KIND_RDMA;
    auto rdma = allocator_->Allocate(spec);
    if (!rdma.ok()) return rdma.status();
    group.rdma = std::move(*rdma);
  }
  v1::PrepareGroupResponse response;
  *response.add_regions() = group.nvl->descriptor();
  if (group.rdma != nullptr) *response.add_regions() = group.rdma->descriptor();
  absl::MutexLock lock(&mutex_);
  if (local_.count(info.name()) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("group '", info.name(), "' already exists on rank ", self));
  }
  local_[info.name()] = std::move(group);
  return response;
}

absl::Status GroupManager::Commit(const v1::CommitGroupRequest& request) {
  const v1::Membership view = membership_->View();
  absl::MutexLock lock(&mutex_);
  auto it = local_.find(request.name());
  if (it == local_.end()) return absl::NotFoundError(absl::StrCat("group '", request.name(), "' was not prepared"));
  LocalGroup& group = it->second;
  if (request.members_size() != group.info.ranks_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("members: ", request.members_size(), " descriptors for ", group.info.ranks_size(), " ranks"));
  }
  group.members.assign(request.members().begin(), request.members().end());
  group.incarnations.clear();
  for (int rank : group.info.ranks()) group.incarnations.push_back(view.members(rank).incarnation());
  group.info.set_state(v1::GROUP_STATE_READY);
  group.info.set_created_epoch(request.epoch());
  return absl::OkStatus();
}

absl::Status GroupManager::Release(const v1::ReleaseGroupRequest& request) {
  absl::MutexLock lock(&mutex_);
  // The memory goes away with the group, and so do its leases.
  std::erase_if(leases_, [&request](const auto& entry) { return entry.second.info.group() == request.name(); });
  if (local_.erase(request.name()) != 0) {
    Logger("groups")->info("released group '{}' ({})", request.name(), request.reason());
  }
  return absl::OkStatus();
}

std::vector<v1::GroupRecord> GroupManager::LocalRecords() const {
  std::vector<v1::GroupRecord> records;
  absl::MutexLock lock(&mutex_);
  for (const auto& [name, group] : local_) {
    if (group.info.state() == v1::GROUP_STATE_CREATING) continue;
    v1::GroupRecord record;
    *record.mutable_group() = group.info;
    record.set_token(group.token);
    records.push_back(std::move(record));
  }
  return records;
}

void GroupManager::OnMembership(const v1::Membership& view) {
  auto degraded = [&view](const v1::GroupInfo& info, const std::vector<uint64_t>& incarnations) {
    for (int i = 0; i < info.ranks_size(); ++i) {
      const v1::MemberInfo& member = view.members(info.ranks(i));
      if (member.state() != v1::MEMBER_STATE_UP) return true;
      if (i < static_cast<int>(incarnations.size()) && member.incarnation() != incarnations[i]) return true;
    }
    return false;
  };
  absl::MutexLock lock(&mutex_);
  for (auto& [name, group] : local_) {
    if (group.info.state() == v1::GROUP_STATE_READY && degraded(group.info, group.incarnations)) {
      group.info.set_state(v1::GROUP_STATE_DEGRADED);
      Logger("groups")->warn("group '{}' degraded: a member is down or restarted", name);
    }
  }
  for (auto& [name, entry] : registry_) {
    if (entry.info.state() == v1::GROUP_STATE_READY && degraded(entry.info, entry.incarnations)) {
      entry.info.set_state(v1::GROUP_STATE_DEGRADED);
    }
  }
}

// ---------------------------------------------------------------- leases

absl::StatusOr<v1::AttachResponse> GroupManager::Attach(const v1::AttachRequest& request,
                                                        const ClientIdentity& client) {
  if (request.group().empty()) return absl::InvalidArgumentError("group: empty");
  if (request.token().empty()) return absl::InvalidArgumentError("token: empty");
  if (request.client_name().size() > 128) return absl::InvalidArgumentError("client_name: longer than 128 bytes");
  absl::Duration ttl =
      request.lease_ttl_ms() == 0 ? lease_limits_.default_ttl : absl::Milliseconds(request.lease_ttl_ms());
  ttl = std::clamp(ttl, lease_limits_.min_ttl, lease_limits_.max_ttl);
  const v1::Membership view = membership_->View();
  const int self = membership_->config().rank;

  absl::MutexLock lock(&mutex_);
  auto it = local_.find(request.group());
  if (it == local_.end()) {
    return absl::NotFoundError(
        absl::StrCat("group '", request.group(), "' has no region on this daemon (rank ", self, ")"));
  }
  LocalGroup& group = it->second;
  if (!ConstantTimeEquals(group.token, request.token())) {
    return absl::PermissionDeniedError(absl::StrCat("wrong token for group '", request.group(), "'"));
  }
  if (request.rank() < 0 || request.rank() >= group.info.ranks_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank: ", request.rank(), " is not a rank of group '",
                                                   request.group(), "' (0..", group.info.ranks_size() - 1, ")"));
  }
  if (request.rank() != group.group_rank) {
    const v1::MemberInfo& owner = view.members(group.info.ranks(request.rank()));
    return absl::FailedPreconditionError(absl::StrCat("group rank ", request.rank(), " is served by daemon rank ",
                                                      owner.rank(), " at ", owner.peer_address(), "; attach there"));
  }
  if (group.info.state() != v1::GROUP_STATE_READY) {
    return absl::UnavailableError(
        absl::StrCat("group '", request.group(), "' is ", v1::GroupState_Name(group.info.state())));
  }
  for (const auto& [id, lease] : leases_) {
    if (lease.info.group() == request.group() && lease.info.rank() == request.rank()) {
      return absl::FailedPreconditionError(absl::StrCat("group '", request.group(), "' rank ", request.rank(),
                                                        " is already attached (pid ", lease.info.pid(), ")"));
    }
  }
  Lease lease;
  lease.ttl = ttl;
  lease.expires = absl::Now() + ttl;
  lease.info.set_lease_id(RandomHex128());
  lease.info.set_group(request.group());
  lease.info.set_rank(request.rank());
  lease.info.set_client_name(request.client_name());
  lease.info.set_pid(client.pid);
  lease.info.set_uid(client.uid);
  lease.info.set_attached_unix(absl::ToUnixSeconds(absl::Now()));
  lease.info.set_expires_unix_ms(absl::ToUnixMillis(lease.expires));

  v1::AttachResponse response;
  response.set_lease_id(lease.info.lease_id());
  response.set_lease_ttl_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(ttl)));
  *response.mutable_group() = group.info;
  response.set_rank(group.group_rank);
  response.set_world_size(group.info.ranks_size());
  response.set_backend(allocator_->backend());
  response.set_epoch(view.epoch());
  const std::string& my_host = view.members(self).host_id();
  for (int i = 0; i < group.info.ranks_size(); ++i) {
    if (view.members(group.info.ranks(i)).host_id() != my_host) continue;
    response.add_nvl_ranks(i);
    for (const v1::RegionDescriptor& region : group.members[i].regions()) {
      if (region.kind() != v1::RegionDescriptor::KIND_NVL && i != group.group_rank) continue;
      v1::RegionDescriptor* added = response.add_regions();
      *added = region;
      added->set_fd_socket(view.members(group.info.ranks(i)).fd_socket());
    }
  }
  Logger("groups")->info("lease {} on group '{}' rank {} for '{}' (pid {}, uid {})", lease.info.lease_id(),
                         request.group(), request.rank(), request.client_name(), client.pid, client.uid);
  leases_[lease.info.lease_id()] = std::move(lease);
  return response;
}

void GroupManager::EndLeaseLocked(const std::string& lease_id, const char* why) {
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) return;
  auto group = local_.find(it->second.info.group());
  if (group != local_.end()) {
    for (memory::Region* region : {group->second.nvl.get(), group->second.rdma.get()}) {
      if (region == nullptr) continue;
      if (absl::Status zeroed = region->Zero(0, region->descriptor().size_bytes()); !zeroed.ok()) {
        Logger("groups")->error("cleaning group '{}' after lease {}: {}", it->second.info.group(), lease_id,
                                zeroed.ToString());
      }
    }
  }
  Logger("groups")->info("lease {} on group '{}' rank {} ended ({})", lease_id, it->second.info.group(),
                         it->second.info.rank(), why);
  leases_.erase(it);
}

absl::Status GroupManager::Detach(const v1::DetachRequest& request) { return EndLease(request.lease_id(), "detached"); }

absl::Status GroupManager::EndLease(const std::string& lease_id, const std::string& reason) {
  absl::MutexLock lock(&mutex_);
  if (leases_.count(lease_id) == 0) {
    return absl::NotFoundError(absl::StrCat("lease_id: '", lease_id, "' is not a live lease"));
  }
  EndLeaseLocked(lease_id, reason.c_str());
  return absl::OkStatus();
}

absl::StatusOr<v1::ClientInfo> GroupManager::LeaseInfo(const std::string& lease_id) const {
  absl::MutexLock lock(&mutex_);
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) return absl::NotFoundError(absl::StrCat("lease_id: '", lease_id, "' is not a live lease"));
  return it->second.info;
}

absl::StatusOr<GroupManager::SharedRegion> GroupManager::ShareRegion(const std::string& group_name, int group_rank,
                                                                     v1::RegionDescriptor::Kind kind,
                                                                     const std::string& token) const {
  const v1::Membership view = membership_->View();
  const int self = membership_->config().rank;
  absl::MutexLock lock(&mutex_);
  auto it = local_.find(group_name);
  if (it == local_.end()) {
    return absl::NotFoundError(
        absl::StrCat("group: '", group_name, "' has no region on this daemon (rank ", self, ")"));
  }
  const LocalGroup& group = it->second;
  if (!ConstantTimeEquals(group.token, token)) {
    return absl::PermissionDeniedError(absl::StrCat("token: wrong token for group '", group_name, "'"));
  }
  if (group_rank < 0 || group_rank >= group.info.ranks_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank: ", group_rank, " is not a rank of group '", group_name,
                                                   "' (0..", group.info.ranks_size() - 1, ")"));
  }
  if (group_rank != group.group_rank) {
    const v1::MemberInfo& owner = view.members(group.info.ranks(group_rank));
    return absl::FailedPreconditionError(absl::StrCat("rank: group rank ", group_rank, " of '", group_name,
                                                      "' is served by daemon rank ", owner.rank(), " (fd socket ",
                                                      owner.fd_socket(), "); ask there"));
  }
  const memory::Region* region = kind == v1::RegionDescriptor::KIND_NVL    ? group.nvl.get()
                                 : kind == v1::RegionDescriptor::KIND_RDMA ? group.rdma.get()
                                                                           : nullptr;
  if (region == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("kind: group '", group_name, "' has no ", v1::RegionDescriptor::Kind_Name(kind), " region"));
  }
  SharedRegion shared;
  shared.descriptor = region->descriptor();
  shared.descriptor.set_fd_socket(view.members(self).fd_socket());
  if (region->shareable_fd() >= 0) {
    // Duplicated under the lock: once it is released the group may be deleted and the Region's fd closed.
    shared.fd.reset(fcntl(region->shareable_fd(), F_DUPFD_CLOEXEC, 0));
    if (!shared.fd.valid()) {
      return absl::InternalError(absl::StrCat("duplicating the fd of group '", group_name, "' ",
                                              v1::RegionDescriptor::Kind_Name(kind), " region: ", strerror(errno)));
    }
  }
  return shared;
}

absl::StatusOr<v1::KeepAliveResponse> GroupManager::KeepAlive(const v1::KeepAliveRequest& request) {
  const uint64_t epoch = membership_->View().epoch();
  absl::MutexLock lock(&mutex_);
  auto it = leases_.find(request.lease_id());
  if (it == leases_.end()) {
    return absl::NotFoundError(absl::StrCat("lease_id: '", request.lease_id(), "' is not a live lease"));
  }
  Lease& lease = it->second;
  lease.expires = absl::Now() + lease.ttl;
  lease.info.set_expires_unix_ms(absl::ToUnixMillis(lease.expires));
  v1::KeepAliveResponse response;
  response.set_lease_ttl_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(lease.ttl)));
  auto group = local_.find(lease.info.group());
  response.set_group_state(group != local_.end() ? group->second.info.state() : v1::GROUP_STATE_UNSPECIFIED);
  response.set_epoch(epoch);
  return response;
}

std::vector<v1::ClientInfo> GroupManager::Clients() const {
  std::vector<v1::ClientInfo> clients;
  absl::MutexLock lock(&mutex_);
  for (const auto& [id, lease] : leases_) clients.push_back(lease.info);
  return clients;
}

void GroupManager::ExpireLeases(absl::Time now) {
  absl::MutexLock lock(&mutex_);
  std::vector<std::string> expired;
  for (const auto& [id, lease] : leases_) {
    if (lease.expires < now) expired.push_back(id);
  }
  for (const std::string& id : expired) EndLeaseLocked(id, "expired");
}

}  // namespace epfabric::daemon::groups
