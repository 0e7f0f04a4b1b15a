#include "services/ops_service.h"

namespace epfabric::daemon {

grpc::Status OpsService::GetTopology(grpc::ServerContext*, const v1::GetTopologyRequest*, v1::Topology* response) {
  *response = topology_();
  return grpc::Status::OK;
}

}  // namespace epfabric::daemon
