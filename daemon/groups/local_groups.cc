#include "groups/local_groups.h"

#include <fcntl.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "epfabric/common/status_macros.h"
#include "groups/group_checks.h"
#include "logging.h"
#include "security/group_secrets.h"

namespace epfabric::daemon::groups {
namespace {

bool IsHex64(const std::string& text) {
  if (text.size() != 64) return false;
  for (char c : text) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<v1::PrepareGroupResponse> LocalGroups::Prepare(const v1::PrepareGroupRequest& request,
                                                              absl::Time deadline) {
  if (absl::Now() > deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat("prepare of '", request.group().name(), "' arrived after the coordinator's deadline"));
  }
  const v1::GroupInfo& info = request.group();
  const int self = membership_->config().rank;
  EPF_RETURN_IF_ERROR(ValidateGroupInfo(info, membership_->config().world_size));
  const auto position = std::find(info.ranks().begin(), info.ranks().end(), self);
  if (position == info.ranks().end()) {
    return absl::InvalidArgumentError(absl::StrCat("group.ranks: rank ", self, " is not a member"));
  }
  for (const std::string* hex : {&request.token_sha256(), &request.data_key(), &request.deletion_key()}) {
    if (!IsHex64(*hex)) {
      return absl::InvalidArgumentError(
          "token_sha256, data_key, deletion_key: each 64 hex digits of the group's token");
    }
  }
  const v1::Membership view = membership_->View();
  if (request.epoch() != view.epoch()) {
    return absl::AbortedError(absl::StrCat("epoch: the coordinator prepares at epoch ", request.epoch(), ", rank ",
                                           self, " knows epoch ", view.epoch(), "; retry"));
  }
  const uint64_t bytes = info.num_nvl_bytes() + info.num_rdma_bytes();
  const int group_rank = static_cast<int>(position - info.ranks().begin());
  auto exists = [&info, self] {
    return absl::AlreadyExistsError(absl::StrCat("group '", info.name(), "' already exists on rank ", self));
  };
  {
    absl::MutexLock lock(&mutex_);
    if (groups_.count(info.name()) != 0) return exists();
    EPF_RETURN_IF_ERROR(CheckQuotaLocked(bytes));
  }
  LocalGroup group;
  group.info = info;
  group.info.set_state(v1::GROUP_STATE_CREATING);  // until Commit, whatever the request said
  group.token_sha256 = request.token_sha256();
  group.deletion_key = request.deletion_key();
  group.group_rank = group_rank;
  // Fabric rank 0 coordinates; at this epoch the view names the incarnation that sent the Prepare.
  group.coordinator_incarnation = view.members_size() > 0 ? view.members(0).incarnation() : 0;
  memory::RegionSpec spec;
  spec.group = info.name();
  spec.rank = group_rank;
  spec.sharing = info.memory_sharing();
  spec.bytes = info.num_nvl_bytes();
  spec.kind = v1::RegionDescriptor::KIND_NVL;
  EPF_ASSIGN_OR_RETURN(group.nvl, allocator_->Allocate(spec));
  if (info.num_rdma_bytes() > 0) {
    spec.bytes = info.num_rdma_bytes();
    spec.kind = v1::RegionDescriptor::KIND_RDMA;
    EPF_ASSIGN_OR_RETURN(group.rdma, allocator_->Allocate(spec));
  }
  spec.bytes = kernels::kDataPathStatsBytes;
  spec.kind = v1::RegionDescriptor::KIND_STATS;
  spec.sharing = v1::MEMORY_SHARING_UNSPECIFIED;
  EPF_ASSIGN_OR_RETURN(group.stats, stats_allocator_->Allocate(spec));
  v1::PrepareGroupResponse response;
  *response.add_regions() = group.nvl->descriptor();
  if (group.rdma != nullptr) {
    *response.add_regions() = group.rdma->descriptor();
    if (transport_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("rank ", self, " has no transport for the RDMA region"));
    }
    transport::GroupTransportSpec transport_spec;
    transport_spec.group = info.name();
    transport_spec.self_rank = group_rank;
    transport_spec.world = info.ranks_size();
    transport_spec.channels = static_cast<int>(info.transport_channels());
    transport_spec.slots = info.ring_slots();
    transport_spec.data_key = request.data_key();
    transport_spec.rdma = group.rdma.get();
    EPF_ASSIGN_OR_RETURN(group.transport, transport_->OpenGroup(transport_spec, response.mutable_transport()));
  }
  if (absl::Now() > deadline) {
    // The coordinator stopped waiting while we allocated (this daemon was stopped or slow): `group` frees it all.
    return absl::DeadlineExceededError(absl::StrCat("prepare of '", info.name(),
                                                    "' finished after the coordinator's "
                                                    "deadline; released"));
  }
  group.prepared_at = absl::Now();
  {
    absl::MutexLock lock(&mutex_);
    if (groups_.count(info.name()) == 0 && CheckQuotaLocked(bytes).ok()) {
      groups_[info.name()] = std::move(group);
      return response;
    }
    if (groups_.count(info.name()) == 0) return CheckQuotaLocked(bytes);  // others took the room meanwhile
  }
  return exists();  // a concurrent Prepare won; `group` frees its regions here, outside the lock
}

absl::Status LocalGroups::Commit(const v1::CommitGroupRequest& request) {
  const v1::Membership view = membership_->View();
  absl::MutexLock lock(&mutex_);
  auto it = groups_.find(request.name());
  if (it == groups_.end()) return absl::NotFoundError(absl::StrCat("group '", request.name(), "' was not prepared"));
  LocalGroup& group = it->second;
  if (group.info.state() != v1::GROUP_STATE_CREATING) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", request.name(), "' is ", v1::GroupState_Name(group.info.state()), ", not CREATING"));
  }
  EPF_RETURN_IF_ERROR(ValidateCommitMembers(group.info, request.members()));
  if (request.epoch() > fabric::kMaxEpoch) {
    return absl::InvalidArgumentError(absl::StrCat("epoch: ", request.epoch(), " is above ", fabric::kMaxEpoch));
  }
  if (group.transport != nullptr) {
    std::vector<v1::TransportEndpoint> endpoints;
    for (const v1::PrepareGroupResponse& member : request.members()) endpoints.push_back(member.transport());
    // Starts connection threads and proxying; nothing here blocks on a peer.
    EPF_RETURN_IF_ERROR(group.transport->Connect(endpoints));
  }
  group.members.assign(request.members().begin(), request.members().end());
  group.incarnations.clear();
  for (int rank : group.info.ranks()) group.incarnations.push_back(view.members(rank).incarnation());
  group.info.set_state(v1::GROUP_STATE_READY);
  group.info.set_created_epoch(request.epoch());
  return absl::OkStatus();
}

