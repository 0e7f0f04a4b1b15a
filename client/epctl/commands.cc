#include "epctl/commands.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "epfabric/v1/control.grpc.pb.h"
#include "epfabric/v1/epctl.pb.h"
#include "epfabric/v1/ops.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace epfabric::epctl {

std::string ToJson(const google::protobuf::Message& message, const OmittedFields& omitted) {
  return ContractJson(message, omitted) + "\n";
}

void SetDeadline(grpc::ClientContext& context, const GlobalOptions& options) {
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(options.timeout_ms));
}

std::string RpcError(const std::string& what, const GlobalOptions& options, const grpc::Status& status) {
  std::string hint;
  // A plaintext client on a mutual-TLS port sees only a failed connection: say what is likely missing.
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE && !options.address.empty() && options.tls_ca.empty()) {
    hint = " (if the peer port runs mutual TLS, it requires TLS: give --tls_ca, --tls_cert and --tls_key)";
  }
  return absl::StrCat("epctl: ", what, " on ", TargetOf(options),
                      " failed: ", absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())), ": ",
                      status.error_message(), hint);
}

std::string ControlOnlyOnSocket(const std::string& command) {
  return absl::StrCat("epctl: ", command,
                      " calls the Control service, which a daemon serves only on its client socket (its peer port "
                      "serves Peer and Ops): use --socket=PATH on the daemon's host");
}

namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// One health check: the grpc.health.v1 answer, and Ops.GetHealth's report where the daemon gives one. Exit code 0
// only when SERVING (and, for the daemon as a whole, not FAIL); 1 otherwise, and for a report refused for the
// caller's credential (a healthy-looking answer from a port that does not accept us is not a health check).
int CheckHealthOnce(const GlobalOptions& options, const std::shared_ptr<grpc::Channel>& channel,
                    v1::HealthDocument* document, std::string* error) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  SetDeadline(context, options);
  HealthCheckRequest request;
  request.set_service(options.service);
  HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) {
    *error = RpcError("health check", options, status);
    return 1;
  }
  document->set_status(response.status());
  document->set_service(options.service);
  // The incidents behind the verdict, when the daemon can tell (Ops.GetHealth).
  auto ops = v1::Ops::NewStub(channel);
  grpc::ClientContext report_context;
  SetDeadline(report_context, options);
  const grpc::Status report_status =
      ops->GetHealth(&report_context, v1::GetHealthRequest(), document->mutable_report());
  if (report_status.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
      report_status.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
    *error = RpcError("Ops.GetHealth", options, report_status);
    return 1;
  }
  if (!report_status.ok()) document->clear_report();
  // The daemon as a whole: a FAIL verdict (e.g. its Join is refused) is a failure even while gRPC serves.
  const bool failed = options.service.empty() && document->report().overall() == v1::HealthReport::FAIL;
  return response.status() == HealthCheckResponse::SERVING && !failed ? 0 : 1;
}

