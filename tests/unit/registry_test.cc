// The coordinator's group registry (daemon/groups/registry.h) against one fake member: an in-process Peer server on
// loopback that prepares, commits and releases by answering OK. The members' Joins are handed to the registry by the
// test, so that their order against a delete is the test's choice.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "epfabric/common/peer_auth.h"
#include "epfabric/v1/peer.grpc.pb.h"
#include "fabric/membership.h"
#include "fabric/peer_links.h"
#include "groups/registry.h"
#include "security/group_secrets.h"

namespace epfabric::daemon {
namespace {

constexpr char kFabric[] = "registry-test";

class FakeMember final : public v1::Peer::Service {
 public:
  grpc::Status PrepareGroup(grpc::ServerContext*, const v1::PrepareGroupRequest* request,
                            v1::PrepareGroupResponse*) override {
    std::lock_guard<std::mutex> lock(mutex);
    last_prepare = *request;
    return grpc::Status::OK;
  }
  grpc::Status CommitGroup(grpc::ServerContext*, const v1::CommitGroupRequest*, v1::CommitGroupResponse*) override {
    return grpc::Status::OK;
  }
  grpc::Status ReleaseGroup(grpc::ServerContext*, const v1::ReleaseGroupRequest*, v1::ReleaseGroupResponse*) override {
    ++releases;
    return grpc::Status::OK;
  }
  std::atomic<int> releases{0};
  std::mutex mutex;
  v1::PrepareGroupRequest last_prepare;
};

v1::MemberInfo Coordinator() {
  v1::MemberInfo self;
  self.set_rank(0);
  self.set_incarnation(1);
  self.set_state(v1::MEMBER_STATE_UP);
  self.set_backend(v1::BACKEND_HOST);
  return self;
}

// Rank 0 (this registry) and rank 1 (the fake member), joined.
class RegistryTest : public ::testing::Test {
 protected:
  RegistryTest()
      : membership_(fabric::FabricConfig{.fabric_id = kFabric, .rank = 0, .world_size = 2}, Coordinator(), nullptr) {}

  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&member_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_NE(port, 0);
    auto links = fabric::PeerLinks::Create(fabric::TlsFiles{});
    ASSERT_TRUE(links.ok()) << links.status();
    links_ = std::move(*links);
    registry_ = std::make_unique<groups::Registry>(&membership_, links_.get());
    join_.set_fabric_id(kFabric);
    join_.set_world_size(2);
    v1::MemberInfo* member = join_.mutable_member();
    member->set_rank(1);
    member->set_incarnation(7);
    member->set_state(v1::MEMBER_STATE_UP);
    member->set_backend(v1::BACKEND_HOST);
    member->set_peer_address("127.0.0.1:" + std::to_string(port));
    ASSERT_TRUE(membership_.HandleJoin(join_).ok());
    // The coordinator's own member side is the fake too (a forced delete asks every member, rank 0 included).
    membership_.SetPeerAddress(member->peer_address());
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
  }

  // The member's Join as it reports group `name` (READY, token `token`).
  v1::JoinRequest JoinReporting(const std::string& name, const std::string& token) const {
    v1::JoinRequest join = join_;
    v1::GroupRecord* record = join.add_groups();
    record->mutable_group()->set_name(name);
    record->mutable_group()->add_ranks(1);
    record->mutable_group()->set_num_nvl_bytes(4096);
    record->mutable_group()->set_state(v1::GROUP_STATE_READY);
    record->set_token_sha256(common::Sha256Hex(token));
    record->set_deletion_key(security::DeletionKey(token));
    return join;
  }

  absl::Status Delete(const std::string& name, const std::string& token, bool force = false) {
    v1::RetireGroupRequest retire;
    retire.set_fabric_id(kFabric);
    retire.set_name(name);
    retire.set_nonce("0123456789abcdef0123456789abcdef");
    retire.set_proof(security::RetireProof(security::DeletionKey(token), name, retire.nonce()));
    retire.set_force(force);
    return registry_->Retire(retire);
  }

