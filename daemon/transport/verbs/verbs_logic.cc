#include "transport/verbs/verbs_logic.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace epfabric::daemon::transport::verbs {
namespace {

constexpr uint32_t k24Bits = (1u << 24) - 1;

}  // namespace

v1::RdmaEndpoint ToProto(const VerbsEndpoint& endpoint, int rank) {
  v1::RdmaEndpoint proto;
  proto.set_rank(rank);
  proto.set_address(endpoint.address);
  proto.set_rkey(endpoint.rkey);
  for (uint32_t qpn : endpoint.qp_numbers) proto.add_qp_numbers(qpn);
  for (uint32_t psn : endpoint.psns) proto.add_psns(psn);
  proto.set_gid(std::string(reinterpret_cast<const char*>(endpoint.gid.data()), endpoint.gid.size()));
  proto.set_lid(endpoint.lid);
  proto.set_mtu(static_cast<uint32_t>(endpoint.mtu));
  proto.set_gid_index(endpoint.gid_index);
  proto.set_port(endpoint.port);
  proto.set_roce(endpoint.roce);
  return proto;
}

absl::StatusOr<VerbsEndpoint> FromProto(const v1::RdmaEndpoint& proto, size_t queue_pairs) {
  auto bad = [&proto](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("rdma endpoint of rank ", proto.rank(), ": ", what));
  };
  if (static_cast<size_t>(proto.qp_numbers_size()) != queue_pairs) {
    return bad(absl::StrCat("qp_numbers: ", proto.qp_numbers_size(), " entries, expected ", queue_pairs));
  }
  if (static_cast<size_t>(proto.psns_size()) != queue_pairs) {
    return bad(absl::StrCat("psns: ", proto.psns_size(), " entries, expected ", queue_pairs));
  }
  if (proto.gid().size() != 16) return bad(absl::StrCat("gid: ", proto.gid().size(), " bytes, expected 16"));
  if (proto.mtu() < IBV_MTU_256 || proto.mtu() > IBV_MTU_4096) {
    return bad(absl::StrCat("mtu: ", proto.mtu(), " is not an ibv_mtu (1..5)"));
  }
  if (proto.port() < 1 || proto.port() > 255) return bad(absl::StrCat("port: ", proto.port(), " is not 1..255"));
  if (proto.gid_index() > 255) return bad(absl::StrCat("gid_index: ", proto.gid_index(), " is over 255"));
  if (!proto.roce() && (proto.lid() == 0 || proto.lid() > 0xffff)) {
    return bad(absl::StrCat("lid: ", proto.lid(), " (InfiniBand routes by LID; 1..65535)"));
  }
  VerbsEndpoint endpoint;
  for (int i = 0; i < proto.qp_numbers_size(); ++i) {
    if (proto.qp_numbers(i) > k24Bits || proto.psns(i) > k24Bits) {
      return bad(absl::StrCat("queue pair ", i, ": QP number ", proto.qp_numbers(i), " or PSN ", proto.psns(i),
                              " is over 24 bits"));
    }
    endpoint.qp_numbers.push_back(proto.qp_numbers(i));
    endpoint.psns.push_back(proto.psns(i));
  }
  endpoint.address = proto.address();
  endpoint.rkey = proto.rkey();
  std::memcpy(endpoint.gid.data(), proto.gid().data(), 16);
  endpoint.lid = static_cast<uint16_t>(proto.lid());
  endpoint.mtu = static_cast<ibv_mtu>(proto.mtu());
  endpoint.gid_index = static_cast<uint8_t>(proto.gid_index());
  endpoint.port = static_cast<uint8_t>(proto.port());
  endpoint.roce = proto.roce();
  return endpoint;
}

const char* RegistrationPathName(RegistrationPath path) {
  switch (path) {
    case RegistrationPath::kHostMemory:
      return "host memory (ibv_reg_mr)";
    case RegistrationPath::kDmaBuf:
      return "dma-buf (ibv_reg_dmabuf_mr)";
    case RegistrationPath::kPeerMemory:
      return "peer memory (ibv_reg_mr, nvidia-peermem)";
  }
  return "unknown";
}

absl::StatusOr<RegistrationPath> ChooseRegistrationPath(bool device_memory, bool dmabuf_supported,
                                                        bool peermem_loaded) {
  if (!device_memory) return RegistrationPath::kHostMemory;
  if (dmabuf_supported) return RegistrationPath::kDmaBuf;
  if (peermem_loaded) return RegistrationPath::kPeerMemory;
  return absl::FailedPreconditionError(
      "verbs: GPU memory cannot be registered: the GPU or kernel has no dma-buf support and nvidia-peermem is not "
      "loaded (modprobe nvidia-peermem, or a kernel >= 5.12 with an open GPU driver for dma-buf)");
}

