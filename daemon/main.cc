// epfabricd: one per GPU. Parses flags, starts the daemon, waits for SIGTERM/SIGINT, shuts down cleanly.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "epfabric/common/cli.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/daemon/daemon.h"
#include "logging.h"
#include "transport/verbs/verbs_probe.h"

ABSL_FLAG(int, rank, 0, "This daemon's rank in the fabric (0 is the coordinator).");
ABSL_FLAG(int, world_size, 1, "Number of daemons in the fabric.");
ABSL_FLAG(std::string, coordinator, "", "host:port of rank 0's peer server; required when --world_size > 1.");
ABSL_FLAG(std::string, peer_listen, "127.0.0.1:0",
          "host:port for the peer server (port 0 picks a free one). Loopback only unless --insecure_peer_port.");
ABSL_FLAG(bool, insecure_peer_port, false,
          "Serve the peer port without credentials (no TLS, no fabric secret), on any address. Tests only.");
ABSL_FLAG(int, max_groups, 256, "Most groups this daemon holds at once (RESOURCE_EXHAUSTED beyond).");
ABSL_FLAG(uint64_t, max_total_region_bytes, 0,
          "Most bytes of regions this daemon holds for all its groups together (0: half the machine's memory on the "
          "host backend, 90% of the GPU's on cuda; 18446744073709551615: no limit of ours).");
ABSL_FLAG(int, max_groups_per_client, 64,
          "Most groups one client identity (a --tenant_labels label, else host and uid) holds across the fabric; "
          "counted by the coordinator (0: no limit).");
ABSL_FLAG(uint64_t, max_region_bytes_per_client, 0,
          "Most bytes of regions one client identity's groups hold on any one member; counted by the coordinator "
          "(0: half of --max_total_region_bytes as in effect).");
ABSL_FLAG(std::string, tenant_labels, "",
          "uid=label,uid=label: uids whose clients count as one tenant for the per-client quotas.");
ABSL_FLAG(std::string, fabric_secret_file, "",
          "File (mode 0600, owned by this user, >= 16 bytes) holding the fabric secret: every peer call carries an "
          "HMAC proof made with it. For fabrics on one host (loopback); across hosts use --tls_*.");
ABSL_FLAG(std::string, client_socket, "", "Path of the Unix socket for clients and local tooling (required).");
ABSL_FLAG(std::string, client_socket_mode, "0660", "Permission bits of the client socket, in octal.");
ABSL_FLAG(std::string, backend, "auto", "auto (cuda when a GPU is visible, else host), cuda or host.");
ABSL_FLAG(int, device, -1, "CUDA device ordinal; -1 picks rank modulo the number of visible GPUs.");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error, critical or off.");
ABSL_FLAG(std::string, log_format, "text",
          "text (readable lines) or json (one JSON object per line: time, level, logger, message, pid).");
ABSL_FLAG(std::string, metrics_listen, "",
          "host:port for the Prometheus endpoint (GET /metrics, text format); empty: none. Port 0 picks a free one. "
          "Shows no tokens, lease ids, pids or uids; group names and counts are visible to whoever can reach it.");
ABSL_FLAG(bool, metrics_expert_series, false,
          "Export epfabric_expert_tokens_received_total per expert (groups x experts series) besides the load "
          "imbalance per group.");
ABSL_FLAG(std::string, host_id, "", "Overrides the machine id that tells hosts apart (e.g. the Kubernetes node).");
ABSL_FLAG(std::string, system_root, "/", "Root under which /sys and /etc are read (for tests).");
ABSL_FLAG(std::string, fabric_id, "epfabric", "Fabric id: daemons with another id are refused.");
ABSL_FLAG(int, heartbeat_ms, 1000, "Heartbeat interval in milliseconds.");
ABSL_FLAG(int, heartbeat_misses, 3, "Missed heartbeats after which a rank is marked down.");
ABSL_FLAG(uint64_t, max_region_bytes, 0, "Largest region this daemon allocates for one group (0: no own limit).");
ABSL_FLAG(std::string, memory_sharing, "posix_fd",
          "cuda backend: posix_fd (cuMem + file descriptor over the socket) or cuda_ipc.");