int RunHealth(const GlobalOptions& options, const std::shared_ptr<grpc::Channel>& channel, std::ostream& out,
              std::ostream& err) {
  // --wait_ms: ask again every 100 ms until healthy or the time is up (a daemon that is still starting).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(options.wait_ms);
  v1::HealthDocument document;
  std::string error;
  int code = 1;
  while (true) {
    document.Clear();
    error.clear();
    code = CheckHealthOnce(options, channel, &document, &error);
    if (code == 0 || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (!error.empty()) {
    err << error << (options.wait_ms > 0 ? absl::StrCat(" (waited ", options.wait_ms, " ms)") : "") << "\n";
    return 1;
  }
  if (options.json) {
    out << ToJson(document);
  } else {
    out << (options.service.empty() ? "epfabricd" : options.service) << ": "
        << HealthCheckResponse::ServingStatus_Name(document.status()) << "\n";
    if (document.has_report()) out << FormatHealthReport(document.report());
  }
  return code;
}

int RunFabric(const GlobalOptions& options, const std::shared_ptr<grpc::Channel>& channel, std::ostream& out,
              std::ostream& err) {
  auto stub = v1::Ops::NewStub(channel);
  grpc::ClientContext context;
  SetDeadline(context, options);
  v1::FabricView fabric;
  const grpc::Status status = stub->GetFabric(&context, v1::GetFabricRequest(), &fabric);
  if (!status.ok()) {
    err << RpcError("GetFabric", options, status) << "\n";
    return 1;
  }
  out << (options.json ? ToJson(fabric) : FormatFabric(fabric));
  return 0;
}

int RunTopology(const GlobalOptions& options, const std::shared_ptr<grpc::Channel>& channel, std::ostream& out,
                std::ostream& err) {
  auto stub = v1::Ops::NewStub(channel);
  grpc::ClientContext context;
  SetDeadline(context, options);
  v1::Topology topology;
  const grpc::Status status = stub->GetTopology(&context, v1::GetTopologyRequest(), &topology);
  if (!status.ok()) {
    err << RpcError("GetTopology", options, status) << "\n";
    return 1;
  }
  out << (options.json ? ToJson(topology) : FormatTopology(topology));
  return 0;
}

int RunCreateGroup(const GlobalOptions& options, const std::shared_ptr<grpc::Channel>& channel, std::ostream& out,
                   std::ostream& err) {
  if (!options.address.empty()) {
    err << ControlOnlyOnSocket("create-group") << "\n";
    return 2;
  }
  auto request = CreateGroupRequestFrom(options);
  if (!request.ok()) {
    err << "epctl: " << request.status().message() << "\n";
    return 2;
  }
  auto stub = v1::Control::NewStub(channel);
  grpc::ClientContext context;
  SetDeadline(context, options);
  v1::CreateGroupResponse response;
  const grpc::Status status = stub->CreateGroup(&context, *request, &response);
  if (!status.ok()) {
    err << RpcError("CreateGroup", options, status) << "\n";
    return 1;
  }
  if (options.json) {
    out << ToJson(response);
  } else {
    out << "group '" << response.group().name() << "' " << v1::GroupState_Name(response.group().state()) << "\ntoken "
        << response.token() << "\n";
  }
  return 0;
}

int RunDeleteGroup(const GlobalOptions& options, const std::shared_ptr<grpc::Channel>& channel, std::ostream& out,
                   std::ostream& err) {
  if (!options.address.empty()) {
    err << ControlOnlyOnSocket("delete-group") << "\n";
    return 2;
  }
  if (options.group.empty()) {
    err << "epctl: --group: required (the group's name)\n";
    return 2;
  }
  auto stub = v1::Control::NewStub(channel);
  grpc::ClientContext context;
  SetDeadline(context, options);
  v1::DeleteGroupRequest request;
  request.set_name(options.group);
  request.set_token(options.token);
  request.set_force(options.force);
  v1::DeleteGroupResponse response;
  const grpc::Status status = stub->DeleteGroup(&context, request, &response);
  if (!status.ok()) {
    err << RpcError("DeleteGroup", options, status) << "\n";
    return 1;
  }
  if (options.json) {
    v1::DeleteGroupDocument document;
    document.set_group(options.group);
    document.set_deleted(true);
    document.set_forced(options.force);
    out << ToJson(document);
  } else {
    out << "group '" << options.group << "' deleted\n";
  }
  return 0;
}

int RunSchema(const GlobalOptions& options, const std::shared_ptr<grpc::Channel>&, std::ostream& out,
              std::ostream& err) {
  for (const JsonDocument& document : JsonDocuments()) {
    if (document.command == options.command) {
      out << ContractSchema(document.type, absl::StrCat("epctl ", document.command, " --json"), document.omitted);
      return 0;
    }
  }
  std::vector<std::string> names;
  for (const JsonDocument& document : JsonDocuments()) names.push_back(document.command);
  err << "epctl: --command: '" << options.command << "' is not one of " << absl::StrJoin(names, ", ") << "\n";
  return 2;
}

std::string BackendName(v1::Backend backend) {
  switch (backend) {
    case v1::BACKEND_CUDA:
      return "cuda";
    case v1::BACKEND_HOST:
      return "host";
    default:
      return "unspecified";
  }
}

}  // namespace

absl::StatusOr<v1::CreateGroupRequest> CreateGroupRequestFrom(const GlobalOptions& options) {
  v1::CreateGroupRequest request;
  if (options.group.empty()) return absl::InvalidArgumentError("--group: required (the group's name)");
  request.set_name(options.group);
  for (absl::string_view part : absl::StrSplit(options.ranks, ',', absl::SkipEmpty())) {
    int rank = 0;
    if (!absl::SimpleAtoi(part, &rank)) {
      return absl::InvalidArgumentError(absl::StrCat("--ranks: '", part, "' is not a rank"));
    }
    request.add_ranks(rank);
  }
  if (request.ranks().empty()) return absl::InvalidArgumentError("--ranks: required (e.g. --ranks=0,1)");
  if (options.nvl_bytes == 0) return absl::InvalidArgumentError("--nvl_bytes: required (bytes per member)");
  request.set_num_nvl_bytes(options.nvl_bytes);
  request.set_num_rdma_bytes(options.rdma_bytes);
  request.set_low_latency(options.low_latency);
  request.set_num_normal_bytes(options.normal_bytes);
  request.set_num_normal_rdma_bytes(options.normal_rdma_bytes);
  request.set_transport_channels(options.transport_channels);
  request.set_ring_slots(options.ring_slots);
  if (options.sharing == "posix_fd") {
    request.set_memory_sharing(v1::MEMORY_SHARING_POSIX_FD);
  } else if (options.sharing == "cuda_ipc") {
    request.set_memory_sharing(v1::MEMORY_SHARING_CUDA_IPC);
  } else if (options.sharing == "posix_shm") {
    request.set_memory_sharing(v1::MEMORY_SHARING_POSIX_SHM);
  } else if (!options.sharing.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--sharing: '", options.sharing, "' is not one of posix_fd, cuda_ipc, posix_shm"));
  }
  return request;
}

const std::vector<JsonDocument>& JsonDocuments() {
  static const auto* documents = new std::vector<JsonDocument>{
      {"health", v1::HealthDocument::descriptor(), {}},
      {"topology", v1::Topology::descriptor(), {}},
      {"fabric", v1::FabricView::descriptor(), {}},
      {"create-group", v1::CreateGroupResponse::descriptor(), {}},
      {"delete-group", v1::DeleteGroupDocument::descriptor(), {}},
      {"groups", v1::ListGroupsResponse::descriptor(), {}},
      // A lease id is its holder's handle: the daemon never lists it, so the document has no such key.
      {"leases", v1::ListClientsResponse::descriptor(), {"epfabric.v1.ClientInfo.lease_id"}},
      {"stats", v1::Stats::descriptor(), {}},
  };
  return *documents;
}

const OmittedFields& OmittedFor(const std::string& command) {
  static const OmittedFields kNone;
  for (const JsonDocument& document : JsonDocuments()) {
    if (document.command == command) return document.omitted;
  }
  return kNone;
}

bool NeedsDaemon(const std::string& command) { return command != "schema"; }

absl::Status ValidateGlobalOptions(const GlobalOptions& options) {
  if (options.socket.empty() == options.address.empty()) {
    return absl::InvalidArgumentError(
        "give exactly one of --socket=PATH and --address=HOST:PORT (or set EPFABRIC_SOCKET to the daemon's socket)");
  }
  if (options.wait_ms < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--wait_ms: ", options.wait_ms, " is negative"));
  }
  if (options.timeout_ms <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("--timeout_ms: ", options.timeout_ms, " is not positive"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> CredentialsFor(const GlobalOptions& options) {
  const int given = !options.tls_ca.empty() + !options.tls_cert.empty() + !options.tls_key.empty();
  if (given == 0) return grpc::InsecureChannelCredentials();
  if (given != 3) return absl::InvalidArgumentError("--tls_ca, --tls_cert and --tls_key go together");
  if (options.address.empty()) return absl::InvalidArgumentError("--tls_*: only with --address (the peer port)");
  grpc::SslCredentialsOptions ssl;
  for (auto [flag, path, field] : {std::tuple{"tls_ca", &options.tls_ca, &ssl.pem_root_certs},
                                   std::tuple{"tls_cert", &options.tls_cert, &ssl.pem_cert_chain},
                                   std::tuple{"tls_key", &options.tls_key, &ssl.pem_private_key}}) {
    std::ifstream in(*path);
    if (!in) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": cannot read '", *path, "'"));
    std::stringstream buffer;
    buffer << in.rdbuf();
    *field = buffer.str();
  }
  return grpc::SslCredentials(ssl);
}

std::string TargetOf(const GlobalOptions& options) {
  return options.socket.empty() ? options.address : absl::StrCat("unix:", options.socket);
}

const std::vector<Command>& Commands() {
  static const auto* commands = new std::vector<Command>{
      {"health", "Is the daemon serving? (grpc.health.v1; exit 0 only when SERVING)",
       "epctl health [--service=NAME] [--wait_ms=N] [--json]\n"
       "  Asks the daemon's grpc.health.v1 service. Without --service it reports the daemon as a whole; with\n"
       "  --service=epfabric.v1.Control (or .Ops, .Peer, .Fabric) that service. Exit status 0 only when SERVING\n"
       "  (and, for the daemon as a whole, Ops.GetHealth's verdict is not FAIL); 1 also when the port refuses\n"
       "  this caller's credential. --wait_ms asks again every 100 ms until SERVING or N ms have passed.\n",
       RunHealth},
      {"topology", "GPUs, their NVLink/peer matrix, RDMA NICs, host id and daemon identity",
       "epctl topology [--json]\n"
       "  Prints Ops.GetTopology: the host id, this daemon (rank, backend, device, addresses), every GPU (name,\n"
       "  UUID, PCI bus id, memory, SMs, compute capability, NUMA node), the GPU-to-GPU matrix (NV<n> = n active\n"
       "  NVLink links, P2P = peer access without NVLink, - = none) and the RDMA NICs with their ports.\n",
       RunTopology},
      {"fabric", "Members of the fabric, their state, the epoch, and the groups this daemon holds",
       "epctl fabric [--json]\n"
       "  Prints Ops.GetFabric as seen by the daemon asked: fabric id, epoch, whether it is degraded, every rank\n"
       "  (UP, DOWN, MISSING) with its host, peer address, backend and incarnation, and the groups (name, state,\n"
       "  ranks, region sizes, attached ranks). Tokens are never shown.\n",
       RunFabric},
      {"create-group", "Create an EP group fabric-wide and print its token",
       "epctl create-group --group=NAME --ranks=0,1,... --nvl_bytes=N [--rdma_bytes=N [--transport_channels=C]\n"
       "                   [--ring_slots=S]] [--low_latency [--normal_bytes=N [--normal_rdma_bytes=N]]]\n"
       "                   [--sharing=posix_fd|cuda_ipc|posix_shm] [--json]\n"
       "  Asks the daemon to create the group on every member (all or nothing) and prints the group's token, which\n"
       "  Attach and delete-group need. The token is shown only here. --normal_bytes: a low-latency group that also\n"
       "  serves normal mode, in the first N bytes of each NVL region (a multiple of 4096); across hosts also in the\n"
       "  first --normal_rdma_bytes of each RDMA region.\n",
       RunCreateGroup},
      {"delete-group", "Delete an EP group fabric-wide (needs its token, or --force)",
       "epctl delete-group --group=NAME (--token=TOKEN | --force)\n"
       "  Frees the group's memory on every member that is up. --force (operators: the daemon's own uid or root)\n"
       "  needs no token and removes a group in any state, or leftovers of a create that failed.\n",
       RunDeleteGroup},
      {"groups", "Groups this daemon knows: state, ranks, region sizes, attached ranks",
       "epctl groups [--json]\n"
       "  Prints Control.ListGroups: every group this daemon holds (the coordinator also lists those it only\n"
       "  registers) with its state (READY, DEGRADED, ...), fabric ranks, region bytes per member and the group ranks\n"
       "  that hold a lease. Tokens are never shown.\n",
       RunGroups},
      {"leases", "Clients attached to this daemon: uid, pid, group, rank, since",
       "epctl leases [--json]\n"
       "  Prints Ops.ListClients: one line per live lease with the holder's uid and pid (SO_PEERCRED), its group and\n"
       "  group rank, when it attached and when it expires unless kept alive. Lease ids are never shown.\n",
       RunLeases},
      {"stats", "The daemon's counters and gauges (the series of /metrics)",
       "epctl stats [--group=G] [--watch [--interval_ms=2000] [--count=N]] [--json]\n"
       "  Prints Ops.GetStats: uptime and every series the Prometheus endpoint shows (RPCs by method and code, the\n"
       "  Attach latency histogram as count and mean, members, epoch, groups, leases, region bytes, refusals).\n"
       "  --group keeps the series of one group. --watch prints them again every --interval_ms (--count times;\n"
       "  0 = until interrupted).\n",
       RunStats},
      {"schema", "The JSON Schema of a command's --json output (no daemon needed)",
       "epctl schema --command=NAME\n"
       "  Prints the JSON Schema (draft 2020-12) of `epctl NAME --json`: keys are the proto field names in .proto\n"
       "  order, all present; 64-bit integers are strings and enums names (the proto3 JSON mapping). The same\n"
       "  schemas are in docs/epctl-json/ (docs/epctl-json.md).\n",
       RunSchema},
  };
  return *commands;
}

const Command* FindCommand(const std::string& name) {
  for (const Command& command : Commands()) {
    if (command.name == name) return &command;
  }
  return nullptr;
}

std::string LinkCell(const v1::GpuLink* link) {
  if (link == nullptr) return "X";
  if (link->nvlink_links() > 0) return absl::StrCat("NV", link->nvlink_links());
  return link->peer_access() ? "P2P" : "-";
}

std::string FormatHealthReport(const v1::HealthReport& report) {
  std::string s = absl::StrCat("health: ", v1::HealthReport::Verdict_Name(report.overall()), "\n");
  for (const auto& incident : report.incidents()) {
    absl::StrAppend(&s, "  ", v1::HealthReport::Verdict_Name(incident.severity()), " ", incident.subsystem(), " ",
                    incident.code(), " (", incident.entity(), "): ", incident.message(), "\n");
  }
  return s;
}

// "socket 127.0.0.1:4100", "verbs", or "-" (a daemon before the transport existed).
std::string TransportText(v1::Transport transport, const std::string& data_address) {
  if (transport == v1::TRANSPORT_UNSPECIFIED) return "-";
  std::string name = v1::Transport_Name(transport);
  name = absl::AsciiStrToLower(name.substr(name.rfind('_') + 1));
  return data_address.empty() ? name : absl::StrCat(name, " ", data_address);
}

std::string FormatFabric(const v1::FabricView& f) {
  const v1::Membership& m = f.membership();
  std::string s = absl::StrCat("fabric '", f.fabric_id(), "'  epoch ", m.epoch(), "  ranks ", m.world_size(),
                               "  self rank ", f.self_rank(), "  degraded: ", f.degraded() ? "yes" : "no", "\n");
  absl::StrAppend(&s, absl::StrFormat("  %-5s %-8s %-22s %-34s %-13s %-24s %s\n", "rank", "state", "peer", "host",
                                      "backend", "transport", "incarnation"));
  for (const v1::MemberInfo& member : m.members()) {
    std::string state = v1::MemberState_Name(member.state());
    state = state.substr(state.rfind('_') + 1);
    absl::StrAppend(&s,
                    absl::StrFormat("  %-5d %-8s %-22s %-34s %-13s %-24s %016x\n", member.rank(), state,
                                    member.peer_address().empty() ? "-" : member.peer_address(),
                                    member.host_id().empty() ? "-" : member.host_id(),
                                    member.backend() == v1::BACKEND_UNSPECIFIED ? "-" : BackendName(member.backend()),
                                    TransportText(member.transport(), member.data_address()), member.incarnation()));
  }
  absl::StrAppend(&s, "\ngroups (", f.groups_size(), ")\n");
  for (const v1::GroupInfo& g : f.groups()) {
    std::string state = v1::GroupState_Name(g.state());
    state = state.substr(state.rfind('_') + 1);
    absl::StrAppend(&s, absl::StrFormat("  %-24s %-9s ranks [%s]  nvl %d B  rdma %d B  attached [%s]\n", g.name(),
                                        state, absl::StrJoin(g.ranks(), ","), g.num_nvl_bytes(), g.num_rdma_bytes(),
                                        absl::StrJoin(g.attached_ranks(), ",")));
  }
  return s;
}

std::string FormatTopology(const v1::Topology& t) {
  std::string s;
  absl::StrAppend(&s, "host      ", t.host_id().empty() ? "(unknown)" : t.host_id(), "  ", t.hostname(), "\n");
  const v1::DaemonInfo& d = t.daemon();
  absl::StrAppend(&s, "daemon    rank ", d.rank(), "/", d.world_size(), "  backend ", BackendName(d.backend()),
                  d.device() >= 0 ? absl::StrCat("  device ", d.device()) : "", "  version ", d.version(), "\n");
  absl::StrAppend(&s, "          peer ", d.peer_address(), "  socket ", d.client_socket(), "  pid ", d.pid(), "\n");
  absl::StrAppend(&s, "          transport ", TransportText(d.transport(), d.data_address()), "\n");

  absl::StrAppend(&s, "\nGPUs (", t.gpus_size(), ")\n");
  if (t.gpus_size() > 0) {
    absl::StrAppend(&s, absl::StrFormat("  %-4s %-24s %-40s %-13s %9s %4s %4s %5s\n", "GPU", "name", "uuid", "pci",
                                        "memory", "SMs", "cc", "numa"));
  }
  for (const v1::Gpu& g : t.gpus()) {
    absl::StrAppend(&s, absl::StrFormat("  %-4d %-24s %-40s %-13s %6.1f GB %4d %2d.%d %5d\n", g.ordinal(), g.name(),
                                        g.uuid(), g.pci_bus_id(), g.memory_bytes() / 1e9, g.sm_count(), g.cc_major(),
                                        g.cc_minor(), g.numa_node()));
  }
  if (t.gpus_size() > 1) {
    std::map<std::pair<int, int>, const v1::GpuLink*> links;
    for (const v1::GpuLink& link : t.gpu_links()) links[{link.from(), link.to()}] = &link;
    absl::StrAppend(&s, "\nGPU links (NV<n>: active NVLink links, P2P: peer access only, -: none)\n       ");
    for (const v1::Gpu& g : t.gpus()) absl::StrAppend(&s, absl::StrFormat("%-7s", absl::StrCat("GPU", g.ordinal())));
    absl::StrAppend(&s, "\n");
    for (const v1::Gpu& from : t.gpus()) {
      absl::StrAppend(&s, absl::StrFormat("  %-5s", absl::StrCat("GPU", from.ordinal())));
      for (const v1::Gpu& to : t.gpus()) {
        const v1::GpuLink* link = nullptr;
        bool self = from.ordinal() == to.ordinal();
        if (!self) {
          auto it = links.find({from.ordinal(), to.ordinal()});
          static const v1::GpuLink kNoLink;
          link = it != links.end() ? it->second : &kNoLink;
        }
        absl::StrAppend(&s, absl::StrFormat("%-7s", LinkCell(link)));
      }
      absl::StrAppend(&s, "\n");
    }
  }

  absl::StrAppend(&s, "\nRDMA NICs (", t.nics_size(), ")\n");
  for (const v1::RdmaNic& n : t.nics()) {
    absl::StrAppend(&s, absl::StrFormat("  %-10s pci %-13s numa %-3d fw %s\n", n.name(),
                                        n.pci_address().empty() ? "?" : n.pci_address(), n.numa_node(), n.firmware()));
    for (const v1::RdmaPort& p : n.ports()) {
      absl::StrAppend(&s, absl::StrFormat("    port %u %-7s %-10s %6.0f Gb/s  gid %s\n", p.port(), p.state(),
                                          p.link_layer(), p.rate_gbps(), p.gid().empty() ? "-" : p.gid()));
    }
  }
  return s;
}

}  // namespace epfabric::epctl
