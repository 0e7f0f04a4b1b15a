// Ops service: read-only questions from tooling. Thin: each method asks a gRPC-free provider.
#pragma once

#include <functional>
#include <vector>

#include "epfabric/v1/ops.grpc.pb.h"
#include "security/peer_authenticator.h"

namespace epfabric::daemon {

struct OpsProviders {
  std::function<v1::Topology()> topology;
  std::function<v1::HealthReport()> health;
  std::function<v1::FabricView()> fabric;
  std::function<std::vector<v1::ClientInfo>()> clients;
  std::function<v1::Stats(const v1::GetStatsRequest&)> stats;
  // On the client socket: the caller's uid (SO_PEERCRED), -1 when unknown; unset on the peer port.
  std::function<int64_t(const grpc::ServerContext&)> caller_uid;
};

class OpsService final : public v1::Ops::Service {
 public:
  // `authenticator` is null on the client socket (its file mode guards it) and set on the peer port, where every
  // call needs a member's or an ops credential.
  explicit OpsService(OpsProviders providers, const security::PeerAuthenticator* authenticator = nullptr)
      : providers_(std::move(providers)), auth_(authenticator) {}

  grpc::Status GetTopology(grpc::ServerContext*, const v1::GetTopologyRequest*, v1::Topology*) override;
  grpc::Status GetHealth(grpc::ServerContext*, const v1::GetHealthRequest*, v1::HealthReport*) override;
  grpc::Status GetStats(grpc::ServerContext*, const v1::GetStatsRequest*, v1::Stats*) override;
  grpc::Status ListClients(grpc::ServerContext*, const v1::ListClientsRequest*, v1::ListClientsResponse*) override;
  grpc::Status GetFabric(grpc::ServerContext*, const v1::GetFabricRequest*, v1::FabricView*) override;

 private:
  OpsProviders providers_;
  const security::PeerAuthenticator* const auth_;
};

// DCGM-style health from the fabric view: FAIL when this daemon is not part of a complete fabric (not joined,
// or its rank refused), WARN for each member down or missing, each degraded group, an unreachable coordinator.
v1::HealthReport BuildHealthReport(const v1::FabricView& fabric, bool coordinator_reachable);

}  // namespace epfabric::daemon