ABSL_FLAG(int, lease_ttl_ms, 10000, "Default lease TTL of an attached client in milliseconds.");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate for mutual TLS on the peer port (with --tls_key, --tls_ca).");
ABSL_FLAG(std::string, tls_key, "", "PEM private key for mutual TLS on the peer port.");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA bundle that peers' certificates must chain to.");
ABSL_FLAG(std::string, tls_target_name, "", "Name to check in peers' certificates instead of the dialled host.");
ABSL_FLAG(int, ranks_per_pod, 0,
          "Daemons per LeaderWorkerSet pod: a certificate with CN epfabric-member:<lws>:pod:<pod name> acts as ranks "
          "[w x N, (w + 1) x N) of fabric <lws>-<group> (w: the pod's worker index). 0: pod certificates are refused.");
ABSL_FLAG(
    std::string, transport, "auto",
    "Wire between hosts: auto (verbs when an RDMA device can register the regions, else socket), socket or verbs.");
ABSL_FLAG(std::string, data_listen, "",
          "Socket wire: host:port of the data listener; empty = the --peer_listen host, any free port.");
ABSL_FLAG(int, proxy_threads, 2, "Threads that drain the transport's command rings (1..64).");
ABSL_FLAG(int, proxy_spin_us, 1000, "How long an idle proxy thread spins before it sleeps, in microseconds.");
ABSL_FLAG(int, proxy_max_sleep_us, 1000,
          "The longest pause of an idle proxy thread, in microseconds (the pause grows to 1/20 of the idle time): a "
          "command posted during a pause waits up to this long.");
ABSL_FLAG(bool, version, false, "Print the version and exit.");

namespace {

using epfabric::daemon::DaemonOptions;

constexpr const char* kUsage =
    "epfabricd: the epfabric daemon, one per GPU. Serves clients on a Unix socket and peers on a TCP port.\n"
    "Usage: epfabricd --client_socket=PATH [--rank=R --world_size=W --coordinator=HOST:PORT] [flags]\n\nFlags:\n";

absl::StatusOr<DaemonOptions> OptionsFromFlags() {
  DaemonOptions o;
  o.rank = absl::GetFlag(FLAGS_rank);
  o.world_size = absl::GetFlag(FLAGS_world_size);
  o.coordinator = absl::GetFlag(FLAGS_coordinator);
  o.peer_listen = absl::GetFlag(FLAGS_peer_listen);
  o.insecure_peer_port = absl::GetFlag(FLAGS_insecure_peer_port);
  o.fabric_secret_file = absl::GetFlag(FLAGS_fabric_secret_file);
  o.max_groups = absl::GetFlag(FLAGS_max_groups);
  o.max_total_region_bytes = absl::GetFlag(FLAGS_max_total_region_bytes);
  o.max_groups_per_client = absl::GetFlag(FLAGS_max_groups_per_client);
  o.max_region_bytes_per_client = absl::GetFlag(FLAGS_max_region_bytes_per_client);
  o.tenant_labels = absl::GetFlag(FLAGS_tenant_labels);
  o.client_socket = absl::GetFlag(FLAGS_client_socket);
  const std::string mode = absl::GetFlag(FLAGS_client_socket_mode);
  if (mode.empty() || mode.find_first_not_of("01234567") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("--client_socket_mode: '", mode, "' is not an octal mode"));
  }
  o.client_socket_mode = static_cast<uint32_t>(std::stoul(mode.substr(0, 6), nullptr, 8));
  EPF_ASSIGN_OR_RETURN(o.backend, epfabric::daemon::ParseBackendChoice(absl::GetFlag(FLAGS_backend)));
  o.device = absl::GetFlag(FLAGS_device);
  o.log_level = absl::GetFlag(FLAGS_log_level);
  o.log_format = absl::GetFlag(FLAGS_log_format);
  o.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  o.metrics_expert_series = absl::GetFlag(FLAGS_metrics_expert_series);
  o.host_id = absl::GetFlag(FLAGS_host_id);
  o.system_root = absl::GetFlag(FLAGS_system_root);
  o.fabric_id = absl::GetFlag(FLAGS_fabric_id);
  o.heartbeat_ms = absl::GetFlag(FLAGS_heartbeat_ms);
  o.heartbeat_misses = absl::GetFlag(FLAGS_heartbeat_misses);
  o.max_region_bytes = absl::GetFlag(FLAGS_max_region_bytes);
  o.memory_sharing = absl::GetFlag(FLAGS_memory_sharing);
  o.lease_ttl_ms = absl::GetFlag(FLAGS_lease_ttl_ms);
  o.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  o.tls_key = absl::GetFlag(FLAGS_tls_key);
  o.tls_ca = absl::GetFlag(FLAGS_tls_ca);
  o.tls_target_name = absl::GetFlag(FLAGS_tls_target_name);
  o.ranks_per_pod = absl::GetFlag(FLAGS_ranks_per_pod);
  o.transport = absl::GetFlag(FLAGS_transport);
  o.data_listen = absl::GetFlag(FLAGS_data_listen);
  o.proxy_threads = absl::GetFlag(FLAGS_proxy_threads);
  o.proxy_spin_us = absl::GetFlag(FLAGS_proxy_spin_us);
  o.proxy_max_sleep_us = absl::GetFlag(FLAGS_proxy_max_sleep_us);
  EPF_RETURN_IF_ERROR(epfabric::daemon::ValidateOptions(o));
  return o;
}

