#include "integration/daemon_under_test.h"

#include <signal.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "epfabric/v1/ops.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace epfabric::testing {

const std::string& TestFabricSecretFile() {
  // One secret per test process: every daemon a test starts belongs to fabrics that trust each other.
  static const std::string path = [] {
    const std::string file = MakeTempDir() + "/fabric.secret";
    std::ofstream out(file);
    out << "epfabric-test-secret-" << ::getpid() << "-" << absl::ToUnixNanos(absl::Now()) << "\n";
    out.close();
    std::filesystem::permissions(file, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
    return file;
  }();
  return path;
}

std::vector<std::string> WithPeerCredential(std::vector<std::string> flags) {
  for (const std::string& flag : flags) {
    if (absl::StartsWith(flag, "--fabric_secret_file") || absl::StartsWith(flag, "--tls_cert") ||
        absl::StartsWith(flag, "--insecure_peer_port") || flag == "--help" || flag == "--version") {
      return flags;
    }
  }
  // Right after the binary: a trailing flag that expects a value must not swallow it.
  flags.insert(flags.empty() ? flags.end() : flags.begin() + 1, "--fabric_secret_file=" + TestFabricSecretFile());
  return flags;
}

absl::StatusOr<std::unique_ptr<DaemonUnderTest>> DaemonUnderTest::Start(const std::vector<std::string>& extra_flags) {
  auto daemon = std::unique_ptr<DaemonUnderTest>(new DaemonUnderTest());
  daemon->dir_ = MakeTempDir();
  daemon->socket_ = daemon->dir_ + "/d.sock";
  // Idle proxy threads pause up to 20 ms (docs/internode.md): the tests run dozens of daemons on CI's 2 cores.
  std::vector<std::string> argv = {DaemonBinary(), "--client_socket=" + daemon->socket_, "--peer_listen=127.0.0.1:0",
                                   "--proxy_max_sleep_us=20000"};
  argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
  auto process = Subprocess::Start(WithPeerCredential(argv));
  if (!process.ok()) return process.status();
  daemon->process_ = std::make_unique<Subprocess>(std::move(*process));

  // Ready when the health service answers SERVING on the socket.
  const absl::Time deadline = absl::Now() + absl::Seconds(15);
  while (absl::Now() < deadline) {
    if (!daemon->process_->running()) {
      return absl::InternalError(absl::StrCat("epfabricd exited early: ", daemon->process_->Stderr()));
    }
    if (std::filesystem::exists(daemon->socket_)) {
      auto stub = grpc::health::v1::Health::NewStub(daemon->SocketChannel());
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
      grpc::health::v1::HealthCheckResponse response;
      if (stub->Check(&context, grpc::health::v1::HealthCheckRequest(), &response).ok() &&
          response.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
        return daemon;
      }
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat("epfabricd not serving after 15 s: ", daemon->process_->Stderr()));
}

DaemonUnderTest::~DaemonUnderTest() {
  if (process_ != nullptr) {
    process_->Signal(SIGTERM);
    (void)process_->Wait(absl::Seconds(3));
  }
  process_.reset();
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

std::shared_ptr<grpc::Channel> DaemonUnderTest::SocketChannel() const {
  return grpc::CreateChannel("unix:" + socket_, grpc::InsecureChannelCredentials());
}

absl::StatusOr<std::string> DaemonUnderTest::PeerAddress() const {
  auto stub = v1::Ops::NewStub(SocketChannel());
  grpc::ClientContext context;
  v1::Topology topology;
  grpc::Status status = stub->GetTopology(&context, v1::GetTopologyRequest(), &topology);
  if (!status.ok()) return absl::UnavailableError(status.error_message());
  return topology.daemon().peer_address();
}

}  // namespace epfabric::testing
