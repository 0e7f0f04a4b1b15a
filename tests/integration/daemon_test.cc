// epfabricd end to end: the real binary on a temporary Unix socket and a loopback port, queried with epctl and
// with plain gRPC clients.
#include <gmock/gmock.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "epfabric/v1/control.grpc.pb.h"
#include "epfabric/v1/ops.grpc.pb.h"
#include "gpu/gpu_env.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "integration/daemon_under_test.h"
#include "proto/reflection_subset.grpc.pb.h"

namespace epfabric::testing {
namespace {

using ::grpc::health::v1::Health;
using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;
using ::testing::HasSubstr;
using ::testing::IsSupersetOf;

absl::StatusOr<HealthCheckResponse::ServingStatus> CheckHealth(const std::shared_ptr<grpc::Channel>& channel,
                                                               const std::string& service) {
  auto stub = Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  HealthCheckRequest request;
  request.set_service(service);
  HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  return response.status();
}

std::vector<std::string> ReflectedServices(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  auto stream = stub->ServerReflectionInfo(&context);
  grpc::reflection::v1alpha::ServerReflectionRequest request;
  request.set_list_services("*");
  std::vector<std::string> names;
  if (!stream->Write(request)) return names;
  stream->WritesDone();
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  while (stream->Read(&response)) {
    for (const auto& service : response.list_services_response().service()) names.push_back(service.name());
  }
  (void)stream->Finish();
  return names;
}

std::string ReadFirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

TEST(Daemon, HealthIsServingForEveryService) {
  auto daemon = DaemonUnderTest::Start();
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto channel = (*daemon)->SocketChannel();
  for (const char* service : {"", "epfabric.v1.Control", "epfabric.v1.Ops"}) {
    auto status = CheckHealth(channel, service);
    ASSERT_TRUE(status.ok()) << service << ": " << status.status();
    EXPECT_EQ(*status, HealthCheckResponse::SERVING) << service;
  }
  // The peer service lives on the TCP port only.
  auto unknown = CheckHealth(channel, "epfabric.v1.Peer");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);