QpTransition InitTransition(uint8_t port) {
  QpTransition t;
  t.attr.qp_state = IBV_QPS_INIT;
  t.attr.pkey_index = 0;
  t.attr.port_num = port;
  t.attr.qp_access_flags = kAccessFlags;
  t.mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  return t;
}

QpTransition RtrTransition(const VerbsEndpoint& remote, size_t remote_qp, uint8_t local_gid_index, ibv_mtu mtu) {
  QpTransition t;
  t.attr.qp_state = IBV_QPS_RTR;
  // The smaller of both sides' MTUs.
  t.attr.path_mtu = std::min(mtu, remote.mtu);
  t.attr.dest_qp_num = remote.qp_numbers.at(remote_qp);
  t.attr.rq_psn = remote.psns.at(remote_qp);
  t.attr.max_dest_rd_atomic = 16;  // atomics in flight that the peer may have towards us
  t.attr.min_rnr_timer = 12;       // 0.64 ms; we never post receives, so RNR should not happen
  t.attr.ah_attr.port_num = remote.port;
  t.attr.ah_attr.sl = 0;
  if (remote.roce) {
    // RoCE routes by GID (RoCE v2: UDP/IP), so the address handle is global.
    t.attr.ah_attr.is_global = 1;
    std::memcpy(t.attr.ah_attr.grh.dgid.raw, remote.gid.data(), 16);
    t.attr.ah_attr.grh.sgid_index = local_gid_index;
    t.attr.ah_attr.grh.hop_limit = 64;
    t.attr.ah_attr.grh.traffic_class = 0;
    t.attr.ah_attr.grh.flow_label = 0;
  } else {
    t.attr.ah_attr.is_global = 0;
    t.attr.ah_attr.dlid = remote.lid;
  }
  t.mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
           IBV_QP_MIN_RNR_TIMER;
  return t;
}

QpTransition RtsTransition(uint32_t psn) {
  QpTransition t;
  t.attr.qp_state = IBV_QPS_RTS;
  t.attr.sq_psn = psn;
  t.attr.timeout = 14;   // 4.096 us * 2^14 = 67 ms per try
  t.attr.retry_cnt = 7;  // then IBV_WC_RETRY_EXC_ERR: the peer is gone (about 0.5 s)
  t.attr.rnr_retry = 7;  // infinite; we never post receives
  t.attr.max_rd_atomic = 16;
  t.mask =
      IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
  return t;
}

absl::Status CompletionError(ibv_wc_status status, ibv_wc_opcode opcode, int peer_rank) {
  const std::string what = absl::StrCat(opcode == IBV_WC_FETCH_ADD ? "signal_add" : "put", " to rank ", peer_rank, ": ",
                                        ibv_wc_status_str(status));
  switch (status) {
    case IBV_WC_SUCCESS:
      return absl::OkStatus();
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_REM_OP_ERR:
    case IBV_WC_REM_ABORT_ERR:
    case IBV_WC_WR_FLUSH_ERR:
    case IBV_WC_RESP_TIMEOUT_ERR:
    case IBV_WC_FATAL_ERR:
      return absl::UnavailableError(absl::StrCat(what, " (rank ", peer_rank, " is unreachable or refused)"));
    default:
      return absl::InternalError(what);
  }
}

v1::Transport ChooseTransport(std::string_view flag, bool verbs_usable) {
  if (flag == "verbs") return v1::TRANSPORT_VERBS;
  if (flag == "socket") return v1::TRANSPORT_SOCKET;
  return verbs_usable ? v1::TRANSPORT_VERBS : v1::TRANSPORT_SOCKET;
}

absl::Status ProbeVerbs() {
  int count = 0;
  ibv_device** devices = ibv_get_device_list(&count);
  if (devices == nullptr || count == 0) {
    if (devices != nullptr) ibv_free_device_list(devices);
    return absl::FailedPreconditionError("--transport=verbs: no RDMA device (ibv_get_device_list found none)");
  }
  std::string seen;
  bool active = false;
  for (int i = 0; i < count && !active; ++i) {
    ibv_context* context = ibv_open_device(devices[i]);
    if (context == nullptr) continue;
    ibv_device_attr attr{};
    if (ibv_query_device(context, &attr) == 0) {
      for (uint8_t port = 1; port <= attr.phys_port_cnt && !active; ++port) {
        ibv_port_attr port_attr{};
        active = ibv_query_port(context, port, &port_attr) == 0 && port_attr.state == IBV_PORT_ACTIVE;
      }
    }
    absl::StrAppend(&seen, seen.empty() ? "" : ", ", ibv_get_device_name(devices[i]));
    ibv_close_device(context);
  }
  ibv_free_device_list(devices);
  if (!active) {
    return absl::FailedPreconditionError(
        absl::StrCat("--transport=verbs: no RDMA device with an active port (devices: ", seen, ")"));
  }
  return absl::OkStatus();
}

}  // namespace epfabric::daemon::transport::verbs
