// Tokens never travel between daemons, forwarded deletes and prepares included (issue #34, the last of decision 148):
// a process without the fabric secret that listens where the coordinator or a member should be receives what a
// forwarded DeleteGroup (RetireGroup) or a PrepareGroup carries, and never the token. Real daemons on loopback; the
// impostor is a plain gRPC server on the dead daemon's port, as in the audit.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <mutex>
#include <vector>

#include "absl/time/clock.h"
#include "epfabric/common/peer_auth.h"
#include "epfabric/v1/peer.grpc.pb.h"
#include "integration/fabric_test_util.h"
#include "integration/fabric_under_test.h"

namespace epfabric::testing {
namespace {

using ::testing::HasSubstr;
using Code = grpc::StatusCode;

// Records every RetireGroup, PrepareGroup and CommitGroup it receives; answers OK (without the fabric's proof).
class Impostor final : public v1::Peer::Service {
 public:
  grpc::Status RetireGroup(grpc::ServerContext*, const v1::RetireGroupRequest* request,
                           v1::RetireGroupResponse*) override {
    std::lock_guard<std::mutex> lock(mutex_);
    retires_.push_back(*request);
    return grpc::Status::OK;  // an OK answer without the server's proof
  }
  grpc::Status PrepareGroup(grpc::ServerContext*, const v1::PrepareGroupRequest* request,
                            v1::PrepareGroupResponse*) override {
    std::lock_guard<std::mutex> lock(mutex_);
    prepares_.push_back(*request);
    return grpc::Status::OK;
  }
  grpc::Status CommitGroup(grpc::ServerContext*, const v1::CommitGroupRequest*, v1::CommitGroupResponse*) override {
    std::lock_guard<std::mutex> lock(mutex_);
    ++commits_;
    return grpc::Status::OK;
  }
  int commits() {
    std::lock_guard<std::mutex> lock(mutex_);
    return commits_;
  }
  std::vector<v1::RetireGroupRequest> retires() {
    std::lock_guard<std::mutex> lock(mutex_);
    return retires_;
  }
  std::vector<v1::PrepareGroupRequest> prepares() {
    std::lock_guard<std::mutex> lock(mutex_);
    return prepares_;
  }

 private:
  std::mutex mutex_;
  std::vector<v1::RetireGroupRequest> retires_;
  std::vector<v1::PrepareGroupRequest> prepares_;
  int commits_ = 0;
};

std::unique_ptr<grpc::Server> Listen(const std::string& address, Impostor* impostor) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials());
  builder.RegisterService(impostor);
  return builder.BuildAndStart();
}

bool Listed(FabricUnderTest& fabric, int rank, const std::string& name) {
  auto view = fabric.Fabric(rank);
  return view.ok() && FindGroup(*view, name) != nullptr;
}

// A forwarded DeleteGroup proves the token with the deletion key: the live coordinator deletes with it and refuses a
// wrong token; a process on the dead coordinator's port receives the name, a nonce and a proof good for that name
// only, never the token.
TEST(GroupSecrets, AForwardedDeleteCarriesNoToken) {
  auto fabric = FabricUnderTest::Start(2, {"--heartbeat_ms=100", "--heartbeat_misses=3"});
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  v1::CreateGroupResponse first, second;
  ASSERT_TRUE(CreateGroup(**fabric, 1, "first", {0, 1}, 1 << 20, &first).ok());
  ASSERT_TRUE(CreateGroup(**fabric, 1, "second", {0, 1}, 1 << 20, &second).ok());

  // Through rank 1 (forwarded to the coordinator): a wrong token is refused, the right one deletes.
  grpc::Status status = DeleteGroup(**fabric, 1, "first", second.token());
  EXPECT_EQ(status.error_code(), Code::PERMISSION_DENIED) << status.error_message();
  EXPECT_TRUE(Listed(**fabric, 0, "first"));
  status = DeleteGroup(**fabric, 1, "first", first.token());
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_FALSE(Listed(**fabric, 0, "first"));
  EXPECT_FALSE(Listed(**fabric, 1, "first"));

  // The coordinator dies; an impostor takes its port; a client deletes "second" through rank 1.
  const std::string address = (*fabric)->coordinator();
  (*fabric)->Kill(0);
  Impostor impostor;
  std::unique_ptr<grpc::Server> server = Listen(address, &impostor);
  ASSERT_NE(server, nullptr) << "cannot listen on " << address;
  status = DeleteGroup(**fabric, 1, "second", second.token());
  EXPECT_FALSE(status.ok()) << "an answer without the coordinator's proof was taken";
  server->Shutdown();
  const std::vector<v1::RetireGroupRequest> retires = impostor.retires();
  ASSERT_EQ(retires.size(), 1u) << "the delete was forwarded to the coordinator's port";
  const v1::RetireGroupRequest& got = retires[0];
  EXPECT_EQ(got.name(), "second");
  EXPECT_TRUE(got.token().empty()) << "the token reached the impostor";
  EXPECT_EQ(got.SerializeAsString().find(second.token()), std::string::npos);
  EXPECT_EQ(got.nonce().size(), 32u);
  const std::string deletion_key = common::HmacSha256Hex(second.token(), "epfabric retire v1");
  EXPECT_EQ(got.proof(), common::HmacSha256Hex(deletion_key, "epfd-retire|second|" + got.nonce()));
  EXPECT_NE(got.proof(), common::HmacSha256Hex(deletion_key, "epfd-retire|first|" + got.nonce()))
      << "the proof names its group";
}