int UsageError(const std::string& message) {
  std::fprintf(stderr, "epfabricd: %s\n", message.c_str());
  return epfabric::cli::kExitUsage;
}

}  // namespace

int main(int argc, char** argv) {
  // Block the termination signals before any thread exists (gRPC starts several), so that only sigwait() below
  // receives them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  auto args = epfabric::cli::ParseFlags(argc, argv);
  if (!args.ok()) return UsageError(std::string(args.status().message()));
  if (args->help) {
    std::printf("%s%s", kUsage, epfabric::cli::FlagsHelp("daemon/main.cc").c_str());
    return epfabric::cli::kExitOk;
  }
  if (absl::GetFlag(FLAGS_version)) {
    std::printf("epfabricd %s\n", EPF_VERSION);
    return epfabric::cli::kExitOk;
  }
  if (!args->positional.empty()) return UsageError(absl::StrCat("unexpected argument '", args->positional[0], "'"));
  auto options = OptionsFromFlags();
  if (!options.ok()) return UsageError(std::string(options.status().message()));
  // --transport=verbs on a machine without a usable RDMA device is a configuration error: one line, exit 2.
  if (options->transport == "verbs") {
    if (absl::Status usable = epfabric::daemon::transport::verbs::ProbeVerbs(); !usable.ok()) {
      return UsageError(std::string(usable.message()));
    }
  }

  epfabric::daemon::SetLogFormat(options->log_format);
  epfabric::daemon::SetLogLevel(options->log_level);
  auto log = epfabric::daemon::Logger("daemon");
  auto daemon = epfabric::daemon::Daemon::Start(*options);
  if (!daemon.ok()) {
    log->error("{}", std::string(daemon.status().message()));
    return epfabric::cli::kExitFailure;
  }

  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  log->info("received {}", signal_number == SIGTERM ? "SIGTERM" : "SIGINT");
  // Leave room within the 2-second budget for releasing resources after the drain.
  (*daemon)->Shutdown(absl::Milliseconds(1500));
  return epfabric::cli::kExitOk;
}