absl::Status LocalGroups::CheckQuotaLocked(uint64_t bytes) const {
  if (groups_.size() >= limits_.max_groups) {
    return absl::ResourceExhaustedError(absl::StrCat("rank ", membership_->config().rank, " holds ", groups_.size(),
                                                     " groups (limit ", limits_.max_groups, ", --max_groups)"));
  }
  if (limits_.max_total_region_bytes == 0) return absl::OkStatus();
  uint64_t held = 0;
  for (const auto& [name, group] : groups_) held += group.info.num_nvl_bytes() + group.info.num_rdma_bytes();
  if (held + bytes > limits_.max_total_region_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("rank ", membership_->config().rank, " holds ", held,
                                                     " bytes of regions; ", bytes, " more exceed the limit of ",
                                                     limits_.max_total_region_bytes, " (--max_total_region_bytes)"));
  }
  return absl::OkStatus();
}

std::vector<std::string> LocalGroups::UncommittedSince(absl::Time before) const {
  std::vector<std::string> names;
  absl::MutexLock lock(&mutex_);
  for (const auto& [name, group] : groups_) {
    if (group.info.state() == v1::GROUP_STATE_CREATING && group.prepared_at < before) names.push_back(name);
  }
  return names;
}

std::vector<std::string> LocalGroups::UncommittedOfAnotherCoordinator(uint64_t coordinator_incarnation) const {
  std::vector<std::string> names;
  absl::MutexLock lock(&mutex_);
  for (const auto& [name, group] : groups_) {
    if (group.info.state() == v1::GROUP_STATE_CREATING && group.coordinator_incarnation != coordinator_incarnation) {
      names.push_back(name);
    }
  }
  return names;
}

std::optional<LocalGroup> LocalGroups::Remove(const std::string& name) {
  absl::MutexLock lock(&mutex_);
  auto it = groups_.find(name);
  if (it == groups_.end()) return std::nullopt;
  std::optional<LocalGroup> removed(std::move(it->second));
  groups_.erase(it);
  return removed;
}

std::vector<v1::GroupRecord> LocalGroups::LocalRecords() const {
  std::vector<v1::GroupRecord> records;
  absl::MutexLock lock(&mutex_);
  for (const auto& [name, group] : groups_) {
    if (group.info.state() == v1::GROUP_STATE_CREATING) continue;
    v1::GroupRecord record;
    *record.mutable_group() = group.info;
    record.set_token_sha256(group.token_sha256);
    record.set_deletion_key(group.deletion_key);
    records.push_back(std::move(record));
  }
  return records;
}

