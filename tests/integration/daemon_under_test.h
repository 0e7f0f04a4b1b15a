// A real epfabricd process on a temporary Unix socket and a loopback port, ready (health SERVING) when Start
// returns, stopped and cleaned up when destroyed.
#pragma once

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "integration/subprocess.h"

namespace epfabric::testing {

// Paths of the binaries under test: $EPF_DAEMON_BINARY / $EPF_EPCTL_BINARY when set (a bundle on the GPU
// machine), else the build tree's (set by CMake).
inline const char* DaemonBinary() {
  const char* env = std::getenv("EPF_DAEMON_BINARY");
  return env != nullptr && *env != '\0' ? env : EPF_DAEMON_BINARY;
}
inline const char* EpctlBinary() {
  const char* env = std::getenv("EPF_EPCTL_BINARY");
  return env != nullptr && *env != '\0' ? env : EPF_EPCTL_BINARY;
}

// A fabric secret file (mode 0600) shared by every daemon this test process starts.
const std::string& TestFabricSecretFile();
// `flags` plus --fabric_secret_file=TestFabricSecretFile() unless they already name a peer credential (or
// --insecure_peer_port, --help, --version).
std::vector<std::string> WithPeerCredential(std::vector<std::string> flags);

class DaemonUnderTest {
 public:
  // Starts epfabricd --client_socket=<tmp>/d.sock --peer_listen=127.0.0.1:0 plus `extra_flags`.
  static absl::StatusOr<std::unique_ptr<DaemonUnderTest>> Start(const std::vector<std::string>& extra_flags = {});

  // SIGTERM, then SIGKILL if it has not exited after 3 s; removes the temporary directory.
  ~DaemonUnderTest();

  const std::string& socket() const { return socket_; }
  Subprocess& process() { return *process_; }
  std::shared_ptr<grpc::Channel> SocketChannel() const;
  // host:port of the peer server, from Ops.GetTopology.
  absl::StatusOr<std::string> PeerAddress() const;

 private:
  std::string dir_;
  std::string socket_;
  std::unique_ptr<Subprocess> process_;
};

}  // namespace epfabric::testing
