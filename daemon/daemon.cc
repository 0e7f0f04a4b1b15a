#include "epfabric/daemon/daemon.h"

#include <cuda_runtime_api.h>
#include <errno.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <ctime>
#include <filesystem>
#include <thread>
#include <utility>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"
#include "epfabric/common/peer_auth.h"
#include "epfabric/common/status_macros.h"
#include "fabric/membership.h"
#include "fabric/peer_links.h"
#include "groups/group_manager.h"
#include "grpc/health/v1/health.pb.h"
#include "logging.h"
#include "memory/region.h"
#include "metrics/daemon_metrics.h"
#include "metrics/http_server.h"
#include "security/host_secret.h"
#include "security/peer_authenticator.h"
#include "services/client_listener.h"
#include "services/control_service.h"
#include "services/fd_channel.h"
#include "services/ops_service.h"
#include "services/peer_service.h"
#include "topology/system_files.h"
#include "topology/topology.h"
#include "transport/transport.h"

namespace epfabric::daemon {
namespace {

constexpr const char* kControlService = "epfabric.v1.Control";
constexpr const char* kOpsService = "epfabric.v1.Ops";
constexpr const char* kPeerService = "epfabric.v1.Peer";
// SERVING only while this daemon is part of a complete, healthy fabric: what a readiness probe should ask.
constexpr const char* kFabricHealth = "epfabric.v1.Fabric";

int VisibleGpuCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

// Makes `path` free for a new socket: removes a stale socket file nobody listens on; refuses a live one or a
// file that is not a socket.
absl::Status ClaimSocketPath(const std::string& path) {
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("--client_socket: cannot stat ", path, ": ", strerror(errno)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("--client_socket: ", path, " exists and is not a socket"));
  }
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket(): ", strerror(errno)));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  const bool live = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  if (live) {
    return absl::FailedPreconditionError(absl::StrCat("--client_socket: ", path, " is in use by a running daemon"));
  }
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::FailedPreconditionError(
        absl::StrCat("--client_socket: cannot remove stale ", path, ": ", strerror(errno)));
  }
  return absl::OkStatus();
}

uint64_t RandomIncarnation() {
  uint64_t value = 0;
  while (value == 0) {
    if (getrandom(&value, sizeof(value), 0) != sizeof(value)) value = 0;
  }
  return value;
}

void SetServing(grpc::Server* server, std::initializer_list<const char*> services, bool serving) {
  if (server == nullptr || server->GetHealthCheckService() == nullptr) return;
  for (const char* service : services) server->GetHealthCheckService()->SetServingStatus(service, serving);
}

// The fabric secret of the peer port: the operator's file; none when TLS or --insecure_peer_port is the credential;
// otherwise one made for the operator (security/host_secret.h): in memory for a single daemon, the host's shared file
// for a fabric of several daemons on loopback (ValidateOptions refused a secret-only port off loopback).
absl::StatusOr<std::string> PeerSecret(const DaemonOptions& options) {
  if (!options.fabric_secret_file.empty()) {
    return common::ReadFabricSecretFile(options.fabric_secret_file, "fabric_secret_file");
  }
  if (options.insecure_peer_port || !options.tls_cert.empty()) return std::string();
  if (options.world_size == 1) {
    Logger("daemon")->info("--world_size=1: no peer can call this daemon (its peer port refuses every call)");
    return security::RandomSecret();
  }
  const std::string path = security::HostFabricSecretPath(options.client_socket, options.fabric_id);
  EPF_ASSIGN_OR_RETURN(security::HostSecret host, security::LoadOrCreateHostFabricSecret(path));
  Logger("daemon")->info(
      "peer calls prove the host's fabric secret {} ({}; every daemon of fabric '{}' whose "
      "--client_socket is in that directory reads it)",
      path, host.created ? "created, mode 0600" : "read", options.fabric_id);
  return host.secret;
}

}  // namespace

absl::StatusOr<ResolvedBackend> ResolveBackend(BackendChoice choice, int device, int rank, int visible_gpus) {
  ResolvedBackend resolved;
  if (choice == BackendChoice::kHost || (choice == BackendChoice::kAuto && visible_gpus == 0)) {
    if (device >= 0 && choice == BackendChoice::kAuto) {
      return absl::FailedPreconditionError(absl::StrCat("--device: ", device, " given but no GPU is visible"));
    }
    return resolved;
  }
  if (visible_gpus == 0) return absl::FailedPreconditionError("--backend: cuda, but no CUDA device is visible");
  if (device >= visible_gpus) {
    return absl::FailedPreconditionError(
        absl::StrCat("--device: ", device, " is not in 0..", visible_gpus - 1, " (visible CUDA devices)"));
  }
  resolved.backend = v1::BACKEND_CUDA;
  resolved.device = device >= 0 ? device : rank % visible_gpus;
  return resolved;
}

