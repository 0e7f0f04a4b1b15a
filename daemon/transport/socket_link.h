// Internal to the socket wire: the issuer side of one group (SocketLink) and of one connection.
#pragma once

#include <memory>
#include <string>

#include "transport/local_copies.h"
#include "transport/wire.h"

namespace epfabric::daemon::transport::socket_wire {

struct LinkOptions {
  absl::Duration connect_timeout;
  absl::Duration handshake_timeout;
  // A connection with nothing queued or unacknowledged for this long is closed; the next command reconnects.
  absl::Duration idle_close;
};

// A group's connections to the other members' data listeners (from Connect's endpoints); commands to this member
// itself go through `copies` (small ones on the proxy's thread, large ones on the daemon's copier).
std::unique_ptr<GroupLink> MakeSocketLink(const GroupSetup& setup, const LinkOptions& options, LocalCopies* copies);

}  // namespace epfabric::daemon::transport::socket_wire
