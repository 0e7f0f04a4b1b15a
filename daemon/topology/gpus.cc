#include <cuda_runtime_api.h>

#include <cstring>

#include <map>
#include <set>

#include "topology/nvml.h"
#include "topology/system_files.h"
#include "topology/topology.h"

namespace epfabric::daemon::topology {

std::vector<v1::Gpu> DiscoverGpus(const std::string& system_root) {
  std::vector<v1::Gpu> gpus;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: an empty list, not an error
    return gpus;
  }
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, ordinal) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    char bus_id[32] = {};
    if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), ordinal) != cudaSuccess) (void)cudaGetLastError();
    uint8_t uuid[16];
    static_assert(sizeof(prop.uuid.bytes) == sizeof(uuid));
    std::memcpy(uuid, prop.uuid.bytes, sizeof(uuid));

    v1::Gpu gpu;
    gpu.set_ordinal(ordinal);
    gpu.set_name(prop.name);
    gpu.set_uuid(FormatGpuUuid(uuid));
    gpu.set_pci_bus_id(NormalizePciBusId(bus_id));
    gpu.set_memory_bytes(prop.totalGlobalMem);
    gpu.set_sm_count(prop.multiProcessorCount);
    gpu.set_cc_major(prop.major);
    gpu.set_cc_minor(prop.minor);
    gpu.set_numa_node(ReadPciNumaNode(system_root, gpu.pci_bus_id()));
    gpu.set_cpu_affinity(ReadPciLocalCpuList(system_root, gpu.pci_bus_id()));
    gpus.push_back(std::move(gpu));
  }
  return gpus;
}

std::vector<v1::GpuLink> DiscoverGpuLinks(const std::vector<v1::Gpu>& gpus) {
  std::set<std::string> gpu_buses;
  for (const v1::Gpu& gpu : gpus) gpu_buses.insert(gpu.pci_bus_id());

  // Per GPU: links to each GPU it reaches directly, and links that end at something else (NVSwitch).
  struct NvLinks {
    bool known = false;
    std::map<std::string, int> to_gpu;
    int to_switch = 0;
  };
  std::vector<NvLinks> nvlinks(gpus.size());
  for (size_t i = 0; i < gpus.size(); ++i) {
    auto by_remote = Nvml::Get().ActiveNvLinksByRemote(gpus[i].uuid());
    if (!by_remote.ok()) continue;
    nvlinks[i].known = true;
    for (const auto& [remote, links] : *by_remote) {
      if (gpu_buses.count(remote) != 0) {
        nvlinks[i].to_gpu[remote] += links;
      } else {
        nvlinks[i].to_switch += links;
      }
    }
  }

  std::vector<v1::GpuLink> result;
  for (size_t i = 0; i < gpus.size(); ++i) {
    for (size_t j = 0; j < gpus.size(); ++j) {
      if (i == j) continue;
      v1::GpuLink link;
      link.set_from(gpus[i].ordinal());
      link.set_to(gpus[j].ordinal());
      int can_access = 0;
      if (cudaDeviceCanAccessPeer(&can_access, gpus[i].ordinal(), gpus[j].ordinal()) != cudaSuccess) {
        (void)cudaGetLastError();
        can_access = 0;
      }
      link.set_peer_access(can_access != 0);
      link.set_nvlink_known(nvlinks[i].known);
      if (nvlinks[i].known) {
        auto direct = nvlinks[i].to_gpu.find(gpus[j].pci_bus_id());
        int links = direct != nvlinks[i].to_gpu.end() ? direct->second : 0;
        if (links == 0 && can_access != 0) links = nvlinks[i].to_switch;
        link.set_nvlink_links(links);
      }
      result.push_back(std::move(link));
    }
  }
  return result;
}

}  // namespace epfabric::daemon::topology
