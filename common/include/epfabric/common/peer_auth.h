// Fabric-secret authentication of peer-port calls (single-host fabrics on loopback; mutual TLS is the other way).
//
// Every member holds the same secret, read from a file only its owner can read. A caller never sends the secret:
// each call carries, in the metadata `kPeerAuthMetadataKey`, a proof
//
//     v3:<role>:<rank>:<unix_ms>:<nonce>:<body_sha256>:<audience>:<hex HMAC-SHA256(secret,
//     "epfabric-peer-v3|fabric|method|role|rank|unix_ms|nonce|body_sha256|audience")>
//
// bound to the fabric, the RPC method, the claimed role and rank, the time (accepted within kPeerAuthMaxSkew), the
// serialized request (its SHA-256), a random 96-bit nonce that the server remembers until the proof's window ends
// (PeerNonceCache), and the daemon it is for (the audience: the port the caller dialled; a secret fabric lives on one
// host, where a port names one daemon). A process that cannot read the secret file cannot make a proof; a server that
// is not a member (an impostor on a dead member's port) learns a proof that is good for nothing: not at another
// daemon, not for another request body, not for the same request a second time, not after the window.
//
// The answer proves its server too: in `kPeerReplyMetadataKey` (trailing metadata) the server sends
//
//     v2:<hex HMAC-SHA256(secret, "epfabric-peer-reply-v2|fabric|method|request nonce|response_sha256")>
//
// so a caller that chose the request's nonce (AddPeerNonce) can tell its fabric's member from a process without the
// secret on that port, and an answer to one call cannot be passed off as the answer to another.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <grpcpp/client_context.h>
#include <grpcpp/support/client_interceptor.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace epfabric::common {

inline constexpr char kPeerAuthMetadataKey[] = "epf-peer-auth";
inline constexpr char kPeerReplyMetadataKey[] = "epf-peer-reply";
// A caller-chosen nonce for the next proof (AddPeerNonce); the proof interceptor takes it out of the metadata.
inline constexpr char kPeerNonceMetadataKey[] = "epf-peer-nonce";
// A proof is accepted this far from the verifier's clock either way (one host: only scheduling delays count), and
// its nonce is remembered until its time plus this.
inline constexpr absl::Duration kPeerAuthMaxSkew = absl::Seconds(15);
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

// What a verified proof says beyond the claim: its nonce (what the answer's proof is bound to) and its time.
struct VerifiedPeerProof {
  PeerProofClaim claim;
  std::string nonce;
  absl::Time time;
};

// SHA-256 of `data`, hex encoded (64 characters).
std::string Sha256Hex(absl::string_view data);

// A fresh random nonce for a proof (24 hex characters).
std::string NewPeerNonce();

// HMAC-SHA256(key, message), hex encoded (64 characters). Also keys the transport's data connections (a key derived
// from the group token, docs/internode.md).
std::string HmacSha256Hex(absl::string_view key, absl::string_view message);

// Makes a proof for one call (`method` is the full gRPC method, "/epfabric.v1.Peer/Join") whose serialized request
// is `body`. An empty `nonce` picks a fresh one; a caller that passes one must never use it twice.
// `audience` is PeerAudience of the address the call goes to.
std::string MakePeerProof(absl::string_view secret, absl::string_view fabric_id, absl::string_view method,
                          const PeerProofClaim& claim, absl::string_view body, absl::Time now,
                          absl::string_view nonce = "", absl::string_view audience = "");

// The audience of a call to `address` ("host:port", "[v6]:port"): its port.
std::string PeerAudience(absl::string_view address);

// Checks a proof against the request the server received (`body`, serialized) and, when `expected_audience` is not
// empty, against the daemon that received it (its peer port); returns what it proves. It does not check the nonce for
// reuse: that is PeerNonceCache's job, after this. Unauthenticated errors say what is wrong without revealing
// anything about the secret.
absl::StatusOr<VerifiedPeerProof> VerifyPeerProof(absl::string_view secret, absl::string_view fabric_id,
                                                  absl::string_view method, absl::string_view proof,
                                                  absl::string_view body, absl::Time now,
                                                  absl::string_view expected_audience = "");

// The server's proof for its answer (`response`, serialized) to the call whose proof had `request_nonce`.
std::string MakePeerReplyProof(absl::string_view secret, absl::string_view fabric_id, absl::string_view method,
                               absl::string_view request_nonce, absl::string_view response);

// Checks an answer's proof. UNAUTHENTICATED says what is missing or wrong.
absl::Status VerifyPeerReplyProof(absl::string_view secret, absl::string_view fabric_id, absl::string_view method,
                                  absl::string_view request_nonce, absl::string_view response, absl::string_view proof);

// Chooses the nonce of the proof that `context`'s call will carry (the proof interceptor takes it from the metadata),
// so that the caller can check the answer's proof (VerifyPeerReplyProof) afterwards. Returns the nonce.
std::string AddPeerNonce(grpc::ClientContext& context);

// The answer's proof from a finished call's trailing metadata (empty when there is none).
std::string PeerReplyProof(const grpc::ClientContext& context);

// Nonces of accepted proofs, each kept until its proof's window ends; a nonce seen again inside the window is a
// replay. Thread-safe. Holds at most `capacity` nonces: beyond that (only a holder of the secret can get there, with
// thousands of calls a second) new proofs are refused until old ones expire.
class PeerNonceCache {
 public:
  explicit PeerNonceCache(size_t capacity = 1 << 18) : capacity_(capacity) {}

  // Remembers `proof`'s nonce; UNAUTHENTICATED when it was used already, RESOURCE_EXHAUSTED when full.
  absl::Status Remember(absl::string_view method, const VerifiedPeerProof& proof, absl::Time now);

 private:
  const size_t capacity_;
  absl::Mutex mutex_;
  absl::flat_hash_map<std::string, absl::Time> expiry_ ABSL_GUARDED_BY(mutex_);
  absl::Time next_sweep_ ABSL_GUARDED_BY(mutex_) = absl::InfinitePast();
};

// A client interceptor that adds a fresh proof to every call of a channel (unary calls: the proof covers the
// request, which goes out in the same batch as the metadata); `audience`: PeerAudience of the channel's address.
std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface> MakePeerProofInterceptorFactory(
    std::string secret, std::string fabric_id, PeerProofClaim claim, std::string audience);

}  // namespace epfabric::common
