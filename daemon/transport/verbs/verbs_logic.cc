#include "transport/verbs/verbs_logic.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace epfabric::daemon::transport::verbs {
namespace {

bool AllZero(const Gid& gid) {
  return std::all_of(gid.begin(), gid.end(), [](uint8_t b) { return b == 0; });
}

bool IsIpv4Mapped(const Gid& gid) {
  for (int i = 0; i < 10; ++i) {
    if (gid[i] != 0) return false;
  }
  return gid[10] == 0xff && gid[11] == 0xff;
}

bool IsLinkLocal(const Gid& gid) { return gid[0] == 0xfe && (gid[1] & 0xc0) == 0x80; }

absl::Status Invalid(int rank, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat("verbs endpoint of rank ", rank, ": ", message));
}

absl::Status Unusable(absl::string_view message) {
  return absl::FailedPreconditionError(absl::StrCat("--transport=verbs: ", message));
}

}  // namespace

void FillEndpoint(const EndpointData& data, v1::TransportEndpoint* out) {
  out->set_transport(v1::TRANSPORT_VERBS);
  out->set_region_bytes(data.region_bytes);
  v1::RdmaEndpoint* rdma = out->mutable_rdma();
  rdma->Clear();
  rdma->set_rank(data.rank);
  rdma->set_address(data.address);
  rdma->set_rkey(data.rkey);
  for (uint32_t qpn : data.qp_numbers) rdma->add_qp_numbers(qpn);
  for (uint32_t psn : data.psns) rdma->add_psns(psn);
  rdma->set_gid(std::string(reinterpret_cast<const char*>(data.gid.data()), data.gid.size()));
  rdma->set_lid(data.lid);
  rdma->set_mtu(static_cast<uint32_t>(data.mtu));
  rdma->set_gid_index(data.gid_index);
  rdma->set_port(data.port);
  rdma->set_roce(data.roce);
}

absl::StatusOr<EndpointData> ParseEndpoint(const v1::TransportEndpoint& endpoint, const EndpointExpectations& expect) {
  const int rank = expect.rank;
  if (endpoint.transport() != v1::TRANSPORT_VERBS) {
    return Invalid(rank, absl::StrCat("transport is ", v1::Transport_Name(endpoint.transport()),
                                      ", expected TRANSPORT_VERBS (every member must run the same wire)"));
  }
  if (!endpoint.has_rdma()) return Invalid(rank, "rdma is missing");
  const v1::RdmaEndpoint& rdma = endpoint.rdma();
  if (rdma.rank() != rank) return Invalid(rank, absl::StrCat("rdma.rank is ", rdma.rank()));
  if (expect.world < 1 || expect.channels < 1 || expect.world > std::numeric_limits<int>::max() / expect.channels) {
    return absl::InvalidArgumentError(
        absl::StrCat("verbs: bad group shape: world ", expect.world, ", channels ", expect.channels));
  }
  const int qps = expect.world * expect.channels;
  if (rdma.qp_numbers_size() != qps) {
    return Invalid(rank, absl::StrCat("rdma.qp_numbers has ", rdma.qp_numbers_size(), " entries, expected ", qps,
                                      " (world ", expect.world, " x channels ", expect.channels, ")"));
  }
  if (rdma.psns_size() != qps) {
    return Invalid(rank, absl::StrCat("rdma.psns has ", rdma.psns_size(), " entries, expected ", qps));
  }
  for (int i = 0; i < qps; ++i) {
    if (rdma.qp_numbers(i) > kMax24Bit) {
      return Invalid(rank, absl::StrCat("rdma.qp_numbers[", i, "] = ", rdma.qp_numbers(i), " is not a 24-bit number"));
    }
    if (rdma.psns(i) > kMax24Bit) {
      return Invalid(rank, absl::StrCat("rdma.psns[", i, "] = ", rdma.psns(i), " is not a 24-bit number"));
    }
  }
  if (rdma.gid().size() != 16) {
    return Invalid(rank, absl::StrCat("rdma.gid has ", rdma.gid().size(), " bytes, expected 16"));
  }
  if (rdma.mtu() < IBV_MTU_256 || rdma.mtu() > IBV_MTU_4096) {
    return Invalid(rank, absl::StrCat("rdma.mtu is ", rdma.mtu(), ", expected 1..5 (enum ibv_mtu, 256..4096 bytes)"));
  }
  if (rdma.port() < 1 || rdma.port() > 255) {
    return Invalid(rank, absl::StrCat("rdma.port is ", rdma.port(), ", expected 1..255"));
  }
  if (rdma.gid_index() > 255) return Invalid(rank, absl::StrCat("rdma.gid_index is ", rdma.gid_index()));
  if (rdma.roce() != expect.roce) {
    return absl::FailedPreconditionError(absl::StrCat("verbs endpoint of rank ", rank, ": rdma.roce is ",
                                                      rdma.roce() ? "true" : "false", " but this member's port is ",
                                                      expect.roce ? "RoCE" : "InfiniBand",
                                                      " (both ends of a queue pair must use the same link layer)"));
  }
  if (endpoint.region_bytes() > std::numeric_limits<uint64_t>::max() - rdma.address()) {
    return Invalid(rank, absl::StrCat("rdma.address ", rdma.address(), " + region_bytes ", endpoint.region_bytes(),
                                      " wraps around"));
  }

  EndpointData data;
  data.rank = rank;
  data.address = rdma.address();
  data.region_bytes = endpoint.region_bytes();
  data.rkey = rdma.rkey();
  data.qp_numbers.assign(rdma.qp_numbers().begin(), rdma.qp_numbers().end());
  data.psns.assign(rdma.psns().begin(), rdma.psns().end());
  std::memcpy(data.gid.data(), rdma.gid().data(), data.gid.size());
  data.mtu = static_cast<ibv_mtu>(rdma.mtu());
  data.gid_index = rdma.gid_index();
  data.port = rdma.port();
  data.roce = rdma.roce();
  if (data.roce) {
    if (AllZero(data.gid)) return Invalid(rank, "rdma.gid is all zero (RoCE routes by GID)");
  } else {
    // Unicast LIDs are 0x0001..0xBFFF; 0xC000.. are multicast and 0xFFFF the permissive LID.
    if (rdma.lid() < 1 || rdma.lid() > 0xBFFF) {
      return Invalid(rank, absl::StrCat("rdma.lid is ", rdma.lid(), ", expected a unicast LID 1..0xBFFF"));
    }
    data.lid = static_cast<uint16_t>(rdma.lid());
  }
  return data;
}

