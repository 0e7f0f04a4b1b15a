#include "groups/group_manager.h"

#include <map>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/proto/grpc_status.h"
#include "groups/fan_out.h"
#include "groups/group_checks.h"
#include "logging.h"
#include "security/group_secrets.h"

namespace epfabric::daemon::groups {
namespace {

void StartNotifyLease(v1::Peer::Stub* stub, grpc::ClientContext* context, const v1::NotifyLeaseRequest* request,
                      v1::NotifyLeaseResponse* response, std::function<void(grpc::Status)> done) {
  stub->async()->NotifyLease(context, request, response, std::move(done));
}

}  // namespace

GroupManager::GroupManager(fabric::Membership* membership, fabric::PeerLinks* links, memory::RegionAllocator* allocator,
                           LeaseLimits lease_limits, GroupLimits group_limits, transport::Transport* transport,
                           ClientQuotas client_quotas)
    : membership_(membership),
      links_(links),
      registry_(membership, links, client_quotas),
      local_(membership, allocator, group_limits, transport),
      leases_(membership, &local_, lease_limits) {
  leases_.SetObserver(
      [this](const std::string& group, int rank, bool attached) { NotifyMembers(group, rank, attached); });
}

void GroupManager::NotifyMembers(const std::string& group, int rank, bool attached) {
  const v1::Membership view = membership_->View();
  // The sequence is also the new lease's serial here and at every member (kernels::kLeaseSerialsOffset).
  const uint64_t sequence = lease_sequence_.fetch_add(1) + 1;
  local_.SetOwnLeaseSerial(group, rank, attached ? sequence : 0, view);
  const std::vector<int> others = local_.OtherMembers(group);
  if (others.empty()) return;
  v1::NotifyLeaseRequest request;
  request.set_fabric_id(membership_->config().fabric_id);
  request.set_sender_rank(membership_->config().rank);
  request.set_group(group);
  request.set_group_rank(rank);
  request.set_attached(attached);
  request.set_sequence(sequence);
  retries_->Sent(request);
  std::vector<std::string> addresses;
  for (int member : others) {
    const bool up = member >= 0 && member < view.members_size() && view.members(member).state() == v1::MEMBER_STATE_UP;
    addresses.push_back(up ? view.members(member).peer_address() : std::string());  // a down one: groups degraded
  }
  if (attached) {
    // Waited for (bounded): when the new client's Attach returns, no member still publishes its rank as lost, so
    // that the survivors' next waits on it cannot end on a stale bit.
    const auto replies =
        CallMembers(*links_, addresses, request, &StartNotifyLease, absl::Now() + kNotifyLeaseDeadline);
    for (size_t i = 0; i < replies.size(); ++i) {
      if (replies[i].called && !replies[i].status.ok()) {
        Logger("groups")->warn("NotifyLease (attached) to fabric rank {} for group '{}': {} (sent again later)",
                               others[i], group, replies[i].status.error_message());
        retries_->Add(others[i], request, absl::Now());
      }
    }
    return;
  }
  // A lease that ended: fire and forget, so that the survivors hear of it while this rank's regions are zeroed.
  struct Call {
    grpc::ClientContext context;
    v1::NotifyLeaseRequest request;
    v1::NotifyLeaseResponse response;
    std::shared_ptr<v1::Peer::Stub> stub;
  };
  for (size_t i = 0; i < addresses.size(); ++i) {
    if (addresses[i].empty()) continue;
    auto call = std::make_shared<Call>();
    call->request = request;
    call->context.set_deadline(absl::ToChronoTime(absl::Now() + kNotifyLeaseDeadline));
    call->stub = links_->Stub(addresses[i]);
    // The callback owns the call; one that fails is sent again by the housekeeping (RetryLeaseNotifications).
    call->stub->async()->NotifyLease(
        &call->context, &call->request, &call->response,
        [call, member = others[i], retries = retries_](grpc::Status status) {
          if (!status.ok()) {
            Logger("groups")->warn("NotifyLease (ended) to fabric rank {} for group '{}': {} (sent again later)",
                                   member, call->request.group(), status.error_message());
            retries->Add(member, call->request, absl::Now());
          }
        });
  }
}

void GroupManager::RetryLeaseNotifications(absl::Time now) {
  const std::vector<LeaseNotificationRetries::Due> due = retries_->TakeDue(now);
  if (due.empty()) return;
  const v1::Membership view = membership_->View();
  std::vector<std::string> addresses;
  for (const LeaseNotificationRetries::Due& d : due) {
    const bool up =
        d.member >= 0 && d.member < view.members_size() && view.members(d.member).state() == v1::MEMBER_STATE_UP;
    addresses.push_back(up ? view.members(d.member).peer_address() : std::string());
  }
  // One call per member, together, bounded: the housekeeping thread also expires leases.
  for (size_t i = 0; i < due.size(); ++i) {
    if (addresses[i].empty()) {
      retries_->Failed(due[i], now);
      continue;
    }
    const auto replies = CallMembers(*links_, {addresses[i]}, due[i].request, &StartNotifyLease,
                                     absl::Now() + kNotifyLeaseRetryDeadline);
    if (replies.size() == 1 && replies[0].called && replies[0].status.ok()) {
      retries_->Delivered(due[i]);
    } else {
      retries_->Failed(due[i], absl::Now());
    }
  }
}

absl::Status GroupManager::ForwardedStatus(const grpc::ClientContext& context, const grpc::Status& status) const {
  if (status.ok()) return absl::OkStatus();
  if (context.GetServerTrailingMetadata().count(kAnsweredByCoordinator) != 0) return FromGrpcStatus(status);
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return absl::DeadlineExceededError(
        absl::StrCat("the coordinator (rank 0 at ", membership_->CoordinatorAddress(),
                     ") did not answer within the deadline; a create it had under way is rolled back everywhere"));
  }
  // Unreachable before the call (nothing happened), or gone during it: then a create or delete it had under way may
  // have reached the members after all. Say so; the caller cannot tell which from here.
  return absl::UnavailableError(absl::StrCat(
      "the coordinator (rank 0 at ", membership_->CoordinatorAddress(),
      ") is unreachable: groups cannot be created or deleted until it is back (", status.error_message(),
      "). If it went away during this call, the call's outcome is unknown: a group it committed stays (DEGRADED once "
      "it restarts; ListGroups shows it, a forced delete removes it), one it had only prepared is released"));
}

