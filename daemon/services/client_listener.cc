#include "services/client_listener.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include <grpcpp/server_posix.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "logging.h"

namespace epfabric::daemon {

ClientListener::~ClientListener() { Stop(); }

absl::Status ClientListener::Start(const std::string& path, uint32_t mode, grpc::Server* server) {
  path_ = path;
  server_ = server;
  listen_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) return absl::InternalError(absl::StrCat("socket(AF_UNIX): ", strerror(errno)));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    close(listen_fd_);
    listen_fd_ = -1;
    return absl::UnavailableError(absl::StrCat("--client_socket: cannot bind ", path, ": ", strerror(err)));
  }
  // Nobody can connect before listen(), so setting the mode here leaves no window.
  if (chmod(path.c_str(), mode) != 0 || listen(listen_fd_, 128) != 0) {
    const int err = errno;
    close(listen_fd_);
    listen_fd_ = -1;
    unlink(path.c_str());
    return absl::InternalError(absl::StrCat("--client_socket: ", path, ": ", strerror(err)));
  }
  thread_ = std::thread([this] { AcceptLoop(); });
  return absl::OkStatus();
}

void ClientListener::Stop() {
  {
    absl::MutexLock lock(&mutex_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) {
    close(listen_fd_);
    listen_fd_ = -1;
    unlink(path_.c_str());
  }
}

void ClientListener::AcceptLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mutex_);
      if (stopping_) return;
    }
    pollfd pfd{listen_fd_, POLLIN, 0};
    if (poll(&pfd, 1, 50) <= 0) continue;  // the timeout lets Stop() end the loop
    // gRPC drives the connection with its event engine, which needs a non-blocking socket.
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      const int error = errno;
      // Out of descriptors: shed the pending connection instead of spinning on it.
      if (error == EMFILE || error == ENFILE) reserve_.ShedOne(listen_fd_);
      int suppressed = 0;
      if (error != EINTR && error != EAGAIN && error != ECONNABORTED && refusal_warning_.ShouldLog(&suppressed)) {
        Logger("daemon")->warn("accept on {}: {} ({} similar warnings suppressed)", path_, strerror(error), suppressed);
      }
      if (error == EMFILE || error == ENFILE) absl::SleepFor(absl::Milliseconds(10));
      continue;
    }
    PeerCredentials credentials;
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
      credentials.pid = cred.pid;
      credentials.uid = cred.uid;
      credentials.gid = cred.gid;
    }
    std::string why;
    if (!limits_.Admit(fd, static_cast<uid_t>(credentials.uid), &why)) {
      int suppressed = 0;
      if (refusal_warning_.ShouldLog(&suppressed)) {
        Logger("daemon")->warn("{}: refusing a connection from pid {} uid {}: {} ({} similar warnings suppressed)",
                               path_, credentials.pid, credentials.uid, why, suppressed);
      }
      close(fd);
      continue;
    }
    {
      absl::MutexLock lock(&mutex_);
      by_fd_[fd] = credentials;  // a reused fd number overwrites the closed connection's entry
    }
    Logger("daemon")->debug("client connection fd {} from pid {} uid {}", fd, credentials.pid, credentials.uid);
    grpc::AddInsecureChannelFromFd(server_, fd);
  }
}

std::optional<PeerCredentials> ClientListener::Lookup(const std::string& grpc_peer) const {
  int fd = -1;
  if (!absl::StartsWith(grpc_peer, "fd:") || !absl::SimpleAtoi(grpc_peer.substr(3), &fd)) return std::nullopt;
  absl::MutexLock lock(&mutex_);
  auto it = by_fd_.find(fd);
  if (it == by_fd_.end()) return std::nullopt;
  return it->second;
}

}  // namespace epfabric::daemon