std::optional<GidInfo> ChooseRoceV2Gid(const std::vector<GidInfo>& gids) {
  // Lower rank wins: IPv4-mapped (what RoCE v2 deployments route), global IPv6, link-local IPv6 (one L2 only).
  std::optional<GidInfo> best;
  int best_rank = 3;
  for (const GidInfo& entry : gids) {
    if (entry.type != IBV_GID_TYPE_ROCE_V2 || AllZero(entry.gid)) continue;
    const int rank = IsIpv4Mapped(entry.gid) ? 0 : IsLinkLocal(entry.gid) ? 2 : 1;
    if (rank < best_rank || (rank == best_rank && best.has_value() && entry.index < best->index)) {
      best = entry;
      best_rank = rank;
    }
  }
  return best;
}

absl::StatusOr<PortChoice> ChoosePort(const VerbsOptions& options, const std::vector<DeviceInfo>& devices) {
  if (devices.empty()) return Unusable("no RDMA device (ibv_get_device_list found none)");
  std::vector<const DeviceInfo*> candidates;
  for (const DeviceInfo& device : devices) {
    if (options.device.empty() || device.name == options.device) candidates.push_back(&device);
  }
  if (candidates.empty()) {
    std::vector<std::string> names;
    for (const DeviceInfo& device : devices) names.push_back(device.name);
    return Unusable(absl::StrCat("no RDMA device named ", options.device, " (found ", absl::StrJoin(names, ", "), ")"));
  }
  if (options.port < 0 || options.port > 255) return Unusable(absl::StrCat("port ", options.port, " is out of range"));
  if (options.gid_index < -1 || options.gid_index > 255) {
    return Unusable(absl::StrCat("gid index ", options.gid_index, " is out of range"));
  }

  absl::Status first_problem;
  for (const DeviceInfo* device : candidates) {
    bool any_active = false;
    for (const PortInfo& port : device->ports) {
      if (options.port != 0 && port.port != options.port) continue;
      if (!port.active) continue;
      any_active = true;
      PortChoice choice;
      choice.device = device->name;
      choice.port = port.port;
      choice.roce = port.ethernet;
      choice.lid = port.lid;
      choice.mtu = port.active_mtu;
      const std::string where = absl::StrCat(device->name, " port ", port.port);
      if (options.gid_index >= 0) {
        auto it = std::find_if(port.gids.begin(), port.gids.end(),
                               [&](const GidInfo& g) { return g.index == static_cast<uint32_t>(options.gid_index); });
        if (it == port.gids.end() || AllZero(it->gid)) {
          if (first_problem.ok())
            first_problem = Unusable(absl::StrCat(where, " has no GID at index ", options.gid_index));
          continue;
        }
        if (port.ethernet && it->type != IBV_GID_TYPE_ROCE_V2) {
          if (first_problem.ok()) {
            first_problem = Unusable(absl::StrCat(where, " GID index ", options.gid_index, " is not RoCE v2"));
          }
          continue;
        }
        choice.gid_index = it->index;
        choice.gid = it->gid;
      } else if (port.ethernet) {
        std::optional<GidInfo> gid = ChooseRoceV2Gid(port.gids);
        if (!gid.has_value()) {
          if (first_problem.ok()) {
            first_problem =
                Unusable(absl::StrCat(where, " has no RoCE v2 GID (give its network interface an IP address)"));
          }
          continue;
        }
        choice.gid_index = gid->index;
        choice.gid = gid->gid;
      } else {
        // InfiniBand routes by LID inside the subnet; GID 0 (the port GUID) is published for completeness.
        if (port.lid == 0 || port.lid > 0xBFFF) {
          if (first_problem.ok())
            first_problem = Unusable(absl::StrCat(where, " has no LID (is a subnet manager up?)"));
          continue;
        }
        choice.gid_index = 0;
        for (const GidInfo& g : port.gids) {
          if (g.index == 0) choice.gid = g.gid;
        }
      }
      return choice;
    }
    if (!any_active && first_problem.ok()) {
      first_problem = options.port != 0
                          ? Unusable(absl::StrCat("device ", device->name, " port ", options.port, " is not active"))
                          : Unusable(absl::StrCat("device ", device->name, " has no active port"));
    }
  }
  return first_problem;
}

