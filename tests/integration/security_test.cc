// The peer port's credentials and the checks behind them (issue #13), with real daemons on loopback: strangers,
// members claiming another rank, non-coordinators driving groups, forged epochs, a re-Join from another address,
// and mutual TLS with certificates that name the fabric and the rank.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "epfabric/common/peer_auth.h"
#include "epfabric/v1/ops.grpc.pb.h"
#include "epfabric/v1/peer.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "integration/fabric_under_test.h"
#include "integration/peer_channel.h"
#include "integration/test_pki.h"

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
grpc::Status WithDeadline(Call call) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return call(&context);
}

v1::CreateGroupResponse MakeGroup(FabricUnderTest& fabric, const std::string& name) {
  v1::CreateGroupRequest request;
  request.set_name(name);
  request.add_ranks(0);
  request.add_ranks(1);
  request.set_num_nvl_bytes(1 << 20);
  v1::CreateGroupResponse response;
  grpc::ClientContext context;
  EXPECT_TRUE(fabric.Control(0)->CreateGroup(&context, request, &response).ok());
  return response;
}

bool GroupReadyOn(FabricUnderTest& fabric, int rank, const std::string& name) {
  auto view = fabric.Fabric(rank);
  if (!view.ok()) return false;
  for (const auto& group : view->groups()) {
    if (group.name() == name) return group.state() == v1::GROUP_STATE_READY;
  }
  return false;
}

