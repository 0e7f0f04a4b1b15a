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
#include "integration/daemon_under_test.h"

namespace epfabric::testing {

// The secret every daemon this test process starts holds.
inline std::string TestFabricSecret() {
  std::ifstream in(TestFabricSecretFile());
  std::string secret((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!secret.empty() && secret.back() == '\n') secret.pop_back();
  return secret;
}

inline std::shared_ptr<grpc::Channel> PeerChannel(const std::string& address, const std::string& fabric_id,
                                                  std::optional<common::PeerProofClaim> claim) {
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  if (claim.has_value()) {
    interceptors.push_back(common::MakePeerProofInterceptorFactory(TestFabricSecret(), fabric_id, *claim));
  }
  return grpc::experimental::CreateCustomChannelWithInterceptors(address, grpc::InsecureChannelCredentials(),
                                                                 grpc::ChannelArguments(), std::move(interceptors));
}

}  // namespace epfabric::testing
