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

}  // namespace

grpc::Status PeerService::Join(grpc::ServerContext*, const v1::JoinRequest* request, v1::JoinResponse* response) {
  return Answer(membership_->HandleJoin(*request), response);
}

grpc::Status PeerService::Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* request,
                                    v1::HeartbeatResponse* response) {
  return Answer(membership_->HandleHeartbeat(*request), response);
}

grpc::Status PeerService::PublishMembership(grpc::ServerContext*, const v1::PublishMembershipRequest* request,
                                            v1::PublishMembershipResponse*) {
  return ToGrpcStatus(membership_->HandlePublish(*request));
}

grpc::Status PeerService::ProposeGroup(grpc::ServerContext* context, const v1::ProposeGroupRequest* request,
                                       v1::CreateGroupResponse* response) {
  context->AddTrailingMetadata(groups::kAnsweredByCoordinator, "1");
  if (absl::Status s = membership_->CheckFabricId(request->fabric_id()); !s.ok()) return ToGrpcStatus(s);
  return Answer(groups_->Propose(request->request()), response);
}

grpc::Status PeerService::RetireGroup(grpc::ServerContext* context, const v1::RetireGroupRequest* request,
                                      v1::RetireGroupResponse*) {
  context->AddTrailingMetadata(groups::kAnsweredByCoordinator, "1");
  if (absl::Status s = membership_->CheckFabricId(request->fabric_id()); !s.ok()) return ToGrpcStatus(s);
  return ToGrpcStatus(groups_->Retire(*request));
}

grpc::Status PeerService::PrepareGroup(grpc::ServerContext*, const v1::PrepareGroupRequest* request,
                                       v1::PrepareGroupResponse* response) {
  if (absl::Status s = membership_->CheckFabricId(request->fabric_id()); !s.ok()) return ToGrpcStatus(s);
  return Answer(groups_->Prepare(*request), response);
}

grpc::Status PeerService::CommitGroup(grpc::ServerContext*, const v1::CommitGroupRequest* request,
                                      v1::CommitGroupResponse*) {
  if (absl::Status s = membership_->CheckFabricId(request->fabric_id()); !s.ok()) return ToGrpcStatus(s);
  return ToGrpcStatus(groups_->Commit(*request));
}

grpc::Status PeerService::ReleaseGroup(grpc::ServerContext*, const v1::ReleaseGroupRequest* request,
                                       v1::ReleaseGroupResponse*) {
  if (absl::Status s = membership_->CheckFabricId(request->fabric_id()); !s.ok()) return ToGrpcStatus(s);
  return ToGrpcStatus(groups_->Release(*request));
}

}  // namespace epfabric::daemon