TEST(PeerAuth, StrangersAreRefusedByEveryPeerMethodAndChangeNothing) {
  auto fabric = FabricUnderTest::Start(2, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  const v1::CreateGroupResponse group = MakeGroup(**fabric, "tenant");
  const std::string fabric_id = (*fabric)->fabric_id();
  for (int target : {0, 1}) {
    auto stub = v1::Peer::NewStub(PeerChannel(PeerAddress(**fabric, target), fabric_id, std::nullopt));
    std::vector<std::pair<const char*, grpc::Status>> calls;
    v1::JoinRequest join;
    join.set_fabric_id(fabric_id);
    join.set_world_size(2);
    join.mutable_member()->set_rank(1);
    v1::JoinResponse join_response;
    calls.emplace_back("Join", WithDeadline([&](auto* c) { return stub->Join(c, join, &join_response); }));
    v1::HeartbeatRequest beat;
    beat.set_fabric_id(fabric_id);
    v1::HeartbeatResponse beat_response;
    calls.emplace_back("Heartbeat", WithDeadline([&](auto* c) { return stub->Heartbeat(c, beat, &beat_response); }));
    v1::PublishMembershipRequest publish;
    publish.set_fabric_id(fabric_id);
    v1::PublishMembershipResponse publish_response;
    calls.emplace_back("Publish",
                       WithDeadline([&](auto* c) { return stub->PublishMembership(c, publish, &publish_response); }));
    v1::ProposeGroupRequest propose;
    propose.set_fabric_id(fabric_id);
    propose.mutable_request()->set_name("stolen");
    propose.mutable_request()->add_ranks(0);
    propose.mutable_request()->set_num_nvl_bytes(4096);
    v1::CreateGroupResponse propose_response;
    calls.emplace_back("Propose",
                       WithDeadline([&](auto* c) { return stub->ProposeGroup(c, propose, &propose_response); }));
    v1::RetireGroupRequest retire;
    retire.set_fabric_id(fabric_id);
    retire.set_name("tenant");
    v1::RetireGroupResponse retire_response;
    calls.emplace_back("Retire", WithDeadline([&](auto* c) { return stub->RetireGroup(c, retire, &retire_response); }));
    v1::PrepareGroupRequest prepare;
    prepare.set_fabric_id(fabric_id);
    v1::PrepareGroupResponse prepare_response;
    calls.emplace_back("Prepare",
                       WithDeadline([&](auto* c) { return stub->PrepareGroup(c, prepare, &prepare_response); }));
    v1::CommitGroupRequest commit;
    commit.set_fabric_id(fabric_id);
    commit.set_name("tenant");
    v1::CommitGroupResponse commit_response;
    calls.emplace_back("Commit", WithDeadline([&](auto* c) { return stub->CommitGroup(c, commit, &commit_response); }));
    v1::ReleaseGroupRequest release;
    release.set_fabric_id(fabric_id);
    release.set_name("tenant");
    v1::ReleaseGroupResponse release_response;
    calls.emplace_back("Release",
                       WithDeadline([&](auto* c) { return stub->ReleaseGroup(c, release, &release_response); }));
    for (const auto& [what, status] : calls) {
      EXPECT_EQ(status.error_code(), Code::UNAUTHENTICATED)
          << what << " on rank " << target << ": " << status.error_message();
      EXPECT_THAT(status.error_message(), HasSubstr("no fabric credential")) << what;
    }
    // Ops on the peer port needs a credential too.
    auto ops = v1::Ops::NewStub(PeerChannel(PeerAddress(**fabric, target), fabric_id, std::nullopt));
    v1::FabricView view;
    EXPECT_EQ(WithDeadline([&](auto* c) { return ops->GetFabric(c, v1::GetFabricRequest(), &view); }).error_code(),
              Code::UNAUTHENTICATED);
  }
  // The group survived the stranger's Release and Retire, on both members.
  EXPECT_TRUE(GroupReadyOn(**fabric, 0, "tenant"));
  EXPECT_TRUE(GroupReadyOn(**fabric, 1, "tenant"));
  auto view = (*fabric)->Fabric(0);
  ASSERT_TRUE(view.ok());
  for (const auto& g : view->groups()) EXPECT_NE(g.name(), "stolen");
}

TEST(PeerAuth, OnlyTheCoordinatorDrivesGroupsAndMembership) {
  auto fabric = FabricUnderTest::Start(3, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  MakeGroup(**fabric, "tenant");
  const std::string fabric_id = (*fabric)->fabric_id();
  // Rank 2 (a member, holding the secret) tries what only rank 0 may do, against rank 1.
  auto stub = v1::Peer::NewStub(PeerChannel(PeerAddress(**fabric, 1), fabric_id, Member(2)));
  v1::ReleaseGroupRequest release;
  release.set_fabric_id(fabric_id);
  release.set_name("tenant");
  v1::ReleaseGroupResponse release_response;
  grpc::Status status = WithDeadline([&](auto* c) { return stub->ReleaseGroup(c, release, &release_response); });
  EXPECT_EQ(status.error_code(), Code::PERMISSION_DENIED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("only rank 0 may call this; the caller is member rank 2"));
  v1::PublishMembershipRequest publish;
  publish.set_fabric_id(fabric_id);
  *publish.mutable_membership() = (*fabric)->Fabric(1)->membership();
  publish.mutable_membership()->set_epoch(publish.membership().epoch() + 1);
  publish.mutable_membership()->mutable_members(1)->set_fd_socket("/tmp/attacker.fds");
  v1::PublishMembershipResponse publish_response;
  status = WithDeadline([&](auto* c) { return stub->PublishMembership(c, publish, &publish_response); });
  EXPECT_EQ(status.error_code(), Code::PERMISSION_DENIED);
  v1::CommitGroupRequest commit;
  commit.set_fabric_id(fabric_id);
  commit.set_name("tenant");
  v1::CommitGroupResponse commit_response;
  EXPECT_EQ(WithDeadline([&](auto* c) { return stub->CommitGroup(c, commit, &commit_response); }).error_code(),
            Code::PERMISSION_DENIED);
  EXPECT_TRUE(GroupReadyOn(**fabric, 1, "tenant"));
  EXPECT_NE((*fabric)->Fabric(1)->membership().members(1).fd_socket(), "/tmp/attacker.fds");
}

TEST(PeerAuth, AMemberJoinsAndBeatsOnlyAsItself) {
  auto fabric = FabricUnderTest::Start(3, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  const std::string fabric_id = (*fabric)->fabric_id();
  const v1::MemberInfo holder = (*fabric)->Fabric(0)->membership().members(1);

  // Rank 2's credential, a Join for rank 1.
  v1::JoinRequest join;
  join.set_fabric_id(fabric_id);
  join.set_world_size(3);
  *join.mutable_member() = holder;
  join.mutable_member()->set_peer_address("127.0.0.1:1");
  v1::JoinResponse response;
  auto as_two = v1::Peer::NewStub(PeerChannel((*fabric)->coordinator(), fabric_id, Member(2)));
  grpc::Status status = WithDeadline([&](auto* c) { return as_two->Join(c, join, &response); });
  EXPECT_EQ(status.error_code(), Code::PERMISSION_DENIED) << status.error_message();

  // Rank 1's own credential, its live incarnation, another address: not that daemon.
  auto as_one = v1::Peer::NewStub(PeerChannel((*fabric)->coordinator(), fabric_id, Member(1)));
  status = WithDeadline([&](auto* c) { return as_one->Join(c, join, &response); });
  EXPECT_EQ(status.error_code(), Code::ALREADY_EXISTS) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("is already joined from " + holder.peer_address()));

  // A forged epoch near 2^64 is refused in a Join and in a publish (even from the coordinator's credential).
  join.mutable_member()->set_peer_address(holder.peer_address());
  join.set_known_epoch(std::numeric_limits<uint64_t>::max());
  status = WithDeadline([&](auto* c) { return as_one->Join(c, join, &response); });
  EXPECT_EQ(status.error_code(), Code::INVALID_ARGUMENT) << status.error_message();
  auto as_zero = v1::Peer::NewStub(PeerChannel(PeerAddress(**fabric, 1), fabric_id, Member(0)));
  v1::PublishMembershipRequest publish;
  publish.set_fabric_id(fabric_id);
  *publish.mutable_membership() = (*fabric)->Fabric(1)->membership();
  publish.mutable_membership()->set_epoch(std::numeric_limits<uint64_t>::max());
  v1::PublishMembershipResponse published;
  status = WithDeadline([&](auto* c) { return as_zero->PublishMembership(c, publish, &published); });
  EXPECT_EQ(status.error_code(), Code::INVALID_ARGUMENT) << status.error_message();

  absl::SleepFor(absl::Milliseconds(500));
  for (int rank : {0, 1, 2}) {
    auto view = (*fabric)->Fabric(rank);
    ASSERT_TRUE(view.ok());
    EXPECT_FALSE(view->degraded()) << rank;
    EXPECT_EQ(view->membership().members(1).peer_address(), holder.peer_address()) << rank;
    EXPECT_LT(view->membership().epoch(), 1000u) << rank;
  }
}

TEST(PeerAuth, ADaemonWithAnotherSecretCannotJoin) {
  auto fabric = FabricUnderTest::Start(3, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  (*fabric)->Kill(2);
  const std::string dir = MakeTempDir();
  const std::string other = dir + "/other.secret";
  std::ofstream(other) << "a-different-secret-of-enough-bytes\n";
  std::filesystem::permissions(other, std::filesystem::perms::owner_read);
  std::vector<std::string> flags = (*fabric)->FlagsFor(2);
  flags.push_back("--fabric_secret_file=" + other);
  auto intruder = DaemonUnderTest::Start(flags);
  ASSERT_TRUE(intruder.ok()) << intruder.status();
  absl::SleepFor(absl::Milliseconds(1000));
  EXPECT_THAT((*intruder)->process().Stderr(), HasSubstr("does not verify"));
  EXPECT_NE((*fabric)->Fabric(0)->membership().members(2).state(), v1::MEMBER_STATE_UP);
  std::filesystem::remove_all(dir);
}

TEST(PeerAuth, OpsToolingReadsThePeerPortWithTheSecretAndSeesNoLeaseIds) {
  auto fabric = FabricUnderTest::Start(2, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  const v1::CreateGroupResponse group = MakeGroup(**fabric, "tenant");
  v1::AttachRequest attach;
  attach.set_group("tenant");
  attach.set_rank(0);
  attach.set_token(group.token());
  v1::AttachResponse attached;
  {
    grpc::ClientContext context;
    ASSERT_TRUE((*fabric)->Control(0)->Attach(&context, attach, &attached).ok());
  }
  ASSERT_FALSE(attached.lease_id().empty());
  auto ops = v1::Ops::NewStub(PeerChannel((*fabric)->coordinator(), (*fabric)->fabric_id(),
                                          common::PeerProofClaim{common::PeerRole::kOps, -1}));
  v1::ListClientsResponse clients;
  grpc::Status status = WithDeadline([&](auto* c) { return ops->ListClients(c, v1::ListClientsRequest(), &clients); });
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(clients.clients_size(), 1);
  EXPECT_TRUE(clients.clients(0).lease_id().empty());
  // The client socket does not list lease ids either.
  v1::ListClientsResponse local;
  grpc::ClientContext context;
  ASSERT_TRUE((*fabric)->Ops(0)->ListClients(&context, v1::ListClientsRequest(), &local).ok());
  ASSERT_EQ(local.clients_size(), 1);
  EXPECT_TRUE(local.clients(0).lease_id().empty());

  // epctl with the secret reads the peer port; without it, it is refused.
  RunResult with =
      RunBinary({EpctlBinary(), "--address=" + (*fabric)->coordinator(),
                 "--fabric_secret_file=" + TestFabricSecretFile(), "--fabric_id=" + (*fabric)->fabric_id(), "fabric"});
  EXPECT_EQ(with.exit_code, 0) << with.err;
  RunResult without =
      RunBinary({EpctlBinary(), "--address=" + (*fabric)->coordinator(), "--timeout_ms=1000", "fabric"});
  EXPECT_NE(without.exit_code, 0);
  EXPECT_THAT(without.err, HasSubstr("no fabric credential"));
}

// On loopback a daemon makes its own credential (docs/security.md, "A first run"); off loopback it needs TLS.
TEST(PeerAuth, DaemonRefusesAPeerPortOffLoopbackWithoutTlsAndAnOpenSecret) {
  const std::string dir = MakeTempDir();
  RunResult result = RunBinary({DaemonBinary(), "--client_socket=" + dir + "/d.sock", "--peer_listen=0.0.0.0:0"});
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_THAT(result.err, HasSubstr("--peer_listen: '0.0.0.0' is not a loopback address"));
  const std::string open = dir + "/open.secret";
  std::ofstream(open) << "a-secret-that-others-can-read\n";
  std::filesystem::permissions(open, std::filesystem::perms::owner_read | std::filesystem::perms::others_read);
  result = RunBinary({DaemonBinary(), "--client_socket=" + dir + "/d.sock", "--fabric_secret_file=" + open});
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_THAT(result.err,
              HasSubstr("has mode 0404; a fabric secret must not be readable or writable by group or others"));
  std::filesystem::remove_all(dir);
}

// ---- mutual TLS: certificates name the fabric and the rank (pod certificates: security_pod_identity_test.cc) ----

TEST(PeerAuth, MutualTlsBindsTheRankToTheCertificate) {
  const std::string dir = MakeTempDir();
  const std::string fabric_id = UniqueFabricId();
  const Pki good = MakeCa(dir, "good");
  const Pki rogue = MakeCa(dir, "rogue");
  std::map<int, std::vector<std::string>> per_rank;
  for (int rank : {0, 1, 2}) {
    per_rank[rank] = Issue(good, absl::StrCat("member", rank), absl::StrCat("epfabric-member:", fabric_id, ":", rank));
  }
  std::vector<std::string> flags = kFast;
  flags.push_back("--fabric_id=" + fabric_id);
  auto fabric = FabricUnderTest::Start(2, flags, per_rank);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok()) << "daemons with certificates for their ranks form a fabric";

  // A certificate from another CA for rank 2: the daemon starts (its CN fits its rank) but never joins.
  auto wider = FabricUnderTest::Start(3, flags, per_rank);
  ASSERT_TRUE(wider.ok()) << wider.status();
  ASSERT_TRUE((*wider)->WaitComplete().ok());
  (*wider)->Kill(2);
  std::vector<std::string> intruder_flags = {absl::StrCat("--rank=2"), "--world_size=3", "--fabric_id=" + fabric_id,
                                             "--backend=host", "--coordinator=" + (*wider)->coordinator()};
  intruder_flags.insert(intruder_flags.end(), kFast.begin(), kFast.end());
  const std::vector<std::string> rogue_tls = Issue(rogue, "rogue2", absl::StrCat("epfabric-member:", fabric_id, ":2"));
  std::vector<std::string> rogue_flags = intruder_flags;
  rogue_flags.insert(rogue_flags.end(), rogue_tls.begin(), rogue_tls.end());
  auto intruder = DaemonUnderTest::Start(rogue_flags);
  ASSERT_TRUE(intruder.ok()) << intruder.status();
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_NE((*wider)->Fabric(0)->membership().members(2).state(), v1::MEMBER_STATE_UP);

  // The good CA's certificate for rank 0 used as rank 2: the daemon refuses to start (exit 2, naming the
  // certificate), and a hand-made peer presenting it as rank 2 is refused by the coordinator.
  std::vector<std::string> stolen_flags = intruder_flags;
  stolen_flags.insert(stolen_flags.begin(), {DaemonBinary(), "--client_socket=" + dir + "/stolen.sock"});
  stolen_flags.insert(stolen_flags.end(), per_rank[0].begin(), per_rank[0].end());
  RunResult stolen = RunBinary(stolen_flags);
  EXPECT_EQ(stolen.exit_code, 2);
  EXPECT_THAT(stolen.err, HasSubstr(absl::StrCat("--tls_cert: the certificate (CN 'epfabric-member:", fabric_id,
                                                 ":0') names rank 0 of fabric ", fabric_id, ", not --rank=2")));
  auto as_two = v1::Peer::NewStub(TlsPeerChannel(
      (*wider)->coordinator(), IssueFiles(good, "member0b", absl::StrCat("epfabric-member:", fabric_id, ":0"))));
  v1::HeartbeatRequest beat;
  beat.set_fabric_id(fabric_id);
  beat.set_rank(2);
  v1::HeartbeatResponse answer;
  const grpc::Status refused =
      WithDeadline([&](grpc::ClientContext* c) { return as_two->Heartbeat(c, beat, &answer); });
  EXPECT_EQ(refused.error_code(), Code::PERMISSION_DENIED) << refused.error_message();
  EXPECT_THAT(refused.error_message(), HasSubstr("only rank 2 may call this; the caller is member rank 0"));

  // epctl: plaintext and wrong-CA callers are refused; an ops certificate of the fabric reads.
  const std::vector<std::string> ops_tls = Issue(good, "ops", "epfabric-ops:" + fabric_id);
  RunResult plain = RunBinary({EpctlBinary(), "--address=" + (*fabric)->coordinator(), "--timeout_ms=1000", "health"});
  EXPECT_EQ(plain.exit_code, 1);
  std::vector<std::string> right = {EpctlBinary(), "--address=" + (*fabric)->coordinator()};
  right.insert(right.end(), ops_tls.begin(), ops_tls.end());
  right.push_back("fabric");
  RunResult ok = RunBinary(right);
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_THAT(ok.out, HasSubstr("degraded: no"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace epfabric::testing
