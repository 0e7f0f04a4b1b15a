#include "services/control_service.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "epfabric/proto/grpc_status.h"
#include "logging.h"
#include "services/call_deadline.h"

#include <unistd.h>

namespace epfabric::daemon {

bool IsOperator(int64_t uid) { return uid == 0 || uid == static_cast<int64_t>(getuid()); }

std::string ClientNaming::Name(int64_t uid) const {
  if (auto it = tenant_of_uid.find(uid); it != tenant_of_uid.end()) return absl::StrCat("tenant:", it->second);
  if (uid < 0) return "";  // an in-process caller (tests): not counted
  return absl::StrCat(host_id, "/uid:", uid);
}

groups::ClientIdentity ControlService::Caller(grpc::ServerContext* context) const {
  groups::ClientIdentity identity;
  if (listener_ == nullptr) return identity;
  if (auto credentials = listener_->Lookup(context->peer())) {
    identity.pid = credentials->pid;
    identity.uid = credentials->uid;
  }
  return identity;
}

grpc::Status ControlService::Finish(const char* method, grpc::ServerContext* context, const absl::Status& status,
                                    bool mutating) const {
  const groups::ClientIdentity caller = Caller(context);
  Logger("control")->log(mutating || !status.ok() ? spdlog::level::info : spdlog::level::debug,
                         "{} from pid {} uid {}: {}", method, caller.pid, caller.uid,
                         status.ok() ? "OK" : status.ToString());
  return ToGrpcStatus(status);
}

grpc::Status ControlService::CreateGroup(grpc::ServerContext* context, const v1::CreateGroupRequest* request,
                                         v1::CreateGroupResponse* response) {
  auto result = groups_->CreateGroup(*request, CallDeadline(*context), naming_.Name(Caller(context).uid));
  if (result.ok()) *response = std::move(*result);
  return Finish("CreateGroup", context, result.status(), true);
}

grpc::Status ControlService::DeleteGroup(grpc::ServerContext* context, const v1::DeleteGroupRequest* request,
                                         v1::DeleteGroupResponse*) {
  if (request->force()) {
    // An operator's tool: only the daemon's own uid (or root) may delete without the token.
    const groups::ClientIdentity caller = Caller(context);
    if (caller.uid < 0 || (caller.uid != 0 && caller.uid != static_cast<int64_t>(getuid()))) {
      return Finish("DeleteGroup", context,
                    absl::PermissionDeniedError(absl::StrCat("force: only uid ", getuid(),
                                                             " (the daemon's) or root may delete without the token; "
                                                             "the caller is uid ",
                                                             caller.uid)),
                    true);
    }
    Logger("control")->warn("forced delete of group '{}' requested by pid {} uid {}", request->name(), caller.pid,
                            caller.uid);
  }
  return Finish("DeleteGroup", context, groups_->DeleteGroup(*request), true);
}

grpc::Status ControlService::ListGroups(grpc::ServerContext* context, const v1::ListGroupsRequest*,
                                        v1::ListGroupsResponse* response) {
  *response = groups_->ListGroups();
  // A tenant sees the groups it holds a lease of here, not every tenant's names; the operator (this daemon's uid or
  // root) sees all of them.
  const groups::ClientIdentity caller = Caller(context);
  if (!IsOperator(caller.uid)) {
    std::set<std::string> own;
    for (const v1::ClientInfo& client : groups_->Clients()) {
      if (client.uid() == caller.uid) own.insert(client.group());
    }
    auto* groups = response->mutable_groups();
    groups->erase(std::remove_if(groups->begin(), groups->end(),
                                 [&](const v1::GroupInfo& group) { return own.count(group.name()) == 0; }),
                  groups->end());
  }
  return Finish("ListGroups", context, absl::OkStatus(), false);
}

grpc::Status ControlService::Attach(grpc::ServerContext* context, const v1::AttachRequest* request,
                                    v1::AttachResponse* response) {
  auto result = groups_->Attach(*request, Caller(context));
  if (result.ok()) *response = std::move(*result);
  return Finish("Attach", context, result.status(), true);
}

grpc::Status ControlService::Detach(grpc::ServerContext* context, const v1::DetachRequest* request,
                                    v1::DetachResponse*) {
  return Finish("Detach", context, groups_->Detach(*request, Caller(context)), true);
}

grpc::Status ControlService::KeepAlive(grpc::ServerContext* context, const v1::KeepAliveRequest* request,
                                       v1::KeepAliveResponse* response) {
  auto result = groups_->KeepAlive(*request, Caller(context));
  if (result.ok()) *response = std::move(*result);
  return Finish("KeepAlive", context, result.status(), false);
}

}  // namespace epfabric::daemon