void LocalGroups::PublishLostLocked(LocalGroup& group, const v1::Membership& view) {
  if (group.stats == nullptr || group.info.state() == v1::GROUP_STATE_CREATING) return;
  uint64_t words[kernels::kLostRankWords] = {};
  auto add = [&](int rank) {
    if (rank >= 0 && rank < kernels::kMaxLostRanks) words[rank / 64] |= uint64_t{1} << (rank % 64);
  };
  for (int rank : groups::LostRanks(group.info, group.incarnations, view)) add(rank);
  for (size_t rank = 0; rank < group.lease_lost.size(); ++rank) {
    if (group.lease_lost[rank]) add(static_cast<int>(rank));
  }
  // By index among the same-host ranks, in Attach's nvl_ranks order (the inner stage of a group across hosts).
  uint64_t local_words[kernels::kLostRankWords] = {};
  const int self = group.group_rank >= 0 && group.group_rank < group.info.ranks_size()
                       ? group.info.ranks(group.group_rank)
                       : -1;  // this daemon's fabric rank
  if (self >= 0 && self < view.members_size()) {
    int local = 0;
    for (int rank = 0; rank < group.info.ranks_size(); ++rank) {
      const int member = group.info.ranks(rank);
      if (member < 0 || member >= view.members_size() ||
          view.members(member).host_id() != view.members(self).host_id()) {
        continue;
      }
      if (local < kernels::kMaxLostRanks && rank < kernels::kMaxLostRanks &&
          ((words[rank / 64] >> (rank % 64)) & 1u) != 0) {
        local_words[local / 64] |= uint64_t{1} << (local % 64);
      }
      ++local;
    }
  }
  // The client's waits read these words concurrently (host backend: atomics; CUDA: the page is mapped for the GPU).
  auto* base = static_cast<char*>(group.stats->base());
  for (int i = 0; i < kernels::kLostRankWords; ++i) {
    std::atomic_ref<uint64_t>(reinterpret_cast<uint64_t*>(base + kernels::kLostRanksOffset)[i])
        .store(words[i], std::memory_order_release);
    std::atomic_ref<uint64_t>(reinterpret_cast<uint64_t*>(base + kernels::kLostLocalRanksOffset)[i])
        .store(local_words[i], std::memory_order_release);
  }
  auto* serials = reinterpret_cast<uint64_t*>(base + kernels::kLeaseSerialsOffset);
  for (int rank = 0; rank < kernels::kMaxLostRanks; ++rank) {
    const uint64_t serial = static_cast<size_t>(rank) < group.lease_serial.size() ? group.lease_serial[rank] : 0;
    std::atomic_ref<uint64_t>(serials[rank]).store(serial, std::memory_order_release);
  }
}

void LocalGroups::SetOwnLeaseSerial(const std::string& name, int group_rank, uint64_t serial,
                                    const v1::Membership& view) {
  absl::MutexLock lock(&mutex_);
  auto it = groups_.find(name);
  if (it == groups_.end() || group_rank < 0 || group_rank >= it->second.info.ranks_size()) return;
  LocalGroup& group = it->second;
  group.lease_serial.resize(group.info.ranks_size(), 0);
  group.lease_serial[group_rank] = serial;
  PublishLostLocked(group, view);
}

absl::Status LocalGroups::SetLeaseLost(const std::string& name, int group_rank, int sender, bool lost,
                                       uint64_t sequence, const v1::Membership& view) {
  absl::MutexLock lock(&mutex_);
  auto it = groups_.find(name);
  if (it == groups_.end()) return absl::NotFoundError(absl::StrCat("no group named '", name, "' here"));
  LocalGroup& group = it->second;
  if (group_rank < 0 || group_rank >= group.info.ranks_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("group_rank = ", group_rank, ": group '", name, "' has ", group.info.ranks_size(), " ranks"));
  }
  if (group.info.ranks(group_rank) != sender) {
    return absl::PermissionDeniedError(absl::StrCat("rank ", group_rank, " of group '", name,
                                                    "' is served by fabric rank ", group.info.ranks(group_rank),
                                                    ", not the caller (", sender, ")"));
  }
  group.lease_lost.resize(group.info.ranks_size(), false);
  group.lease_sequence.resize(group.info.ranks_size(), 0);
  if (sequence <= group.lease_sequence[group_rank]) return absl::OkStatus();  // older than what was applied
  group.lease_sequence[group_rank] = sequence;
  group.lease_serial.resize(group.info.ranks_size(), 0);
  group.lease_serial[group_rank] = lost ? 0 : sequence;
  if (group.lease_lost[group_rank] != lost) {
    group.lease_lost[group_rank] = lost;
    Logger("groups")->info("group '{}' rank {}: {}", name, group_rank,
                           lost ? "its client's lease ended (published as lost)" : "a client attached again");
  }
  PublishLostLocked(group, view);
  return absl::OkStatus();
}

