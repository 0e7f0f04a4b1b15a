// The peer-port credential a daemon uses when the operator names none (docs/security.md, "A first run").
//
// A fabric on one host needs a secret that every member can read and no other user can: the first daemon creates it,
// 0600 and owned by its user, beside its client socket, and every later daemon of that fabric with its socket in the
// same directory reads the same file. A single daemon (--world_size=1) has no peer to prove anything to: it keeps a
// random secret in memory, so its loopback peer port refuses every call.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace epfabric::daemon::security {

// `<directory of client_socket>/.<fabric_id>.fabric-secret`; a fabric id with characters other than [A-Za-z0-9._-]
// is replaced by the first 16 hex digits of its SHA-256.
std::string HostFabricSecretPath(const std::string& client_socket, const std::string& fabric_id);

// Reads the secret at `path` (the checks of common::ReadFabricSecretFile: owned by this user, no group/other bits,
// >= 16 bytes). When there is no file, creates it from 32 random bytes: written to a private temporary file and
// linked into place, so a daemon starting at the same moment reads either nothing (and retries) or the whole
// winner's secret. Returns the secret and whether this call created the file.
struct HostSecret {
  std::string secret;
  bool created = false;
};
absl::StatusOr<HostSecret> LoadOrCreateHostFabricSecret(const std::string& path);

// 32 random bytes as 64 hex digits (getrandom).
absl::StatusOr<std::string> RandomSecret();

}  // namespace epfabric::daemon::security
