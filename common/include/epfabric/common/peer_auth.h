// Fabric-secret authentication of peer-port calls (single-host fabrics on loopback; mutual TLS is the other way).
//
// Every member holds the same secret, read from a file only its owner can read. A caller never sends the secret:
// each call carries, in the metadata `kPeerAuthMetadataKey`, a proof
//
//     v1:<role>:<rank>:<unix_ms>:<nonce>:<hex HMAC-SHA256(secret,
//     "epfabric-peer-v1|fabric|method|role|rank|unix_ms|nonce")>
//
// bound to the fabric, the RPC method, the claimed role and rank, and the time (accepted within
// kPeerAuthMaxSkew). A process that cannot read the secret file cannot make a proof; a server that is not a member
// (an impostor on a dead member's port) learns nothing it could reuse for another method or after the window.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <grpcpp/support/client_interceptor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace epfabric::common {

inline constexpr char kPeerAuthMetadataKey[] = "epf-peer-auth";
inline constexpr absl::Duration kPeerAuthMaxSkew = absl::Seconds(30);
// Shortest secret accepted (bytes after trimming trailing whitespace).
inline constexpr size_t kMinFabricSecretBytes = 16;

// Who a proof claims to be: a fabric member (rank >= 0) or read-only ops tooling (rank -1).
enum class PeerRole { kMember, kOps };

// Reads the secret from `path`: a regular file owned by this user, not readable or writable by group or others
// (0600 or 0400), at least kMinFabricSecretBytes long. `flag` names the flag in errors.
absl::StatusOr<std::string> ReadFabricSecretFile(const std::string& path, absl::string_view flag);

struct PeerProofClaim {
  PeerRole role = PeerRole::kMember;
  int rank = -1;
};

// SHA-256 of `data`, hex encoded (64 characters).
std::string Sha256Hex(absl::string_view data);

// HMAC-SHA256(key, message), hex encoded (64 characters). Also keys the transport's data connections (a key derived
// from the group token, docs/internode.md).
std::string HmacSha256Hex(absl::string_view key, absl::string_view message);

// Makes a proof for one call (`method` is the full gRPC method, "/epfabric.v1.Peer/Join").
std::string MakePeerProof(absl::string_view secret, absl::string_view fabric_id, absl::string_view method,
                          const PeerProofClaim& claim, absl::Time now);

// Checks a proof; returns the claim it proves. Unauthenticated errors say what is wrong without revealing anything
// about the secret.
absl::StatusOr<PeerProofClaim> VerifyPeerProof(absl::string_view secret, absl::string_view fabric_id,
                                               absl::string_view method, absl::string_view proof, absl::Time now);

// A client interceptor that adds a fresh proof to every call of a channel.
std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface> MakePeerProofInterceptorFactory(
    std::string secret, std::string fabric_id, PeerProofClaim claim);

}  // namespace epfabric::common
