#include "services/peer_service.h"

#include "epfabric/common/status_macros.h"
#include "epfabric/proto/grpc_status.h"
#include "services/call_deadline.h"

namespace epfabric::daemon {
namespace {

template <typename Response>
grpc::Status Answer(absl::StatusOr<Response> result, Response* response) {
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = std::move(*result);
  return grpc::Status::OK;
}

// The coordinator's rank: the only caller of PublishMembership, PrepareGroup, CommitGroup and ReleaseGroup.
constexpr int kCoordinatorRank = 0;

// `call()` (an absl::Status or StatusOr) when `fabric_id` is this daemon's fabric, else the mismatch.
template <typename Call>
auto IfSameFabric(const fabric::Membership& membership, const std::string& fabric_id, Call call) -> decltype(call()) {
  EPF_RETURN_IF_ERROR(membership.CheckFabricId(fabric_id));
  return call();
}

}  // namespace

#define EPF_PEER_AUTHORIZE(expr)                                         \
  do {                                                                   \
    if (auto who = (expr); !who.ok()) return ToGrpcStatus(who.status()); \
  } while (false)

grpc::Status PeerService::Join(grpc::ServerContext* context, const v1::JoinRequest* request,
                               v1::JoinResponse* response) {
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, "/epfabric.v1.Peer/Join", request->member().rank()));
  return Answer(membership_->HandleJoin(*request), response);
}

grpc::Status PeerService::Heartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest* request,
                                    v1::HeartbeatResponse* response) {
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, "/epfabric.v1.Peer/Heartbeat", request->rank()));
  return Answer(membership_->HandleHeartbeat(*request), response);
}

grpc::Status PeerService::PublishMembership(grpc::ServerContext* context, const v1::PublishMembershipRequest* request,
                                            v1::PublishMembershipResponse*) {
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, "/epfabric.v1.Peer/PublishMembership", kCoordinatorRank));
  return ToGrpcStatus(membership_->HandlePublish(*request));
}

grpc::Status PeerService::ProposeGroup(grpc::ServerContext* context, const v1::ProposeGroupRequest* request,
                                       v1::CreateGroupResponse* response) {
  context->AddTrailingMetadata(groups::kAnsweredByCoordinator, "1");
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, "/epfabric.v1.Peer/ProposeGroup"));
  return Answer(IfSameFabric(*membership_, request->fabric_id(),
                             [&] { return groups_->Propose(request->request(), CallDeadline(*context)); }),
                response);
}

grpc::Status PeerService::RetireGroup(grpc::ServerContext* context, const v1::RetireGroupRequest* request,
                                      v1::RetireGroupResponse*) {
  context->AddTrailingMetadata(groups::kAnsweredByCoordinator, "1");
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, "/epfabric.v1.Peer/RetireGroup"));
  return ToGrpcStatus(IfSameFabric(*membership_, request->fabric_id(), [&] { return groups_->Retire(*request); }));
}

grpc::Status PeerService::PrepareGroup(grpc::ServerContext* context, const v1::PrepareGroupRequest* request,
                                       v1::PrepareGroupResponse* response) {
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, "/epfabric.v1.Peer/PrepareGroup", kCoordinatorRank));
  return Answer(IfSameFabric(*membership_, request->fabric_id(),
                             [&] { return groups_->Prepare(*request, CallDeadline(*context, absl::ZeroDuration())); }),
                response);
}

grpc::Status PeerService::CommitGroup(grpc::ServerContext* context, const v1::CommitGroupRequest* request,
                                      v1::CommitGroupResponse*) {
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, "/epfabric.v1.Peer/CommitGroup", kCoordinatorRank));
  return ToGrpcStatus(IfSameFabric(*membership_, request->fabric_id(), [&] { return groups_->Commit(*request); }));
}

grpc::Status PeerService::ReleaseGroup(grpc::ServerContext* context, const v1::ReleaseGroupRequest* request,
                                       v1::ReleaseGroupResponse*) {
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, "/epfabric.v1.Peer/ReleaseGroup", kCoordinatorRank));
  return ToGrpcStatus(IfSameFabric(*membership_, request->fabric_id(), [&] { return groups_->Release(*request); }));
}

grpc::Status PeerService::NotifyLease(grpc::ServerContext* context, const v1::NotifyLeaseRequest* request,
                                      v1::NotifyLeaseResponse*) {
  // A member speaks only for the ranks it serves: authenticated as sender_rank, which LocalGroups checks serves
  // group_rank.
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, "/epfabric.v1.Peer/NotifyLease", request->sender_rank()));
  return ToGrpcStatus(IfSameFabric(*membership_, request->fabric_id(), [&] { return groups_->OnPeerLease(*request); }));
}

}  // namespace epfabric::daemon
