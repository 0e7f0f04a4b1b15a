#include "fabric/peer_links.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "epfabric/common/status_macros.h"

namespace epfabric::daemon::fabric {
namespace {

absl::StatusOr<std::string> ReadPem(const char* flag, const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": cannot read '", path, "'"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  if (buffer.str().find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", path, "' holds no PEM data"));
  }
  return buffer.str();
}

}  // namespace

absl::StatusOr<std::unique_ptr<PeerLinks>> PeerLinks::Create(const TlsFiles& files, std::string secret,
                                                             std::string fabric_id, common::PeerProofClaim claim) {
  auto links = std::make_unique<PeerLinks>();
  links->secret_ = std::move(secret);
  links->fabric_id_ = std::move(fabric_id);
  links->claim_ = claim;
  const int given = !files.cert.empty() + !files.key.empty() + !files.ca.empty();
  if (given != 0 && given != 3) {
    return absl::InvalidArgumentError("--tls_cert, --tls_key and --tls_ca go together: give all three or none");
  }
  if (given == 0) return links;
  EPF_ASSIGN_OR_RETURN(links->cert_, ReadPem("tls_cert", files.cert));
  EPF_ASSIGN_OR_RETURN(links->key_, ReadPem("tls_key", files.key));
  EPF_ASSIGN_OR_RETURN(links->ca_, ReadPem("tls_ca", files.ca));
  links->tls_ = true;
  links->target_name_ = files.target_name;
  return links;
}

std::shared_ptr<grpc::ServerCredentials> PeerLinks::ServerCredentials() const {
  if (!tls_) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = ca_;
  options.pem_key_cert_pairs.push_back({key_, cert_});
  return grpc::SslServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> PeerLinks::ChannelCredentials() const {
  if (!tls_) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = ca_;
  options.pem_private_key = key_;
  options.pem_cert_chain = cert_;
  return grpc::SslCredentials(options);
}

std::shared_ptr<grpc::Channel> PeerLinks::Channel(const std::string& address) {
  absl::MutexLock lock(&mutex_);
  auto it = channels_.find(address);
  if (it != channels_.end()) return it->second;
  grpc::ChannelArguments args;
  if (tls_ && !target_name_.empty()) args.SetSslTargetNameOverride(target_name_);
  // Peers come and go (restarts); reconnect quickly instead of gRPC's default backoff of up to 2 minutes. The
  // "minimum reconnect backoff" is gRPC's time limit of one connection attempt (TCP connect plus the HTTP/2 and TLS
  // handshakes), not a pause: at 100 ms a starved or sanitised daemon's handshake timed out and every call on the
  // channel failed UNAVAILABLE until the next attempt. A refused connection still fails at once; calls keep their
  // own deadlines.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 5000);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  if (!secret_.empty()) {
    interceptors.push_back(
        common::MakePeerProofInterceptorFactory(secret_, fabric_id_, claim_, common::PeerAudience(address)));
  }
  auto channel = grpc::experimental::CreateCustomChannelWithInterceptors(address, ChannelCredentials(), args,
                                                                         std::move(interceptors));
  channels_[address] = channel;
  return channel;
}

std::string PeerLinks::ExpectProof(grpc::ClientContext& context) const {
  if (secret_.empty()) return "";
  return common::AddPeerNonce(context);
}

absl::Status PeerLinks::VerifyAnswer(const grpc::ClientContext& context, const std::string& nonce,
                                     absl::string_view method, const google::protobuf::MessageLite& response) const {
  if (secret_.empty()) return absl::OkStatus();
  return common::VerifyPeerReplyProof(secret_, fabric_id_, method, nonce, response.SerializeAsString(),
                                      common::PeerReplyProof(context));
}

std::shared_ptr<v1::Peer::Stub> PeerLinks::Stub(const std::string& address) {
  return std::shared_ptr<v1::Peer::Stub>(v1::Peer::NewStub(Channel(address)));
}

}  // namespace epfabric::daemon::fabric
