#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "epfabric/daemon/daemon.h"
#include "epfabric/daemon/options.h"

namespace epfabric::daemon {
namespace {

// A fabric secret file of this process (mode 0600): the peer port needs a credential.
std::string SecretFile() {
  static const std::string path = [] {
    const std::string file =
        (std::filesystem::temp_directory_path() / ("epf-unit-" + std::to_string(getpid()) + ".secret")).string();
    std::ofstream(file) << "a-unit-test-fabric-secret\n";
    std::filesystem::permissions(file, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
    return file;
  }();
  return path;
}

DaemonOptions Valid() {
  DaemonOptions o;
  o.client_socket = (std::filesystem::temp_directory_path() / "epf-unit.sock").string();
  o.fabric_secret_file = SecretFile();
  return o;
}

TEST(ValidateOptions, DefaultsWithASocketAreValid) { EXPECT_TRUE(ValidateOptions(Valid()).ok()); }

// On loopback the daemon makes its own credential (security/host_secret.h); off loopback one must be named.
TEST(ValidateOptions, ALoopbackPeerPortNeedsNoHandMadeCredential) {
  DaemonOptions o = Valid();
  o.fabric_secret_file.clear();
  EXPECT_TRUE(ValidateOptions(o).ok());
  o.world_size = 2;
  EXPECT_TRUE(ValidateOptions(o).ok());
  o.peer_listen = "10.0.0.1:7000";
  EXPECT_EQ(ValidateOptions(o).message(),
            "--peer_listen: '10.0.0.1' is not a loopback address; give --tls_cert/--tls_key/--tls_ca for mutual TLS, "
            "or --insecure_peer_port to listen without it");
}

TEST(ValidateOptions, MultiRankNeedsACoordinator) {
  DaemonOptions o = Valid();
  o.world_size = 4;
  o.rank = 3;
  EXPECT_EQ(ValidateOptions(o).message(),
            "--coordinator: required when --world_size > 1 (host:port of rank 0's peer server)");
  o.coordinator = "10.0.0.1:7000";
  EXPECT_EQ(ValidateOptions(o).message(),
            "--coordinator: '10.0.0.1' is not a loopback address; calls to it need mutual TLS "
            "(--tls_cert/--tls_key/--tls_ca) or --insecure_peer_port");
  o.coordinator = "127.0.0.1:7000";
  EXPECT_TRUE(ValidateOptions(o).ok());
  o.coordinator = "127.0.0.1:0";
  EXPECT_EQ(ValidateOptions(o).message(), "--coordinator: port 0 cannot be dialled");
}

TEST(ValidateOptions, RankOutsideWorld) {
  DaemonOptions o = Valid();
  o.rank = -1;
  EXPECT_EQ(ValidateOptions(o).message(), "--rank: -1 is not in 0..0 (--world_size=1)");
  EXPECT_EQ(ValidateOptions(o).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ValidateOptions, NonLoopbackPeerPortNeedsExplicitInsecure) {
  DaemonOptions o = Valid();
  o.peer_listen = "0.0.0.0:7000";
  EXPECT_FALSE(ValidateOptions(o).ok());
  o.insecure_peer_port = true;
  EXPECT_TRUE(ValidateOptions(o).ok());
  o.insecure_peer_port = false;
  for (const char* loopback : {"127.0.0.1:0", "localhost:7000", "[::1]:7000", "127.1.2.3:9"}) {
    o.peer_listen = loopback;
    EXPECT_TRUE(ValidateOptions(o).ok()) << loopback;
  }
}

TEST(ValidateOptions, SocketPathLimits) {
  DaemonOptions o = Valid();
  o.client_socket = "/tmp/" + std::string(120, 'x');
  EXPECT_EQ(ValidateOptions(o).message(), "--client_socket: path is 125 bytes; Unix sockets allow at most 107");
  o.client_socket = "";
  EXPECT_FALSE(ValidateOptions(o).ok());
}

TEST(ValidateOptions, SocketMode) {
  DaemonOptions o = Valid();
  o.client_socket_mode = 01777;
  EXPECT_EQ(ValidateOptions(o).message(), "--client_socket_mode: only permission bits (0..0777) are allowed");
  o.client_socket_mode = 0600;
  EXPECT_TRUE(ValidateOptions(o).ok());
}

TEST(ValidateOptions, LogLevelNames) {
  DaemonOptions o = Valid();
  for (const char* level : {"trace", "debug", "info", "warn", "error", "critical", "off"}) {
    o.log_level = level;
    EXPECT_TRUE(ValidateOptions(o).ok()) << level;
  }
  o.log_level = "verbose";
  EXPECT_FALSE(ValidateOptions(o).ok());
}

TEST(ParseHostPort, Forms) {
  auto v4 = ParseHostPort("10.1.2.3:7000");
  ASSERT_TRUE(v4.ok());
  EXPECT_EQ(v4->host, "10.1.2.3");
  EXPECT_EQ(v4->port, 7000);
  auto v6 = ParseHostPort("[fe80::1]:0");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->host, "fe80::1");
  EXPECT_EQ(v6->port, 0);
  for (const char* bad : {"", "host", ":80", "h:", "h:-1", "h:65536", "fe80::1:80", "[fe80::1]80", "h:8x"}) {
    EXPECT_FALSE(ParseHostPort(bad).ok()) << bad;
  }
}

TEST(ParseBackendChoice, Names) {
  EXPECT_EQ(*ParseBackendChoice("auto"), BackendChoice::kAuto);
  EXPECT_EQ(*ParseBackendChoice("cuda"), BackendChoice::kCuda);
  EXPECT_EQ(*ParseBackendChoice("host"), BackendChoice::kHost);
  EXPECT_FALSE(ParseBackendChoice("CUDA").ok());
}

TEST(ResolveBackend, AutoPicksCudaOnlyWithAGpu) {
  auto none = ResolveBackend(BackendChoice::kAuto, -1, 3, 0);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->backend, v1::BACKEND_HOST);
  EXPECT_EQ(none->device, -1);
  auto some = ResolveBackend(BackendChoice::kAuto, -1, 3, 2);
  ASSERT_TRUE(some.ok());
  EXPECT_EQ(some->backend, v1::BACKEND_CUDA);
  EXPECT_EQ(some->device, 1);  // rank 3 on 2 GPUs
}

TEST(ResolveBackend, ExplicitChoices) {
  EXPECT_EQ(ResolveBackend(BackendChoice::kHost, -1, 0, 8)->backend, v1::BACKEND_HOST);
  EXPECT_EQ(ResolveBackend(BackendChoice::kCuda, 5, 0, 8)->device, 5);
  EXPECT_EQ(ResolveBackend(BackendChoice::kCuda, -1, 0, 0).status().message(),
            "--backend: cuda, but no CUDA device is visible");
  EXPECT_EQ(ResolveBackend(BackendChoice::kCuda, 2, 0, 2).status().message(),
            "--device: 2 is not in 0..1 (visible CUDA devices)");
  EXPECT_EQ(ResolveBackend(BackendChoice::kAuto, 0, 0, 0).status().message(),
            "--device: 0 given but no GPU is visible");
}

}  // namespace
}  // namespace epfabric::daemon
