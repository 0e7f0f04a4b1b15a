#include "epfabric/daemon/options.h"

#include <sys/stat.h>
#include <sys/un.h>

#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "epfabric/common/peer_auth.h"
#include "epfabric/common/status_macros.h"
#include "security/member_identity.h"
#include "spdlog/common.h"

namespace epfabric::daemon {

absl::StatusOr<BackendChoice> ParseBackendChoice(const std::string& text) {
  if (text == "auto") return BackendChoice::kAuto;
  if (text == "cuda") return BackendChoice::kCuda;
  if (text == "host") return BackendChoice::kHost;
  return absl::InvalidArgumentError(absl::StrCat("--backend: '", text, "' is not one of auto, cuda, host"));
}

absl::StatusOr<HostPort> ParseHostPort(const std::string& text) {
  HostPort result;
  std::string port_text;
  if (absl::StartsWith(text, "[")) {
    const size_t close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not [ipv6]:port"));
    }
    result.host = text.substr(1, close - 1);
    port_text = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == std::string::npos) return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not host:port"));
    result.host = text.substr(0, colon);
    port_text = text.substr(colon + 1);
    if (absl::StrContains(result.host, ':')) {
      return absl::InvalidArgumentError(absl::StrCat("'", text, "': write IPv6 addresses as [addr]:port"));
    }
  }
  if (result.host.empty()) return absl::InvalidArgumentError(absl::StrCat("'", text, "' has no host"));
  if (!absl::SimpleAtoi(port_text, &result.port) || result.port < 0 || result.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("'", text, "' has no port in 0..65535"));
  }
  return result;
}

