#include "services/fd_channel.h"

#include <errno.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "logging.h"

namespace epfabric::daemon {
namespace {

// How often blocked loops look at the stop flag.
constexpr int kPollMs = 100;

v1::FdResponse ErrorResponse(const absl::Status& status) {
  v1::FdResponse response;
  response.set_code(static_cast<int32_t>(status.code()));
  response.set_message(std::string(status.message()));
  return response;
}

std::string Describe(const common::PeerCredentials& peer) { return absl::StrCat("pid ", peer.pid, " uid ", peer.uid); }

}  // namespace

std::string FdSocketPath(const std::string& client_socket) { return client_socket + ".fds"; }

FdChannel::~FdChannel() { Stop(); }

absl::Status FdChannel::Start(const std::string& path, uint32_t mode) {
  path_ = path;
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("--client_socket: the fd side channel ", path, " is ", path.size(),
                                                   " bytes; Unix sockets allow at most ", sizeof(addr.sun_path) - 1,
                                                   " (shorten --client_socket)"));
  }
  listen_fd_.reset(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!listen_fd_.valid()) return absl::InternalError(absl::StrCat("socket(AF_UNIX): ", strerror(errno)));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  if (bind(listen_fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    listen_fd_.reset();
    return absl::UnavailableError(absl::StrCat("fd side channel: cannot bind ", path, ": ", strerror(err)));
  }
  // Nobody can connect before listen(), so setting the mode here leaves no window.
  if (chmod(path.c_str(), mode) != 0 || listen(listen_fd_.get(), 128) != 0) {
    const int err = errno;
    listen_fd_.reset();
    unlink(path.c_str());
    return absl::InternalError(absl::StrCat("fd side channel: ", path, ": ", strerror(err)));
  }
  wake_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd_.valid()) {
    const int err = errno;
    listen_fd_.reset();
    unlink(path.c_str());
    return absl::InternalError(absl::StrCat("fd side channel: eventfd: ", strerror(err)));
  }
  poll_thread_ = std::thread([this] { PollLoop(); });
  for (int i = 0; i < kWorkers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  return absl::OkStatus();
}

bool FdChannel::HasWorkOrStopping() const { return stopping_ || !ready_.empty(); }

bool FdChannel::stopping() const {
  absl::MutexLock lock(&mutex_);
  return stopping_;
}

void FdChannel::Wake() {
  const uint64_t one = 1;
  if (wake_fd_.valid()) (void)!write(wake_fd_.get(), &one, sizeof(one));
}

void FdChannel::Stop() {
  {
    absl::MutexLock lock(&mutex_);
    if (stopping_) return;
    stopping_ = true;
    // Wakes a worker stuck in a read or write of its connection; the channel leaves the leases alone when stopping.
    for (auto& connection : connections_) shutdown(connection->fd.get(), SHUT_RDWR);
  }
  Wake();
  if (poll_thread_.joinable()) poll_thread_.join();
  for (std::thread& worker : workers_) worker.join();
  workers_.clear();
  if (listen_fd_.valid()) {
    listen_fd_.reset();
    unlink(path_.c_str());
  }
  std::list<std::unique_ptr<Connection>> connections;
  {
    absl::MutexLock lock(&mutex_);
    connections.swap(connections_);
    ready_.clear();
  }
}