std::string DescribePort(const PortChoice& choice) {
  if (choice.roce)
    return absl::StrCat(choice.device, " port ", choice.port, " (RoCE v2, gid index ", choice.gid_index, ")");
  return absl::StrCat(choice.device, " port ", choice.port, " (InfiniBand, lid ", choice.lid, ")");
}

absl::string_view RegistrationPathName(RegistrationPath path) {
  switch (path) {
    case RegistrationPath::kHostRegMr:
      return "ibv_reg_mr (host memory)";
    case RegistrationPath::kDmaBuf:
      return "ibv_reg_dmabuf_mr (DMA-BUF)";
    case RegistrationPath::kPeerMemRegMr:
      return "ibv_reg_mr (device memory, nvidia-peermem)";
  }
  return "unknown";
}

std::vector<RegistrationPath> RegistrationOrder(const RegistrationCaps& caps) {
  if (!caps.device_memory) return {RegistrationPath::kHostRegMr};
  std::vector<RegistrationPath> order;
  if (caps.dmabuf_supported) order.push_back(RegistrationPath::kDmaBuf);
  if (caps.allow_peermem) order.push_back(RegistrationPath::kPeerMemRegMr);
  return order;
}

DmaBufRange DmaBufRangeFor(uint64_t base, uint64_t bytes, uint64_t page_size) {
  DmaBufRange range;
  range.start = base / page_size * page_size;
  range.offset = base - range.start;
  const uint64_t end = range.offset + bytes;
  range.size = (end + page_size - 1) / page_size * page_size;
  return range;
}

QpTransition InitTransition(uint8_t port) {
  QpTransition t;
  t.attr.qp_state = IBV_QPS_INIT;
  t.attr.pkey_index = 0;
  t.attr.port_num = port;
  t.attr.qp_access_flags = kRegionAccess;
  t.mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  return t;
}

