// The Prometheus endpoint: GET /metrics over HTTP/1.1 (cpp-httplib, Debian's libcpp-httplib), on its own small
// thread pool so that a slow scraper never holds a gRPC thread. Read-only: no other path, no other method.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace httplib {
class Server;
}

namespace epfabric::daemon::metrics {

class HttpServer {
 public:
  // Binds `listen` ("host:port"; port 0 picks a free one); Serve() then answers GET /metrics with render(), which
  // runs on the server's threads. Between the two, address() is known and nothing is served.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Bind(const std::string& listen,
                                                          std::function<std::string()> render);
  void Serve();
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Stops accepting and joins the server thread. Idempotent.
  void Stop();
  // host:port it listens on (with the chosen port).
  const std::string& address() const { return address_; }

  // Threads serving requests (scrapes are rare; one more waits on the listening socket).
  static constexpr int kThreads = 2;

 private:
  HttpServer() = default;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::string address_;
};

}  // namespace epfabric::daemon::metrics