std::vector<int> LocalGroups::OtherMembers(const std::string& name) const {
  absl::MutexLock lock(&mutex_);
  auto it = groups_.find(name);
  if (it == groups_.end() || it->second.info.state() == v1::GROUP_STATE_CREATING) return {};
  std::vector<int> others;
  for (int i = 0; i < it->second.info.ranks_size(); ++i) {
    if (i != it->second.group_rank) others.push_back(it->second.info.ranks(i));
  }
  return others;
}

void LocalGroups::OnMembership(const v1::Membership& view) {
  absl::MutexLock lock(&mutex_);
  for (auto& [name, group] : groups_) {
    if (group.info.state() == v1::GROUP_STATE_READY && LostAMember(group.info, group.incarnations, view)) {
      group.info.set_state(v1::GROUP_STATE_DEGRADED);
      Logger("groups")->warn("group '{}' degraded: a member is down or restarted", name);
    } else if (group.info.state() == v1::GROUP_STATE_DEGRADED && CanRestore(group.info, group.incarnations, view)) {
      // Every member is up again with the incarnation that committed: their regions never went away.
      group.info.set_state(v1::GROUP_STATE_READY);
      Logger("groups")->info("group '{}' restored: every member is back with the same incarnation", name);
    }
    PublishLostLocked(group, view);
  }
}

std::map<std::string, v1::GroupInfo> LocalGroups::Groups() const {
  std::map<std::string, v1::GroupInfo> groups;
  absl::MutexLock lock(&mutex_);
  for (const auto& [name, group] : groups_) groups[name] = group.info;
  return groups;
}

v1::GroupState LocalGroups::State(const std::string& name) const {
  absl::MutexLock lock(&mutex_);
  auto it = groups_.find(name);
  return it != groups_.end() ? it->second.info.state() : v1::GROUP_STATE_UNSPECIFIED;
}

std::vector<int> LocalGroups::LostRanks(const std::string& name, const v1::Membership& view) const {
  absl::MutexLock lock(&mutex_);
  auto it = groups_.find(name);
  if (it == groups_.end() || it->second.info.state() != v1::GROUP_STATE_DEGRADED) return {};
  return groups::LostRanks(it->second.info, it->second.incarnations, view);
}

std::vector<std::shared_ptr<memory::Region>> LocalGroups::Regions(const std::string& name) const {
  std::vector<std::shared_ptr<memory::Region>> regions;
  absl::MutexLock lock(&mutex_);
  auto it = groups_.find(name);
  if (it == groups_.end()) return regions;
  for (const std::shared_ptr<memory::Region>& region : {it->second.nvl, it->second.rdma}) {
    if (region != nullptr) regions.push_back(region);
  }
  if (it->second.transport != nullptr) regions.push_back(it->second.transport->commands());
  return regions;
}

transport::GroupTransport* LocalGroups::TransportOf(const std::string& name) const {
  absl::MutexLock lock(&mutex_);
  auto it = groups_.find(name);
  return it == groups_.end() ? nullptr : it->second.transport.get();
}

std::map<std::string, transport::RingCounters> LocalGroups::TransportCounters() const {
  std::map<std::string, transport::RingCounters> all;
  absl::MutexLock lock(&mutex_);  // ring counters take only the rings' own (leaf) locks
  for (const auto& [name, group] : groups_) {
    if (group.transport == nullptr) continue;
    transport::RingCounters& sum = all[name];
    for (const transport::RingCounters& ring : group.transport->counters()) {
      sum.executed += ring.executed;
      sum.refused += ring.refused;
      sum.failed += ring.failed;
      sum.skipped += ring.skipped;
    }
  }
  return all;
}

void LocalGroups::StopTransport(const std::string& name) {
  // Outside the lock: waiting for commands in flight may take a while (bounded).
  if (transport::GroupTransport* transport = TransportOf(name); transport != nullptr) {
    transport->Stop(absl::Seconds(2));
  }
}

void LocalGroups::ResetTransport(const std::string& name) {
  if (transport::GroupTransport* transport = TransportOf(name); transport != nullptr) transport->Reset();
}