struct Daemon::State {
  DaemonOptions options;
  ResolvedBackend backend;
  std::string socket_path;
  std::string fd_socket_path;
  std::string host_id;
  int64_t start_time_unix = 0;
  // CUDA/NVML/verbs discovery runs one at a time (ops calls are rare): DiscoverLocked requires it. It guards no
  // data of ours, only the libraries' global state.
  absl::Mutex topology_mutex;

  std::unique_ptr<fabric::PeerLinks> links;
  std::unique_ptr<memory::RegionAllocator> allocator;
  std::unique_ptr<transport::Transport> transport;  // before groups: outlives every group's transport
  std::unique_ptr<fabric::Membership> membership;
  std::unique_ptr<groups::GroupManager> groups;
  std::unique_ptr<FdChannel> fd_channel;  // declared after groups: stopped before the group manager goes
  ClientListener listener;
  std::unique_ptr<ControlService> control;
  std::unique_ptr<PeerService> peer;
  std::unique_ptr<OpsService> ops;       // client socket
  std::unique_ptr<OpsService> peer_ops;  // peer port: needs a member's or an ops credential
  std::unique_ptr<security::PeerAuthenticator> peer_auth;
  // Membership changes arrive on the fabric thread (or a peer handler) while Start may still be building the
  // servers. Once set, a server lives as long as the State, so a raw pointer read under the lock stays valid.
  mutable absl::Mutex servers_mutex;
  std::unique_ptr<grpc::Server> client_server ABSL_GUARDED_BY(servers_mutex);
  std::unique_ptr<grpc::Server> peer_server ABSL_GUARDED_BY(servers_mutex);

  absl::Mutex housekeeping_mutex;
  bool stopping ABSL_GUARDED_BY(housekeeping_mutex) = false;
  std::thread housekeeping;
  bool shut_down = false;  // Shutdown's own flag; Shutdown runs on one thread (main's, or the destructor's)

  // metrics (daemon/metrics): declared last, so that the endpoint stops before anything a scrape reads goes away.
  std::unique_ptr<metrics::DaemonMetrics> metrics;
  std::unique_ptr<metrics::HttpServer> metrics_http;  // set before it serves; null without --metrics_listen

  v1::DaemonInfo Info() const {
    v1::DaemonInfo info;
    info.set_rank(options.rank);
    info.set_world_size(options.world_size);
    info.set_backend(backend.backend);
    info.set_version(EPF_VERSION);
    info.set_device(backend.device);
    info.set_peer_address(membership->self().peer_address());
    info.set_client_socket(socket_path);
    info.set_pid(getpid());
    info.set_start_time_unix(start_time_unix);
    info.set_transport(transport->kind());
    info.set_data_address(transport->data_address());
    if (metrics_http != nullptr) info.set_metrics_address(metrics_http->address());
    return info;
  }

  v1::Topology Topology() {
    const v1::DaemonInfo info = Info();
    absl::MutexLock lock(&topology_mutex);
    return DiscoverLocked(info);
  }

  v1::Topology DiscoverLocked(const v1::DaemonInfo& info) ABSL_EXCLUSIVE_LOCKS_REQUIRED(topology_mutex) {
    return topology::DiscoverTopology(options.system_root, options.host_id, info);
  }

  v1::FabricView Fabric() const {
    v1::FabricView view;
    view.set_fabric_id(options.fabric_id);
    view.set_self_rank(options.rank);
    *view.mutable_membership() = membership->View();
    view.set_degraded(membership->Degraded());
    view.set_join_refused(membership->JoinRefusal());
    view.set_coordinator_unverified(membership->CoordinatorUnverified());
    // Keep the response alive for the loop: a range-for over a member of a temporary dangles (before C++23).
    v1::ListGroupsResponse listed = groups->ListGroups();
    for (v1::GroupInfo& group : *listed.mutable_groups()) *view.add_groups() = std::move(group);
    return view;
  }

