// The socket wire: TCP between daemons for hosts without RDMA NICs, and for every test here. Issuer side: one
// connection per (group, destination rank, channel), with a sender thread that writes frames and an ack thread that
// completes them. Destination side: one data listener per daemon, a thread per accepted connection that checks the
// handshake (socket_protocol.h), then every frame against the group's region, writes, and acknowledges.
//
// What keeps the listener from being exhausted (docs/security.md, "The data port"): the whole handshake must finish
// within handshake_timeout of the accept, however its bytes trickle in; at most max_pending_handshakes connections
// are unproven at once, and a new one sheds the oldest (an issuing daemon sends its hello with the connect and
// finishes in a round trip, so only a stalling stranger is ever the oldest); a proven connection replaces the one
// of the same (group, issuer rank, channel), so a group holds at most ranks x channels of them; every connection is
// closed after idle_timeout without a frame (the issuer closes its own first, at half of it, and reconnects on its
// next command); all of them together hold at most a third of `ulimit -n` minus 64 descriptors; and when accept
// runs out of descriptors a spare one sheds the pending connection and accepting pauses, so the loop cannot spin.
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
  // Accepted data connections at once (each holds a thread); more are closed at once. Also bounded by the
  // descriptor limit (a third of `ulimit -n` minus 64).
  int max_connections = 2048;
  // Connections that have not finished their handshake; a new one beyond this closes the oldest of them.
  int max_pending_handshakes = 64;
  // A proven connection that carries no frame for this long is closed by the listener; the issuer closes an idle
  // connection of its own at half of it and reconnects on its next command.
  absl::Duration idle_timeout = absl::Minutes(10);
};

// What the data listener refused, for tests, Ops and metrics.
struct SocketWireCounters {
  uint64_t handshakes_refused = 0;   // unknown group, wrong proof, bad hello, too slow, shed for a newer one
  uint64_t frames_refused = 0;       // failed authentication, out of range, bad sequence or type: connection closed
  uint64_t connections_refused = 0;  // over max_connections (or the descriptor budget), or out of descriptors
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
