// The client Unix socket, accepted by our own loop instead of gRPC's: each accepted connection's peer
// credentials (SO_PEERCRED: pid, uid) are recorded before the connection is handed to the gRPC server, so that
// handlers can say who called. gRPC names such connections "fd:<n>" (ServerContext::peer()).
#pragma once

#include <sys/types.h>

#include <map>
#include <optional>
#include <string>
#include <thread>

#include <grpcpp/server.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "services/connection_limits.h"

namespace epfabric::daemon {

struct PeerCredentials {
  pid_t pid = -1;
  uid_t uid = static_cast<uid_t>(-1);
  gid_t gid = static_cast<gid_t>(-1);
};

class ClientListener {
 public:
  ClientListener() = default;
  ~ClientListener();

  // Binds `path` (which must be free) with permission bits `mode` and starts accepting into `server`.
  absl::Status Start(const std::string& path, uint32_t mode, grpc::Server* server);
  // Stops accepting (existing connections stay with gRPC until its shutdown) and removes the socket file.
  void Stop();

  // The credentials of the connection a call arrived on, from ServerContext::peer().
  std::optional<PeerCredentials> Lookup(const std::string& grpc_peer) const;

 private:
  void AcceptLoop();

  std::string path_;
  int listen_fd_ = -1;
  grpc::Server* server_ = nullptr;
  std::thread thread_;
  // gRPC owns the connections once handed over; the limits notice closed ones by their socket inode.
  static constexpr size_t kMaxConnections = 512;
  static constexpr size_t kMaxConnectionsPerUid = 128;
  ConnectionLimits limits_{kMaxConnections, kMaxConnectionsPerUid};
  DescriptorReserve reserve_;
  RateLimitedWarning refusal_warning_;

  mutable absl::Mutex mutex_;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::map<int, PeerCredentials> by_fd_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace epfabric::daemon