  // Both servers (either may be null).
  std::pair<grpc::Server*, grpc::Server*> Servers() const ABSL_LOCKS_EXCLUDED(servers_mutex) {
    absl::MutexLock lock(&servers_mutex);
    return {client_server.get(), peer_server.get()};
  }

  void OnMembership(const v1::Membership& view, bool degraded) {
    groups->OnMembership(view);
    if (metrics != nullptr) metrics->OnMembership(view);  // metrics hook
    const bool self_up = view.members(options.rank).state() == v1::MEMBER_STATE_UP;
    absl::MutexLock lock(&servers_mutex);
    for (grpc::Server* server : {client_server.get(), peer_server.get()}) {
      SetServing(server, {kFabricHealth}, self_up && !degraded);
    }
  }
};

namespace {

// The default --max_total_region_bytes: half the machine's memory for host regions (they are shared memory; the
// daemons of the other GPUs and the tenants need the rest), 90% of the GPU's memory for device regions.
uint64_t DefaultRegionBudget(v1::Backend backend, int device, const std::string& system_root) {
  if (backend == v1::BACKEND_CUDA) {
    for (const v1::Gpu& gpu : topology::DiscoverGpus(system_root)) {
      if (gpu.ordinal() == device && gpu.memory_bytes() > 0) return gpu.memory_bytes() / 10 * 9;
    }
  }
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return 0;  // unknown: no limit of ours
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size) / 2;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& options) {
  auto state = std::make_unique<State>();
  State* s = state.get();
  s->options = options;
  s->start_time_unix = std::time(nullptr);
  s->socket_path = std::filesystem::absolute(options.client_socket).string();
  s->fd_socket_path = FdSocketPath(s->socket_path);
  s->host_id = topology::ReadHostId(options.system_root, options.host_id);

  EPF_ASSIGN_OR_RETURN(s->backend, ResolveBackend(options.backend, options.device, options.rank, VisibleGpuCount()));
  if (s->backend.backend == v1::BACKEND_CUDA) {
    const cudaError_t err = cudaSetDevice(s->backend.device);
    if (err != cudaSuccess) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot use CUDA device ", s->backend.device, ": ", cudaGetErrorString(err)));
    }
  }

  EPF_ASSIGN_OR_RETURN(const std::string secret, PeerSecret(options));
  fabric::TlsFiles tls{options.tls_cert, options.tls_key, options.tls_ca, options.tls_target_name};
  EPF_ASSIGN_OR_RETURN(s->links,
                       fabric::PeerLinks::Create(tls, secret, options.fabric_id,
                                                 common::PeerProofClaim{common::PeerRole::kMember, options.rank}));
  security::PeerAuthConfig auth_config;
  auth_config.fabric_id = options.fabric_id;
  auth_config.secret = secret;
  auth_config.mutual_tls = s->links->tls();
  auth_config.insecure = options.insecure_peer_port;
  auth_config.ranks_per_pod = options.ranks_per_pod;
  s->peer_auth = std::make_unique<security::PeerAuthenticator>(std::move(auth_config));
  if (!s->links->tls() && secret.empty()) {
    Logger("daemon")->warn("the peer port {} accepts every caller (--insecure_peer_port): tests only",
                           options.peer_listen);
  }

  if (s->backend.backend == v1::BACKEND_CUDA) {
    s->allocator = memory::MakeCudaAllocator(
        s->backend.device,
        options.memory_sharing == "cuda_ipc" ? v1::MEMORY_SHARING_CUDA_IPC : v1::MEMORY_SHARING_POSIX_FD,
        options.max_region_bytes);
  } else {
    s->allocator =
        memory::MakeHostAllocator(absl::StrCat(options.fabric_id, ".d", options.rank), options.max_region_bytes);
  }

  EPF_ASSIGN_OR_RETURN(const HostPort peer_listen, ParseHostPort(options.peer_listen));
  {
    transport::TransportOptions transport_options;
    // auto: verbs only when a device can register the regions; the socket wire otherwise.
    transport_options.kind = options.transport == "verbs"    ? v1::TRANSPORT_VERBS
                             : options.transport == "socket" ? v1::TRANSPORT_SOCKET
                                                             : v1::TRANSPORT_UNSPECIFIED;
    transport_options.device = s->backend.backend == v1::BACKEND_CUDA ? s->backend.device : -1;
    transport_options.socket.listen = !options.data_listen.empty() ? options.data_listen
                                                                   : (peer_listen.host.find(':') != std::string::npos
                                                                          ? absl::StrCat("[", peer_listen.host, "]:0")
                                                                          : absl::StrCat(peer_listen.host, ":0"));
    transport_options.proxy.threads = options.proxy_threads;
    transport_options.proxy.spin = absl::Microseconds(options.proxy_spin_us);
    transport_options.proxy.max_sleep = absl::Microseconds(options.proxy_max_sleep_us);
    transport_options.name_prefix = absl::StrCat(options.fabric_id, ".d", options.rank);
    EPF_ASSIGN_OR_RETURN(s->transport, transport::Transport::Start(transport_options));
  }

  fabric::FabricConfig fabric_config;
  fabric_config.fabric_id = options.fabric_id;
  fabric_config.rank = options.rank;
  fabric_config.world_size = options.world_size;
  fabric_config.coordinator = options.coordinator;
  fabric_config.heartbeat_interval = absl::Milliseconds(options.heartbeat_ms);
  fabric_config.heartbeat_misses = options.heartbeat_misses;
  v1::MemberInfo self;
  self.set_rank(options.rank);
  self.set_host_id(s->host_id);
  self.set_backend(s->backend.backend);
  self.set_version(EPF_VERSION);
  self.set_incarnation(RandomIncarnation());
  self.set_state(v1::MEMBER_STATE_UP);
  self.set_fd_socket(s->fd_socket_path);
  self.set_transport(s->transport->kind());
  self.set_data_address(s->transport->data_address());
  if (s->backend.backend == v1::BACKEND_CUDA) {
    for (const v1::Gpu& gpu : topology::DiscoverGpus(options.system_root)) {
      if (gpu.ordinal() == s->backend.device) self.set_gpu_uuid(gpu.uuid());
    }
  }
  s->membership = std::make_unique<fabric::Membership>(fabric_config, self, s->links.get());
  groups::LeaseLimits lease_limits;
  lease_limits.default_ttl = absl::Milliseconds(options.lease_ttl_ms);
  groups::GroupLimits group_limits{static_cast<size_t>(options.max_groups), options.max_total_region_bytes};
  if (group_limits.max_total_region_bytes == 0) {
    group_limits.max_total_region_bytes =
        DefaultRegionBudget(s->backend.backend, s->backend.device, options.system_root);
  } else if (group_limits.max_total_region_bytes == UINT64_MAX) {
    group_limits.max_total_region_bytes = 0;  // none of ours
  }
  groups::ClientQuotas client_quotas{static_cast<size_t>(options.max_groups_per_client),
                                     options.max_region_bytes_per_client != 0
                                         ? options.max_region_bytes_per_client
                                         : group_limits.max_total_region_bytes / 2};
  Logger("daemon")->info(
      "regions: at most {} bytes in all (--max_total_region_bytes{}); per client {} groups, {} bytes "
      "per member",
      group_limits.max_total_region_bytes, options.max_total_region_bytes == 0 ? ", derived" : "",
      client_quotas.max_groups, client_quotas.max_region_bytes);
  s->groups = std::make_unique<groups::GroupManager>(s->membership.get(), s->links.get(), s->allocator.get(),
                                                     lease_limits, group_limits, s->transport.get(), client_quotas);
  s->membership->SetChangeListener([s](const v1::Membership& view, bool degraded) { s->OnMembership(view, degraded); });
  s->membership->SetJoinObserver([s](const v1::JoinRequest& request) { s->groups->Adopt(request); });
  s->membership->SetLocalGroups([s] { return s->groups->LocalRecords(); });

  s->fd_channel = std::make_unique<FdChannel>(s->groups.get());
  ClientNaming naming;
  naming.host_id = s->host_id;
  EPF_ASSIGN_OR_RETURN(naming.tenant_of_uid, ParseTenantLabels(options.tenant_labels));
  s->control = std::make_unique<ControlService>(s->groups.get(), &s->listener, std::move(naming));
  s->peer = std::make_unique<PeerService>(s->membership.get(), s->groups.get(), s->peer_auth.get());
  // metrics: read through the owners' accessors at scrape time.
  s->metrics = std::make_unique<metrics::DaemonMetrics>([s] {
    metrics::DaemonSnapshot snapshot;
    snapshot.info = s->Info();
    snapshot.fabric = s->Fabric();
    snapshot.coordinator_reachable = s->membership->CoordinatorReachable();
    snapshot.clients = s->groups->Clients();
    snapshot.heartbeats_missed = s->membership->HeartbeatsMissed();
    snapshot.fd_connections_refused = s->fd_channel->ConnectionsRefused();
    snapshot.fd_requests_refused = s->fd_channel->RequestsRefused();
    for (const auto& [group, counters] : s->groups->TransportCounters()) {
      snapshot.transport_groups.push_back(
          {group, counters.executed, counters.refused, counters.failed, counters.skipped});
    }
    snapshot.datapath_groups = s->groups->DataPathStats();
    snapshot.expert_series = s->options.metrics_expert_series;
    const transport::SocketWireCounters wire = s->transport->socket_counters();
    snapshot.data_handshakes_refused = wire.handshakes_refused;
    snapshot.data_frames_refused = wire.frames_refused;
    snapshot.data_connections_refused = wire.connections_refused;
    snapshot.data_frames_applied = wire.frames_applied;
    return snapshot;
  });
  OpsProviders providers;
  providers.stats = [s](const v1::GetStatsRequest& request) {
    return s->metrics->Stats(request, std::time(nullptr) - s->start_time_unix);
  };
  providers.topology = [s] { return s->Topology(); };
  providers.fabric = [s] { return s->Fabric(); };
  providers.health = [s] { return BuildHealthReport(s->Fabric(), s->membership->CoordinatorReachable()); };
  providers.clients = [s] { return s->groups->Clients(); };
  s->peer_ops = std::make_unique<OpsService>(providers, s->peer_auth.get());
  providers.caller_uid = [s](const grpc::ServerContext& context) -> int64_t {
    auto credentials = s->listener.Lookup(context.peer());
    return credentials ? static_cast<int64_t>(credentials->uid) : -1;
  };
  s->ops = std::make_unique<OpsService>(std::move(providers));

  EPF_RETURN_IF_ERROR(ClaimSocketPath(s->socket_path));
  EPF_RETURN_IF_ERROR(ClaimSocketPath(s->fd_socket_path));
  if (!options.metrics_listen.empty()) {
    // Bound before the gRPC servers (a failure leaves nothing behind); served once the address is recorded.
    EPF_ASSIGN_OR_RETURN(s->metrics_http,
                         metrics::HttpServer::Bind(options.metrics_listen, [s] { return s->metrics->Render(); }));
    s->metrics_http->Serve();
  }
  grpc::EnableDefaultHealthCheckService(true);
  // gRPC's own health service carries no protobuf descriptor: linking ours registers grpc.health.v1.Health in the
  // generated pool, so that reflection can describe it and the metrics count its calls under its service name.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  // Peer server first: its port becomes part of this daemon's identity in the fabric.
  const HostPort& listen = peer_listen;
  {
    grpc::ServerBuilder builder;
    int selected_port = 0;
    builder.AddListeningPort(options.peer_listen, s->links->ServerCredentials(), &selected_port);
    // gRPC sets SO_REUSEPORT by default: a second process (another daemon, or a same-uid impostor) could then bind
    // this port too and take a share of the connections. Without it, a taken port fails the bind.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.RegisterService(s->peer.get());
    builder.RegisterService(s->peer_ops.get());
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(s->metrics->InterceptorFactory("peer"));
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
    grpc::Server* peer_server = nullptr;
    {
      absl::MutexLock lock(&s->servers_mutex);
      s->peer_server = builder.BuildAndStart();
      peer_server = s->peer_server.get();
    }
    if (peer_server == nullptr || selected_port == 0) {
      return absl::UnavailableError(absl::StrCat("--peer_listen: cannot listen on ", options.peer_listen,
                                                 " (is another process listening on that port?)"));
    }
    const bool ipv6 = listen.host.find(':') != std::string::npos;
    s->peer_auth->SetAudience(absl::StrCat(selected_port));
    s->membership->SetPeerAddress(ipv6 ? absl::StrCat("[", listen.host, "]:", selected_port)
                                       : absl::StrCat(listen.host, ":", selected_port));
    SetServing(peer_server, {"", kPeerService, kOpsService}, true);
    SetServing(peer_server, {kFabricHealth}, false);
  }

  // Client server: no listening port of gRPC's own; ClientListener accepts and hands connections over.
  {
    grpc::ServerBuilder builder;
    // A client connection with no call for 10 minutes is closed (a lease's keep-alives come every TTL/3, at most
    // 100 s apart); gRPC clients reconnect on their next call.
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, 10 * 60 * 1000);
    builder.RegisterService(s->control.get());
    builder.RegisterService(s->ops.get());
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(s->metrics->InterceptorFactory("client"));
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
    grpc::Server* client_server = nullptr;
    grpc::Server* peer_server = nullptr;
    {
      absl::MutexLock lock(&s->servers_mutex);
      s->client_server = builder.BuildAndStart();
      client_server = s->client_server.get();
      peer_server = s->peer_server.get();
    }
    if (client_server == nullptr) return absl::InternalError("cannot start the client gRPC server");
    // The fd side channel first: a client that finds the gRPC socket finds its neighbour too.
    absl::Status started = s->fd_channel->Start(s->fd_socket_path, options.client_socket_mode);
    if (started.ok()) started = s->listener.Start(s->socket_path, options.client_socket_mode, client_server);
    if (!started.ok()) {
      peer_server->Shutdown();
      client_server->Shutdown();
      return started;
    }
    SetServing(client_server, {"", kControlService, kOpsService}, true);
    SetServing(client_server, {kFabricHealth}, false);
  }

  s->membership->Start();
  s->housekeeping = std::thread([s] {
    while (true) {
      {
        absl::MutexLock lock(&s->housekeeping_mutex);
        if (s->housekeeping_mutex.AwaitWithTimeout(absl::Condition(&s->stopping), absl::Milliseconds(200))) return;
      }
      s->groups->ExpireLeases(absl::Now());  // zeroes regions: no lock of ours is held
      s->groups->CleanUpFailedCreates(absl::Now());
      s->groups->RetryLeaseNotifications(absl::Now());
    }
  });

  Logger("daemon")->info(
      "epfabricd {} rank {}/{} fabric '{}' backend {} device {}: clients on unix:{} and unix:{} (mode {:o}), "
      "peers on {}{}; transport {}{}",
      EPF_VERSION, options.rank, options.world_size, options.fabric_id, v1::Backend_Name(s->backend.backend),
      s->backend.device, s->socket_path, s->fd_socket_path, options.client_socket_mode,
      s->membership->self().peer_address(), s->links->tls() ? " (mutual TLS)" : "", s->transport->Describe(),
      s->metrics_http != nullptr ? absl::StrCat(", metrics on http://", s->metrics_http->address(), "/metrics") : "");
  return std::unique_ptr<Daemon>(new Daemon(std::move(state)));
}

