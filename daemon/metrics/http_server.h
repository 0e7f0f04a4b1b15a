// The Prometheus endpoint: GET /metrics over HTTP/1.1 on one poll() thread of its own, so that a slow scraper never
// holds a gRPC thread and slow or idle connections never hold a scrape:
//  - at most kMaxConnections connections; a new one beyond that closes the oldest that has not sent its request (a
//    scraper sends its request at once, so a flood of idle or trickling connections cannot keep it out);
//  - a connection has kConnectionDeadline from accept to send its request (at most kMaxRequestBytes) and read the
//    answer; then it is closed, whatever it is doing;
//  - one request per connection (Connection: close);
//  - out of descriptors, accepting pauses briefly instead of spinning.
// Read-only: GET /metrics and GET /, nothing else (404 other paths, 405 other methods).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace epfabric::daemon::metrics {

class HttpServer {
 public:
  // Binds `listen` ("host:port"; port 0 picks a free one) without SO_REUSEPORT: a taken port is an error. Serve()
  // then answers GET /metrics with render(), which runs on the server's thread. Between the two, address() is known
  // and nothing is served.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Bind(const std::string& listen,
                                                          std::function<std::string()> render);
  void Serve();
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Stops accepting, closes every connection and joins the server thread. Idempotent.
  void Stop();
  // host:port it listens on (with the chosen port).
  const std::string& address() const { return address_; }

  static constexpr int kMaxConnections = 64;
  static constexpr size_t kMaxRequestBytes = 8192;
  static constexpr absl::Duration kConnectionDeadline = absl::Seconds(5);

 private:
  HttpServer() = default;
  void Run();

  std::function<std::string()> render_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};  // a pipe: Stop() writes a byte to end Run()
  std::thread thread_;
  std::string address_;
};

}  // namespace epfabric::daemon::metrics