  auto peer_address = (*daemon)->PeerAddress();
  ASSERT_TRUE(peer_address.ok()) << peer_address.status();
  EXPECT_THAT(*peer_address, ::testing::StartsWith("127.0.0.1:"));
  auto tcp = grpc::CreateChannel(*peer_address, grpc::InsecureChannelCredentials());
  for (const char* service : {"", "epfabric.v1.Peer", "epfabric.v1.Ops"}) {
    auto status = CheckHealth(tcp, service);
    ASSERT_TRUE(status.ok()) << service << ": " << status.status();
    EXPECT_EQ(*status, HealthCheckResponse::SERVING) << service;
  }
}

TEST(Daemon, EpctlHealthExitsZeroWhenServing) {
  auto daemon = DaemonUnderTest::Start();
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  RunResult result = RunBinary({EpctlBinary(), "--socket=" + (*daemon)->socket(), "health"});
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(result.out, "epfabricd: SERVING\nhealth: PASS\n");

  result = RunBinary({EpctlBinary(), "--socket", (*daemon)->socket(), "--service=epfabric.v1.Nope", "health"});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_THAT(result.err, HasSubstr("NOT_FOUND"));
}

TEST(Daemon, EpctlHealthFailsWithoutDaemon) {
  const std::string dir = MakeTempDir();
  RunResult result = RunBinary({EpctlBinary(), "--socket=" + dir + "/none.sock", "--timeout_ms=300", "health"});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_THAT(result.err, HasSubstr("health check on unix:" + dir + "/none.sock failed"));
  std::filesystem::remove_all(dir);
}

TEST(Daemon, TopologyOverSocketAndPeerPort) {
  auto daemon = DaemonUnderTest::Start({"--rank=0", "--world_size=1", "--host_id=node-a"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  RunResult result = RunBinary({EpctlBinary(), "--socket=" + (*daemon)->socket(), "topology", "--json"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  v1::Topology topology;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(result.out, &topology).ok()) << result.out;
  EXPECT_EQ(topology.host_id(), "node-a");
  EXPECT_EQ(topology.daemon().rank(), 0);
  EXPECT_EQ(topology.daemon().world_size(), 1);
  EXPECT_EQ(topology.daemon().version(), EPF_VERSION);
  EXPECT_EQ(topology.daemon().client_socket(), (*daemon)->socket());
  EXPECT_EQ(topology.daemon().pid(), (*daemon)->process().pid());
  const int gpus = CudaDeviceCount();
  EXPECT_EQ(topology.gpus_size(), gpus);
  EXPECT_EQ(topology.gpu_links_size(), gpus * (gpus - 1));
  EXPECT_EQ(topology.daemon().backend(), gpus > 0 ? v1::BACKEND_CUDA : v1::BACKEND_HOST);

  // The same through the peer port, as remote tooling would ask.
  auto peer_address = (*daemon)->PeerAddress();
  ASSERT_TRUE(peer_address.ok());
  result = RunBinary(
      {EpctlBinary(), "--address=" + *peer_address, "--fabric_secret_file=" + TestFabricSecretFile(), "topology"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_THAT(result.out, HasSubstr("host      node-a"));
  EXPECT_THAT(result.out, HasSubstr(absl::StrCat("GPUs (", gpus, ")")));
}

TEST(Daemon, HostIdComesFromMachineIdByDefault) {
  const std::string machine_id = ReadFirstLine("/etc/machine-id");
  if (machine_id.empty()) GTEST_SKIP() << "no /etc/machine-id here";
  auto daemon = DaemonUnderTest::Start();
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto stub = v1::Ops::NewStub((*daemon)->SocketChannel());
  grpc::ClientContext context;
  v1::Topology topology;
  ASSERT_TRUE(stub->GetTopology(&context, v1::GetTopologyRequest(), &topology).ok());
  EXPECT_EQ(topology.host_id(), machine_id);
}

TEST(Daemon, ReflectionListsServices) {
  auto daemon = DaemonUnderTest::Start();
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  EXPECT_THAT(ReflectedServices((*daemon)->SocketChannel()),
              IsSupersetOf({"epfabric.v1.Control", "epfabric.v1.Ops", "grpc.health.v1.Health"}));
  auto peer_address = (*daemon)->PeerAddress();
  ASSERT_TRUE(peer_address.ok());
  EXPECT_THAT(ReflectedServices(grpc::CreateChannel(*peer_address, grpc::InsecureChannelCredentials())),
              IsSupersetOf({"epfabric.v1.Peer", "epfabric.v1.Ops"}));
}

// grpcurl's `describe grpc.health.v1.Health`: the daemon's reflection finds the file that defines the health service
// (gRPC's own health service carries no descriptor; the daemon registers ours), and its health checks are counted
// under that service in epfabric_rpcs_total.
TEST(Daemon, ReflectionDescribesTheHealthServiceAndMetricsCountIt) {
  auto daemon = DaemonUnderTest::Start({"--metrics_listen=127.0.0.1:0"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub((*daemon)->SocketChannel());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  auto stream = stub->ServerReflectionInfo(&context);
  grpc::reflection::v1alpha::ServerReflectionRequest request;
  request.set_file_containing_symbol("grpc.health.v1.Health");
  ASSERT_TRUE(stream->Write(request));
  stream->WritesDone();
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_FALSE(response.has_error_response()) << response.error_response().error_message();
  ASSERT_GE(response.file_descriptor_response().file_descriptor_proto_size(), 1);
  EXPECT_NE(response.file_descriptor_response().file_descriptor_proto(0).find("grpc/health/v1/health.proto"),
            std::string::npos);
  (void)stream->Finish();

  ASSERT_TRUE(CheckHealth((*daemon)->SocketChannel(), "").ok());
  RunResult stats = RunBinary({EpctlBinary(), "--socket=" + (*daemon)->socket(), "stats"});
  ASSERT_EQ(stats.exit_code, 0) << stats.err;
  EXPECT_THAT(stats.out, ::testing::ContainsRegex("epfabric_rpcs_total [^\n]*method=Check[^\n]*"
                                                  "service=grpc.health.v1.Health"));
  EXPECT_THAT(stats.out, ::testing::Not(::testing::HasSubstr("service=unknown")));
}

TEST(Daemon, BadRequestIsRefusedAndTheDaemonKeepsServing) {
  auto daemon = DaemonUnderTest::Start();
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto control = v1::Control::NewStub((*daemon)->SocketChannel());
  grpc::ClientContext context;
  v1::CreateGroupResponse response;
  const grpc::Status status = control->CreateGroup(&context, v1::CreateGroupRequest(), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "name: '' must be 1-64 characters of [A-Za-z0-9._-]");
  auto health = CheckHealth((*daemon)->SocketChannel(), "");
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(*health, HealthCheckResponse::SERVING);
}

TEST(Daemon, ClientSocketHasRequestedMode) {
  auto daemon = DaemonUnderTest::Start();
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  struct stat st {};
  ASSERT_EQ(stat((*daemon)->socket().c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);

  auto restricted = DaemonUnderTest::Start({"--client_socket_mode=0600"});
  ASSERT_TRUE(restricted.ok()) << restricted.status();
  ASSERT_EQ(stat((*restricted)->socket().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

class StopSignal : public ::testing::TestWithParam<int> {};

TEST_P(StopSignal, ExitsZeroWithinTwoSecondsAndRemovesSocket) {
  auto daemon = DaemonUnderTest::Start();
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string socket = (*daemon)->socket();
  const absl::Time start = absl::Now();
  (*daemon)->process().Signal(GetParam());
  auto code = (*daemon)->process().Wait(absl::Seconds(5));
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(code.ok()) << "still running 5 s after the signal";
  EXPECT_EQ(*code, 0) << (*daemon)->process().Stderr();
  EXPECT_LT(took, absl::Seconds(2));
  EXPECT_FALSE(std::filesystem::exists(socket));
  EXPECT_THAT((*daemon)->process().Stderr(), HasSubstr("stopped"));
}

INSTANTIATE_TEST_SUITE_P(Daemon, StopSignal, ::testing::Values(SIGTERM, SIGINT));

TEST(Daemon, RefusesASocketHeldByALiveDaemon) {
  auto first = DaemonUnderTest::Start();
  ASSERT_TRUE(first.ok()) << first.status();
  RunResult second = RunBinary(WithPeerCredential({DaemonBinary(), "--client_socket=" + (*first)->socket()}));
  EXPECT_EQ(second.exit_code, 1);
  EXPECT_THAT(second.err, HasSubstr("is in use by a running daemon"));
  // The first one is unharmed.
  auto health = CheckHealth((*first)->SocketChannel(), "");
  ASSERT_TRUE(health.ok()) << health.status();
}

TEST(Daemon, ReplacesAStaleSocketFile) {
  const std::string dir = MakeTempDir();
  const std::string path = dir + "/stale.sock";
  // A socket file with nobody listening, as a daemon killed with SIGKILL leaves behind.
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  close(fd);
  ASSERT_TRUE(std::filesystem::exists(path));

  auto process = Subprocess::Start(WithPeerCredential({DaemonBinary(), "--client_socket=" + path}));
  ASSERT_TRUE(process.ok());
  absl::StatusOr<HealthCheckResponse::ServingStatus> health;
  for (int i = 0; i < 500; ++i) {
    health = CheckHealth(grpc::CreateChannel("unix:" + path, grpc::InsecureChannelCredentials()), "");
    if (health.ok()) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(health.ok()) << health.status() << process->Stderr();
  process->Signal(SIGTERM);
  EXPECT_EQ(process->Wait(absl::Seconds(5)).value_or(-1), 0);
  std::filesystem::remove_all(dir);
}

TEST(Daemon, RefusesToReplaceARegularFile) {
  const std::string dir = MakeTempDir();
  const std::string path = dir + "/not-a-socket";
  std::ofstream(path) << "data";
  RunResult result = RunBinary(WithPeerCredential({DaemonBinary(), "--client_socket=" + path}));
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_THAT(result.err, HasSubstr("exists and is not a socket"));
  EXPECT_TRUE(std::filesystem::exists(path));
  std::filesystem::remove_all(dir);
}

TEST(Daemon, CudaBackendWithoutGpuFailsClearly) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "this machine has a GPU";
  const std::string dir = MakeTempDir();
  RunResult result =
      RunBinary(WithPeerCredential({DaemonBinary(), "--client_socket=" + dir + "/d.sock", "--backend=cuda"}));
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_THAT(result.err, HasSubstr("no CUDA device is visible"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/d.sock"));
  std::filesystem::remove_all(dir);
}

struct BadFlags {
  std::vector<std::string> flags;
  std::string message;
  bool with_credential = true;  // add the test fabric secret unless the case is about credentials
};

void PrintTo(const BadFlags& bad, std::ostream* os) { *os << "[" << absl::StrJoin(bad.flags, " ") << "]"; }

class DaemonBadFlags : public ::testing::TestWithParam<BadFlags> {};

TEST_P(DaemonBadFlags, ExitTwoWithOneLineNamingTheFlag) {
  const std::string dir = MakeTempDir();
  auto expand = [&dir](std::string text) {
    if (const size_t at = text.find("$DIR"); at != std::string::npos) text.replace(at, 4, dir);
    return text;
  };
  std::vector<std::string> argv = {DaemonBinary()};
  for (const std::string& flag : GetParam().flags) argv.push_back(expand(flag));
  RunResult result = RunBinary(GetParam().with_credential ? WithPeerCredential(argv) : argv);
  EXPECT_EQ(result.exit_code, 2) << result.err;
  EXPECT_EQ(result.err, "epfabricd: " + expand(GetParam().message) + "\n");
  EXPECT_TRUE(std::filesystem::is_empty(dir)) << "nothing may be created";
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Daemon, DaemonBadFlags,
    ::testing::Values(
        BadFlags{{"--client_socket=$DIR/s", "--bogus=1"}, "--bogus: unknown flag"},
        BadFlags{{"--client_socket=$DIR/s", "--rank=abc"}, "--rank: Illegal value 'abc' specified for flag 'rank'"},
        BadFlags{{"--client_socket=$DIR/s", "--rank"}, "--rank: needs a value"},
        BadFlags{{"--client_socket=$DIR/s", "--rank=2", "--world_size=2", "--coordinator=127.0.0.1:1"},
                 "--rank: 2 is not in 0..1 (--world_size=2)"},
        BadFlags{{"--client_socket=$DIR/s", "--world_size=0"}, "--world_size: 0 is not in 1..4096"},
        BadFlags{{"--client_socket=$DIR/s", "--rank=1", "--world_size=2"},
                 "--coordinator: required when --world_size > 1 (host:port of rank 0's peer server)"},
        BadFlags{{"--client_socket=$DIR/s", "--world_size=2", "--coordinator=nohost"},
                 "--coordinator: 'nohost' is not host:port"},
        BadFlags{{"--client_socket=$DIR/s", "--peer_listen=0.0.0.0:7000"},
                 "--peer_listen: '0.0.0.0' is not a loopback address; give --tls_cert/--tls_key/--tls_ca for mutual "
                 "TLS, or --insecure_peer_port to listen without it"},
        BadFlags{{"--client_socket=$DIR/s", "--tls_cert=/etc/hostname"},
                 "--tls_key: --tls_cert, --tls_key and --tls_ca go together: give all three or none"},
        BadFlags{{"--client_socket=$DIR/s", "--tls_cert=$DIR/c", "--tls_key=$DIR/k", "--tls_ca=$DIR/a"},
                 "--tls_cert: '$DIR/c' is not a readable file"},
        BadFlags{{"--client_socket=$DIR/s", "--heartbeat_ms=5"}, "--heartbeat_ms: 5 is not in 10..60000"},
        BadFlags{{"--client_socket=$DIR/s", "--proxy_max_sleep_us=5"}, "--proxy_max_sleep_us: 5 is not in 10..100000"},
        BadFlags{{"--client_socket=$DIR/s", "--memory_sharing=nccl"},
                 "--memory_sharing: 'nccl' is not one of posix_fd, cuda_ipc"},
        BadFlags{{"--client_socket=$DIR/s", "--fabric_id="}, "--fabric_id: must be 1-128 bytes"},
        BadFlags{{"--client_socket=$DIR/s", "--peer_listen=127.0.0.1:70000"},
                 "--peer_listen: '127.0.0.1:70000' has no port in 0..65535"},
        BadFlags{{}, "--client_socket: required (path of the client Unix socket)"},
        BadFlags{{"--client_socket=$DIR/missing/s"}, "--client_socket: directory '$DIR/missing' does not exist"},
        BadFlags{{"--client_socket=$DIR/s", "--backend=tpu"}, "--backend: 'tpu' is not one of auto, cuda, host"},
        BadFlags{{"--client_socket=$DIR/s", "--backend=host", "--device=0"},
                 "--device: applies only to --backend=cuda or auto"},
        BadFlags{{"--client_socket=$DIR/s", "--client_socket_mode=999"},
                 "--client_socket_mode: '999' is not an octal mode"},
        BadFlags{{"--client_socket=$DIR/s", "--client_socket_mode=0060"},
                 "--client_socket_mode: the daemon's own user needs read and write (0600)"},
        BadFlags{{"--client_socket=$DIR/s", "--log_level=loud"},
                 "--log_level: 'loud' is not one of trace, debug, info, warn, error, critical, off"},
        BadFlags{{"--client_socket=$DIR/s", "extra"}, "unexpected argument 'extra'"}));

TEST(Daemon, HelpAndVersionExitZero) {
  RunResult help = RunBinary({DaemonBinary(), "--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_THAT(help.out, HasSubstr("--client_socket="));
  EXPECT_THAT(help.out, HasSubstr("--world_size=1"));
  RunResult version = RunBinary({DaemonBinary(), "--version"});
  EXPECT_EQ(version.exit_code, 0);
  EXPECT_EQ(version.out, absl::StrCat("epfabricd ", EPF_VERSION, "\n"));
}

TEST(Epctl, UsageErrorsExitTwo) {
  RunResult none = RunBinary({EpctlBinary()});
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_THAT(none.err, HasSubstr("Commands:"));
  RunResult unknown = RunBinary({EpctlBinary(), "--socket=/x", "frobnicate"});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_EQ(unknown.err, "epctl: unknown command 'frobnicate' (see epctl --help)\n");
  RunResult both = RunBinary({EpctlBinary(), "--socket=/x", "--address=127.0.0.1:1", "health"});
  EXPECT_EQ(both.exit_code, 2);
  EXPECT_EQ(both.err,
            "epctl: give exactly one of --socket=PATH and --address=HOST:PORT (or set EPFABRIC_SOCKET to the daemon's "
            "socket)\n");
  RunResult neither = RunBinary({EpctlBinary(), "topology"});
  EXPECT_EQ(neither.exit_code, 2);
}

TEST(Epctl, HelpForEveryCommand) {
  for (const char* command : {"health", "topology"}) {
    RunResult help = RunBinary({EpctlBinary(), command, "--help"});
    EXPECT_EQ(help.exit_code, 0) << command;
    EXPECT_THAT(help.out, HasSubstr(absl::StrCat("epctl ", command))) << command;
  }
  RunResult help = RunBinary({EpctlBinary(), "--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_THAT(help.out, HasSubstr("--socket="));
}

}  // namespace
}  // namespace epfabric::testing
