// Ops.GetTopology: what this host has (GPUs, how they reach each other, RDMA NICs) and who this daemon is.
// With no GPU and no NIC the lists are empty; discovery never fails the call.
#pragma once

#include <string>
#include <vector>

#include "epfabric/v1/ops.pb.h"

namespace epfabric::daemon::topology {

// GPUs visible to the CUDA runtime, with NUMA/CPU affinity from sysfs under `system_root`.
std::vector<v1::Gpu> DiscoverGpus(const std::string& system_root);

// Every ordered pair of distinct GPUs: peer access (CUDA) and active NVLink links (NVML). When a GPU's links end
// at a non-GPU device (an NVSwitch), every peer-accessible pair through it is given that GPU's switch link count.
std::vector<v1::GpuLink> DiscoverGpuLinks(const std::vector<v1::Gpu>& gpus);

// RDMA devices from libibverbs, with PCI address and NUMA node from sysfs under `system_root`.
std::vector<v1::RdmaNic> DiscoverRdmaNics(const std::string& system_root);

// Everything, for the daemon described by `daemon`.
v1::Topology DiscoverTopology(const std::string& system_root, const std::string& host_id_override,
                              const v1::DaemonInfo& daemon);

}  // namespace epfabric::daemon::topology
