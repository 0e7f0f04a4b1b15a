#include "security/peer_authenticator.h"

#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "epfabric/common/status_macros.h"

namespace epfabric::daemon::security {

std::string PeerIdentity::Describe() const {
  if (!authenticated) return "an unauthenticated caller";
  if (role == common::PeerRole::kOps) return "ops tooling";
  return absl::StrCat("member ", MemberScope{first_rank, end_rank, pod}.Describe());
}

std::string MemberCommonName(absl::string_view fabric_id, int rank) {
  return absl::StrCat("epfabric-member:", fabric_id, ":", rank);
}

std::string OpsCommonName(absl::string_view fabric_id) { return absl::StrCat("epfabric-ops:", fabric_id); }

absl::StatusOr<PeerIdentity> PeerAuthenticator::FromCommonName(absl::string_view method, absl::string_view cn) const {
  PeerIdentity identity;
  identity.authenticated = true;
  if (cn == OpsCommonName(config_.fabric_id)) {
    identity.role = common::PeerRole::kOps;
    return identity;
  }
  if (!IsMemberCommonName(cn)) {
    return absl::UnauthenticatedError(absl::StrCat(
        method, ": the client certificate's CN '", cn, "' is neither '", MemberCommonName(config_.fabric_id, 0),
        "' (any rank), a pod's nor '", OpsCommonName(config_.fabric_id), "'"));
  }
  absl::StatusOr<MemberScope> scope = MemberScopeOf(cn, config_.fabric_id, config_.ranks_per_pod);
  if (!scope.ok()) return absl::UnauthenticatedError(absl::StrCat(method, ": ", scope.status().message()));
  identity.first_rank = scope->first_rank;
  identity.end_rank = scope->end_rank;
  identity.pod = scope->pod;
  return identity;
}

absl::StatusOr<PeerIdentity> PeerAuthenticator::Check(absl::string_view method, const std::string* tls_common_name,
                                                      absl::string_view proof, absl::string_view body,
                                                      absl::Time now) const {
  if (config_.insecure && !config_.mutual_tls && config_.secret.empty()) return PeerIdentity{};
  std::optional<PeerIdentity> identity;
  if (config_.mutual_tls) {
    if (tls_common_name == nullptr) {
      return absl::UnauthenticatedError(absl::StrCat(method, ": no client certificate with a common name"));
    }
    EPF_ASSIGN_OR_RETURN(identity, FromCommonName(method, *tls_common_name));
  }
  if (!config_.secret.empty()) {
    EPF_ASSIGN_OR_RETURN(const common::VerifiedPeerProof verified,
                         common::VerifyPeerProof(config_.secret, config_.fabric_id, method, proof, body, now, [&] {
                           absl::MutexLock lock(&audience_mutex_);
                           return audience_;
                         }()));
    PeerIdentity from_secret;
    from_secret.authenticated = true;
    from_secret.role = verified.claim.role;
    from_secret.first_rank = verified.claim.rank;
    from_secret.end_rank = verified.claim.role == common::PeerRole::kMember ? verified.claim.rank + 1 : -1;
    from_secret.nonce = verified.nonce;
    if (identity.has_value() && (identity->role != from_secret.role || (from_secret.role == common::PeerRole::kMember &&
                                                                        !identity->ActsAs(from_secret.first_rank)))) {
      return absl::UnauthenticatedError(absl::StrCat(method, ": the certificate names ", identity->Describe(),
                                                     " but the fabric credential names ", from_secret.Describe()));
    }
    // Spent only once everything else holds: a forged or stale proof cannot fill the cache.
    EPF_RETURN_IF_ERROR(nonces_.Remember(method, verified, now));
    identity = from_secret;
  }
  if (!identity.has_value()) return absl::UnauthenticatedError(absl::StrCat(method, ": no credential configured"));
  return *identity;
}

absl::StatusOr<PeerIdentity> PeerAuthenticator::Authenticate(const grpc::ServerContext& context,
                                                             absl::string_view method,
                                                             const google::protobuf::MessageLite& request) const {
  std::string common_name;
  bool have_cn = false;
  if (config_.mutual_tls) {
    const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
    if (auth != nullptr) {
      const std::vector<grpc::string_ref> values = auth->FindPropertyValues("x509_common_name");
      if (values.size() == 1) {
        common_name.assign(values[0].data(), values[0].size());
        have_cn = true;
      }
    }
  }
  absl::string_view proof;
  const auto& metadata = context.client_metadata();
  if (auto it = metadata.find(common::kPeerAuthMetadataKey); it != metadata.end()) {
    proof = absl::string_view(it->second.data(), it->second.size());
  }
  // The handler's request re-serialized: the bytes the caller signed (one schema, no map fields in peer or ops
  // requests), or different bytes for a different request.
  const std::string body = config_.secret.empty() ? std::string() : request.SerializeAsString();
  return Check(method, have_cn ? &common_name : nullptr, proof, body, absl::Now());
}

absl::StatusOr<PeerIdentity> PeerAuthenticator::RequireMember(const grpc::ServerContext& context,
                                                              absl::string_view method,
                                                              const google::protobuf::MessageLite& request,
                                                              int rank) const {
  auto identity = Authenticate(context, method, request);
  if (!identity.ok() || !identity->authenticated) return identity;
  if (identity->role != common::PeerRole::kMember) {
    return absl::PermissionDeniedError(
        absl::StrCat(method, ": needs a member's credential; the caller is ", identity->Describe()));
  }
  if (rank >= 0 && !identity->ActsAs(rank)) {
    return absl::PermissionDeniedError(
        absl::StrCat(method, ": only rank ", rank, " may call this; the caller is ", identity->Describe()));
  }
  return identity;
}

absl::StatusOr<PeerIdentity> PeerAuthenticator::RequireReader(const grpc::ServerContext& context,
                                                              absl::string_view method,
                                                              const google::protobuf::MessageLite& request) const {
  return Authenticate(context, method, request);
}

void PeerAuthenticator::SignReply(grpc::ServerContext& context, const PeerIdentity& caller, absl::string_view method,
                                  const google::protobuf::MessageLite& response) const {
  if (config_.secret.empty() || caller.nonce.empty()) return;
  context.AddTrailingMetadata(common::kPeerReplyMetadataKey,
                              common::MakePeerReplyProof(config_.secret, config_.fabric_id, method, caller.nonce,
                                                         response.SerializeAsString()));
}

}  // namespace epfabric::daemon::security
