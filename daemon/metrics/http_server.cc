#include "metrics/http_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/daemon/options.h"

namespace epfabric::daemon::metrics {
namespace {

// How long accepting pauses when the process is out of descriptors (the pending connection stays in the backlog).
constexpr absl::Duration kAcceptPause = absl::Milliseconds(100);

struct Connection {
  int fd = -1;
  absl::Time deadline;
  std::string in;
  std::string out;  // non-empty once the request is answered
  size_t sent = 0;
};

std::string Answer(int status, absl::string_view reason, absl::string_view content_type, absl::string_view body) {
  return absl::StrCat("HTTP/1.1 ", status, " ", reason, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n",
                      status == 405 ? "Allow: GET\r\n" : "", "\r\n", body);
}

// The answer to a complete request head (`head`: up to, not including, the blank line). Refusals have no body: the
// status says it all.
std::string Respond(absl::string_view head, const std::function<std::string()>& render) {
  const absl::string_view line = head.substr(0, head.find("\r\n"));
  const std::vector<absl::string_view> parts = absl::StrSplit(line, ' ');
  if (parts.size() != 3 || !absl::StartsWith(parts[2], "HTTP/1.")) {
    return Answer(400, "Bad Request", "text/plain", "");
  }
  if (parts[0] != "GET") return Answer(405, "Method Not Allowed", "text/plain", "");
  const absl::string_view path = parts[1].substr(0, parts[1].find('?'));
  if (path == "/metrics") return Answer(200, "OK", "text/plain; version=0.0.4; charset=utf-8", render());
  if (path == "/") return Answer(200, "OK", "text/plain", "epfabricd: metrics at /metrics\n");
  return Answer(404, "Not Found", "text/plain", "");
}

// Reads what `c` sent; answers once the request head is complete. False when the connection is done with.
bool ReadRequest(Connection& c, const std::function<std::string()>& render) {
  char buffer[4096];
  while (true) {
    const ssize_t got = ::recv(c.fd, buffer, sizeof(buffer), MSG_DONTWAIT);
    if (got == 0) return false;
    if (got < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    c.in.append(buffer, static_cast<size_t>(got));
    if (const size_t end = c.in.find("\r\n\r\n"); end != std::string::npos) {
      c.out = Respond(absl::string_view(c.in).substr(0, end), render);
      return true;
    }
    if (c.in.size() > HttpServer::kMaxRequestBytes) {
      c.out = Answer(431, "Request Header Fields Too Large", "text/plain", "");
      return true;
    }
  }
}

// Sends what is left of the answer. False when the connection is done with (all sent, or an error).
bool WriteAnswer(Connection& c) {
  while (c.sent < c.out.size()) {
    const ssize_t put = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (put < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    c.sent += static_cast<size_t>(put);
  }
  return false;
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Bind(const std::string& listen,
                                                             std::function<std::string()> render) {
  EPF_ASSIGN_OR_RETURN(const HostPort host_port, ParseHostPort(listen));
  std::unique_ptr<HttpServer> http(new HttpServer());
  http->render_ = std::move(render);
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (int err = getaddrinfo(host_port.host.c_str(), std::to_string(host_port.port).c_str(), &hints, &found); err != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--metrics_listen: ", listen, ": ", gai_strerror(err)));
  }
  std::string error = "no address";
  for (addrinfo* a = found; a != nullptr && http->listen_fd_ < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    // SO_REUSEADDR only (a restart over connections in TIME_WAIT): on Linux it never lets two sockets listen on one
    // port, so a taken port fails here. SO_REUSEPORT would let a second process share the port.
    const int yes = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, kMaxConnections) == 0) {
      http->listen_fd_ = fd;
    } else {
      error = std::strerror(errno);
      ::close(fd);
    }
  }
  freeaddrinfo(found);
  if (http->listen_fd_ < 0) {
    return absl::UnavailableError(absl::StrCat("--metrics_listen: cannot listen on ", listen, ": ", error,
                                               " (is another process listening on that port?)"));
  }
  if (::pipe2(http->wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::InternalError(absl::StrCat("--metrics_listen: pipe: ", std::strerror(errno)));
  }
  sockaddr_storage bound = {};
  socklen_t length = sizeof(bound);
  ::getsockname(http->listen_fd_, reinterpret_cast<sockaddr*>(&bound), &length);
  const int port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                     : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  const bool ipv6 = host_port.host.find(':') != std::string::npos;
  http->address_ = ipv6 ? absl::StrCat("[", host_port.host, "]:", port) : absl::StrCat(host_port.host, ":", port);
  return http;
}

void HttpServer::Serve() {
  if (thread_.joinable() || listen_fd_ < 0) return;
  thread_ = std::thread([this] { Run(); });
}

HttpServer::~HttpServer() {
  Stop();
  for (int fd : {listen_fd_, wake_[0], wake_[1]}) {
    if (fd >= 0) ::close(fd);
  }
}

void HttpServer::Stop() {
  if (!thread_.joinable()) return;
  const char byte = 0;
  (void)!::write(wake_[1], &byte, 1);
  thread_.join();
}

void HttpServer::Run() {
  std::vector<Connection> connections;
  absl::Time accept_after = absl::InfinitePast();
  std::vector<pollfd> fds;
  while (true) {
    absl::Time now = absl::Now();
    absl::Time wake = now + absl::Seconds(1);
    fds.assign({{wake_[0], POLLIN, 0}, {now >= accept_after ? listen_fd_ : -1, POLLIN, 0}});
    if (now < accept_after) wake = std::min(wake, accept_after);
    for (const Connection& c : connections) {
      fds.push_back({c.fd, static_cast<short>(c.out.empty() ? POLLIN : POLLOUT), 0});
      wake = std::min(wake, c.deadline);
    }
    const int timeout_ms = static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(wake - now) + 1));
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) break;
    if (fds[0].revents != 0) break;  // Stop()
    now = absl::Now();

    // Serve the connections that are ready; close those done, failed or past their deadline.
    std::vector<Connection> kept;
    kept.reserve(connections.size());
    for (size_t i = 0; i < connections.size(); ++i) {
      Connection& c = connections[i];
      const short events = fds[i + 2].revents;
      bool open = now < c.deadline;
      if (open && events != 0) {
        if (c.out.empty()) open = ReadRequest(c, render_);
        if (open && !c.out.empty()) open = WriteAnswer(c);
      }
      if (open) {
        kept.push_back(std::move(c));
      } else {
        ::close(c.fd);
      }
    }
    connections = std::move(kept);

    if ((fds[1].revents & POLLIN) == 0) continue;
    for (int accepted = 0; accepted < kMaxConnections; ++accepted) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        // Out of descriptors: leave the connection in the backlog and look again shortly, instead of spinning.
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
          accept_after = now + kAcceptPause;
        break;
      }
      if (static_cast<int>(connections.size()) >= kMaxConnections) {
        // Full: the oldest connection still sending its request makes room (a scraper's request comes at once).
        auto oldest =
            std::find_if(connections.begin(), connections.end(), [](const Connection& c) { return c.out.empty(); });
        if (oldest == connections.end()) {
          ::close(fd);
          continue;
        }
        ::close(oldest->fd);
        connections.erase(oldest);
      }
      connections.push_back(Connection{fd, now + kConnectionDeadline, {}, {}, 0});
    }
  }
  for (const Connection& c : connections) ::close(c.fd);
}

}  // namespace epfabric::daemon::metrics