void FdChannel::Accept() {
  common::UniqueFd fd(accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
  if (!fd.valid()) {
    const int error = errno;
    if (error == EMFILE || error == ENFILE) reserve_.ShedOne(listen_fd_.get());
    int suppressed = 0;
    if (error != EINTR && error != EAGAIN && error != ECONNABORTED && refusal_warning_.ShouldLog(&suppressed)) {
      Logger("fdchannel")
          ->warn("accept on {}: {} ({} similar warnings suppressed)", path_, strerror(error), suppressed);
    }
    return;
  }
  auto credentials = common::GetPeerCredentials(fd.get());
  if (!credentials.ok()) {
    Logger("fdchannel")->warn("{}: dropping a connection: {}", path_, credentials.status().ToString());
    return;
  }
  std::string why;
  if (limits_.live() >= kMaxConnections) {
    absl::MutexLock lock(&mutex_);
    EvictOldestIdleLocked();
  }
  if (!limits_.Admit(fd.get(), credentials->uid, &why)) {
    connections_refused_.fetch_add(1, std::memory_order_relaxed);  // metrics hook
    int suppressed = 0;
    if (refusal_warning_.ShouldLog(&suppressed)) {
      Logger("fdchannel")
          ->warn("{}: refusing a connection from {}: {} ({} similar warnings suppressed)", path_,
                 Describe(*credentials), why, suppressed);
    }
    return;  // closes it
  }
  auto connection = std::make_unique<Connection>();
  connection->fd = std::move(fd);
  connection->peer = *credentials;
  connection->last_activity = absl::Now();
  Logger("fdchannel")->debug("connection from {}", Describe(connection->peer));
  absl::MutexLock lock(&mutex_);
  connections_.push_back(std::move(connection));
}

void FdChannel::EvictOldestIdleLocked() {
  for (auto it = connections_.begin(); it != connections_.end(); ++it) {
    Connection* connection = it->get();
    if (connection->busy || connection->finished || !connection->held_lease.empty()) continue;
    Logger("fdchannel")
        ->info("every connection slot is taken: closing the oldest connection without a lease ({})",
               Describe(connection->peer));
    // Reaped by the poller's next round (the connection may be in the round's poll set now); its slot is free now.
    shutdown(connection->fd.get(), SHUT_RDWR);
    connection->finished = true;
    limits_.Release(connection->fd.get());
    return;
  }
}

void FdChannel::PollLoop() {
  std::vector<pollfd> entries;
  std::vector<Connection*> polled;
  while (true) {
    entries.assign({pollfd{wake_fd_.get(), POLLIN, 0}, pollfd{listen_fd_.get(), POLLIN, 0}});
    polled.clear();
    bool partial_waiting = false;
    {
      absl::MutexLock lock(&mutex_);
      if (stopping_) return;
      const absl::Time now = absl::Now();
      for (auto it = connections_.begin(); it != connections_.end();) {
        Connection* connection = it->get();
        if (connection->finished) {  // its worker closed it: the descriptor closes with it here
          limits_.Release(connection->fd.get());
          it = connections_.erase(it);
          continue;
        }
        if (!connection->busy && connection->held_lease.empty() && now - connection->last_activity > kIdleTimeout) {
          Logger("fdchannel")
              ->info("closing an idle connection of {} (no lease, nothing sent for {})", Describe(connection->peer),
                     absl::FormatDuration(kIdleTimeout));
          limits_.Release(connection->fd.get());
          it = connections_.erase(it);
          continue;
        }
        if (!connection->busy && connection->partial_since != absl::InfinitePast()) {
          if (now - connection->partial_since > kMessageTimeout) {
            Logger("fdchannel")
                ->info("closing the connection of {}: its request did not arrive whole within {}",
                       Describe(connection->peer), absl::FormatDuration(kMessageTimeout));
            limits_.Release(connection->fd.get());
            it = connections_.erase(it);
            continue;
          }
          // Its bytes stay readable, so polling it would spin: look again after kPartialRecheck.
          if (now - connection->last_activity >= kPartialRecheck) {
            connection->busy = true;
            ready_.push_back(connection);
          } else {
            partial_waiting = true;
          }
        } else if (!connection->busy) {
          entries.push_back(pollfd{connection->fd.get(), POLLIN, 0});
          polled.push_back(connection);
        }
        ++it;
      }
    }
    const int wait_ms = partial_waiting ? static_cast<int>(absl::ToInt64Milliseconds(kPartialRecheck)) : kPollMs;
    if (poll(entries.data(), entries.size(), wait_ms) <= 0) continue;
    if (entries[0].revents != 0) {
      uint64_t drained = 0;
      (void)!read(wake_fd_.get(), &drained, sizeof(drained));
    }
    if (entries[1].revents != 0) Accept();
    // Workers wait for ready_ through the mutex's condition.
    absl::MutexLock lock(&mutex_);
    for (size_t i = 0; i < polled.size(); ++i) {
      if (entries[i + 2].revents == 0 || polled[i]->finished) continue;
      polled[i]->busy = true;
      ready_.push_back(polled[i]);
    }
  }
}

void FdChannel::WorkerLoop() {
  while (true) {
    Connection* connection = nullptr;
    {
      absl::MutexLock lock(&mutex_);
      mutex_.Await(absl::Condition(this, &FdChannel::HasWorkOrStopping));
      if (stopping_) return;
      connection = ready_.front();
      ready_.pop_front();
    }
    const Served served = ServeOne(connection);
    const bool keep = served != Served::kClose;
    if (!keep) {
      // The peer sees the end of the connection now; the descriptor is closed when the poller reaps it.
      shutdown(connection->fd.get(), SHUT_RDWR);
      if (!connection->held_lease.empty()) OnConnectionClosed(connection->held_lease, connection->peer);
    }
    {
      absl::MutexLock lock(&mutex_);
      connection->busy = false;
      connection->finished = !keep;
      connection->last_activity = absl::Now();
      if (served == Served::kAnswered) {
        connection->partial_since = absl::InfinitePast();
      } else if (served == Served::kPartial && connection->partial_since == absl::InfinitePast()) {
        connection->partial_since = connection->last_activity;
      }
    }
    Wake();
  }
}

FdChannel::Served FdChannel::ServeOne(Connection* connection) {
  const int fd = connection->fd.get();
  // Only a request that has arrived whole is read (a 4-byte length, then the payload): a worker never waits for the
  // rest of one. A length over the limit is read and refused below.
  char head[4 + kMaxRequestBytes];
  const ssize_t queued = recv(fd, head, sizeof(head), MSG_PEEK | MSG_DONTWAIT);
  if (queued == 0) return Served::kClose;
  if (queued < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? Served::kNothing : Served::kClose;
  if (queued < 4) return Served::kPartial;
  const uint32_t length = static_cast<uint32_t>(static_cast<uint8_t>(head[0])) |
                          static_cast<uint32_t>(static_cast<uint8_t>(head[1])) << 8 |
                          static_cast<uint32_t>(static_cast<uint8_t>(head[2])) << 16 |
                          static_cast<uint32_t>(static_cast<uint8_t>(head[3])) << 24;
  if (length <= kMaxRequestBytes && static_cast<size_t>(queued) < 4 + length) return Served::kPartial;
  // Clients never send descriptors: max_fds = 0 refuses (and closes) any that arrive.
  auto message = common::ReceiveFds(fd, kAnswerTimeout, /*max_fds=*/0, kMaxRequestBytes);
  if (!message.ok()) {
    if (message.status().code() != absl::StatusCode::kUnavailable) {
      // The stream cannot be resynchronised after a refused or incomplete message: answer, then close.
      Logger("fdchannel")
          ->info("closing the connection of {}: {}", Describe(connection->peer), message.status().ToString());
      const v1::FdResponse response = ErrorResponse(absl::Status(
          message.status().code() == absl::StatusCode::kResourceExhausted ? absl::StatusCode::kInvalidArgument
                                                                          : message.status().code(),
          absl::StrCat(message.status().message(), "; closing the connection")));
      (void)common::SendFds(fd, {}, response.SerializeAsString(), kAnswerTimeout);
    }
    return Served::kClose;
  }
  if (stopping()) return Served::kClose;
  Answer answer;
  v1::FdRequest request;
  if (!request.ParseFromString(message->payload)) {
    answer.response = ErrorResponse(absl::InvalidArgumentError(
        absl::StrCat("payload: ", message->payload.size(), " bytes that are not an epfabric.v1.FdRequest")));
  } else {
    answer = Handle(request, connection->peer, &connection->held_lease);
  }
  if (answer.response.code() != 0) {
    requests_refused_.fetch_add(1, std::memory_order_relaxed);  // metrics hook
    Logger("fdchannel")->info("refused a request from {}: {}", Describe(connection->peer), answer.response.message());
  }
  std::vector<int> fds;
  if (answer.fd.valid()) fds.push_back(answer.fd.get());
  if (absl::Status sent = common::SendFds(fd, fds, answer.response.SerializeAsString(), kAnswerTimeout); !sent.ok()) {
    Logger("fdchannel")->info("answering {}: {}", Describe(connection->peer), sent.ToString());
    return Served::kClose;
  }
  return Served::kAnswered;
}

FdChannel::Answer FdChannel::Handle(const v1::FdRequest& request, const common::PeerCredentials& peer,
                                    std::string* held_lease) {
  auto refuse = [](const absl::Status& status) {
    Answer refused;
    refused.response = ErrorResponse(status);
    return refused;
  };
  if (request.group().empty()) return refuse(absl::InvalidArgumentError("group: empty"));
  if (request.token().empty()) return refuse(absl::InvalidArgumentError("token: empty"));
  if (request.kind() != v1::RegionDescriptor::KIND_NVL && request.kind() != v1::RegionDescriptor::KIND_RDMA &&
      request.kind() != v1::RegionDescriptor::KIND_COMMANDS && request.kind() != v1::RegionDescriptor::KIND_STATS) {
    return refuse(absl::InvalidArgumentError(
        absl::StrCat("kind: ", request.kind(), " is not KIND_NVL, KIND_RDMA, KIND_COMMANDS or KIND_STATS")));
  }
  auto shared = groups_->ShareRegion(request.group(), request.rank(), request.kind(), request.token());
  if (!shared.ok()) return refuse(shared.status());

  if (!request.lease_id().empty()) {
    if (!held_lease->empty() && *held_lease != request.lease_id()) {
      return refuse(absl::FailedPreconditionError(
          absl::StrCat("lease_id: this connection already holds lease ", *held_lease, "; one lease per connection")));
    }
    // Checked on every request that names the lease, not only when it is bound: a request may name another group.
    auto lease = groups_->LeaseInfo(request.lease_id());
    if (!lease.ok()) return refuse(lease.status());
    if (lease->group() != request.group() || lease->rank() != request.rank()) {
      return refuse(absl::PermissionDeniedError(absl::StrCat("lease_id: lease ", request.lease_id(), " is for group '",
                                                             lease->group(), "' rank ", lease->rank(), ", not '",
                                                             request.group(), "' rank ", request.rank())));
    }
    if (lease->pid() != peer.pid || lease->uid() != peer.uid) {
      return refuse(absl::PermissionDeniedError(absl::StrCat("lease_id: lease ", request.lease_id(),
                                                             " was taken by pid ", lease->pid(), " uid ", lease->uid(),
                                                             "; this connection is ", Describe(peer))));
    }
    if (held_lease->empty()) {
      absl::MutexLock lock(&mutex_);
      if (!held_leases_.insert(request.lease_id()).second) {
        return refuse(absl::FailedPreconditionError(
            absl::StrCat("lease_id: lease ", request.lease_id(), " is already held by another connection")));
      }
      *held_lease = request.lease_id();
      Logger("fdchannel")
          ->info("lease {} (group '{}' rank {}) is held by a connection of {}", *held_lease, request.group(),
                 request.rank(), Describe(peer));
    }
  }
  if (request.kind() != v1::RegionDescriptor::KIND_NVL && request.lease_id().empty()) {
    return refuse(absl::PermissionDeniedError(
        "kind: RDMA and command regions are only handed to the holder of their rank's lease (give lease_id)"));
  }
  Answer answer;
  answer.response.set_code(0);
  *answer.response.mutable_region() = std::move(shared->descriptor);
  answer.response.set_holds_lease(!request.lease_id().empty() && request.lease_id() == *held_lease);
  answer.fd = std::move(shared->fd);
  return answer;
}

void FdChannel::OnConnectionClosed(const std::string& lease_id, const common::PeerCredentials& peer) {
  {
    absl::MutexLock lock(&mutex_);
    held_leases_.erase(lease_id);
    if (stopping_) return;
  }
  // NotFound: the lease already ended (Detach, expiry, group deleted); nothing to do.
  (void)groups_->EndLease(lease_id, absl::StrCat("the connection that held it closed (", Describe(peer), ")"));
}

}  // namespace epfabric::daemon