absl::StatusOr<v1::CreateGroupResponse> GroupManager::CreateGroup(const v1::CreateGroupRequest& request,
                                                                  absl::Time deadline, const std::string& client) {
  EPF_RETURN_IF_ERROR(ValidateCreateGroup(request, membership_->config().world_size));
  if (deadline == absl::InfiniteFuture()) deadline = absl::Now() + kPeerCallDeadline;
  if (membership_->is_coordinator()) return registry_.Propose(request, deadline, client);
  v1::ProposeGroupRequest forward;
  forward.set_fabric_id(membership_->config().fabric_id);
  *forward.mutable_request() = request;
  forward.set_client(client);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));  // the coordinator finishes within it, or rolls back
  const std::string nonce = links_->ExpectProof(context);
  v1::CreateGroupResponse response;
  const grpc::Status status =
      links_->Stub(membership_->CoordinatorAddress())->ProposeGroup(&context, forward, &response);
  if (!status.ok()) return ForwardedStatus(context, status);
  // The answer carries the group's token for the client: only the fabric's coordinator may choose it.
  EPF_RETURN_IF_ERROR(links_->VerifyAnswer(context, nonce, "/epfabric.v1.Peer/ProposeGroup", response));
  return response;
}

absl::Status GroupManager::DeleteGroup(const v1::DeleteGroupRequest& request) {
  if (request.name().empty()) return absl::InvalidArgumentError("name: empty");
  if (request.token().empty() && !request.force()) return absl::InvalidArgumentError("token: empty");
  v1::RetireGroupRequest retire;
  retire.set_fabric_id(membership_->config().fabric_id);
  retire.set_name(request.name());
  // The token stays here: the coordinator's port may be held by someone else (a dead coordinator's, with a fabric
  // secret only). A proof made with the deletion key for this name and a fresh nonce goes instead.
  if (!request.force()) {
    retire.set_nonce(RandomHex128());
    retire.set_proof(security::RetireProof(security::DeletionKey(request.token()), request.name(), retire.nonce()));
  }
  retire.set_force(request.force());
  if (membership_->is_coordinator()) return registry_.Retire(retire);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kPeerCallDeadline));
  const std::string nonce = links_->ExpectProof(context);
  v1::RetireGroupResponse response;
  const grpc::Status status = links_->Stub(membership_->CoordinatorAddress())->RetireGroup(&context, retire, &response);
  if (!status.ok()) return ForwardedStatus(context, status);
  return links_->VerifyAnswer(context, nonce, "/epfabric.v1.Peer/RetireGroup", response);
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
  // A coordinator killed between Prepare and Commit: once it is back as a new incarnation, what its predecessor
  // prepared can never be committed, so it goes now rather than after kUncommittedLifetime.
  const v1::Membership view = membership_->View();
  if (view.members_size() == 0 || view.members(0).state() != v1::MEMBER_STATE_UP) return;
  const uint64_t coordinator = view.members(0).incarnation();
  for (const std::string& name : local_.UncommittedOfAnotherCoordinator(coordinator)) {
    v1::ReleaseGroupRequest release;
    release.set_name(name);
    release.set_reason(absl::StrCat("prepared but never committed: the coordinator restarted since (now incarnation ",
                                    coordinator, ")"));
    (void)Release(release);
  }
}

void GroupManager::OnMembership(const v1::Membership& view) {
  local_.OnMembership(view);
  registry_.OnMembership(view);
}

}  // namespace epfabric::daemon::groups
