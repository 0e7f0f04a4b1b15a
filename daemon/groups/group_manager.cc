#include "groups/group_manager.h"

#include <map>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/proto/grpc_status.h"
#include "groups/fan_out.h"
#include "logging.h"

namespace epfabric::daemon::groups {

GroupManager::GroupManager(fabric::Membership* membership, fabric::PeerLinks* links, memory::RegionAllocator* allocator,
                           LeaseLimits lease_limits, GroupLimits group_limits, transport::Transport* transport)
    : membership_(membership),
      links_(links),
      registry_(membership, links),
      local_(membership, allocator, group_limits, transport),
      leases_(membership, &local_, lease_limits) {}

absl::Status GroupManager::ForwardedStatus(const grpc::ClientContext& context, const grpc::Status& status) const {
  if (status.ok()) return absl::OkStatus();
  if (context.GetServerTrailingMetadata().count(kAnsweredByCoordinator) != 0) return FromGrpcStatus(status);
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return absl::DeadlineExceededError(
        absl::StrCat("the coordinator (rank 0 at ", membership_->CoordinatorAddress(),
                     ") did not answer within the deadline; a create it had under way is rolled back everywhere"));
  }
  return absl::UnavailableError(absl::StrCat("the coordinator (rank 0 at ", membership_->CoordinatorAddress(),
                                             ") is unreachable: groups cannot be created or deleted until it is back (",
                                             status.error_message(), ")"));
}

absl::StatusOr<v1::CreateGroupResponse> GroupManager::CreateGroup(const v1::CreateGroupRequest& request,
                                                                  absl::Time deadline) {
  EPF_RETURN_IF_ERROR(ValidateCreateGroup(request, membership_->config().world_size));
  if (deadline == absl::InfiniteFuture()) deadline = absl::Now() + kPeerCallDeadline;
  if (membership_->is_coordinator()) return registry_.Propose(request, deadline);
  v1::ProposeGroupRequest forward;
  forward.set_fabric_id(membership_->config().fabric_id);
  *forward.mutable_request() = request;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));  // the coordinator finishes within it, or rolls back
  v1::CreateGroupResponse response;
  const grpc::Status status =
      links_->Stub(membership_->CoordinatorAddress())->ProposeGroup(&context, forward, &response);
  if (!status.ok()) return ForwardedStatus(context, status);
  return response;
}

absl::Status GroupManager::DeleteGroup(const v1::DeleteGroupRequest& request) {
  if (request.name().empty()) return absl::InvalidArgumentError("name: empty");
  if (request.token().empty() && !request.force()) return absl::InvalidArgumentError("token: empty");
  v1::RetireGroupRequest retire;
  retire.set_fabric_id(membership_->config().fabric_id);
  retire.set_name(request.name());
  retire.set_token(request.token());
  retire.set_force(request.force());
  if (membership_->is_coordinator()) return registry_.Retire(retire);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kPeerCallDeadline));
  v1::RetireGroupResponse response;
  const grpc::Status status = links_->Stub(membership_->CoordinatorAddress())->RetireGroup(&context, retire, &response);
  return ForwardedStatus(context, status);
}

v1::ListGroupsResponse GroupManager::ListGroups() const {
  v1::ListGroupsResponse response;
  const std::map<std::string, std::vector<int>> attached = leases_.AttachedRanks();
  const std::map<std::string, v1::GroupInfo> local = local_.Groups();
  for (const auto& [name, group] : local) {
    v1::GroupInfo* info = response.add_groups();
    *info = group;
    info->clear_attached_ranks();
    if (auto it = attached.find(name); it != attached.end()) {
      for (int rank : it->second) info->add_attached_ranks(rank);
    }
  }
  for (const auto& [name, group] : registry_.Groups()) {
    if (local.count(name) == 0) *response.add_groups() = group;
  }
  return response;
}

absl::Status GroupManager::Release(const v1::ReleaseGroupRequest& request) {
  // The memory goes away with the group, and so do its leases.
  std::optional<LocalGroup> released = leases_.ReleaseGroup(request.name());
  if (!released.has_value()) return absl::OkStatus();
  released.reset();  // frees the regions, outside every lock
  Logger("groups")->info("released group '{}' ({})", request.name(), request.reason());
  return absl::OkStatus();
}

void GroupManager::CleanUpFailedCreates(absl::Time now) {
  registry_.RetryPendingReleases();
  for (const std::string& name : local_.UncommittedSince(now - kUncommittedLifetime)) {
    v1::ReleaseGroupRequest release;
    release.set_name(name);
    release.set_reason("prepared but never committed: the coordinator gave up on it");
    (void)Release(release);
  }
}

void GroupManager::OnMembership(const v1::Membership& view) {
  local_.OnMembership(view);
  registry_.OnMembership(view);
}

}  // namespace epfabric::daemon::groups
