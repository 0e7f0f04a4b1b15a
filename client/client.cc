#include "epfabric/client/client.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "epfabric/common/fd_passing.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/kernels/datapath_stats.h"
#include "epfabric/proto/grpc_status.h"
#include "epfabric/v1/control.grpc.pb.h"
#include "epfabric/v1/fdchannel.pb.h"
#include "epfabric/v1/ops.grpc.pb.h"
#include "lease_state.h"
#include "memory/region_import.h"

namespace epfabric::client {
namespace {

using common::UniqueFd;
using internal::Annotate;
using internal::DeadlineIn;
using memory::MappedRegion;

// The daemon serves its fd side channel here (daemon/services/fd_channel.h).
std::string FdSocketNextTo(const std::string& client_socket) { return client_socket + ".fds"; }

absl::StatusOr<UniqueFd> ConnectUnix(const std::string& path) {
  sockaddr_un address{};
  if (path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("socket path '", path, "' is longer than ", sizeof(address.sun_path) - 1, " bytes"));
  }
  UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return absl::InternalError(absl::StrCat("socket(AF_UNIX): ", std::strerror(errno)));
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  // A Unix stream connect completes or fails at once (EAGAIN only when the backlog is full).
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    const int error = errno;
    const absl::StatusCode code = error == ENOENT   ? absl::StatusCode::kNotFound
                                  : error == EACCES ? absl::StatusCode::kPermissionDenied
                                                    : absl::StatusCode::kUnavailable;
    return absl::Status(code, absl::StrCat("connect to ", path, ": ", std::strerror(error)));
  }
  return fd;
}

// Sharing kinds whose memory is a file descriptor handed out by the owning daemon's side channel (the group token
// gates it): cuMem allocations (POSIX_FD) and host memfds (POSIX_SHM). CUDA_IPC needs only the descriptor.
bool SharedAsFd(v1::MemorySharing sharing) {
  return sharing == v1::MEMORY_SHARING_POSIX_FD || sharing == v1::MEMORY_SHARING_POSIX_SHM;
}

struct FetchedRegion {
  v1::RegionDescriptor descriptor;
  UniqueFd fd;  // POSIX_FD and POSIX_SHM (host memfd)
  bool holds_lease = false;
};

// One request/response exchange on a side-channel connection.
absl::StatusOr<FetchedRegion> FetchRegion(int connection, const v1::FdRequest& request, absl::Duration timeout) {
  if (absl::Status sent = common::SendFds(connection, {}, request.SerializeAsString(), timeout); !sent.ok()) {
    return sent;
  }
  EPF_ASSIGN_OR_RETURN(auto message, common::ReceiveFds(connection, timeout, /*max_fds=*/1));
  v1::FdResponse response;
  if (!response.ParseFromString(message.payload)) {
    return absl::InternalError("the daemon's answer is not an epfabric.v1.FdResponse");
  }
  if (response.code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(response.code()), response.message());
  }
  FetchedRegion fetched;
  fetched.descriptor = response.region();
  fetched.holds_lease = response.holds_lease();
  if (fetched.descriptor.rank() != request.rank() || fetched.descriptor.kind() != request.kind()) {
    return absl::InternalError(absl::StrCat("asked for rank ", request.rank(), " ",
                                            v1::RegionDescriptor::Kind_Name(request.kind()),
                                            ", the daemon described rank ", fetched.descriptor.rank(), " ",
                                            v1::RegionDescriptor::Kind_Name(fetched.descriptor.kind())));
  }
  const bool wants_fd = SharedAsFd(fetched.descriptor.sharing());
  if (wants_fd != (message.fds.size() == 1)) {
    return absl::InternalError(absl::StrCat("a ", v1::MemorySharing_Name(fetched.descriptor.sharing()),
                                            " region arrived with ", message.fds.size(), " file descriptors"));
  }
  if (wants_fd) fetched.fd = std::move(message.fds[0]);
  return fetched;
}

}  // namespace

// ---------------------------------------------------------------- Client

struct Client::State {
  std::string socket_path;
  ConnectOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::shared_ptr<v1::Control::Stub> stub;

  // Where this process reaches the fd socket that a daemon announced as `announced`.
  std::string PeerFdSocket(const std::string& announced) const {
    if (options.fd_socket_directory.empty()) return announced;
    return (std::filesystem::path(options.fd_socket_directory) / std::filesystem::path(announced).filename()).string();
  }
};

Client::Client(std::unique_ptr<State> state) : state_(std::move(state)) {}
Client::~Client() = default;

