// Ops service: read-only questions from tooling. Thin: each method asks a gRPC-free provider.
#pragma once

#include <functional>

#include "epfabric/v1/ops.grpc.pb.h"

namespace epfabric::daemon {

class OpsService final : public v1::Ops::Service {
 public:
  using TopologyProvider = std::function<v1::Topology()>;
  explicit OpsService(TopologyProvider topology) : topology_(std::move(topology)) {}

  grpc::Status GetTopology(grpc::ServerContext* context, const v1::GetTopologyRequest* request,
                           v1::Topology* response) override;
  // GetHealth, GetStats, ListClients and GetFabric answer UNIMPLEMENTED until the fabric work lands.

 private:
  TopologyProvider topology_;
};

}  // namespace epfabric::daemon
