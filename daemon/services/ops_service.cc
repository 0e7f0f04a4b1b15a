#include "services/ops_service.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "epfabric/proto/grpc_status.h"

namespace epfabric::daemon {
namespace {

grpc::Status Unavailable(const char* what) {
  return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, absl::StrCat(what, " is not provided by this daemon"));
}

void AddIncident(v1::HealthReport& report, v1::HealthReport::Verdict severity, const std::string& subsystem,
                 const std::string& code, const std::string& message, const std::string& entity) {
  v1::HealthReport::Incident* incident = report.add_incidents();
  incident->set_subsystem(subsystem);
  incident->set_severity(severity);
  incident->set_code(code);
  incident->set_message(message);
  incident->set_entity(entity);
  if (severity > report.overall()) report.set_overall(severity);
}

}  // namespace

#define EPF_OPS_AUTHORIZE(method)                                                                     \
  do {                                                                                                \
    if (auth_ != nullptr) {                                                                           \
      if (auto who = auth_->RequireReader(*context, "/epfabric.v1.Ops/" method, *request); !who.ok()) \
        return ToGrpcStatus(who.status());                                                            \
    }                                                                                                 \
  } while (false)

grpc::Status OpsService::GetTopology(grpc::ServerContext* context, const v1::GetTopologyRequest* request,
                                     v1::Topology* response) {
  EPF_OPS_AUTHORIZE("GetTopology");
  if (!providers_.topology) return Unavailable("topology");
  *response = providers_.topology();
  return grpc::Status::OK;
}

grpc::Status OpsService::GetHealth(grpc::ServerContext* context, const v1::GetHealthRequest* request,
                                   v1::HealthReport* response) {
  EPF_OPS_AUTHORIZE("GetHealth");
  if (!providers_.health) return Unavailable("health");
  *response = providers_.health();
  return grpc::Status::OK;
}

grpc::Status OpsService::GetStats(grpc::ServerContext* context, const v1::GetStatsRequest* request,
                                  v1::Stats* response) {
  EPF_OPS_AUTHORIZE("GetStats");
  if (!providers_.stats) return Unavailable("stats");
  *response = providers_.stats(*request);
  return grpc::Status::OK;
}

grpc::Status OpsService::ListClients(grpc::ServerContext* context, const v1::ListClientsRequest* request,
                                     v1::ListClientsResponse* response) {
  EPF_OPS_AUTHORIZE("ListClients");
  if (!providers_.clients) return Unavailable("clients");
  // A lease id is its holder's handle on the lease: it is never listed (docs/security.md). On the client socket a
  // tenant sees its own leases only; the operator (the daemon's uid or root) sees everyone's.
  const int64_t caller = providers_.caller_uid ? providers_.caller_uid(*context) : 0;
  const bool everyone = caller == 0 || caller == static_cast<int64_t>(getuid());
  for (v1::ClientInfo& client : providers_.clients()) {
    if (!everyone && client.uid() != caller) continue;
    client.clear_lease_id();
    *response->add_clients() = std::move(client);
  }
  return grpc::Status::OK;
}

grpc::Status OpsService::GetFabric(grpc::ServerContext* context, const v1::GetFabricRequest* request,
                                   v1::FabricView* response) {
  EPF_OPS_AUTHORIZE("GetFabric");
  if (!providers_.fabric) return Unavailable("fabric");
  *response = providers_.fabric();
  return grpc::Status::OK;
}

v1::HealthReport BuildHealthReport(const v1::FabricView& fabric, bool coordinator_reachable) {
  v1::HealthReport report;
  report.set_overall(v1::HealthReport::PASS);
  const v1::Membership& membership = fabric.membership();
  const int self = fabric.self_rank();
  if (self < membership.members_size() && membership.members(self).state() != v1::MEMBER_STATE_UP) {
    AddIncident(report, v1::HealthReport::FAIL, "fabric", "NOT_A_MEMBER",
                "this daemon is not counted in the fabric (not joined yet, or its rank is held by another daemon)",
                absl::StrCat("rank ", self));
  }
  if (!fabric.coordinator_unverified().empty()) {
    AddIncident(report, v1::HealthReport::FAIL, "fabric", "COORDINATOR_UNAUTHENTICATED",
                absl::StrCat("the process on the coordinator's peer port is not this fabric's coordinator; its "
                             "answers are refused: ",
                             fabric.coordinator_unverified()),
                "rank 0");
  } else if (!fabric.join_refused().empty()) {
    AddIncident(report, v1::HealthReport::FAIL, "fabric", "JOIN_REFUSED",
                absl::StrCat("the coordinator refuses this daemon: ", fabric.join_refused()),
                absl::StrCat("rank ", self));
  } else if (!coordinator_reachable) {
    AddIncident(report, v1::HealthReport::WARN, "fabric", "COORDINATOR_UNREACHABLE",
                "rank 0 does not answer; serving what exists, groups cannot be created or deleted", "rank 0");
  }
  for (const v1::MemberInfo& member : membership.members()) {
    if (member.rank() == self || member.state() == v1::MEMBER_STATE_UP) continue;
    if (member.rank() == 0 && !coordinator_reachable) continue;  // reported above
    AddIncident(report, v1::HealthReport::WARN, "fabric",
                member.state() == v1::MEMBER_STATE_DOWN ? "PEER_DOWN" : "PEER_MISSING",
                member.state() == v1::MEMBER_STATE_DOWN ? "stopped answering heartbeats" : "has not joined yet",
                absl::StrCat("rank ", member.rank()));
  }
  for (const v1::GroupInfo& group : fabric.groups()) {
    if (group.state() != v1::GROUP_STATE_DEGRADED) continue;
    AddIncident(report, v1::HealthReport::WARN, "groups", "GROUP_DEGRADED",
                "a member is down or restarted; delete and re-create the group", absl::StrCat("group ", group.name()));
  }
  return report;
}

}  // namespace epfabric::daemon
