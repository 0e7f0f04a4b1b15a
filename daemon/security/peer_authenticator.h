// Who is calling on the peer port, and may they call this method.
//
// Credentials (docs/security.md):
//  - mutual TLS: the client certificate chains to the fabric CA (gRPC checks that) and its subject CN names the
//    fabric and the role: a member daemon's (security/member_identity.h: one rank, or a LeaderWorkerSet pod's ranks)
//    or "epfabric-ops:<fabric_id>" for read-only ops tooling;
//  - a fabric secret (--fabric_secret_file): a per-call HMAC proof (common/peer_auth.h) naming the role and rank,
//    covering the request the handler received, with a nonce that is accepted once;
//  - --insecure_peer_port: nothing is checked (tests only; the daemon logs a warning at start).
// When both TLS and a secret are configured, a call must carry both, and the proof's rank must be one the
// certificate covers.
#pragma once

#include <string>

#include <google/protobuf/message_lite.h>
#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "epfabric/common/peer_auth.h"
#include "security/member_identity.h"

namespace epfabric::daemon::security {

struct PeerAuthConfig {
  std::string fabric_id;
  std::string secret;       // empty: no fabric secret
  bool mutual_tls = false;  // the peer server requires and verifies client certificates
  bool insecure = false;    // --insecure_peer_port without TLS or secret: accept every call
  int ranks_per_pod = 0;    // ranks of one LeaderWorkerSet pod (pod certificates); 0: pod certificates refused
};

struct PeerIdentity {
  common::PeerRole role = common::PeerRole::kMember;
  // The ranks a member may act as, [first_rank, end_rank): one for a rank certificate or a fabric-secret proof, its
  // pod's for a pod certificate; -1 for ops or when unchecked.
  int first_rank = -1;
  int end_rank = -1;
  std::string pod;             // the pod a pod certificate names
  bool authenticated = false;  // false only with --insecure_peer_port
  std::string nonce;           // the proof's nonce (fabric secret only): the answer's proof is bound to it
  bool ActsAs(int rank) const { return rank >= first_rank && rank < end_rank; }
  std::string Describe() const;
};

// The common name a certificate for this role needs.
std::string MemberCommonName(absl::string_view fabric_id, int rank);
std::string OpsCommonName(absl::string_view fabric_id);

class PeerAuthenticator {
 public:
  explicit PeerAuthenticator(PeerAuthConfig config) : config_(std::move(config)) {}

  // The port this daemon's peer server listens on (known once it is bound): from then on a proof must name it. Until
  // it is set no proof's audience is checked (no call can arrive before the port is bound).
  void SetAudience(std::string port) ABSL_LOCKS_EXCLUDED(audience_mutex_) {
    absl::MutexLock lock(&audience_mutex_);
    audience_ = std::move(port);
  }

  // The caller's identity, or UNAUTHENTICATED saying what is missing or wrong. `request` is the request the handler
  // received: a fabric-secret proof must have been made for it (its serialization), and its nonce is spent.
  absl::StatusOr<PeerIdentity> Authenticate(const grpc::ServerContext& context, absl::string_view method,
                                            const google::protobuf::MessageLite& request) const;

  // A member of this fabric; with `rank` >= 0, one that may act as that rank. PERMISSION_DENIED names who called.
  absl::StatusOr<PeerIdentity> RequireMember(const grpc::ServerContext& context, absl::string_view method,
                                             const google::protobuf::MessageLite& request, int rank = -1) const;
  // A member or ops tooling (read-only methods).
  absl::StatusOr<PeerIdentity> RequireReader(const grpc::ServerContext& context, absl::string_view method,
                                             const google::protobuf::MessageLite& request) const;

  // With a fabric secret: adds the answer's proof (bound to the caller's nonce) to `context`'s trailing metadata,
  // so that the caller can tell this daemon from a process without the secret on its port. Call it once the
  // response is final; without a secret it does nothing.
  void SignReply(grpc::ServerContext& context, const PeerIdentity& caller, absl::string_view method,
                 const google::protobuf::MessageLite& response) const;

  // The pure checks behind Authenticate, for tests: a certificate CN and a proof (either may be empty when that
  // credential is not configured) for the serialized request `body`. Spends the proof's nonce.
  absl::StatusOr<PeerIdentity> Check(absl::string_view method, const std::string* tls_common_name,
                                     absl::string_view proof, absl::string_view body, absl::Time now) const;

 private:
  absl::StatusOr<PeerIdentity> FromCommonName(absl::string_view method, absl::string_view cn) const;

  const PeerAuthConfig config_;
  mutable absl::Mutex audience_mutex_;
  std::string audience_ ABSL_GUARDED_BY(audience_mutex_);
  // Nonces of accepted proofs: a replay within the window is refused.
  mutable common::PeerNonceCache nonces_;
};

}  // namespace epfabric::daemon::security
