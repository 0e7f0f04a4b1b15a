#include "epfabric/daemon/daemon.h"

#include <cuda_runtime_api.h>
#include <errno.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <ctime>
#include <filesystem>
#include <mutex>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"
#include "epfabric/v1/control.grpc.pb.h"
#include "epfabric/v1/peer.grpc.pb.h"
#include "logging.h"
#include "services/ops_service.h"
#include "topology/topology.h"

namespace epfabric::daemon {
namespace {

constexpr const char* kControlService = "epfabric.v1.Control";
constexpr const char* kOpsService = "epfabric.v1.Ops";
constexpr const char* kPeerService = "epfabric.v1.Peer";

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

void SetServing(grpc::Server& server, std::initializer_list<const char*> services) {
  grpc::HealthCheckServiceInterface* health = server.GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus("", true);
  for (const char* service : services) health->SetServingStatus(service, true);
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
  std::string peer_address;
  int64_t start_time_unix = 0;
  std::mutex topology_mutex;  // CUDA/NVML/verbs discovery is not re-entrant-friendly; ops calls are rare

  State() : ops([this] { return Topology(); }) {}

  OpsService ops;
  v1::Control::Service control;  // all methods UNIMPLEMENTED until the attach work lands
  v1::Peer::Service peer;        // all methods UNIMPLEMENTED until the fabric work lands
  std::unique_ptr<grpc::Server> client_server;
  std::unique_ptr<grpc::Server> peer_server;
  bool shut_down = false;

  v1::Topology Topology() {
    v1::DaemonInfo info;
    info.set_rank(options.rank);
    info.set_world_size(options.world_size);
    info.set_backend(backend.backend);
    info.set_version(EPF_VERSION);
    info.set_device(backend.device);
    info.set_peer_address(peer_address);
    info.set_client_socket(socket_path);
    info.set_pid(getpid());
    info.set_start_time_unix(start_time_unix);
    std::lock_guard<std::mutex> lock(topology_mutex);
    return topology::DiscoverTopology(options.system_root, options.host_id, info);
  }
};

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& options) {
  auto log = Logger("daemon");
  auto state = std::make_unique<State>();
  state->options = options;
  state->start_time_unix = std::time(nullptr);
  state->socket_path = std::filesystem::absolute(options.client_socket).string();

  auto backend = ResolveBackend(options.backend, options.device, options.rank, VisibleGpuCount());
  if (!backend.ok()) return backend.status();
  state->backend = *backend;
  if (state->backend.backend == v1::BACKEND_CUDA) {
    const cudaError_t err = cudaSetDevice(state->backend.device);
    if (err != cudaSuccess) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot use CUDA device ", state->backend.device, ": ", cudaGetErrorString(err)));
    }
  }
  if (absl::Status claimed = ClaimSocketPath(state->socket_path); !claimed.ok()) return claimed;

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  // Client server: Control + Ops on the Unix socket. The socket file is created with the requested mode (umask
  // covers the window between bind and chmod).
  {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(absl::StrCat("unix:", state->socket_path), grpc::InsecureServerCredentials());
    builder.RegisterService(&state->control);
    builder.RegisterService(&state->ops);
    const mode_t old_umask = umask(~options.client_socket_mode & 0777);
    state->client_server = builder.BuildAndStart();
    umask(old_umask);
    if (state->client_server == nullptr) {
      return absl::UnavailableError(absl::StrCat("--client_socket: cannot listen on ", state->socket_path));
    }
    if (chmod(state->socket_path.c_str(), options.client_socket_mode) != 0) {
      state->client_server->Shutdown();
      unlink(state->socket_path.c_str());
      return absl::InternalError(absl::StrCat("chmod ", state->socket_path, ": ", strerror(errno)));
    }
    SetServing(*state->client_server, {kControlService, kOpsService});
  }

  // Peer server: Peer + Ops on TCP.
  {
    auto listen = ParseHostPort(options.peer_listen);
    if (!listen.ok()) return listen.status();
    grpc::ServerBuilder builder;
    int selected_port = 0;
    builder.AddListeningPort(options.peer_listen, grpc::InsecureServerCredentials(), &selected_port);
    builder.RegisterService(&state->peer);
    builder.RegisterService(&state->ops);
    state->peer_server = builder.BuildAndStart();
    if (state->peer_server == nullptr || selected_port == 0) {
      state->client_server->Shutdown();
      unlink(state->socket_path.c_str());
      return absl::UnavailableError(absl::StrCat("--peer_listen: cannot listen on ", options.peer_listen));
    }
    const bool ipv6 = listen->host.find(':') != std::string::npos;
    state->peer_address =
        ipv6 ? absl::StrCat("[", listen->host, "]:", selected_port) : absl::StrCat(listen->host, ":", selected_port);
    SetServing(*state->peer_server, {kPeerService, kOpsService});
  }

  log->info("epfabricd {} rank {}/{} backend {} device {}: clients on unix:{} (mode {:o}), peers on {}", EPF_VERSION,
            options.rank, options.world_size, v1::Backend_Name(state->backend.backend), state->backend.device,
            state->socket_path, options.client_socket_mode, state->peer_address);
  return std::unique_ptr<Daemon>(new Daemon(std::move(state)));
}

Daemon::Daemon(std::unique_ptr<State> state) : state_(std::move(state)) {}

Daemon::~Daemon() { Shutdown(absl::Seconds(1)); }

void Daemon::Shutdown(absl::Duration grace) {
  if (state_ == nullptr || state_->shut_down) return;
  state_->shut_down = true;
  auto log = Logger("daemon");
  log->info("shutting down (grace {} ms)", absl::ToInt64Milliseconds(grace));
  // Probes see NOT_SERVING first; then both servers stop accepting and drain against one common deadline.
  for (grpc::Server* server : {state_->client_server.get(), state_->peer_server.get()}) {
    if (server != nullptr && server->GetHealthCheckService() != nullptr) server->GetHealthCheckService()->Shutdown();
  }
  const auto deadline = absl::ToChronoTime(absl::Now() + grace);
  for (grpc::Server* server : {state_->client_server.get(), state_->peer_server.get()}) {
    if (server != nullptr) server->Shutdown(deadline);
  }
  for (grpc::Server* server : {state_->client_server.get(), state_->peer_server.get()}) {
    if (server != nullptr) server->Wait();
  }
  if (unlink(state_->socket_path.c_str()) != 0 && errno != ENOENT) {
    log->warn("cannot remove {}: {}", state_->socket_path, strerror(errno));
  }
  log->info("stopped");
}

const std::string& Daemon::peer_address() const { return state_->peer_address; }
const ResolvedBackend& Daemon::backend() const { return state_->backend; }

}  // namespace epfabric::daemon
