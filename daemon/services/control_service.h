// Control service (clients on the Unix socket). Thin: logs who called (SO_PEERCRED) and hands each call to the
// group manager; absl::Status becomes a gRPC status here.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "epfabric/v1/control.grpc.pb.h"
#include "groups/group_manager.h"
#include "services/client_listener.h"

namespace epfabric::daemon {

// The daemon's own uid or root: an operator, who sees every tenant's groups and leases (tenants see their own).
bool IsOperator(int64_t uid);

// How callers are named for the coordinator's per-client quotas: the operator's tenant label of the caller's uid
// (--tenant_labels), else "<host_id>/uid:<uid>" (uids are per host).
struct ClientNaming {
  std::string host_id;
  std::map<int64_t, std::string> tenant_of_uid;
  std::string Name(int64_t uid) const;
};

class ControlService final : public v1::Control::Service {
 public:
  ControlService(groups::GroupManager* groups, const ClientListener* listener, ClientNaming naming = {})
      : groups_(groups), listener_(listener), naming_(std::move(naming)) {}

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
  const ClientNaming naming_;
};

}  // namespace epfabric::daemon
