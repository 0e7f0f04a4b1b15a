#include "metrics/http_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/daemon/options.h"

namespace epfabric::daemon::metrics {

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Bind(const std::string& listen,
                                                             std::function<std::string()> render) {
  EPF_ASSIGN_OR_RETURN(const HostPort host_port, ParseHostPort(listen));
  std::unique_ptr<HttpServer> http(new HttpServer());
  http->server_ = std::make_unique<httplib::Server>();
  httplib::Server& server = *http->server_;
  server.new_task_queue = [] { return new httplib::ThreadPool(kThreads); };
  // A scrape is one small GET: no bodies, short deadlines, few requests per connection.
  server.set_payload_max_length(1024);
  server.set_read_timeout(5, 0);
  server.set_write_timeout(5, 0);
  server.set_keep_alive_max_count(16);
  server.set_keep_alive_timeout(30);
  server.Get("/metrics", [render = std::move(render)](const httplib::Request&, httplib::Response& response) {
    response.set_content(render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  server.Get("/", [](const httplib::Request&, httplib::Response& response) {
    response.set_content("epfabricd: metrics at /metrics\n", "text/plain");
  });

  // cpp-httplib's default sets SO_REUSEPORT, which lets a second process bind the same port and take a share of the
  // scrapes. SO_REUSEADDR alone (a restart while old connections linger in TIME_WAIT) never lets two sockets listen
  // on one port on Linux: a taken port fails the bind.
  server.set_socket_options([](socket_t sock) {
    const int yes = 1;
    const int no = 0;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    setsockopt(sock, SOL_SOCKET, SO_REUSEPORT, &no, sizeof(no));
  });
  int port = host_port.port;
  if (port == 0) {
    port = server.bind_to_any_port(host_port.host);
    if (port < 0) port = 0;
  } else if (!server.bind_to_port(host_port.host, port)) {
    port = 0;
  }
  if (port == 0) {
    return absl::UnavailableError(
        absl::StrCat("--metrics_listen: cannot listen on ", listen, " (is another process listening on that port?)"));
  }
  const bool ipv6 = host_port.host.find(':') != std::string::npos;
  http->address_ = ipv6 ? absl::StrCat("[", host_port.host, "]:", port) : absl::StrCat(host_port.host, ":", port);
  return http;
}

void HttpServer::Serve() {
  if (thread_.joinable()) return;
  thread_ = std::thread([server = server_.get()] { server->listen_after_bind(); });
  // stop() only ends a server that is running: wait for the thread to get there, so that Stop never hangs.
  for (int i = 0; i < 2000 && !server_->is_running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::Stop() {
  if (server_ != nullptr) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace epfabric::daemon::metrics
