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

grpc::Status PeerService::Signed(grpc::ServerContext& context, const security::PeerIdentity& caller,
                                 absl::string_view method, grpc::Status status,
                                 const google::protobuf::MessageLite& response) const {
  if (status.ok()) auth_->SignReply(context, caller, method, response);
  return status;
}

// Binds `who` to the authenticated caller, or answers the call with the refusal.
#define EPF_PEER_AUTHORIZE(expr) \
  auto who = (expr);             \
  if (!who.ok()) return ToGrpcStatus(who.status())

grpc::Status PeerService::Join(grpc::ServerContext* context, const v1::JoinRequest* request,
                               v1::JoinResponse* response) {
  constexpr absl::string_view kMethod = "/epfabric.v1.Peer/Join";
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, kMethod, *request, request->member().rank()));
  return Signed(*context, *who, kMethod, Answer(membership_->HandleJoin(*request), response), *response);
}

grpc::Status PeerService::Heartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest* request,
                                    v1::HeartbeatResponse* response) {
  constexpr absl::string_view kMethod = "/epfabric.v1.Peer/Heartbeat";
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, kMethod, *request, request->rank()));
  return Signed(*context, *who, kMethod, Answer(membership_->HandleHeartbeat(*request), response), *response);
}

grpc::Status PeerService::PublishMembership(grpc::ServerContext* context, const v1::PublishMembershipRequest* request,
                                            v1::PublishMembershipResponse* response) {
  constexpr absl::string_view kMethod = "/epfabric.v1.Peer/PublishMembership";
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, kMethod, *request, kCoordinatorRank));
  return Signed(*context, *who, kMethod, ToGrpcStatus(membership_->HandlePublish(*request)), *response);
}

grpc::Status PeerService::ProposeGroup(grpc::ServerContext* context, const v1::ProposeGroupRequest* request,
                                       v1::CreateGroupResponse* response) {
  constexpr absl::string_view kMethod = "/epfabric.v1.Peer/ProposeGroup";
  context->AddTrailingMetadata(groups::kAnsweredByCoordinator, "1");
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, kMethod, *request));
  return Signed(
      *context, *who, kMethod,
      Answer(
          IfSameFabric(*membership_, request->fabric_id(),
                       [&] { return groups_->Propose(request->request(), CallDeadline(*context), request->client()); }),
          response),
      *response);
}

grpc::Status PeerService::RetireGroup(grpc::ServerContext* context, const v1::RetireGroupRequest* request,
                                      v1::RetireGroupResponse* response) {
  constexpr absl::string_view kMethod = "/epfabric.v1.Peer/RetireGroup";
  context->AddTrailingMetadata(groups::kAnsweredByCoordinator, "1");
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, kMethod, *request));
  return Signed(
      *context, *who, kMethod,
      ToGrpcStatus(IfSameFabric(*membership_, request->fabric_id(), [&] { return groups_->Retire(*request); })),
      *response);
}

grpc::Status PeerService::PrepareGroup(grpc::ServerContext* context, const v1::PrepareGroupRequest* request,
                                       v1::PrepareGroupResponse* response) {
  constexpr absl::string_view kMethod = "/epfabric.v1.Peer/PrepareGroup";
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, kMethod, *request, kCoordinatorRank));
  return Signed(
      *context, *who, kMethod,
      Answer(IfSameFabric(*membership_, request->fabric_id(),
                          [&] { return groups_->Prepare(*request, CallDeadline(*context, absl::ZeroDuration())); }),
             response),
      *response);
}

grpc::Status PeerService::CommitGroup(grpc::ServerContext* context, const v1::CommitGroupRequest* request,
                                      v1::CommitGroupResponse* response) {
  constexpr absl::string_view kMethod = "/epfabric.v1.Peer/CommitGroup";
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, kMethod, *request, kCoordinatorRank));
  return Signed(
      *context, *who, kMethod,
      ToGrpcStatus(IfSameFabric(*membership_, request->fabric_id(), [&] { return groups_->Commit(*request); })),
      *response);
}

grpc::Status PeerService::ReleaseGroup(grpc::ServerContext* context, const v1::ReleaseGroupRequest* request,
                                       v1::ReleaseGroupResponse* response) {
  constexpr absl::string_view kMethod = "/epfabric.v1.Peer/ReleaseGroup";
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, kMethod, *request, kCoordinatorRank));
  return Signed(
      *context, *who, kMethod,
      ToGrpcStatus(IfSameFabric(*membership_, request->fabric_id(), [&] { return groups_->Release(*request); })),
      *response);
}

grpc::Status PeerService::NotifyLease(grpc::ServerContext* context, const v1::NotifyLeaseRequest* request,
                                      v1::NotifyLeaseResponse* response) {
  constexpr absl::string_view kMethod = "/epfabric.v1.Peer/NotifyLease";
  // A member speaks only for the ranks it serves: authenticated as sender_rank, which LocalGroups checks serves
  // group_rank.
  EPF_PEER_AUTHORIZE(auth_->RequireMember(*context, kMethod, *request, request->sender_rank()));
  return Signed(
      *context, *who, kMethod,
      ToGrpcStatus(IfSameFabric(*membership_, request->fabric_id(), [&] { return groups_->OnPeerLease(*request); })),
      *response);
}

}  // namespace epfabric::daemon
