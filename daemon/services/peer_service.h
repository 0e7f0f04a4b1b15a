// Peer service (daemon <-> daemon on the peer port). Thin: authenticates the caller (security/peer_authenticator.h)
// and checks that its role may call the method (only the coordinator, rank 0, publishes membership and drives
// Prepare/Commit/Release; a member joins and beats only as itself), checks the fabric id, then hands each call to
// the membership or the group manager. Every OK answer carries the server's proof (with a fabric secret).
#pragma once

#include "epfabric/v1/peer.grpc.pb.h"
#include "fabric/membership.h"
#include "groups/group_manager.h"
#include "security/peer_authenticator.h"

namespace epfabric::daemon {

class PeerService final : public v1::Peer::Service {
 public:
  PeerService(fabric::Membership* membership, groups::GroupManager* groups,
              const security::PeerAuthenticator* authenticator)
      : membership_(membership), groups_(groups), auth_(authenticator) {}

  grpc::Status Join(grpc::ServerContext*, const v1::JoinRequest*, v1::JoinResponse*) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*, v1::HeartbeatResponse*) override;
  grpc::Status PublishMembership(grpc::ServerContext*, const v1::PublishMembershipRequest*,
                                 v1::PublishMembershipResponse*) override;
  grpc::Status ProposeGroup(grpc::ServerContext*, const v1::ProposeGroupRequest*, v1::CreateGroupResponse*) override;
  grpc::Status RetireGroup(grpc::ServerContext*, const v1::RetireGroupRequest*, v1::RetireGroupResponse*) override;
  grpc::Status PrepareGroup(grpc::ServerContext*, const v1::PrepareGroupRequest*, v1::PrepareGroupResponse*) override;
  grpc::Status CommitGroup(grpc::ServerContext*, const v1::CommitGroupRequest*, v1::CommitGroupResponse*) override;
  grpc::Status ReleaseGroup(grpc::ServerContext*, const v1::ReleaseGroupRequest*, v1::ReleaseGroupResponse*) override;
  grpc::Status NotifyLease(grpc::ServerContext*, const v1::NotifyLeaseRequest*, v1::NotifyLeaseResponse*) override;
  // Barrier answers UNIMPLEMENTED until a control-plane barrier is needed.

 private:
  // `status`, after adding the answer's proof to `context` when it is OK (security::PeerAuthenticator::SignReply).
  grpc::Status Signed(grpc::ServerContext& context, const security::PeerIdentity& caller, absl::string_view method,
                      grpc::Status status, const google::protobuf::MessageLite& response) const;

  fabric::Membership* const membership_;
  groups::GroupManager* const groups_;
  const security::PeerAuthenticator* const auth_;
};

}  // namespace epfabric::daemon
