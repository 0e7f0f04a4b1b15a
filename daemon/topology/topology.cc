#include "topology/topology.h"

#include <unistd.h>

#include "topology/system_files.h"

namespace epfabric::daemon::topology {

v1::Topology DiscoverTopology(const std::string& system_root, const std::string& host_id_override,
                              const v1::DaemonInfo& daemon) {
  v1::Topology topology;
  topology.set_host_id(ReadHostId(system_root, host_id_override));
  char hostname[256] = {};
  if (gethostname(hostname, sizeof(hostname) - 1) == 0) topology.set_hostname(hostname);
  *topology.mutable_daemon() = daemon;
  std::vector<v1::Gpu> gpus = DiscoverGpus(system_root);
  for (v1::GpuLink& link : DiscoverGpuLinks(gpus)) *topology.add_gpu_links() = std::move(link);
  for (v1::Gpu& gpu : gpus) *topology.add_gpus() = std::move(gpu);
  for (v1::RdmaNic& nic : DiscoverRdmaNics(system_root)) *topology.add_nics() = std::move(nic);
  return topology;
}

}  // namespace epfabric::daemon::topology