Daemon::Daemon(std::unique_ptr<State> state) : state_(std::move(state)) {}

Daemon::~Daemon() { Shutdown(absl::Seconds(1)); }

void Daemon::Shutdown(absl::Duration grace) {
  if (state_ == nullptr || state_->shut_down) return;
  State* s = state_.get();
  s->shut_down = true;
  auto log = Logger("daemon");
  log->info("shutting down (grace {} ms)", absl::ToInt64Milliseconds(grace));
  const auto deadline = absl::ToChronoTime(absl::Now() + grace);
  // Probes see NOT_SERVING first; no new clients; then the fabric loop stops and the servers drain against one
  // common deadline. Memory is freed last, when nothing can use it any more.
  const auto [client_server, peer_server] = s->Servers();
  for (grpc::Server* server : {client_server, peer_server}) {
    if (server != nullptr && server->GetHealthCheckService() != nullptr) server->GetHealthCheckService()->Shutdown();
  }
  if (s->metrics_http != nullptr) s->metrics_http->Stop();
  s->listener.Stop();
  s->fd_channel->Stop();
  s->membership->Stop();
  {
    absl::MutexLock lock(&s->housekeeping_mutex);
    s->stopping = true;
  }
  if (s->housekeeping.joinable()) s->housekeeping.join();
  for (grpc::Server* server : {client_server, peer_server}) {
    if (server != nullptr) server->Shutdown(deadline);
  }
  for (grpc::Server* server : {client_server, peer_server}) {
    if (server != nullptr) server->Wait();
  }
  s->groups.reset();
  s->transport.reset();
  log->info("stopped");
}

std::string Daemon::peer_address() const { return state_->membership->self().peer_address(); }
const ResolvedBackend& Daemon::backend() const { return state_->backend; }

}  // namespace epfabric::daemon
