// epctl: the ops command line for epfabricd. `epctl [--socket=PATH | --address=HOST:PORT] COMMAND [--json]`.
#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "absl/flags/flag.h"
#include "epctl/commands.h"
#include "epfabric/common/cli.h"
#include "epfabric/common/peer_auth.h"

ABSL_FLAG(std::string, socket, "",
          "Unix socket of the daemon (its --client_socket); default $EPFABRIC_SOCKET when --address is not given.");
ABSL_FLAG(std::string, address, "", "host:port of the daemon's peer port, instead of --socket.");
ABSL_FLAG(int, timeout_ms, 5000, "Deadline of each call in milliseconds.");
ABSL_FLAG(bool, json, false, "Print JSON instead of text.");
ABSL_FLAG(std::string, service, "", "health: the service to ask about (default: the daemon as a whole).");
ABSL_FLAG(int, wait_ms, 0, "health: ask again every 100 ms until SERVING or this many milliseconds have passed.");
ABSL_FLAG(std::string, command, "", "schema: the command whose --json output to describe.");
ABSL_FLAG(bool, version, false, "Print epctl's version and exit.");
ABSL_FLAG(std::string, group, "", "create-group/delete-group: the group's name; stats: only this group's series.");
ABSL_FLAG(std::string, ranks, "", "create-group: fabric ranks of the members, comma-separated.");
ABSL_FLAG(uint64_t, nvl_bytes, 0, "create-group: bytes of the NVLink region per member.");
ABSL_FLAG(uint64_t, rdma_bytes, 0, "create-group: bytes of the RDMA region per member.");
ABSL_FLAG(uint32_t, transport_channels, 0, "create-group: transport command rings per member (0: default 4).");
ABSL_FLAG(uint32_t, ring_slots, 0, "create-group: slots per command ring, a power of two (0: default 1024).");
ABSL_FLAG(bool, low_latency, false, "create-group: lay regions out for the low-latency kernels.");
ABSL_FLAG(uint64_t, normal_bytes, 0,
          "create-group --low_latency: bytes at the start of each NVL region for normal mode (the group serves both).");
ABSL_FLAG(uint64_t, normal_rdma_bytes, 0,
          "create-group --low_latency --normal_bytes with --rdma_bytes: the same for each RDMA region (across hosts).");
ABSL_FLAG(std::string, sharing, "", "create-group: posix_fd, cuda_ipc or posix_shm (default: the daemon's).");
ABSL_FLAG(std::string, token, "", "delete-group: the group's token.");
ABSL_FLAG(bool, force, false, "delete-group: without the token (the daemon's own uid or root only; logged).");
ABSL_FLAG(bool, watch, false, "stats: print again every --interval_ms.");
ABSL_FLAG(int, interval_ms, 2000, "stats --watch: milliseconds between reports.");
ABSL_FLAG(int, count, 0, "stats --watch: number of reports (0: until interrupted).");
ABSL_FLAG(std::string, fabric_secret_file, "",
          "With --address to a peer port on loopback: the fabric secret file (mode 0600); epctl calls as ops tooling.");
ABSL_FLAG(std::string, fabric_id, "epfabric", "With --fabric_secret_file: the daemon's --fabric_id.");
ABSL_FLAG(std::string, tls_ca, "", "With --address to a mutual-TLS peer port: PEM CA bundle.");
ABSL_FLAG(std::string, tls_cert, "", "With --address to a mutual-TLS peer port: PEM client certificate.");
ABSL_FLAG(std::string, tls_key, "", "With --address to a mutual-TLS peer port: PEM client key.");
ABSL_FLAG(std::string, tls_target_name, "",
          "With --tls_*: the name to check in the daemon's certificate instead of the host of --address.");

namespace {

void PrintUsage(std::ostream& out) {
  out << "epctl: ops tool for epfabricd.\n"
         "Usage: epctl [--socket=PATH | --address=HOST:PORT] [--json] [--timeout_ms=N] COMMAND\n"
         "       (no --socket or --address: the socket in $EPFABRIC_SOCKET)\n"
         "       epctl COMMAND --help\n\nCommands:\n";
  for (const auto& command : epfabric::epctl::Commands()) {
    out << "  " << command.name << std::string(14 - std::min<size_t>(13, command.name.size()), ' ') << command.summary
        << "\n";
  }
  out << "\nFlags:\n" << epfabric::cli::FlagsHelp("epctl/main.cc");
}

int UsageError(const std::string& message) {
  std::cerr << "epctl: " << message << "\n";
  return epfabric::cli::kExitUsage;
}

}  // namespace

// The daemon's socket when neither --socket nor --address is given: $EPFABRIC_SOCKET, as the client library reads
// it. A template for several ranks ("gpu{local_rank}.sock") names no one socket.
absl::StatusOr<std::string> DefaultSocket() {
  const char* env = std::getenv("EPFABRIC_SOCKET");
  if (env == nullptr || *env == '\0') return std::string();
  const std::string socket = env;
  if (socket.find('{') != std::string::npos) {
    return absl::InvalidArgumentError("EPFABRIC_SOCKET='" + socket +
                                      "' is a template for several ranks; give --socket=PATH for one daemon");
  }
  return socket;
}