const std::string& Client::socket_path() const { return state_->socket_path; }

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& socket_path, ConnectOptions options) {
  struct stat st {};
  if (stat(socket_path.c_str(), &st) != 0) {
    const int error = errno;
    return absl::Status(error == EACCES ? absl::StatusCode::kPermissionDenied : absl::StatusCode::kNotFound,
                        absl::StrCat("socket_path: '", socket_path, "': ", std::strerror(error)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("socket_path: '", socket_path, "' is not a socket"));
  }
  // A socket file left by a daemon that is gone refuses a connection at once; gRPC would keep retrying until the
  // timeout (the chaos test saw the full 5 s). One plain connect tells them apart.
  if (absl::StatusOr<UniqueFd> probe = ConnectUnix(socket_path); !probe.ok()) {
    return absl::Status(probe.status().code(),
                        absl::StrCat("no daemon listens on ", socket_path, " (", probe.status().message(), ")"));
  }
  auto state = std::make_unique<State>();
  state->socket_path = socket_path;
  state->options = std::move(options);
  grpc::ChannelArguments arguments;
  // A connection of our own, not one shared with other Clients of this process through gRPC's global pool.
  arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  state->channel = grpc::CreateCustomChannel("unix:" + socket_path, grpc::InsecureChannelCredentials(), arguments);
  if (!state->channel->WaitForConnected(DeadlineIn(state->options.timeout))) {
    return absl::UnavailableError(
        absl::StrCat("no daemon answers on ", socket_path, " within ", absl::FormatDuration(state->options.timeout)));
  }
  state->stub = v1::Control::NewStub(state->channel);
  return std::unique_ptr<Client>(new Client(std::move(state)));
}

absl::StatusOr<v1::CreateGroupResponse> Client::CreateGroup(const v1::CreateGroupRequest& request) {
  const State& c = *state_;
  grpc::ClientContext context;
  // Creating a group allocates on every member and may take longer than one control call.
  context.set_deadline(DeadlineIn(std::max(c.options.timeout, absl::Seconds(30))));
  v1::CreateGroupResponse response;
  const grpc::Status status = c.stub->CreateGroup(&context, request, &response);
  if (!status.ok()) {
    return Annotate(FromGrpcStatus(status), absl::StrCat("create group '", request.name(), "' on ", c.socket_path));
  }
  return response;
}

absl::StatusOr<v1::Topology> Client::GetTopology() {
  const State& c = *state_;
  grpc::ClientContext context;
  context.set_deadline(DeadlineIn(c.options.timeout));
  v1::Topology topology;
  const grpc::Status status = v1::Ops::NewStub(c.channel)->GetTopology(&context, v1::GetTopologyRequest(), &topology);
  if (!status.ok()) return Annotate(FromGrpcStatus(status), absl::StrCat("topology of ", c.socket_path));
  return topology;
}

absl::StatusOr<v1::DaemonInfo> Client::GetDaemonInfo() {
  EPF_ASSIGN_OR_RETURN(v1::Topology topology, GetTopology());
  return std::move(*topology.mutable_daemon());
}

absl::Status Client::DeleteGroup(const std::string& group, const std::string& token) {
  const State& c = *state_;
  grpc::ClientContext context;
  context.set_deadline(DeadlineIn(std::max(c.options.timeout, absl::Seconds(30))));
  v1::DeleteGroupRequest request;
  request.set_name(group);
  request.set_token(token);
  v1::DeleteGroupResponse response;
  const grpc::Status status = c.stub->DeleteGroup(&context, request, &response);
  if (!status.ok()) return Annotate(FromGrpcStatus(status), absl::StrCat("delete group '", group, "'"));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Lease>> Client::Attach(const std::string& group, int rank, const std::string& token,
                                                      AttachOptions options) {
  const State& c = *state_;
  const std::string what = absl::StrCat("attach to group '", group, "' rank ", rank, " on ", c.socket_path);
  v1::AttachRequest request;
  request.set_group(group);
  request.set_rank(rank);
  request.set_token(token);
  request.set_client_name(c.options.client_name);
  request.set_lease_ttl_ms(static_cast<uint32_t>(
      std::clamp<int64_t>(absl::ToInt64Milliseconds(options.lease_ttl), 0, std::numeric_limits<uint32_t>::max())));
  auto s = std::make_unique<Lease::State>();
  s->stub = c.stub;
  s->socket_path = c.socket_path;
  s->timeout = c.options.timeout;
  {
    grpc::ClientContext context;
    context.set_deadline(DeadlineIn(c.options.timeout));
    const grpc::Status status = c.stub->Attach(&context, request, &s->attach);
    if (!status.ok()) return Annotate(FromGrpcStatus(status), what);
  }
  const v1::AttachResponse& attach = s->attach;
  // From here on a failure gives the lease back, so that the rank can be attached again at once.
  absl::Cleanup release = [&c, &attach] {
    grpc::ClientContext context;
    context.set_deadline(DeadlineIn(c.options.timeout));
    v1::DetachRequest detach;
    detach.set_lease_id(attach.lease_id());
    v1::DetachResponse response;
    (void)c.stub->Detach(&context, detach, &response);
  };
  s->ttl = absl::Milliseconds(attach.lease_ttl_ms());
  s->nvl_ranks.assign(attach.nvl_ranks().begin(), attach.nvl_ranks().end());
  std::sort(s->nvl_ranks.begin(), s->nvl_ranks.end());
  {
    absl::MutexLock lock(&s->mutex);  // not shared yet, but the fields are guarded: say so
    s->group_state = attach.group().state();
    s->epoch = attach.epoch();
  }
  if (attach.world_size() <= 0 || attach.rank() != rank) {
    return absl::InternalError(
        absl::StrCat(what, ": the daemon answered rank ", attach.rank(), " of world size ", attach.world_size()));
  }
  memory::ImportOptions import_options;
  import_options.accessing_device = options.accessing_device;
  absl::MutexLock lock(&s->mutex);  // nobody else sees the state yet; taken for the annotations
  s->nvl.resize(attach.world_size());
  s->nvl_descriptors.resize(attach.world_size());

  // The lease's own side channel: holds the lease (liveness) and brings this rank's own regions.
  const std::string own_fd_socket = FdSocketNextTo(c.socket_path);
  auto side_channel = ConnectUnix(own_fd_socket);
  if (!side_channel.ok()) return Annotate(side_channel.status(), absl::StrCat(what, ": fd side channel"));
  s->side_channel = std::move(*side_channel);
  // The uid the daemons run as (the one this process was pointed at): another rank's fd socket must be served by it
  // too before the group's token goes there (a process that bound a dead daemon's socket path is not).
  EPF_ASSIGN_OR_RETURN(const common::PeerCredentials own_daemon, common::GetPeerCredentials(s->side_channel.get()));
  // A request for one of this rank's own regions on its lease's side channel.
  auto own_request = [&](v1::RegionDescriptor::Kind kind) {
    v1::FdRequest fd_request;
    fd_request.set_group(group);
    fd_request.set_rank(rank);
    fd_request.set_kind(kind);
    fd_request.set_token(token);
    fd_request.set_lease_id(attach.lease_id());
    return fd_request;
  };
  auto map_own = [&](v1::RegionDescriptor::Kind kind) -> absl::StatusOr<std::pair<FetchedRegion, MappedRegion>> {
    auto fetched = FetchRegion(s->side_channel.get(), own_request(kind), c.options.timeout);
    if (!fetched.ok()) return Annotate(fetched.status(), absl::StrCat(what, ": fd side channel ", own_fd_socket));
    if (!fetched->holds_lease) {
      return absl::InternalError(absl::StrCat(what, ": the fd side channel did not take the lease"));
    }
    auto mapped = memory::ImportRegion(fetched->descriptor, fetched->fd.get(), import_options);
    if (!mapped.ok()) {
      return Annotate(mapped.status(),
                      absl::StrCat(what, ": mapping this rank's ", v1::RegionDescriptor::Kind_Name(kind), " region"));
    }
    return std::make_pair(std::move(*fetched), std::move(*mapped));
  };
  // This rank's host-memory regions beside the NVL one (command rings, counters page): registered with CUDA on the
  // cuda backend, so that kernels and asynchronous copies reach them.
  auto map_own_host = [&](v1::RegionDescriptor::Kind kind, const char* region) -> absl::StatusOr<MappedRegion> {
    memory::ImportOptions host_options = import_options;
    host_options.register_with_cuda = attach.backend() == v1::BACKEND_CUDA;
    auto fetched = FetchRegion(s->side_channel.get(), own_request(kind), c.options.timeout);
    if (!fetched.ok()) return Annotate(fetched.status(), absl::StrCat(what, ": fd side channel (", region, ")"));
    auto mapped = memory::ImportRegion(fetched->descriptor, fetched->fd.get(), host_options);
    if (!mapped.ok()) return Annotate(mapped.status(), absl::StrCat(what, ": mapping ", region));
    return std::move(*mapped);
  };
  EPF_ASSIGN_OR_RETURN(auto own, map_own(v1::RegionDescriptor::KIND_NVL));
  s->nvl_descriptors[rank] = std::move(own.first.descriptor);
  s->nvl[rank] = std::move(own.second);

  for (const v1::RegionDescriptor& descriptor : attach.regions()) {
    const int owner = descriptor.rank();
    if (owner < 0 || owner >= attach.world_size()) {
      return absl::InternalError(absl::StrCat(what, ": a region of rank ", owner, " is outside the group"));
    }
    if (owner == rank) {
      if (descriptor.kind() == v1::RegionDescriptor::KIND_RDMA) {
        EPF_ASSIGN_OR_RETURN(auto rdma, map_own(v1::RegionDescriptor::KIND_RDMA));
        s->rdma = std::move(rdma.second);
      } else if (descriptor.kind() == v1::RegionDescriptor::KIND_STATS) {
        // The data-path counters page: written here, read by the daemon; device totals are copied into it.
        EPF_ASSIGN_OR_RETURN(s->stats, map_own_host(v1::RegionDescriptor::KIND_STATS, "the counters page"));
      } else if (descriptor.kind() == v1::RegionDescriptor::KIND_COMMANDS) {
        // Read by the daemon's proxy; a cuda client's kernels write it.
        EPF_ASSIGN_OR_RETURN(s->commands, map_own_host(v1::RegionDescriptor::KIND_COMMANDS, "the command rings"));
      }
      continue;  // NVL mapped above
    }
    if (descriptor.kind() != v1::RegionDescriptor::KIND_NVL) continue;
    v1::RegionDescriptor peer = descriptor;
    UniqueFd peer_fd;
    if (SharedAsFd(descriptor.sharing())) {
      // The fd comes from the owning daemon's side channel, on a short connection that holds no lease.
      if (descriptor.fd_socket().empty()) {
        return absl::FailedPreconditionError(absl::StrCat(what, ": rank ", owner, "'s region is ",
                                                          v1::MemorySharing_Name(descriptor.sharing()),
                                                          " but its daemon announced no fd socket"));
      }
      const std::string path = c.PeerFdSocket(descriptor.fd_socket());
      auto connection = ConnectUnix(path);
      if (!connection.ok()) {
        return Annotate(connection.status(), absl::StrCat(what, ": fd socket of rank ", owner));
      }
      EPF_ASSIGN_OR_RETURN(const common::PeerCredentials server, common::GetPeerCredentials(connection->get()));
      if (server.uid != own_daemon.uid) {
        return absl::PermissionDeniedError(absl::StrCat(what, ": fd socket of rank ", owner, " ", path,
                                                        " is served by uid ", server.uid, ", not by the daemons' uid ",
                                                        own_daemon.uid, "; the token was not sent"));
      }
      v1::FdRequest fd_request;
      fd_request.set_group(group);
      fd_request.set_rank(owner);
      fd_request.set_kind(v1::RegionDescriptor::KIND_NVL);
      fd_request.set_token(token);
      auto fetched = FetchRegion(connection->get(), fd_request, c.options.timeout);
      if (!fetched.ok())
        return Annotate(fetched.status(), absl::StrCat(what, ": fd socket of rank ", owner, " ", path));
      peer = std::move(fetched->descriptor);
      peer_fd = std::move(fetched->fd);
    }
    auto mapped = memory::ImportRegion(peer, peer_fd.get(), import_options);
    if (!mapped.ok()) return Annotate(mapped.status(), absl::StrCat(what, ": mapping rank ", owner, "'s NVL region"));
    s->nvl_descriptors[owner] = std::move(peer);
    s->nvl[owner] = std::move(*mapped);
  }
  for (int nvl_rank : s->nvl_ranks) {
    if (nvl_rank < 0 || nvl_rank >= attach.world_size() || !s->nvl[nvl_rank].has_value()) {
      return absl::InternalError(absl::StrCat(what, ": same-host rank ", nvl_rank, " came without a region"));
    }
  }
  s->attach.clear_regions();  // they live in nvl_descriptors now
  std::move(release).Cancel();
  Lease::State* raw = s.get();
  if (options.keep_alive) raw->keep_alive = std::thread([raw] { raw->KeepAliveLoop(); });
  return std::unique_ptr<Lease>(new Lease(std::move(s)));
}

}  // namespace epfabric::client
