// Internal to the socket wire: the issuer side of one group (SocketLink) and of one connection.
#pragma once

#include <memory>
#include <string>

#include "transport/wire.h"

namespace epfabric::daemon::transport::socket_wire {

struct LinkOptions {
  absl::Duration connect_timeout;
  absl::Duration handshake_timeout;
};

// A group's connections to the other members' data listeners (from Connect's endpoints); commands to this member
// itself are applied here, in the proxy's thread.
std::unique_ptr<GroupLink> MakeSocketLink(const GroupSetup& setup, const LinkOptions& options);

}  // namespace epfabric::daemon::transport::socket_wire
