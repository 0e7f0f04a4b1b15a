// Proofs on the peer port bound to their request and spent once, and members that refuse a coordinator without the
// secret (issue #34), with real daemons on loopback.
// Each test plays an attacker of the issue: a process that received a member's proofs (it bound a dead member's
// port), or one that bound a dead coordinator's port without the secret.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "epfabric/common/peer_auth.h"
#include "epfabric/v1/ops.grpc.pb.h"
#include "epfabric/v1/peer.grpc.pb.h"
#include "integration/fabric_under_test.h"
#include "integration/peer_channel.h"

namespace epfabric::testing {
namespace {

using ::testing::HasSubstr;
using Code = grpc::StatusCode;

const std::vector<std::string> kFast = {"--heartbeat_ms=100", "--heartbeat_misses=3"};

common::PeerProofClaim Member(int rank) { return {common::PeerRole::kMember, rank}; }

std::string PeerAddress(FabricUnderTest& fabric, int rank) {
  return fabric.Fabric(0)->membership().members(rank).peer_address();
}

template <typename Call>
grpc::Status WithDeadline(Call call, const std::string& proof = "") {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  if (!proof.empty()) context.AddMetadata(common::kPeerAuthMetadataKey, proof);
  return call(&context);
}

bool GroupReadyOn(FabricUnderTest& fabric, int rank, const std::string& name) {
  auto view = fabric.Fabric(rank);
  if (!view.ok()) return false;
  for (const auto& group : view->groups()) {
    if (group.name() == name) return group.state() == v1::GROUP_STATE_READY;
  }
  return false;
}

TEST(PeerProof, ACapturedProofIsGoodForItsOwnRequestOnceAndForNothingElse) {
  auto fabric = FabricUnderTest::Start(2, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  const std::string fabric_id = (*fabric)->fabric_id();
  v1::CreateGroupRequest create;
  create.set_name("tenant");
  create.add_ranks(0);
  create.add_ranks(1);
  create.set_num_nvl_bytes(1 << 20);
  v1::CreateGroupResponse created;
  ASSERT_TRUE(WithDeadline([&](auto* c) { return (*fabric)->Control(0)->CreateGroup(c, create, &created); }).ok());

  // Rank 0's ReleaseGroup of a group the attacker made and deleted, as the attacker received it: the proof it
  // carried, which rank 1 also accepted once.
  std::vector<std::string> captured;
  auto as_zero = v1::Peer::NewStub(PeerChannel(PeerAddress(**fabric, 1), fabric_id, Member(0), &captured));
  v1::ReleaseGroupRequest decoy;
  decoy.set_fabric_id(fabric_id);
  decoy.set_name("decoy");
  v1::ReleaseGroupResponse released;
  grpc::Status status = WithDeadline([&](auto* c) { return as_zero->ReleaseGroup(c, decoy, &released); });
  ASSERT_NE(status.error_code(), Code::UNAUTHENTICATED) << status.error_message();
  ASSERT_EQ(captured.size(), 1u);

  // The proof replayed on another tenant's group, on a channel with no credential of its own.
  auto stranger = v1::Peer::NewStub(PeerChannel(PeerAddress(**fabric, 1), fabric_id, std::nullopt));
  v1::ReleaseGroupRequest tenant = decoy;
  tenant.set_name("tenant");
  status = WithDeadline([&](auto* c) { return stranger->ReleaseGroup(c, tenant, &released); }, captured[0]);
  EXPECT_EQ(status.error_code(), Code::UNAUTHENTICATED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("made for another request"));
  EXPECT_TRUE(GroupReadyOn(**fabric, 1, "tenant"));

  // The same proof with its own request: spent.
  status = WithDeadline([&](auto* c) { return stranger->ReleaseGroup(c, decoy, &released); }, captured[0]);
  EXPECT_EQ(status.error_code(), Code::UNAUTHENTICATED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("used already"));

  // A proof made for rank 1 (as the coordinator sends the same Release to every member) is no good at rank 0.
  const std::string for_rank_1 = common::MakePeerProof(TestFabricSecret(), fabric_id, "/epfabric.v1.Peer/ReleaseGroup",
                                                       Member(0), tenant.SerializeAsString(), absl::Now(), "",
                                                       common::PeerAudience(PeerAddress(**fabric, 1)));
  auto stranger_at_zero = v1::Peer::NewStub(PeerChannel(PeerAddress(**fabric, 0), fabric_id, std::nullopt));
  status = WithDeadline([&](auto* c) { return stranger_at_zero->ReleaseGroup(c, tenant, &released); }, for_rank_1);
  EXPECT_EQ(status.error_code(), Code::UNAUTHENTICATED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("made for another daemon"));
  EXPECT_TRUE(GroupReadyOn(**fabric, 0, "tenant"));

  // A fresh proof from the coordinator's credential passes.
  status = WithDeadline([&](auto* c) { return as_zero->ReleaseGroup(c, tenant, &released); });
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_FALSE(GroupReadyOn(**fabric, 1, "tenant"));
}

// A process without the secret on a dead coordinator's port: it answers Joins and heartbeats with a view whose fd
// sockets are its own, and CreateGroup with a token of its choosing.
class FakeCoordinator final : public v1::Peer::Service {
 public:
  static constexpr char kFdSocket[] = "/tmp/epf-fake-coordinator.fds";

  explicit FakeCoordinator(v1::Membership view) : view_(std::move(view)) {
    view_.set_epoch(view_.epoch() + 100);
    for (v1::MemberInfo& member : *view_.mutable_members()) {
      member.set_state(v1::MEMBER_STATE_UP);
      member.set_fd_socket(kFdSocket);
    }
  }
  grpc::Status Join(grpc::ServerContext*, const v1::JoinRequest*, v1::JoinResponse* response) override {
    joins_.fetch_add(1);
    *response->mutable_membership() = view_;
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*, v1::HeartbeatResponse* response) override {
    response->set_epoch(view_.epoch());
    *response->mutable_membership() = view_;
    return grpc::Status::OK;
  }
  grpc::Status ProposeGroup(grpc::ServerContext*, const v1::ProposeGroupRequest* request,
                            v1::CreateGroupResponse* response) override {
    response->set_token(std::string(32, 'a'));
    response->mutable_group()->set_name(request->request().name());
    return grpc::Status::OK;
  }
  int joins() const { return joins_.load(); }

 private:
  v1::Membership view_;
  std::atomic<int> joins_{0};
};

TEST(CoordinatorProof, AMemberRefusesAnAnswerWithoutTheSecret) {
  auto fabric = FabricUnderTest::Start(2, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  const v1::Membership view = (*fabric)->Fabric(1)->membership();
  const std::string real_fd_socket = view.members(1).fd_socket();
  (*fabric)->Kill(0);
  FakeCoordinator fake(view);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort((*fabric)->coordinator(), grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&fake);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_NE(port, 0);

  // Rank 1's health says why it refuses the answers on rank 0's port.
  v1::HealthReport health;
  bool refused = false;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while ((!refused || fake.joins() == 0) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(100));
    health.Clear();
    (void)WithDeadline([&](auto* c) { return (*fabric)->Ops(1)->GetHealth(c, v1::GetHealthRequest(), &health); });
    refused = false;
    for (const auto& incident : health.incidents()) refused |= incident.code() == "COORDINATOR_UNAUTHENTICATED";
  }
  ASSERT_TRUE(refused) << health.DebugString();
  EXPECT_EQ(health.overall(), v1::HealthReport::FAIL);
  EXPECT_GT(fake.joins(), 0);
  auto seen = (*fabric)->Fabric(1);
  ASSERT_TRUE(seen.ok());
  EXPECT_THAT(seen->coordinator_unverified(), HasSubstr("no fabric proof"));
  for (const v1::MemberInfo& member : seen->membership().members()) {
    EXPECT_NE(member.fd_socket(), FakeCoordinator::kFdSocket) << member.rank();
  }
  EXPECT_EQ(seen->membership().members(1).fd_socket(), real_fd_socket);

  // A client's CreateGroup forwarded to the fake does not come back with the fake's token.
  v1::CreateGroupRequest create;
  create.set_name("tenant");
  create.add_ranks(0);
  create.add_ranks(1);
  create.set_num_nvl_bytes(1 << 20);
  v1::CreateGroupResponse created;
  grpc::Status status = WithDeadline([&](auto* c) { return (*fabric)->Control(1)->CreateGroup(c, create, &created); });
  EXPECT_FALSE(status.ok()) << "the fake's token came back: " << created.token();
  EXPECT_TRUE(created.token().empty());
  server->Shutdown();
}

}  // namespace
}  // namespace epfabric::testing