int main(int argc, char** argv) {
  auto args = epfabric::cli::ParseFlags(argc, argv);
  if (!args.ok()) return UsageError(std::string(args.status().message()));
  if (absl::GetFlag(FLAGS_version)) {
    std::cout << "epctl " << EPF_VERSION << "\n";
    return epfabric::cli::kExitOk;
  }
  if (args->positional.empty()) {
    if (args->help) {
      PrintUsage(std::cout);
      return epfabric::cli::kExitOk;
    }
    PrintUsage(std::cerr);
    return epfabric::cli::kExitUsage;
  }
  if (args->positional.size() > 1) return UsageError("unexpected argument '" + args->positional[1] + "'");
  const epfabric::epctl::Command* command = epfabric::epctl::FindCommand(args->positional[0]);
  if (command == nullptr) return UsageError("unknown command '" + args->positional[0] + "' (see epctl --help)");
  if (args->help) {
    std::cout << command->help;
    return epfabric::cli::kExitOk;
  }

  epfabric::epctl::GlobalOptions options;
  options.socket = absl::GetFlag(FLAGS_socket);
  options.address = absl::GetFlag(FLAGS_address);
  options.timeout_ms = absl::GetFlag(FLAGS_timeout_ms);
  options.json = absl::GetFlag(FLAGS_json);
  options.service = absl::GetFlag(FLAGS_service);
  options.wait_ms = absl::GetFlag(FLAGS_wait_ms);
  options.command = absl::GetFlag(FLAGS_command);
  options.tls_target_name = absl::GetFlag(FLAGS_tls_target_name);
  options.group = absl::GetFlag(FLAGS_group);
  options.ranks = absl::GetFlag(FLAGS_ranks);
  options.nvl_bytes = absl::GetFlag(FLAGS_nvl_bytes);
  options.rdma_bytes = absl::GetFlag(FLAGS_rdma_bytes);
  options.low_latency = absl::GetFlag(FLAGS_low_latency);
  options.normal_bytes = absl::GetFlag(FLAGS_normal_bytes);
  options.normal_rdma_bytes = absl::GetFlag(FLAGS_normal_rdma_bytes);
  options.transport_channels = absl::GetFlag(FLAGS_transport_channels);
  options.ring_slots = absl::GetFlag(FLAGS_ring_slots);
  options.sharing = absl::GetFlag(FLAGS_sharing);
  options.token = absl::GetFlag(FLAGS_token);
  options.force = absl::GetFlag(FLAGS_force);
  options.watch = absl::GetFlag(FLAGS_watch);
  options.interval_ms = absl::GetFlag(FLAGS_interval_ms);
  options.count = absl::GetFlag(FLAGS_count);
  options.tls_ca = absl::GetFlag(FLAGS_tls_ca);
  options.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key = absl::GetFlag(FLAGS_tls_key);
  options.fabric_secret_file = absl::GetFlag(FLAGS_fabric_secret_file);
  options.fabric_id = absl::GetFlag(FLAGS_fabric_id);
  if (!epfabric::epctl::NeedsDaemon(command->name)) {
    return command->run(options, nullptr, std::cout, std::cerr);
  }
  if (options.socket.empty() && options.address.empty()) {
    auto socket = DefaultSocket();
    if (!socket.ok()) return UsageError(std::string(socket.status().message()));
    options.socket = *socket;
  }
  if (!options.tls_target_name.empty() && options.tls_ca.empty()) {
    return UsageError("--tls_target_name: only with --tls_ca/--tls_cert/--tls_key");
  }
  if (absl::Status valid = epfabric::epctl::ValidateGlobalOptions(options); !valid.ok()) {
    return UsageError(std::string(valid.message()));
  }
  auto credentials = epfabric::epctl::CredentialsFor(options);
  if (!credentials.ok()) return UsageError(std::string(credentials.status().message()));
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  if (!options.fabric_secret_file.empty()) {
    auto secret = epfabric::common::ReadFabricSecretFile(options.fabric_secret_file, "fabric_secret_file");
    if (!secret.ok()) return UsageError(std::string(secret.status().message()));
    interceptors.push_back(epfabric::common::MakePeerProofInterceptorFactory(
        *secret, options.fabric_id, epfabric::common::PeerProofClaim{epfabric::common::PeerRole::kOps, -1},
        epfabric::common::PeerAudience(options.address)));
  }
  grpc::ChannelArguments channel_args;
  if (!options.tls_target_name.empty()) channel_args.SetSslTargetNameOverride(options.tls_target_name);
  auto channel = grpc::experimental::CreateCustomChannelWithInterceptors(
      epfabric::epctl::TargetOf(options), *credentials, channel_args, std::move(interceptors));
  return command->run(options, channel, std::cout, std::cerr);
}