QpTransition RtrTransition(const PortChoice& local, const EndpointData& remote, uint32_t remote_qpn,
                           uint32_t remote_psn, const VerbsOptions& options, int max_dest_rd_atomic) {
  QpTransition t;
  t.attr.qp_state = IBV_QPS_RTR;
  t.attr.path_mtu = std::min(local.mtu, remote.mtu);
  t.attr.dest_qp_num = remote_qpn & kMax24Bit;
  t.attr.rq_psn = remote_psn & kMax24Bit;
  t.attr.max_dest_rd_atomic = static_cast<uint8_t>(std::clamp(max_dest_rd_atomic, 1, 255));
  t.attr.min_rnr_timer = options.min_rnr_timer;
  t.attr.ah_attr.port_num = local.port;
  t.attr.ah_attr.sl = options.service_level;
  t.attr.ah_attr.src_path_bits = 0;
  if (local.roce) {
    // RoCE v2: the GRH carries the route (UDP/IP from the GID); the LID is unused.
    t.attr.ah_attr.is_global = 1;
    t.attr.ah_attr.dlid = 0;
    std::memcpy(t.attr.ah_attr.grh.dgid.raw, remote.gid.data(), remote.gid.size());
    t.attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(local.gid_index);
    t.attr.ah_attr.grh.hop_limit = options.hop_limit;
    t.attr.ah_attr.grh.traffic_class = options.traffic_class;
    t.attr.ah_attr.grh.flow_label = 0;
  } else {
    // InfiniBand inside one subnet: the subnet manager's LIDs route; no GRH.
    t.attr.ah_attr.is_global = 0;
    t.attr.ah_attr.dlid = remote.lid;
  }
  t.mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
           IBV_QP_MIN_RNR_TIMER;
  return t;
}

QpTransition RtsTransition(uint32_t local_psn, const VerbsOptions& options, int max_rd_atomic) {
  QpTransition t;
  t.attr.qp_state = IBV_QPS_RTS;
  t.attr.timeout = options.timeout;
  t.attr.retry_cnt = options.retry_count;
  t.attr.rnr_retry = options.rnr_retry;
  t.attr.sq_psn = local_psn & kMax24Bit;
  t.attr.max_rd_atomic = static_cast<uint8_t>(std::clamp(max_rd_atomic, 1, 255));
  t.mask =
      IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC;
  return t;
}

absl::StatusOr<QueueSizes> SizeQueues(int num_qps, int requested_depth, int max_qp_wr, int max_cqe) {
  if (num_qps < 1) return absl::InvalidArgumentError(absl::StrCat("verbs: ", num_qps, " queue pairs"));
  if (requested_depth < 1) {
    return absl::InvalidArgumentError(absl::StrCat("verbs: send queue depth ", requested_depth, " (expected >= 1)"));
  }
  int depth = std::min(requested_depth, max_qp_wr);
  depth = static_cast<int>(std::min<int64_t>(depth, max_cqe / num_qps));
  if (depth < 1) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "verbs: ", num_qps, " queue pairs do not fit the device (max_qp_wr ", max_qp_wr, ", max_cqe ", max_cqe, ")"));
  }
  return QueueSizes{depth, depth * num_qps};
}

uint64_t MaxWriteBytes(uint32_t port_max_msg_sz) {
  // 1 GiB keeps one write's share of the link bounded even when the port allows 2 GiB messages.
  constexpr uint64_t kCap = uint64_t{1} << 30;
  return port_max_msg_sz == 0 ? kCap : std::min<uint64_t>(port_max_msg_sz, kCap);
}

uint64_t WriteCount(uint64_t bytes, uint64_t max_write_bytes) {
  if (bytes == 0) return 1;
  return bytes / max_write_bytes + (bytes % max_write_bytes != 0 ? 1 : 0);
}

absl::StatusCode CodeForWcStatus(ibv_wc_status status) {
  switch (status) {
    case IBV_WC_SUCCESS:
      return absl::StatusCode::kOk;
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
    case IBV_WC_RESP_TIMEOUT_ERR:
    case IBV_WC_REM_ABORT_ERR:
    case IBV_WC_WR_FLUSH_ERR:
    case IBV_WC_REM_OP_ERR:
      return absl::StatusCode::kUnavailable;
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_LOC_ACCESS_ERR:
    case IBV_WC_MW_BIND_ERR:
      return absl::StatusCode::kPermissionDenied;
    case IBV_WC_LOC_LEN_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_REM_INV_RD_REQ_ERR:
      return absl::StatusCode::kInvalidArgument;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::Status WcStatusToStatus(ibv_wc_status status, uint32_t vendor_error, absl::string_view group, int peer,
                              int channel, absl::string_view operation) {
  const absl::StatusCode code = CodeForWcStatus(status);
  if (code == absl::StatusCode::kOk) return absl::OkStatus();
  return absl::Status(code, absl::StrFormat("verbs: group %s, rank %d, channel %d: %s failed: %s (status %d, vendor "
                                            "error 0x%x)",
                                            group, peer, channel, operation, ibv_wc_status_str(status),
                                            static_cast<int>(status), vendor_error));
}

}  // namespace epfabric::daemon::transport::verbs