absl::StatusOr<v1::AttachResponse> LocalGroups::DescribeForAttach(const v1::AttachRequest& request,
                                                                  const v1::Membership& view) const {
  const int self = membership_->config().rank;
  absl::MutexLock lock(&mutex_);
  auto it = groups_.find(request.group());
  if (it == groups_.end()) {
    return absl::NotFoundError(
        absl::StrCat("group '", request.group(), "' has no region on this daemon (rank ", self, ")"));
  }
  const LocalGroup& group = it->second;
  if (!security::TokenMatchesDigest(request.token(), group.token_sha256)) {
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
  if (group.info.state() == v1::GROUP_STATE_DEGRADED) {
    std::vector<std::string> lost;
    for (int r : groups::LostRanks(group.info, group.incarnations, view)) {
      lost.push_back(absl::StrCat(r, " (daemon rank ", group.info.ranks(r), ")"));
    }
    return absl::UnavailableError(absl::StrCat(
        "group '", request.group(), "' is GROUP_STATE_DEGRADED: group rank(s) ", absl::StrJoin(lost, ", "),
        " down or restarted; it is READY again when they are back with the incarnation that committed it"));
  }
  if (group.info.state() != v1::GROUP_STATE_READY) {
    return absl::UnavailableError(
        absl::StrCat("group '", request.group(), "' is ", v1::GroupState_Name(group.info.state())));
  }
  v1::AttachResponse response;
  *response.mutable_group() = group.info;
  response.set_rank(group.group_rank);
  response.set_world_size(group.info.ranks_size());
  response.set_backend(allocator_->backend());
  response.set_epoch(view.epoch());
  if (group.transport != nullptr && transport_ != nullptr) response.set_transport(transport_->kind());
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
  if (group.stats != nullptr) {
    v1::RegionDescriptor* stats = response.add_regions();
    *stats = group.stats->descriptor();
    stats->set_rank(group.group_rank);
    stats->set_fd_socket(view.members(self).fd_socket());
  }
  if (group.transport != nullptr) {
    v1::RegionDescriptor* commands = response.add_regions();
    *commands = group.transport->commands()->descriptor();
    commands->set_rank(group.group_rank);
    commands->set_fd_socket(view.members(self).fd_socket());
  }
  return response;
}

absl::StatusOr<SharedRegion> LocalGroups::ShareRegion(const std::string& group_name, int group_rank,
                                                      v1::RegionDescriptor::Kind kind, const std::string& token) const {
  const v1::Membership view = membership_->View();
  const int self = membership_->config().rank;
  absl::MutexLock lock(&mutex_);
  auto it = groups_.find(group_name);
  if (it == groups_.end()) {
    return absl::NotFoundError(
        absl::StrCat("group: '", group_name, "' has no region on this daemon (rank ", self, ")"));
  }
  const LocalGroup& group = it->second;
  if (!security::TokenMatchesDigest(token, group.token_sha256)) {
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
  const memory::Region* region = nullptr;
  std::shared_ptr<memory::Region> commands;  // held here: a lease end may replace the transport's meanwhile
  if (kind == v1::RegionDescriptor::KIND_NVL) region = group.nvl.get();
  if (kind == v1::RegionDescriptor::KIND_RDMA) region = group.rdma.get();
  if (kind == v1::RegionDescriptor::KIND_COMMANDS && group.transport != nullptr) {
    commands = group.transport->commands();
    region = commands.get();
  }
  if (kind == v1::RegionDescriptor::KIND_STATS) region = group.stats.get();
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

std::vector<GroupDataPathStats> LocalGroups::DataPathStats() const {
  std::vector<GroupDataPathStats> out;
  absl::MutexLock lock(&mutex_);
  for (const auto& [name, group] : groups_) {
    if (group.stats == nullptr || group.info.state() == v1::GROUP_STATE_CREATING) continue;
    auto* page = static_cast<kernels::DataPathStats*>(group.stats->base());
    kernels::DataPathStats copy{};
    // Word by word with relaxed loads: the client writes concurrently (kernels/datapath_stats.h).
    const auto* from = reinterpret_cast<const uint64_t*>(page);
    auto* to = reinterpret_cast<uint64_t*>(&copy);
    for (size_t i = 0; i < sizeof(copy) / sizeof(uint64_t); ++i) to[i] = kernels::StatsLoad(from + i);
    if (copy.magic != kernels::kDataPathStatsMagic) continue;  // no Buffer has written here yet
    out.push_back({name, group.group_rank, copy});
  }
  return out;
}

}  // namespace epfabric::daemon::groups