bool IsLoopbackHost(const std::string& host) {
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

namespace {

absl::Status FlagError(const char* flag, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", message));
}

// This daemon's own certificate must let it act as its --rank in its --fabric_id: its peers would refuse every call
// otherwise, and a daemon that starts anyway hangs unready instead of saying which certificate it holds.
absl::Status CheckOwnCertificate(const DaemonOptions& o) {
  absl::StatusOr<std::string> cn = security::CertificateCommonName(o.tls_cert);
  if (!cn.ok()) return FlagError("tls_cert", std::string(cn.status().message()));
  absl::StatusOr<security::MemberScope> scope = security::MemberScopeOf(*cn, o.fabric_id, o.ranks_per_pod);
  if (!scope.ok()) {
    return FlagError("tls_cert", absl::StrCat(scope.status().message(), "; this daemon is rank ", o.rank, " of fabric ",
                                              o.fabric_id, " (--ranks_per_pod=", o.ranks_per_pod, ")"));
  }
  if (!scope->Covers(o.rank)) {
    return FlagError("tls_cert", absl::StrCat("the certificate (CN '", *cn, "') names ", scope->Describe(),
                                              " of fabric ", o.fabric_id, ", not --rank=", o.rank));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::map<int64_t, std::string>> ParseTenantLabels(const std::string& text) {
  std::map<int64_t, std::string> labels;
  if (text.empty()) return labels;
  for (absl::string_view pair : absl::StrSplit(text, ',')) {
    const size_t eq = pair.find('=');
    int64_t uid = -1;
    if (eq == absl::string_view::npos || !absl::SimpleAtoi(pair.substr(0, eq), &uid) || uid < 0) {
      return absl::InvalidArgumentError(absl::StrCat("'", pair, "' is not uid=label"));
    }
    const absl::string_view label = pair.substr(eq + 1);
    if (label.empty() || label.size() > 63 ||
        label.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-") !=
            absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("label '", label, "' of uid ", uid, " is not [A-Za-z0-9._-]{1,63}"));
    }
    labels[uid] = std::string(label);
  }
  return labels;
}

absl::Status ValidateOptions(const DaemonOptions& o) {
  if (o.world_size < 1 || o.world_size > 4096) {
    return FlagError("world_size", absl::StrCat(o.world_size, " is not in 1..4096"));
  }
  if (o.rank < 0 || o.rank >= o.world_size) {
    return FlagError("rank",
                     absl::StrCat(o.rank, " is not in 0..", o.world_size - 1, " (--world_size=", o.world_size, ")"));
  }
  // Rank 0 is the coordinator: it needs no address of itself.
  if (o.world_size > 1 && o.rank != 0 && o.coordinator.empty()) {
    return FlagError("coordinator", "required when --world_size > 1 (host:port of rank 0's peer server)");
  }
  if (!o.coordinator.empty()) {
    auto coordinator = ParseHostPort(o.coordinator);
    if (!coordinator.ok()) return FlagError("coordinator", std::string(coordinator.status().message()));
    if (coordinator->port == 0) return FlagError("coordinator", "port 0 cannot be dialled");
  }
  const int tls_files = !o.tls_cert.empty() + !o.tls_key.empty() + !o.tls_ca.empty();
  if (tls_files != 0 && tls_files != 3) {
    return FlagError(o.tls_cert.empty() ? "tls_cert" : (o.tls_key.empty() ? "tls_key" : "tls_ca"),
                     "--tls_cert, --tls_key and --tls_ca go together: give all three or none");
  }
  for (auto [flag, path] :
       {std::pair{"tls_cert", o.tls_cert}, std::pair{"tls_key", o.tls_key}, std::pair{"tls_ca", o.tls_ca}}) {
    std::error_code ec;
    if (!path.empty() && !std::filesystem::is_regular_file(path, ec)) {
      return FlagError(flag, absl::StrCat("'", path, "' is not a readable file"));
    }
  }
  if (o.ranks_per_pod < 0 || o.ranks_per_pod > security::kMaxFabricRanks) {
    return FlagError("ranks_per_pod", absl::StrCat(o.ranks_per_pod, " is not in 0..", security::kMaxFabricRanks));
  }
  if (tls_files == 3) EPF_RETURN_IF_ERROR(CheckOwnCertificate(o));
  auto listen = ParseHostPort(o.peer_listen);
  if (!listen.ok()) return FlagError("peer_listen", std::string(listen.status().message()));
  // A fabric secret never protects traffic that leaves the host: its proofs travel with the requests in plaintext.
  if (!IsLoopbackHost(listen->host) && !o.insecure_peer_port && tls_files == 0) {
    return FlagError("peer_listen",
                     absl::StrCat("'", listen->host,
                                  "' is not a loopback address; give --tls_cert/--tls_key/--tls_ca for mutual TLS, or "
                                  "--insecure_peer_port to listen without it"));
  }
  if (!o.fabric_secret_file.empty()) {
    EPF_RETURN_IF_ERROR(common::ReadFabricSecretFile(o.fabric_secret_file, "fabric_secret_file"));
  }
  if (o.transport != "auto" && o.transport != "socket" && o.transport != "verbs") {
    return FlagError("transport", absl::StrCat("'", o.transport, "' is not auto, socket or verbs"));
  }
  if (!o.data_listen.empty()) {
    auto data = ParseHostPort(o.data_listen);
    if (!data.ok()) return FlagError("data_listen", std::string(data.status().message()));
    // The data port proves each connection's group, but its frames travel in plaintext: off the host only where the
    // operator said the network is trusted (the same rule as the peer port's).
    if (!IsLoopbackHost(data->host) && !o.insecure_peer_port && tls_files == 0) {
      return FlagError("data_listen",
                       absl::StrCat("'", data->host,
                                    "' is not a loopback address; the socket wire carries data in plaintext: give "
                                    "--tls_cert/--tls_key/--tls_ca (a fabric between hosts) or --insecure_peer_port"));
    }
  }
  if (o.proxy_threads < 1 || o.proxy_threads > 64) {
    return FlagError("proxy_threads", absl::StrCat(o.proxy_threads, " is not in 1..64"));
  }
  if (o.proxy_spin_us < 0 || o.proxy_spin_us > 1000000) {
    return FlagError("proxy_spin_us", absl::StrCat(o.proxy_spin_us, " is not in 0..1000000"));
  }
  if (o.proxy_max_sleep_us < 10 || o.proxy_max_sleep_us > 100000) {
    return FlagError("proxy_max_sleep_us", absl::StrCat(o.proxy_max_sleep_us, " is not in 10..100000"));
  }
  if (!o.coordinator.empty() && !o.insecure_peer_port && tls_files == 0) {
    auto coordinator = ParseHostPort(o.coordinator);
    if (coordinator.ok() && !IsLoopbackHost(coordinator->host)) {
      return FlagError("coordinator", absl::StrCat("'", coordinator->host,
                                                   "' is not a loopback address; calls to it need mutual TLS "
                                                   "(--tls_cert/--tls_key/--tls_ca) or --insecure_peer_port"));
    }
  }
  if (o.client_socket.empty()) return FlagError("client_socket", "required (path of the client Unix socket)");
  if (o.client_socket.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return FlagError("client_socket",
                     absl::StrCat("path is ", o.client_socket.size(), " bytes; Unix sockets allow at most ",
                                  sizeof(sockaddr_un{}.sun_path) - 1));
  }
  const std::filesystem::path parent = std::filesystem::absolute(o.client_socket).parent_path();
  std::error_code ec;
  if (!std::filesystem::is_directory(parent, ec)) {
    return FlagError("client_socket", absl::StrCat("directory '", parent.string(), "' does not exist"));
  }
  if ((o.client_socket_mode & ~0777u) != 0) {
    return FlagError("client_socket_mode", "only permission bits (0..0777) are allowed");
  }
  if ((o.client_socket_mode & 0600u) != 0600u) {
    return FlagError("client_socket_mode", "the daemon's own user needs read and write (0600)");
  }
  if (o.device < -1) return FlagError("device", absl::StrCat(o.device, " is not a CUDA ordinal (or -1 for auto)"));
  if (o.backend == BackendChoice::kHost && o.device >= 0) {
    return FlagError("device", "applies only to --backend=cuda or auto");
  }
  if (o.log_format != "text" && o.log_format != "json") {
    return FlagError("log_format", absl::StrCat("'", o.log_format, "' is not text or json"));
  }
  if (!o.metrics_listen.empty()) {
    if (auto metrics = ParseHostPort(o.metrics_listen); !metrics.ok()) {
      return FlagError("metrics_listen", std::string(metrics.status().message()));
    }
  }
  if (spdlog::level::from_str(o.log_level) == spdlog::level::off && o.log_level != "off") {
    return FlagError("log_level",
                     absl::StrCat("'", o.log_level, "' is not one of trace, debug, info, warn, error, critical, off"));
  }
  if (o.host_id.size() > 256) return FlagError("host_id", "longer than 256 bytes");
  if (o.fabric_id.empty() || o.fabric_id.size() > 128) return FlagError("fabric_id", "must be 1-128 bytes");
  if (o.heartbeat_ms < 10 || o.heartbeat_ms > 60000) {
    return FlagError("heartbeat_ms", absl::StrCat(o.heartbeat_ms, " is not in 10..60000"));
  }
  if (o.heartbeat_misses < 1 || o.heartbeat_misses > 100) {
    return FlagError("heartbeat_misses", absl::StrCat(o.heartbeat_misses, " is not in 1..100"));
  }
  if (o.memory_sharing != "posix_fd" && o.memory_sharing != "cuda_ipc") {
    return FlagError("memory_sharing", absl::StrCat("'", o.memory_sharing, "' is not one of posix_fd, cuda_ipc"));
  }
  if (o.max_groups < 1 || o.max_groups > 65536) {
    return FlagError("max_groups", absl::StrCat(o.max_groups, " is not in 1..65536"));
  }
  if (o.max_groups_per_client < 0 || o.max_groups_per_client > 65536) {
    return FlagError("max_groups_per_client", absl::StrCat(o.max_groups_per_client, " is not in 0..65536"));
  }
  if (absl::StatusOr<std::map<int64_t, std::string>> labels = ParseTenantLabels(o.tenant_labels); !labels.ok()) {
    return FlagError("tenant_labels", std::string(labels.status().message()));
  }
  if (o.lease_ttl_ms < 1000 || o.lease_ttl_ms > 300000) {
    return FlagError("lease_ttl_ms", absl::StrCat(o.lease_ttl_ms, " is not in 1000..300000"));
  }
  return absl::OkStatus();
}

}  // namespace epfabric::daemon
