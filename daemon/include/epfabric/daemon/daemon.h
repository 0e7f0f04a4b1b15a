// epfabricd as a library: main() parses flags into DaemonOptions, calls Daemon::Start and waits for a signal;
// tests can run a Daemon in-process the same way.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "epfabric/daemon/options.h"
#include "epfabric/v1/common.pb.h"

namespace epfabric::daemon {

// The backend and CUDA device a daemon ends up with.
struct ResolvedBackend {
  v1::Backend backend = v1::BACKEND_HOST;
  int device = -1;  // -1 on the host backend
};

// auto -> cuda when a GPU is visible, else host. device -1 -> rank modulo the GPU count. Errors name the flag.
absl::StatusOr<ResolvedBackend> ResolveBackend(BackendChoice choice, int device, int rank, int visible_gpus);

class Daemon {
 public:
  // Binds the client socket and the peer port and starts serving. Fails (nothing left behind) when the socket
  // path is held by a live daemon or is not a socket, or a port cannot be bound.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const DaemonOptions& options);

  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Marks every service NOT_SERVING, stops accepting, lets in-flight calls finish for up to `grace` (then
  // cancels them), releases resources and removes the socket file. Idempotent.
  void Shutdown(absl::Duration grace);

  // host:port the peer server listens on (the chosen port when --peer_listen had port 0).
  std::string peer_address() const;
  const ResolvedBackend& backend() const;

 private:
  struct State;
  explicit Daemon(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace epfabric::daemon
