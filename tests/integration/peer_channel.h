// Channels to a daemon's peer port as a test's hand-made peer: with a fabric-secret proof for `claim` made from the
// test process's secret (TestFabricSecretFile), or with no credential at all (nullopt), as a stranger would call.
#pragma once

#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "epfabric/common/peer_auth.h"
#include "epfabric/v1/peer.pb.h"
#include "integration/daemon_under_test.h"

namespace epfabric::testing {

// The secret every daemon this test process starts holds.
inline std::string TestFabricSecret() {
  std::ifstream in(TestFabricSecretFile());
  std::string secret((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!secret.empty() && secret.back() == '\n') secret.pop_back();
  return secret;
}

// What a coordinator sends members of a group's token (daemon/security/group_secrets.h): its digest, data key and
// deletion key, never the token.
inline void SetGroupSecrets(v1::PrepareGroupRequest* prepare, const std::string& token) {
  prepare->set_token_sha256(common::Sha256Hex(token));
  prepare->set_data_key(common::HmacSha256Hex(token, "epfabric data v1"));
  prepare->set_deletion_key(common::HmacSha256Hex(token, "epfabric retire v1"));
}

// What a forwarded DeleteGroup carries instead of the token: a nonce and the proof made with the deletion key.
inline void SetRetireProof(v1::RetireGroupRequest* retire, const std::string& token,
                           const std::string& nonce = "0123456789abcdef0123456789abcdef") {
  retire->set_nonce(nonce);
  retire->set_proof(common::HmacSha256Hex(common::HmacSha256Hex(token, "epfabric retire v1"),
                                          "epfd-retire|" + retire->name() + "|" + nonce));
}

// Copies every proof that a channel's calls carry into `proofs` (what an impostor on the callee's port receives).
class ProofRecorder final : public grpc::experimental::Interceptor {
 public:
  explicit ProofRecorder(std::vector<std::string>* proofs) : proofs_(proofs) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      auto* metadata = methods->GetSendInitialMetadata();
      if (auto it = metadata->find(common::kPeerAuthMetadataKey); it != metadata->end()) {
        proofs_->push_back(it->second);
      }
    }
    methods->Proceed();
  }

 private:
  std::vector<std::string>* const proofs_;
};

class ProofRecorderFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit ProofRecorderFactory(std::vector<std::string>* proofs) : proofs_(proofs) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new ProofRecorder(proofs_);
  }

 private:
  std::vector<std::string>* const proofs_;
};

// With `proofs`, every proof the channel's calls carry is appended to it (not thread-safe: one call at a time).
inline std::shared_ptr<grpc::Channel> PeerChannel(const std::string& address, const std::string& fabric_id,
                                                  std::optional<common::PeerProofClaim> claim,
                                                  std::vector<std::string>* proofs = nullptr) {
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  if (claim.has_value()) {
    interceptors.push_back(
        common::MakePeerProofInterceptorFactory(TestFabricSecret(), fabric_id, *claim, common::PeerAudience(address)));
  }
  if (proofs != nullptr) interceptors.push_back(std::make_unique<ProofRecorderFactory>(proofs));
  return grpc::experimental::CreateCustomChannelWithInterceptors(address, grpc::InsecureChannelCredentials(),
                                                                 grpc::ChannelArguments(), std::move(interceptors));
}

}  // namespace epfabric::testing
