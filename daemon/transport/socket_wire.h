// The socket wire: TCP between daemons for hosts without RDMA NICs, and for every test here. Issuer side: one
// connection per (group, destination rank, channel), with a sender thread that writes frames and an ack thread that
// completes them. Destination side: one data listener per daemon, a thread per accepted connection that checks the
// handshake (socket_protocol.h), then every frame against the group's region, writes, and acknowledges.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/wire.h"

namespace epfabric::daemon::transport {

struct SocketWireOptions {
  // host:port of the data listener (--data_listen); port 0 picks a free one.
  std::string listen = "127.0.0.1:0";
  absl::Duration connect_timeout = absl::Seconds(5);
  // A connection that has not proven its group within this time is closed.
  absl::Duration handshake_timeout = absl::Seconds(2);
  // Accepted data connections at once (each holds a thread); more are closed at once.
  int max_connections = 2048;
};

// What the data listener refused, for tests, Ops and metrics.
struct SocketWireCounters {
  uint64_t handshakes_refused = 0;   // unknown group, wrong proof, bad hello
  uint64_t frames_refused = 0;       // out of range, bad sequence or type: the connection is closed
  uint64_t connections_refused = 0;  // over max_connections
  uint64_t frames_applied = 0;
};

class SocketWire : public Wire {
 public:
  static absl::StatusOr<std::unique_ptr<SocketWire>> Start(const SocketWireOptions& options);
  // The address peers dial ("host:port", the chosen port).
  virtual std::string address() const = 0;
  virtual SocketWireCounters counters() const = 0;
};

}  // namespace epfabric::daemon::transport