// A PrepareGroup reaches whoever holds a member's port while the coordinator still takes that member for up: it
// carries the token's digest and the keys derived from it, not the token, and its answer without the fabric's proof
// ends the create before any Commit. The group is created and works without
// the token on the members: Attach and the fd side channel compare digests, the data key opens the data port.
TEST(GroupSecrets, APrepareCarriesNoToken) {
  // A member is taken for down after 50 missed beats of 100 ms: time to put an impostor on its port.
  auto fabric = FabricUnderTest::Start(3, {"--heartbeat_ms=100", "--heartbeat_misses=50"});
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());

  // End to end without tokens on the members: create, attach on both ranks (right and wrong token), delete.
  v1::CreateGroupResponse live;
  ASSERT_TRUE(CreateGroup(**fabric, 0, "live", {0, 1}, 1 << 20, &live).ok());
  for (int rank : {0, 1}) {
    v1::AttachResponse attached;
    grpc::Status status = Attach(**fabric, rank, "live", rank, std::string(live.token().size(), '0'), &attached);
    EXPECT_EQ(status.error_code(), Code::PERMISSION_DENIED) << rank << ": " << status.error_message();
    status = Attach(**fabric, rank, "live", rank, live.token(), &attached);
    EXPECT_TRUE(status.ok()) << rank << ": " << status.error_message();
  }
  ASSERT_TRUE(DeleteGroup(**fabric, 1, "live", live.token()).ok());

  const std::string address = (*fabric)->Fabric(0)->membership().members(2).peer_address();
  (*fabric)->Kill(2);
  Impostor impostor;
  std::unique_ptr<grpc::Server> server = Listen(address, &impostor);
  ASSERT_NE(server, nullptr) << "cannot listen on " << address;
  v1::CreateGroupResponse created;
  grpc::Status status = CreateGroup(**fabric, 0, "tenant", {0, 2}, 1 << 20, &created);
  server->Shutdown();
  EXPECT_EQ(status.error_code(), Code::UNAUTHENTICATED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("without the fabric's proof"));
  EXPECT_EQ(impostor.commits(), 0) << "a create went on past an answer without the proof";
  EXPECT_FALSE(Listed(**fabric, 0, "tenant"));
  const std::vector<v1::PrepareGroupRequest> prepares = impostor.prepares();
  ASSERT_FALSE(prepares.empty()) << "the coordinator still took rank 2 for up: " << status.error_message();
  for (const v1::PrepareGroupRequest& prepare : prepares) {
    EXPECT_EQ(prepare.group().name(), "tenant");
    EXPECT_TRUE(prepare.token().empty()) << "a token reached the impostor";
    EXPECT_EQ(prepare.token_sha256().size(), 64u);
    EXPECT_EQ(prepare.data_key().size(), 64u);
    EXPECT_EQ(prepare.deletion_key().size(), 64u);
  }
}

}  // namespace
}  // namespace epfabric::testing
