#include <infiniband/verbs.h>

#include "absl/strings/str_cat.h"
#include "topology/system_files.h"
#include "topology/topology.h"

namespace epfabric::daemon::topology {
namespace {

const char* PortStateName(ibv_port_state state) {
  switch (state) {
    case IBV_PORT_NOP:
      return "NOP";
    case IBV_PORT_DOWN:
      return "DOWN";
    case IBV_PORT_INIT:
      return "INIT";
    case IBV_PORT_ARMED:
      return "ARMED";
    case IBV_PORT_ACTIVE:
      return "ACTIVE";
    case IBV_PORT_ACTIVE_DEFER:
      return "ACTIVE_DEFER";
  }
  return "UNKNOWN";
}

const char* LinkLayerName(uint8_t link_layer) {
  switch (link_layer) {
    case IBV_LINK_LAYER_INFINIBAND:
      return "InfiniBand";
    case IBV_LINK_LAYER_ETHERNET:
      return "Ethernet";
    default:
      return "Unspecified";
  }
}

// Port rate in Gb/s from the verbs width and speed codes; 0 when either is unknown.
double PortRateGbps(uint8_t active_width, uint32_t active_speed) {
  int lanes = 0;
  switch (active_width) {
    case 1:
      lanes = 1;
      break;
    case 2:
      lanes = 4;
      break;
    case 4:
      lanes = 8;
      break;
    case 8:
      lanes = 12;
      break;
    case 16:
      lanes = 2;
      break;
    default:
      return 0;
  }
  double per_lane = 0;
  switch (active_speed) {
    case 1:
      per_lane = 2.5;
      break;  // SDR
    case 2:
      per_lane = 5.0;
      break;  // DDR
    case 4:
      per_lane = 10.0;
      break;  // QDR (and FDR10 on older stacks)
    case 8:
      per_lane = 10.3125;
      break;  // FDR10
    case 16:
      per_lane = 14.0625;
      break;  // FDR
    case 32:
      per_lane = 25.78125;
      break;  // EDR
    case 64:
      per_lane = 53.125;
      break;  // HDR
    case 128:
      per_lane = 106.25;
      break;  // NDR
    case 256:
      per_lane = 212.5;
      break;  // XDR
    default:
      return 0;
  }
  return lanes * per_lane;
}

}  // namespace

std::vector<v1::RdmaNic> DiscoverRdmaNics(const std::string& system_root) {
  std::vector<v1::RdmaNic> nics;
  int num_devices = 0;
  ibv_device** devices = ibv_get_device_list(&num_devices);
  if (devices == nullptr) return nics;
  for (int d = 0; d < num_devices; ++d) {
    v1::RdmaNic nic;
    nic.set_name(ibv_get_device_name(devices[d]));
    nic.set_pci_address(ReadRdmaDevicePciAddress(system_root, nic.name()));
    nic.set_numa_node(ReadRdmaDeviceNumaNode(system_root, nic.name()));
    ibv_context* context = ibv_open_device(devices[d]);
    if (context != nullptr) {
      ibv_device_attr attr{};
      if (ibv_query_device(context, &attr) == 0) {
        nic.set_firmware(attr.fw_ver);
        for (uint8_t port = 1; port <= attr.phys_port_cnt; ++port) {
          ibv_port_attr port_attr{};
          if (ibv_query_port(context, port, &port_attr) != 0) continue;
          v1::RdmaPort* p = nic.add_ports();
          p->set_port(port);
          p->set_state(PortStateName(port_attr.state));
          p->set_link_layer(LinkLayerName(port_attr.link_layer));
          p->set_lid(port_attr.lid);
          p->set_rate_gbps(PortRateGbps(port_attr.active_width, port_attr.active_speed));
          ibv_gid gid{};
          if (port_attr.gid_tbl_len > 0 && ibv_query_gid(context, port, 0, &gid) == 0) {
            p->set_gid(FormatGid(gid.raw));
          }
        }
      }
      ibv_close_device(context);
    }
    nics.push_back(std::move(nic));
  }
  ibv_free_device_list(devices);
  return nics;
}

}  // namespace epfabric::daemon::topology
