// Channels to other daemons' peer ports, with the fabric's credentials: mutual TLS when certificates are
// configured, plaintext otherwise (then the peer port only listens on loopback unless explicitly allowed).
#pragma once

#include <map>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "epfabric/common/peer_auth.h"
#include "epfabric/v1/peer.grpc.pb.h"

namespace epfabric::daemon::fabric {

struct TlsFiles {
  std::string cert;  // PEM certificate chain of this daemon
  std::string key;   // PEM private key
  std::string ca;    // PEM CA bundle that peers' certificates must chain to
  // Name to check in peers' certificates instead of the dialled host (e.g. when dialling IP addresses).
  std::string target_name;
  bool enabled() const { return !cert.empty(); }
};

class PeerLinks {
 public:
  // Reads the PEM files (all three or none). Errors name the flag. With a non-empty `secret`, every call made
  // through these links carries a fabric-secret proof for `claim` (common/peer_auth.h).
  static absl::StatusOr<std::unique_ptr<PeerLinks>> Create(const TlsFiles& files, std::string secret = "",
                                                           std::string fabric_id = "",
                                                           common::PeerProofClaim claim = {});

  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const;
  std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials() const;

  // A stub for the peer server at `address`, sharing one channel per address.
  std::shared_ptr<v1::Peer::Stub> Stub(const std::string& address);
  std::shared_ptr<grpc::Channel> Channel(const std::string& address);

  bool tls() const { return tls_; }

  // An answer the caller must be able to trust (a membership view, fd socket paths, a group's token): with a fabric
  // secret, ExpectProof chooses the call's nonce before the call, and VerifyAnswer checks after an OK call that the
  // server proved the secret over `response` and that nonce (UNAUTHENTICATED otherwise: a process without the
  // secret on the peer's port). Without a secret (mutual TLS authenticates the server; insecure mode nothing),
  // ExpectProof returns "" and VerifyAnswer accepts.
  std::string ExpectProof(grpc::ClientContext& context) const;
  absl::Status VerifyAnswer(const grpc::ClientContext& context, const std::string& nonce, absl::string_view method,
                            const google::protobuf::MessageLite& response) const;

 private:
  bool tls_ = false;
  std::string cert_, key_, ca_, target_name_;
  std::string secret_, fabric_id_;
  common::PeerProofClaim claim_;
  absl::Mutex mutex_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace epfabric::daemon::fabric
