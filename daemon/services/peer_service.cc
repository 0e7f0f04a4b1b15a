#include "services/peer_service.h"

#include "epfabric/proto/grpc_status.h"

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

}  // namespace

#define EPF_PEER_AUTHORIZE(expr)                                        \
  do {                                                                  \
    if (auto who = (expr); !who.ok()) return ToGrpcStatus(who.status()); \
  } while (false)

grpc::Status PeerService::Join(grpc::ServerContext* context, const v1::JoinRequest* request, v1::JoinResponse* response) {
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
  if (absl::Status s = membership_->CheckFabricId(request->fabric_id()); !s.ok()) return ToGrpcStatus(s);
  return Answer(groups_->Propose(request->request()), response);
}

grpc::Status PeerService::RetireGroup(grpc::ServerContext* context, const v1::RetireGroupRequest* request,
                                      v1::RetireGroupResponse*) {
  context->AddTrailingMetadata(groups::kAnsweredByCoordinator, "1");
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, "/epfabric.v1.Peer/RetireGroup"));
  if (absl::Status s = membership_->CheckFabricId(request->fabric_id()); !s.ok()) return ToGrpcStatus(s);
  return ToGrpcStatus(groups_->Retire(*request));
}

grpc::Status PeerService::PrepareGroup(grpc::ServerContext* context, const v1::PrepareGroupRequest* request,
                                       v1::PrepareGroupResponse* response) {
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, "/epfabric.v1.Peer/PrepareGroup", kCoordinatorRank));
  if (absl::Status s = membership_->CheckFabricId(request->fabric_id()); !s.ok()) return ToGrpcStatus(s);
  return Answer(groups_->Prepare(*request), response);
}

grpc::Status PeerService::CommitGroup(grpc::ServerContext* context, const v1::CommitGroupRequest* request,
                                      v1::CommitGroupResponse*) {
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, "/epfabric.v1.Peer/CommitGroup", kCoordinatorRank));
  if (absl::Status s = membership_->CheckFabricId(request->fabric_id()); !s.ok()) return ToGrpcStatus(s);
  return ToGrpcStatus(groups_->Commit(*request));
}

grpc::Status PeerService::ReleaseGroup(grpc::ServerContext* context, const v1::ReleaseGroupRequest* request,
                                       v1::ReleaseGroupResponse*) {
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, "/epfabric.v1.Peer/ReleaseGroup", kCoordinatorRank));
  if (absl::Status s = membership_->CheckFabricId(request->fabric_id()); !s.ok()) return ToGrpcStatus(s);
  return ToGrpcStatus(groups_->Release(*request));
}

}  // namespace epfabric::daemon
