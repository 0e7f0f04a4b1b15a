// What an epfabricd is told to be: parsed from flags by main(), validated before anything starts.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace epfabric::daemon {

enum class BackendChoice { kAuto, kCuda, kHost };

absl::StatusOr<BackendChoice> ParseBackendChoice(const std::string& text);

struct DaemonOptions {
  int rank = 0;
  int world_size = 1;
  // host:port of rank 0's peer server. Required when world_size > 1.
  std::string coordinator;
  // host:port for this daemon's peer server; port 0 picks a free port.
  std::string peer_listen = "127.0.0.1:0";
  // Serve the peer port without any credential (tests only): no TLS, no fabric secret.
  bool insecure_peer_port = false;
  // File (mode 0600, owned by this user) holding the fabric secret that authenticates peer calls on loopback.
  std::string fabric_secret_file;
  // Unix socket for clients and local ops tooling.
  std::string client_socket;
  // Permission bits of the client socket file.
  uint32_t client_socket_mode = 0660;
  BackendChoice backend = BackendChoice::kAuto;
  // CUDA ordinal; -1 picks rank modulo the number of visible GPUs.
  int device = -1;
  // spdlog level name.
  std::string log_level = "info";
  // "text" (one readable line per record) or "json" (one JSON object per line, for log collectors).
  std::string log_format = "text";
  // host:port of the Prometheus endpoint (GET /metrics); empty: no endpoint. Port 0 picks a free port.
  std::string metrics_listen;
  // Metrics: one series per expert (tokens received) besides the per-group load imbalance; off by default because
  // its cardinality is groups x experts.
  bool metrics_expert_series = false;
  // Overrides the machine id used to tell hosts apart (Kubernetes: the node name).
  std::string host_id;
  // Root of sysfs and of /etc, /proc: tests point it at a fake tree.
  std::string system_root = "/";

  // Fabric: daemons with another id are refused.
  std::string fabric_id = "epfabric";
  int heartbeat_ms = 1000;
  int heartbeat_misses = 3;
  // Largest region this daemon allocates for one group (0: no limit of ours; the device or shm decides).
  uint64_t max_region_bytes = 0;
  // cuda backend: "posix_fd" (cuMem + file descriptor over the socket) or "cuda_ipc".
  std::string memory_sharing = "posix_fd";
  // Quotas (RESOURCE_EXHAUSTED beyond): groups held by this daemon, and bytes of their regions (0: derived from the
  // machine: half its memory on the host backend, 90% of the GPU's on cuda; UINT64_MAX: none).
  int max_groups = 256;
  uint64_t max_total_region_bytes = 0;
  // Per client identity (a tenant label, else host and uid), counted by the coordinator across the fabric: groups,
  // and bytes of regions on any one member (0 for bytes: half of max_total_region_bytes as derived; 0 for groups:
  // none).
  int max_groups_per_client = 64;
  uint64_t max_region_bytes_per_client = 0;
  // "uid=label,uid=label": uids whose clients count as one tenant for the quotas (empty: every uid on its own).
  std::string tenant_labels;
  // Default client lease TTL.
  int lease_ttl_ms = 10000;
  // Mutual TLS on the peer port: all three or none.
  std::string tls_cert;
  std::string tls_key;
  std::string tls_ca;
  // Name checked in peers' certificates instead of the dialled host.
  std::string tls_target_name;
  // Ranks (daemons) of one LeaderWorkerSet pod: a pod certificate ("epfabric-member:<lws>:pod:<pod>") covers
  // [worker x ranks_per_pod, (worker + 1) x ranks_per_pod) (daemon/security/member_identity.h). 0: pod certificates
  // are refused, this daemon's own included.
  int ranks_per_pod = 0;

  // Transport between hosts (docs/internode.md): "auto" (verbs when a device can register the regions, else
  // socket), "socket" or "verbs".
  std::string transport = "auto";
  // Socket wire: host:port of the data listener; "" = the peer listener's host, any free port.
  std::string data_listen;
  // Proxy threads that drain the command rings, how long an idle one spins before it sleeps, and its longest pause.
  int proxy_threads = 2;
  int proxy_spin_us = 1000;
  int proxy_max_sleep_us = 1000;
};

// --tenant_labels parsed: uid -> label. Labels are [A-Za-z0-9._-]{1,63}.
absl::StatusOr<std::map<int64_t, std::string>> ParseTenantLabels(const std::string& text);

// Checks every field and their combinations. The error message starts with the offending flag ("--rank: ...").
absl::Status ValidateOptions(const DaemonOptions& options);

// Splits "host:port" ("[::1]:7000" for IPv6). The port must be 0..65535; the host must not be empty.
struct HostPort {
  std::string host;
  int port = 0;
};
absl::StatusOr<HostPort> ParseHostPort(const std::string& text);

// True for 127.0.0.0/8, ::1 and "localhost".
bool IsLoopbackHost(const std::string& host);

}  // namespace epfabric::daemon