  FakeMember member_;
  std::unique_ptr<grpc::Server> server_;
  fabric::Membership membership_;
  std::unique_ptr<fabric::PeerLinks> links_;
  std::unique_ptr<groups::Registry> registry_;
  v1::JoinRequest join_;
};

// EPF_CHAOS_SEED=20261124, iteration 151 (stop_daemon in data target=0 delay_ms=27 pause_ms=546): the members took
// the stopped coordinator for gone and sent Joins listing the group; a delete queued beside them released the group
// everywhere, and a Join handled after it brought the group back into the registry, DEGRADED, for good.
TEST_F(RegistryTest, AJoinFromBeforeADeleteDoesNotBringTheGroupBack) {
  v1::CreateGroupRequest create;
  create.set_name("chaos-151");
  create.add_ranks(1);
  create.set_num_nvl_bytes(4096);
  auto created = registry_->Propose(create);
  ASSERT_TRUE(created.ok()) << created.status();
  const v1::JoinRequest before_delete = JoinReporting("chaos-151", created->token());
  registry_->Adopt(before_delete);  // while the group exists: nothing to adopt
  ASSERT_EQ(registry_->Groups().at("chaos-151").state(), v1::GROUP_STATE_READY);

  ASSERT_TRUE(Delete("chaos-151", created->token()).ok());
  EXPECT_EQ(member_.releases.load(), 1);
  EXPECT_TRUE(registry_->PendingReleases().empty());
  registry_->Adopt(before_delete);  // the same snapshot, handled after the delete
  EXPECT_EQ(registry_->Groups().count("chaos-151"), 0u) << "a deleted group was adopted again";

  // The name is free: created again, the new group is a different one, and a stale report of the old one still
  // brings nothing back once the new one is deleted too.
  auto again = registry_->Propose(create);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(Delete("chaos-151", again->token()).ok());
  registry_->Adopt(before_delete);
  registry_->Adopt(JoinReporting("chaos-151", again->token()));
  EXPECT_TRUE(registry_->Groups().empty());
}

// A restarted coordinator adopts what the members report; one it deleted after adopting it stays deleted, and so does
// a name it did not know and deleted by force.
TEST_F(RegistryTest, AdoptedGroupsOnceDeletedAreNotAdoptedAgain) {
  const std::string token = "0123456789abcdef0123456789abcdef";
  const v1::JoinRequest join = JoinReporting("left-by-a-predecessor", token);
  registry_->Adopt(join);
  ASSERT_EQ(registry_->Groups().count("left-by-a-predecessor"), 1u);
  EXPECT_EQ(registry_->Groups().at("left-by-a-predecessor").state(), v1::GROUP_STATE_DEGRADED);
  ASSERT_TRUE(Delete("left-by-a-predecessor", token).ok());
  registry_->Adopt(join);
  EXPECT_TRUE(registry_->Groups().empty());

  ASSERT_TRUE(Delete("never-reported", "", /*force=*/true).ok());
  EXPECT_TRUE(registry_->PendingReleases().empty());
  registry_->Adopt(JoinReporting("never-reported", token));
  EXPECT_TRUE(registry_->Groups().empty());

  // A group nobody deleted is adopted as before.
  registry_->Adopt(JoinReporting("still-held", "fedcba9876543210fedcba9876543210"));
  EXPECT_EQ(registry_->Groups().count("still-held"), 1u);
}

// Members get the token's digest and the keys derived from it, never the token; a delete proves the token with the
// deletion key, for its own name.
TEST_F(RegistryTest, MembersGetNoTokenAndADeleteProvesItForItsName) {
  v1::CreateGroupRequest create;
  create.set_name("secret");
  create.add_ranks(1);
  create.set_num_nvl_bytes(4096);
  auto created = registry_->Propose(create);
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string& token = created->token();
  {
    std::lock_guard<std::mutex> lock(member_.mutex);
    const v1::PrepareGroupRequest& prepare = member_.last_prepare;
    EXPECT_TRUE(prepare.token().empty());
    EXPECT_EQ(prepare.token_sha256(), security::TokenDigest(token));
    EXPECT_EQ(prepare.data_key(), security::DataKey(token));
    EXPECT_EQ(prepare.deletion_key(), security::DeletionKey(token));
    EXPECT_EQ(prepare.SerializeAsString().find(token), std::string::npos);
  }
  v1::RetireGroupRequest retire;
  retire.set_fabric_id(kFabric);
  retire.set_name("secret");
  retire.set_nonce("00112233445566778899aabbccddeeff");
  // Made for another name, with another token, with a nonce of the wrong shape: refused, the group stays.
  retire.set_proof(security::RetireProof(security::DeletionKey(token), "other", retire.nonce()));
  EXPECT_TRUE(absl::IsPermissionDenied(registry_->Retire(retire)));
  retire.set_proof(security::RetireProof(security::DeletionKey(std::string(32, '0')), "secret", retire.nonce()));
  EXPECT_TRUE(absl::IsPermissionDenied(registry_->Retire(retire)));
  retire.set_nonce("short");
  retire.set_proof(security::RetireProof(security::DeletionKey(token), "secret", retire.nonce()));
  EXPECT_TRUE(absl::IsPermissionDenied(registry_->Retire(retire)));
  retire.set_token(token);  // the old way: the token itself is not taken either
  retire.clear_proof();
  EXPECT_TRUE(absl::IsPermissionDenied(registry_->Retire(retire)));
  EXPECT_EQ(registry_->Groups().count("secret"), 1u);
  EXPECT_EQ(member_.releases.load(), 0);
  // The proof made from the token for this name deletes.
  retire.clear_token();
  retire.set_nonce("00112233445566778899aabbccddeeff");
  retire.set_proof(security::RetireProof(security::DeletionKey(token), "secret", retire.nonce()));
  EXPECT_TRUE(registry_->Retire(retire).ok());
  EXPECT_EQ(registry_->Groups().count("secret"), 0u);

  // A group adopted from a Join without its deletion key is deleted only by force.
  // (Another token: the registry remembers the deleted group's digest and would not adopt it.)
  const std::string other = "77777777777777777777777777777777";
  v1::JoinRequest join = JoinReporting("unkeyed", other);
  join.mutable_groups(0)->clear_deletion_key();
  registry_->Adopt(join);
  ASSERT_EQ(registry_->Groups().count("unkeyed"), 1u);
  absl::Status refused = Delete("unkeyed", other);
  EXPECT_TRUE(absl::IsPermissionDenied(refused)) << refused;
  EXPECT_TRUE(Delete("unkeyed", "", /*force=*/true).ok());
}

}  // namespace
}  // namespace epfabric::daemon
