// Fabric formation, membership, groups and security, with real daemons on loopback (host backend).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "epfabric/common/fd_passing.h"
#include "epfabric/v1/fdchannel.pb.h"
#include "epfabric/v1/peer.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "integration/fabric_test_util.h"
#include "integration/fabric_under_test.h"
#include "memory_test_util.h"

namespace epfabric::testing {
namespace {

using ::testing::HasSubstr;

// Fast heartbeats keep these tests short; the detection-time test uses the defaults.
const std::vector<std::string> kFast = {"--heartbeat_ms=100", "--heartbeat_misses=3"};

// What a client gets from `daemon`'s fd side channel for `group`'s NVL region of `rank`: the region's memfd.
absl::StatusOr<common::UniqueFd> FetchRegionFd(DaemonUnderTest& daemon, const std::string& group, int rank,
                                               const std::string& token) {
  auto connection = ConnectTo(daemon.socket() + ".fds");
  if (!connection.ok()) return connection.status();
  v1::FdRequest request;
  request.set_group(group);
  request.set_rank(rank);
  request.set_kind(v1::RegionDescriptor::KIND_NVL);
  request.set_token(token);
  if (absl::Status sent = common::SendFds(connection->get(), {}, request.SerializeAsString(), absl::Seconds(5));
      !sent.ok()) {
    return sent;
  }
  auto message = common::ReceiveFds(connection->get(), absl::Seconds(5));
  if (!message.ok()) return message.status();
  v1::FdResponse response;
  if (!response.ParseFromString(message->payload)) return absl::InternalError("not an FdResponse");
  if (response.code() != 0) return absl::Status(static_cast<absl::StatusCode>(response.code()), response.message());
  if (message->fds.size() != 1) return absl::InternalError(absl::StrCat(message->fds.size(), " fds arrived"));
  return std::move(message->fds[0]);
}

grpc::health::v1::HealthCheckResponse::ServingStatus FabricHealth(DaemonUnderTest& daemon) {
  auto stub = grpc::health::v1::Health::NewStub(daemon.SocketChannel());
  grpc::ClientContext context;
  grpc::health::v1::HealthCheckRequest request;
  request.set_service("epfabric.v1.Fabric");
  grpc::health::v1::HealthCheckResponse response;
  if (!stub->Check(&context, request, &response).ok()) return grpc::health::v1::HealthCheckResponse::UNKNOWN;
  return response.status();
}

TEST(Fabric, EightDaemonsFormAFabric) {
  const absl::Time start = absl::Now();
  auto fabric = FabricUnderTest::Start(8, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  const absl::Duration took = absl::Now() - start;
  std::cout << "[ FORMED   ] 8 daemons (processes started one after another) in " << absl::ToDoubleMilliseconds(took)
            << " ms\n";
  for (int rank = 0; rank < 8; ++rank) {
    auto view = (*fabric)->Fabric(rank);
    ASSERT_TRUE(view.ok());
    EXPECT_EQ(view->self_rank(), rank);
    EXPECT_EQ(view->fabric_id(), (*fabric)->fabric_id());
    EXPECT_FALSE(view->degraded());
    EXPECT_EQ(FabricHealth((*fabric)->daemon(rank)), grpc::health::v1::HealthCheckResponse::SERVING) << rank;
    for (int r = 0; r < 8; ++r) {
      EXPECT_EQ(view->membership().members(r).rank(), r);
      EXPECT_FALSE(view->membership().members(r).peer_address().empty());
      EXPECT_EQ(view->membership().members(r).backend(), v1::BACKEND_HOST);
    }
  }
}

TEST(Fabric, KilledDaemonIsMarkedDownWithinThreeSecondsAndRejoins) {
  auto fabric = FabricUnderTest::Start(4);  // default heartbeats: 1 s, 3 misses
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  v1::CreateGroupResponse with3, without3;
  ASSERT_TRUE(CreateGroup(**fabric, 1, "with-3", {0, 1, 2, 3}, 1 << 20, &with3).ok());
  ASSERT_TRUE(CreateGroup(**fabric, 1, "without-3", {0, 1, 2}, 1 << 20, &without3).ok());
  auto before = (*fabric)->Fabric(0);
  ASSERT_TRUE(before.ok()) << before.status();
  const uint64_t epoch_before = before->membership().epoch();

  (*fabric)->Kill(3);
  const absl::Time killed = absl::Now();
  for (int rank : {0, 1, 2}) {
    auto view = (*fabric)->WaitView(
        rank, [](const v1::FabricView& v) { return StateOf(v, 3) == v1::MEMBER_STATE_DOWN; }, absl::Seconds(3));
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_GT(view->membership().epoch(), epoch_before);
    EXPECT_TRUE(view->degraded());
  }
  std::cout << "[ DETECTED ] rank 3 down everywhere " << absl::ToDoubleMilliseconds(absl::Now() - killed)
            << " ms after SIGKILL\n";
  // Groups containing it are DEGRADED, the others are not; health says so.
  for (int rank : {0, 1, 2}) {
    auto view = (*fabric)->Fabric(rank);
    ASSERT_TRUE(view.ok());
    ASSERT_NE(FindGroup(*view, "with-3"), nullptr);
    EXPECT_EQ(FindGroup(*view, "with-3")->state(), v1::GROUP_STATE_DEGRADED) << rank;
    ASSERT_NE(FindGroup(*view, "without-3"), nullptr);
    EXPECT_EQ(FindGroup(*view, "without-3")->state(), v1::GROUP_STATE_READY) << rank;
    EXPECT_EQ(FabricHealth((*fabric)->daemon(rank)), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  }
  grpc::ClientContext context;
  v1::HealthReport report;
  ASSERT_TRUE((*fabric)->Ops(1)->GetHealth(&context, v1::GetHealthRequest(), &report).ok());
  EXPECT_EQ(report.overall(), v1::HealthReport::WARN);
  std::vector<std::string> codes;
  for (const auto& incident : report.incidents()) codes.push_back(incident.code() + " " + incident.entity());
  EXPECT_THAT(codes, ::testing::UnorderedElementsAre("PEER_DOWN rank 3", "GROUP_DEGRADED group with-3"));
  // A group with a member that is down cannot be created.
  v1::CreateGroupResponse refused;
  const grpc::Status create_status = CreateGroup(**fabric, 2, "needs-3", {2, 3}, 1 << 20, &refused);
  EXPECT_EQ(create_status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(create_status.error_message(),
            "rank 3 is MEMBER_STATE_DOWN: a group can only be created when all its members are up");
  // A degraded group refuses attach; the healthy one still works.
  v1::AttachResponse attached;
  EXPECT_EQ(Attach(**fabric, 1, "with-3", 1, with3.token(), &attached).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(Attach(**fabric, 1, "without-3", 1, without3.token(), &attached).ok());

  // Restarted: it rejoins with a new incarnation and a new epoch. Its old group stays DEGRADED (its memory died
  // with the process) until deleted; the fabric is whole again.
  const uint64_t epoch_down = (*fabric)->Fabric(0)->membership().epoch();
  ASSERT_TRUE((*fabric)->Restart(3).ok());
  ASSERT_TRUE((*fabric)->WaitComplete(absl::Seconds(10)).ok());
  auto view = (*fabric)->Fabric(2);
  ASSERT_TRUE(view.ok());
  EXPECT_GT(view->membership().epoch(), epoch_down);
  EXPECT_EQ(FindGroup(*view, "with-3")->state(), v1::GROUP_STATE_DEGRADED);
  EXPECT_EQ((*fabric)->Fabric(3)->groups_size(), 0) << "a restarted daemon holds no groups";
  ASSERT_TRUE(DeleteGroup(**fabric, 2, "with-3", with3.token()).ok());
  EXPECT_EQ(FindGroup(*(*fabric)->Fabric(0), "with-3"), nullptr);
  v1::CreateGroupResponse again;
  EXPECT_TRUE(CreateGroup(**fabric, 3, "with-3", {0, 1, 2, 3}, 1 << 20, &again).ok());
}

TEST(Fabric, SecondDaemonClaimingALiveRankIsRefused) {
  auto fabric = FabricUnderTest::Start(3, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  const uint64_t holder = (*fabric)->Fabric(0)->membership().members(2).incarnation();
  auto duplicate = DaemonUnderTest::Start((*fabric)->FlagsFor(2));
  ASSERT_TRUE(duplicate.ok()) << duplicate.status();
  absl::SleepFor(absl::Milliseconds(800));
  auto view = (*fabric)->Fabric(0);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->membership().members(2).incarnation(), holder);
  EXPECT_EQ(StateOf(*view, 2), v1::MEMBER_STATE_UP);
  EXPECT_THAT((*duplicate)->process().Stderr(), HasSubstr("is held by a live daemon"));
  EXPECT_EQ(FabricHealth(**duplicate), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  // Its health says why, as a failure (not a warning about an unreachable coordinator), and epctl exits non-zero.
  v1::HealthReport report;
  grpc::ClientContext context;
  ASSERT_TRUE(
      v1::Ops::NewStub((*duplicate)->SocketChannel())->GetHealth(&context, v1::GetHealthRequest(), &report).ok());
  EXPECT_EQ(report.overall(), v1::HealthReport::FAIL);
  bool refused = false;
  for (const auto& incident : report.incidents()) {
    refused |= incident.code() == "JOIN_REFUSED" && absl::StrContains(incident.message(), "is held by a live daemon");
    EXPECT_NE(incident.code(), "COORDINATOR_UNREACHABLE");
  }
  EXPECT_TRUE(refused) << report.DebugString();
  RunResult health = RunBinary({EpctlBinary(), "--socket=" + (*duplicate)->socket(), "health"});
  EXPECT_NE(health.exit_code, 0) << health.out;
}

TEST(Fabric, OtherFabricIdIsRefused) {
  auto fabric = FabricUnderTest::Start(2, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  std::vector<std::string> flags = (*fabric)->FlagsFor(1);
  flags.push_back("--fabric_id=intruder");
  auto intruder = DaemonUnderTest::Start(flags);
  ASSERT_TRUE(intruder.ok());
  absl::SleepFor(absl::Milliseconds(500));
  // The fabric id is part of every proof: a daemon of another fabric is refused before any handler runs.
  EXPECT_THAT((*intruder)->process().Stderr(), HasSubstr("does not verify for fabric"));
  EXPECT_EQ(FabricHealth(**intruder), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  auto view = (*fabric)->Fabric(0);
  ASSERT_TRUE(view.ok());
  EXPECT_TRUE(AllUp(*view));
}

TEST(Fabric, CoordinatorLossDegradesAndRecovers) {
  auto fabric = FabricUnderTest::Start(3, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  v1::CreateGroupResponse group;
  ASSERT_TRUE(CreateGroup(**fabric, 2, "survivor", {1, 2}, 1 << 20, &group).ok());
  const uint64_t epoch_before = (*fabric)->Fabric(1)->membership().epoch();
  (*fabric)->Kill(0);
  for (int rank : {1, 2}) {
    auto view = (*fabric)->WaitView(
        rank, [](const v1::FabricView& v) { return v.degraded() && StateOf(v, 0) == v1::MEMBER_STATE_DOWN; },
        absl::Seconds(3));
    ASSERT_TRUE(view.ok()) << view.status();
  }
  // Still serving what exists: the group is there and can be attached; creation needs the coordinator.
  v1::AttachResponse attached;
  EXPECT_TRUE(Attach(**fabric, 1, "survivor", 0, group.token(), &attached).ok());
  v1::CreateGroupResponse refused;
  const grpc::Status status = CreateGroup(**fabric, 1, "new", {1, 2}, 1 << 20, &refused);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(status.error_message(), HasSubstr("coordinator (rank 0 at"));
  grpc::ClientContext context;
  v1::HealthReport report;
  ASSERT_TRUE((*fabric)->Ops(2)->GetHealth(&context, v1::GetHealthRequest(), &report).ok());
  EXPECT_EQ(report.incidents(0).code(), "COORDINATOR_UNREACHABLE");

  // Rank 0 comes back on the same address: everyone rejoins above the old epoch, and the new coordinator learns
  // the group from its members, so it can be deleted.
  ASSERT_TRUE((*fabric)->Restart(0).ok());
  ASSERT_TRUE((*fabric)->WaitComplete(absl::Seconds(10)).ok());
  EXPECT_GT((*fabric)->Fabric(0)->membership().epoch(), epoch_before);
  EXPECT_NE(FindGroup(*(*fabric)->Fabric(0), "survivor"), nullptr);
  EXPECT_TRUE(DeleteGroup(**fabric, 1, "survivor", group.token()).ok());
  EXPECT_EQ(FindGroup(*(*fabric)->Fabric(2), "survivor"), nullptr);
}

TEST(Groups, CreateAndDeleteOnEveryMember) {
  auto fabric = FabricUnderTest::Start(4, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  v1::CreateGroupResponse created;
  const grpc::Status status = CreateGroup(**fabric, 3, "moe-0", {3, 1, 2}, 3 << 20, &created, 1 << 20);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(created.token().size(), 32u);  // 128 bits, hex
  EXPECT_EQ(created.group().state(), v1::GROUP_STATE_READY);
  EXPECT_EQ((*fabric)->MemfdRegions(), 12)
      << "an NVL, an RDMA and a command region and a data-path counters page on each of 3 members";
  for (int rank : {1, 2, 3}) {
    auto view = (*fabric)->Fabric(rank);
    ASSERT_TRUE(view.ok());
    const v1::GroupInfo* group = FindGroup(*view, "moe-0");
    ASSERT_NE(group, nullptr) << rank;
    EXPECT_EQ(group->state(), v1::GROUP_STATE_READY);
    EXPECT_THAT(group->ranks(), ::testing::ElementsAre(3, 1, 2));
    EXPECT_EQ(group->num_nvl_bytes(), 3u << 20);
    EXPECT_EQ(group->num_rdma_bytes(), 1u << 20);
  }
  // ListGroups never shows tokens (the proto has no field for one) and lists the group on members.
  grpc::ClientContext list_context;
  v1::ListGroupsResponse listed;
  ASSERT_TRUE((*fabric)->Control(2)->ListGroups(&list_context, v1::ListGroupsRequest(), &listed).ok());
  ASSERT_EQ(listed.groups_size(), 1);
  EXPECT_EQ(listed.DebugString().find(created.token()), std::string::npos);

  // Same name again: refused fabric-wide, through any daemon.
  v1::CreateGroupResponse twice;
  EXPECT_EQ(CreateGroup(**fabric, 0, "moe-0", {0}, 1 << 20, &twice).error_code(), grpc::StatusCode::ALREADY_EXISTS);

  ASSERT_TRUE(DeleteGroup(**fabric, 1, "moe-0", created.token()).ok());
  for (int rank = 0; rank < 4; ++rank) EXPECT_EQ(FindGroup(*(*fabric)->Fabric(rank), "moe-0"), nullptr);
  EXPECT_EQ((*fabric)->MemfdRegions(), 0);
}

TEST(Groups, RollbackWhenOneMemberCannotAllocate) {
  // Rank 3 may allocate at most 1 MiB per region.
  auto fabric = FabricUnderTest::Start(4, kFast, {{3, {"--max_region_bytes=1048576"}}});
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  v1::CreateGroupResponse response;
  const grpc::Status status = CreateGroup(**fabric, 1, "too-big", {0, 1, 2, 3}, 2 << 20, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), ::testing::StartsWith("rank 3: "));
  for (int rank = 0; rank < 4; ++rank) EXPECT_EQ(FindGroup(*(*fabric)->Fabric(rank), "too-big"), nullptr) << rank;
  EXPECT_EQ((*fabric)->MemfdRegions(), 0) << "the members that had allocated released";
  // The name is free again, and a size that fits everywhere works.
  EXPECT_TRUE(CreateGroup(**fabric, 1, "too-big", {0, 1, 2, 3}, 1 << 20, &response).ok());
}

TEST(Groups, TenantsAreIsolated) {
  auto fabric = FabricUnderTest::Start(2, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  v1::CreateGroupResponse a, b;
  ASSERT_TRUE(CreateGroup(**fabric, 0, "tenant-a", {0, 1}, 1 << 20, &a).ok());
  ASSERT_TRUE(CreateGroup(**fabric, 0, "tenant-b", {0, 1}, 1 << 20, &b).ok());
  ASSERT_NE(a.token(), b.token());
  v1::AttachResponse attached;
  grpc::Status status = Attach(**fabric, 0, "tenant-b", 0, a.token(), &attached);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(status.error_message(), "wrong token for group 'tenant-b'");
  status = DeleteGroup(**fabric, 1, "tenant-b", a.token());
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(status.error_message(), "wrong token for group 'tenant-b'");
  EXPECT_NE(FindGroup(*(*fabric)->Fabric(1), "tenant-b"), nullptr);

  // With its own token: attach works, returns only its own group's regions, and is exclusive per rank.
  status = Attach(**fabric, 0, "tenant-a", 0, a.token(), &attached);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(attached.world_size(), 2);
  EXPECT_THAT(attached.nvl_ranks(), ::testing::ElementsAre(0, 1));
  // Both ranks' NVL regions and this rank's data-path counters page (KIND_STATS).
  ASSERT_EQ(attached.regions_size(), 3);
  EXPECT_EQ(attached.regions(2).kind(), v1::RegionDescriptor::KIND_STATS);
  EXPECT_EQ(attached.regions(2).rank(), 0);
  for (const auto& region : attached.regions()) {
    // Host memory is described, not named: the memory itself comes only as an fd from the owner's side channel.
    EXPECT_EQ(region.sharing(), v1::MEMORY_SHARING_POSIX_SHM);
    EXPECT_TRUE(region.handle().empty());
    EXPECT_EQ(region.fd_socket(), (*fabric)->daemon(region.rank()).socket() + ".fds");
  }
  v1::AttachResponse second;
  status = Attach(**fabric, 0, "tenant-a", 0, a.token(), &second);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  // The lease is listed with the caller's pid (SO_PEERCRED on the Unix socket).
  grpc::ClientContext context;
  v1::ListClientsResponse clients;
  ASSERT_TRUE((*fabric)->Ops(0)->ListClients(&context, v1::ListClientsRequest(), &clients).ok());
  ASSERT_EQ(clients.clients_size(), 1);
  EXPECT_EQ(clients.clients(0).pid(), getpid());
  EXPECT_EQ(clients.clients(0).uid(), static_cast<int64_t>(getuid()));
  // Rank 1 of the group is served by daemon 1, not daemon 0.
  status = Attach(**fabric, 0, "tenant-a", 1, a.token(), &second);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("served by daemon rank 1"));
}

TEST(Groups, LeaseEndsOnDetachAndExpiryAndCleansTheRegion) {
  auto fabric = FabricUnderTest::Start(1, {"--lease_ttl_ms=1000"});
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  v1::CreateGroupResponse group;
  ASSERT_TRUE(CreateGroup(**fabric, 0, "leased", {0}, 1 << 20, &group).ok());
  v1::AttachResponse attached;
  ASSERT_TRUE(Attach(**fabric, 0, "leased", 0, group.token(), &attached).ok());
  ASSERT_EQ(attached.regions_size(), 2);  // the NVL region and the counters page
  // Dirty the region as a client would, through the fd its daemon hands out.
  auto fd = FetchRegionFd((*fabric)->daemon(0), "leased", 0, group.token());
  ASSERT_TRUE(fd.ok()) << fd.status();
  ASSERT_EQ(pwrite(fd->get(), "dirty", 5, 4096), 5);
  auto first_byte_at_4096 = [&fd] {
    char byte = 'x';
    return pread(fd->get(), &byte, 1, 4096) == 1 ? byte : 'x';
  };
  EXPECT_EQ(first_byte_at_4096(), 'd');
  v1::DetachRequest detach;
  detach.set_lease_id(attached.lease_id());
  grpc::ClientContext detach_context;
  v1::DetachResponse detached;
  ASSERT_TRUE((*fabric)->Control(0)->Detach(&detach_context, detach, &detached).ok());
  // The zeroing runs after Detach returns; the next Attach of the rank waits for it.
  ASSERT_TRUE(Attach(**fabric, 0, "leased", 0, group.token(), &attached).ok());
  EXPECT_EQ(first_byte_at_4096(), '\0') << "the rank's region is zero when it is attached again";

  // Expiry: not kept alive for the 1 s TTL, the lease ends and the rank can be attached again.
  v1::KeepAliveRequest keep;
  keep.set_lease_id(attached.lease_id());
  grpc::ClientContext keep_context;
  v1::KeepAliveResponse kept;
  ASSERT_TRUE((*fabric)->Control(0)->KeepAlive(&keep_context, keep, &kept).ok());
  EXPECT_EQ(kept.group_state(), v1::GROUP_STATE_READY);
  absl::SleepFor(absl::Milliseconds(1600));
  grpc::ClientContext late_context;
  EXPECT_EQ((*fabric)->Control(0)->KeepAlive(&late_context, keep, &kept).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(Attach(**fabric, 0, "leased", 0, group.token(), &attached).ok());
}

}  // namespace
}  // namespace epfabric::testing

namespace epfabric::testing {
namespace {

// Mutual TLS and the fabric secret on the peer port: security_test.cc.

// Every RPC with bad input: the right status code, and the daemon keeps serving.
TEST(Security, MalformedRequestsGetTheRightStatus) {
  // The handlers' own validation: the peer port's credential checks are off here (--insecure_peer_port), so that
  // requests can claim any rank; security_test.cc covers the credentials.
  std::vector<std::string> flags = kFast;
  flags.push_back("--insecure_peer_port");
  auto fabric = FabricUnderTest::Start(2, flags);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  auto control = (*fabric)->Control(0);
  using Code = grpc::StatusCode;
  auto create = [&](auto mutate) {
    v1::CreateGroupRequest request;
    request.set_name("g");
    request.add_ranks(0);
    request.set_num_nvl_bytes(1 << 20);
    mutate(request);
    grpc::ClientContext context;
    v1::CreateGroupResponse response;
    return control->CreateGroup(&context, request, &response);
  };
  struct Case {
    const char* what;
    grpc::Status status;
    Code code;
    const char* message;
  };
  std::vector<Case> cases = {
      {"bad name", create([](auto& r) { r.set_name("a b"); }), Code::INVALID_ARGUMENT,
       "name: 'a b' must be 1-64 characters of [A-Za-z0-9._-]"},
      {"empty name", create([](auto& r) { r.set_name(""); }), Code::INVALID_ARGUMENT, nullptr},
      {"no ranks", create([](auto& r) { r.clear_ranks(); }), Code::INVALID_ARGUMENT,
       "ranks: a group needs at least one rank"},
      {"rank outside", create([](auto& r) { r.add_ranks(7); }), Code::INVALID_ARGUMENT,
       "ranks: 7 is outside the fabric (ranks 0..1)"},
      {"duplicate rank", create([](auto& r) { r.add_ranks(0); }), Code::INVALID_ARGUMENT, "ranks: 0 appears twice"},
      {"zero size", create([](auto& r) { r.set_num_nvl_bytes(0); }), Code::INVALID_ARGUMENT,
       "num_nvl_bytes: must be positive"},
      {"absurd size", create([](auto& r) { r.set_num_nvl_bytes(1ull << 50); }), Code::INVALID_ARGUMENT, nullptr},
      {"absurd rdma", create([](auto& r) { r.set_num_rdma_bytes(1ull << 50); }), Code::INVALID_ARGUMENT, nullptr},
      {"sharing enum", create([](auto& r) { r.set_memory_sharing(static_cast<v1::MemorySharing>(42)); }),
       Code::INVALID_ARGUMENT, nullptr},
      {"cuda sharing on host", create([](auto& r) { r.set_memory_sharing(v1::MEMORY_SHARING_CUDA_IPC); }),
       Code::INVALID_ARGUMENT, nullptr},
  };
  {
    v1::DeleteGroupRequest request;
    grpc::ClientContext c1;
    v1::DeleteGroupResponse response;
    cases.push_back(
        {"delete no name", control->DeleteGroup(&c1, request, &response), Code::INVALID_ARGUMENT, "name: empty"});
    request.set_name("nope");
    request.set_token("x");
    grpc::ClientContext c2;
    cases.push_back(
        {"delete unknown", control->DeleteGroup(&c2, request, &response), Code::NOT_FOUND, "no group named 'nope'"});
  }
  {
    v1::AttachRequest request;
    v1::AttachResponse response;
    grpc::ClientContext c1;
    cases.push_back({"attach empty", control->Attach(&c1, request, &response), Code::INVALID_ARGUMENT, nullptr});
    request.set_group("nope");
    request.set_token("t");
    grpc::ClientContext c2;
    cases.push_back({"attach unknown", control->Attach(&c2, request, &response), Code::NOT_FOUND, nullptr});
    request.set_client_name(std::string(200, 'x'));
    grpc::ClientContext c3;
    cases.push_back({"attach long name", control->Attach(&c3, request, &response), Code::INVALID_ARGUMENT, nullptr});
  }
  {
    v1::CreateGroupResponse made;
    ASSERT_TRUE(CreateGroup(**fabric, 0, "real", {0, 1}, 1 << 20, &made).ok());
    v1::AttachRequest request;
    request.set_group("real");
    request.set_token(made.token());
    request.set_rank(5);
    v1::AttachResponse response;
    grpc::ClientContext c1;
    cases.push_back({"attach bad rank", control->Attach(&c1, request, &response), Code::INVALID_ARGUMENT, nullptr});
    request.set_rank(-1);
    grpc::ClientContext c2;
    cases.push_back(
        {"attach negative rank", control->Attach(&c2, request, &response), Code::INVALID_ARGUMENT, nullptr});
  }
  {
    v1::DetachRequest request;
    request.set_lease_id("none");
    v1::DetachResponse response;
    grpc::ClientContext c1;
    cases.push_back({"detach unknown", control->Detach(&c1, request, &response), Code::NOT_FOUND, nullptr});
    v1::KeepAliveRequest keep;
    v1::KeepAliveResponse kept;
    grpc::ClientContext c2;
    cases.push_back({"keepalive unknown", control->KeepAlive(&c2, keep, &kept), Code::NOT_FOUND, nullptr});
  }
  // Peer RPCs, straight to rank 0's and rank 1's peer ports.
  auto peer0 = v1::Peer::NewStub(grpc::CreateChannel((*fabric)->coordinator(), grpc::InsecureChannelCredentials()));
  auto peer1 =
      v1::Peer::NewStub(grpc::CreateChannel(*(*fabric)->daemon(1).PeerAddress(), grpc::InsecureChannelCredentials()));
  {
    v1::JoinRequest join;
    join.set_fabric_id("other");
    v1::JoinResponse joined;
    grpc::ClientContext c1;
    cases.push_back({"join other fabric", peer0->Join(&c1, join, &joined), Code::FAILED_PRECONDITION, nullptr});
    join.set_fabric_id((*fabric)->fabric_id());
    join.set_world_size(9);
    grpc::ClientContext c2;
    cases.push_back({"join world size", peer0->Join(&c2, join, &joined), Code::FAILED_PRECONDITION, nullptr});
    join.set_world_size(2);
    join.mutable_member()->set_rank(0);
    grpc::ClientContext c3;
    cases.push_back({"join as rank 0", peer0->Join(&c3, join, &joined), Code::INVALID_ARGUMENT, nullptr});
    join.mutable_member()->set_rank(1);
    grpc::ClientContext c4;
    cases.push_back({"join no address", peer0->Join(&c4, join, &joined), Code::INVALID_ARGUMENT, nullptr});
    join.mutable_member()->set_peer_address("127.0.0.1:1");
    grpc::ClientContext c5;
    cases.push_back({"join no incarnation", peer0->Join(&c5, join, &joined), Code::INVALID_ARGUMENT, nullptr});
    grpc::ClientContext c6;
    cases.push_back({"join a member", peer1->Join(&c6, join, &joined), Code::FAILED_PRECONDITION, nullptr});
  }
  {
    v1::HeartbeatRequest beat;
    beat.set_fabric_id((*fabric)->fabric_id());
    beat.set_rank(99);
    v1::HeartbeatResponse answer;
    grpc::ClientContext c1;
    cases.push_back({"beat bad rank", peer0->Heartbeat(&c1, beat, &answer), Code::INVALID_ARGUMENT, nullptr});
    beat.set_rank(1);
    beat.set_incarnation(12345);
    grpc::ClientContext c2;
    cases.push_back({"beat stale incarnation", peer0->Heartbeat(&c2, beat, &answer), Code::NOT_FOUND, nullptr});
    v1::PublishMembershipRequest publish;
    publish.set_fabric_id((*fabric)->fabric_id());
    v1::PublishMembershipResponse published;
    grpc::ClientContext c3;
    cases.push_back({"publish to coordinator", peer0->PublishMembership(&c3, publish, &published),
                     Code::FAILED_PRECONDITION, nullptr});
  }
  {
    v1::PrepareGroupRequest prepare;
    prepare.set_fabric_id((*fabric)->fabric_id());
    prepare.mutable_group()->set_name("p");
    prepare.mutable_group()->add_ranks(0);
    v1::PrepareGroupResponse prepared;
    grpc::ClientContext c1;
    cases.push_back(
        {"prepare non-member", peer1->PrepareGroup(&c1, prepare, &prepared), Code::INVALID_ARGUMENT, nullptr});
    prepare.mutable_group()->add_ranks(1);
    grpc::ClientContext c2;
    cases.push_back(
        {"prepare zero size", peer1->PrepareGroup(&c2, prepare, &prepared), Code::INVALID_ARGUMENT, nullptr});
    v1::CommitGroupRequest commit;
    commit.set_fabric_id((*fabric)->fabric_id());
    commit.set_name("never-prepared");
    v1::CommitGroupResponse committed;
    grpc::ClientContext c3;
    cases.push_back({"commit unknown", peer1->CommitGroup(&c3, commit, &committed), Code::NOT_FOUND, nullptr});
    v1::ProposeGroupRequest propose;
    propose.set_fabric_id((*fabric)->fabric_id());
    v1::CreateGroupResponse proposed;
    grpc::ClientContext c4;
    cases.push_back(
        {"propose to a member", peer1->ProposeGroup(&c4, propose, &proposed), Code::FAILED_PRECONDITION, nullptr});
    v1::RetireGroupRequest retire;
    retire.set_fabric_id("other");
    v1::RetireGroupResponse retired;
    grpc::ClientContext c5;
    cases.push_back(
        {"retire other fabric", peer0->RetireGroup(&c5, retire, &retired), Code::FAILED_PRECONDITION, nullptr});
    v1::BarrierRequest barrier;
    v1::BarrierResponse passed;
    grpc::ClientContext c6;
    cases.push_back({"barrier", peer0->Barrier(&c6, barrier, &passed), Code::UNIMPLEMENTED, nullptr});
  }
  for (const Case& c : cases) {
    EXPECT_EQ(c.status.error_code(), c.code) << c.what << ": " << c.status.error_message();
    if (c.message != nullptr) EXPECT_EQ(c.status.error_message(), c.message) << c.what;
  }
  // Still serving, fabric whole.
  ASSERT_TRUE((*fabric)->WaitComplete(absl::Seconds(5)).ok());
  EXPECT_EQ(FabricHealth((*fabric)->daemon(0)), grpc::health::v1::HealthCheckResponse::SERVING);
}

}  // namespace
}  // namespace epfabric::testing
