// Control service (clients on the Unix socket). Thin: logs who called (SO_PEERCRED) and hands each call to the
// group manager; absl::Status becomes a gRPC status here.
#pragma once

#include "epfabric/v1/control.grpc.pb.h"
#include "groups/group_manager.h"
#include "services/client_listener.h"

namespace epfabric::daemon {

class ControlService final : public v1::Control::Service {
 public:
  ControlService(groups::GroupManager* groups, const ClientListener* listener) : groups_(groups), listener_(listener) {}

  grpc::Status CreateGroup(grpc::ServerContext*, const v1::CreateGroupRequest*, v1::CreateGroupResponse*) override;
  grpc::Status DeleteGroup(grpc::ServerContext*, const v1::DeleteGroupRequest*, v1::DeleteGroupResponse*) override;
  grpc::Status ListGroups(grpc::ServerContext*, const v1::ListGroupsRequest*, v1::ListGroupsResponse*) override;
  grpc::Status Attach(grpc::ServerContext*, const v1::AttachRequest*, v1::AttachResponse*) override;
  grpc::Status Detach(grpc::ServerContext*, const v1::DetachRequest*, v1::DetachResponse*) override;
  grpc::Status KeepAlive(grpc::ServerContext*, const v1::KeepAliveRequest*, v1::KeepAliveResponse*) override;

 private:
  groups::ClientIdentity Caller(grpc::ServerContext* context) const;
  // Logs the call with the caller's pid/uid (mutating calls at info, the rest at debug) and converts the status.
  grpc::Status Finish(const char* method, grpc::ServerContext* context, const absl::Status& status,
                      bool mutating) const;

  groups::GroupManager* const groups_;
  const ClientListener* const listener_;
};

}  // namespace epfabric::daemon
