// libepfabric_client against real daemons on loopback (host backend): attach, leases, keep-alive, health, attach
// time. Client processes are this binary started again in a helper mode (--epf_client_helper), talking to the test
// over a Unix socket of its own (memory_test_util.h). The same binary holds fd_channel_test.cc and isolation_test.cc.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "epfabric/client/client.h"
#include "epfabric/v1/fdchannel.pb.h"
#include "integration/client_test_helpers.h"
#include "integration/client_test_util.h"
#include "integration/fabric_under_test.h"
#include "memory_test_util.h"
#include "support/sanitizers.h"

namespace epfabric::testing {
namespace {

using client::Client;
using client::Lease;
using ::testing::HasSubstr;

// ---------------------------------------------------------------- tests

TEST(Client, EveryRankOfAFourRankGroupFromItsOwnProcessSeesEveryPeer) {
  auto fabric = FabricUnderTest::Start(4, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  auto group = CreateGroup(**fabric, "four", {0, 1, 2, 3});
  ASSERT_TRUE(group.ok()) << group.status();
  auto parent = ChildChannel::Listen();
  ASSERT_TRUE(parent.ok()) << parent.status();
  std::vector<Helper> helpers =
      StartHelpers(*parent, **fabric, "--epf_client_helper", "exchange", "four", group->token(), {0, 1, 2, 3});
  ASSERT_EQ(helpers.size(), 4u);
  // Every helper wrote its pattern before saying "attached"; now each checks every peer through its own mapping.
  for (Helper& helper : helpers) ASSERT_TRUE(Say(helper.channel.get(), "check").ok());
  for (Helper& helper : helpers) {
    auto said = Hear(helper.channel.get());
    ASSERT_TRUE(said.ok()) << said.status();
    // "checked <ranks seen> <mismatched words>"
    ASSERT_EQ(said->size(), 3u) << absl::StrJoin(*said, " ");
    EXPECT_EQ((*said)[0], "checked");
    EXPECT_EQ((*said)[1], "4") << "rank " << helper.rank << " mapped every same-host rank";
    EXPECT_EQ((*said)[2], "0") << "rank " << helper.rank << " saw every peer's pattern";
  }
  for (Helper& helper : helpers) ASSERT_TRUE(Say(helper.channel.get(), "detach").ok());
  std::vector<double> times;
  for (Helper& helper : helpers) {
    auto exit_code = WaitChild(helper.pid, absl::Seconds(30));
    EXPECT_TRUE(exit_code.ok() && *exit_code == 0) << "helper rank " << helper.rank;
    times.push_back(helper.attach_ms);
  }
  std::cout << "[ ATTACH   ] fresh client process, connect + attach + map 4 same-host 1 MiB regions: ";
  for (double t : times) std::cout << t << " ms ";
  std::cout << "(ranks 0..3)\n";
  // Detached: every rank is free again.
  auto view = (*fabric)->Fabric(0);
  ASSERT_TRUE(view.ok());
  for (const auto& g : view->groups()) EXPECT_EQ(g.attached_ranks_size(), 0) << g.DebugString();
}

TEST(Client, SeparateClientsMapTheSameMemory) {
  auto fabric = FabricUnderTest::Start(2, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  auto group = CreateGroup(**fabric, "pair", {0, 1}, /*rdma_bytes=*/65536);
  ASSERT_TRUE(group.ok()) << group.status();
  auto zero = AttachVia((*fabric)->daemon(0).socket(), "pair", 0, group->token());
  ASSERT_TRUE(zero.ok()) << zero.status();
  auto one = AttachVia((*fabric)->daemon(1).socket(), "pair", 1, group->token());
  ASSERT_TRUE(one.ok()) << one.status();
  Lease& a = **zero;
  Lease& b = **one;
  EXPECT_TRUE(a.Healthy().ok()) << a.Healthy();
  EXPECT_EQ(a.rank(), 0);
  EXPECT_EQ(b.rank(), 1);
  EXPECT_EQ(a.world_size(), 2);
  EXPECT_EQ(a.nvl_ranks(), std::vector<int>({0, 1}));
  EXPECT_EQ(a.backend(), v1::BACKEND_HOST);
  EXPECT_EQ(a.group_name(), "pair");
  EXPECT_EQ(a.group_state(), v1::GROUP_STATE_READY);
  EXPECT_EQ(a.lease_ttl(), absl::Seconds(10));
  EXPECT_NE(a.lease_id(), b.lease_id());
  for (int r : {0, 1}) {
    ASSERT_NE(a.region(r), nullptr);
    ASSERT_NE(b.region(r), nullptr);
    EXPECT_NE(a.region(r), b.region(r)) << "two clients, two mappings";
    EXPECT_EQ(a.region_bytes(r), kRegionBytes);
    ASSERT_NE(a.region_descriptor(r), nullptr);
    EXPECT_EQ(a.region_descriptor(r)->fd_socket(), (*fabric)->daemon(r).socket() + ".fds");
  }
  EXPECT_EQ(a.region(2), nullptr);
  EXPECT_EQ(a.region(-1), nullptr);
  ASSERT_NE(a.rdma_region(), nullptr);
  EXPECT_EQ(a.rdma_region_bytes(), 65536u);
  WritePattern(a.region(0), kRegionBytes, 11);
  WritePattern(b.region(1), kRegionBytes, 12);
  WritePattern(a.rdma_region(), 65536, 13);
  EXPECT_EQ(Mismatches(b.region(0), kRegionBytes, 11), 0u) << "rank 1 reads rank 0's writes";
  EXPECT_EQ(Mismatches(a.region(1), kRegionBytes, 12), 0u) << "rank 0 reads rank 1's writes";
  EXPECT_EQ(Mismatches(b.rdma_region(), 65536, 13, /*expected_zero=*/true), 0u) << "RDMA regions are per rank";
  // An RDMA region goes only to the holder of its rank's lease.
  auto connection = ConnectTo((*fabric)->daemon(0).socket() + ".fds");
  ASSERT_TRUE(connection.ok());
  v1::FdRequest request;
  request.set_group("pair");
  request.set_rank(0);
  request.set_kind(v1::RegionDescriptor::KIND_RDMA);
  request.set_token(group->token());
  auto answer = Ask(connection->get(), request);
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->response.code(), static_cast<int>(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(answer->response.message(), HasSubstr("only handed to the holder of their rank's lease"));
}

TEST(Client, SecondAttachIsRefusedAndDetachFreesAndCleansTheRank) {
  auto fabric = FabricUnderTest::Start(1, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  auto group = CreateGroup(**fabric, "solo", {0});
  ASSERT_TRUE(group.ok()) << group.status();
  const std::string socket = (*fabric)->daemon(0).socket();
  auto first = AttachVia(socket, "solo", 0, group->token());
  ASSERT_TRUE(first.ok()) << first.status();
  WritePattern((*first)->region(0), kRegionBytes, 21);

  auto second = AttachVia(socket, "solo", 0, group->token());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_THAT(second.status().message(), HasSubstr("already attached"));
  auto wrong = AttachVia(socket, "solo", 0, "00000000000000000000000000000000");
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kPermissionDenied) << wrong.status();
  auto unknown = AttachVia(socket, "nope", 0, group->token());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
  EXPECT_EQ(Client::Connect(socket + ".missing").status().code(), absl::StatusCode::kNotFound);

  EXPECT_TRUE((*first)->Detach().ok());
  EXPECT_TRUE((*first)->Detach().ok()) << "idempotent";
  EXPECT_EQ((*first)->region(0), nullptr);
  EXPECT_EQ((*first)->Healthy().code(), absl::StatusCode::kFailedPrecondition);
  auto again = AttachVia(socket, "solo", 0, group->token());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(Mismatches((*again)->region(0), kRegionBytes, 0, /*expected_zero=*/true), 0u)
      << "the region was zeroed when the lease ended";
}

TEST(Client, LeaseExpiresWithoutKeepAliveAndTheOldConnectionCannotEndTheNextLease) {
  auto fabric = FabricUnderTest::Start(1, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  auto group = CreateGroup(**fabric, "ttl", {0});
  ASSERT_TRUE(group.ok()) << group.status();
  const std::string socket = (*fabric)->daemon(0).socket();
  auto stale = AttachVia(socket, "ttl", 0, group->token(), {.lease_ttl = absl::Seconds(1), .keep_alive = false});
  ASSERT_TRUE(stale.ok()) << stale.status();
  WritePattern((*stale)->region(0), kRegionBytes, 31);
  absl::SleepFor(absl::Milliseconds(1600));
  // Its side channel is still open, but the TTL passed: the rank is free and clean.
  auto next = AttachVia(socket, "ttl", 0, group->token(), {.lease_ttl = absl::Seconds(1)});
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(Mismatches((*next)->region(0), kRegionBytes, 0, true), 0u);
  // The stale lease goes away (Detach answers NOT_FOUND, its connection closes): the new lease must survive that.
  EXPECT_TRUE((*stale)->Detach().ok());
  stale->reset();
  absl::SleepFor(absl::Milliseconds(700));
  EXPECT_TRUE((*next)->Healthy().ok()) << (*next)->Healthy();
  auto third = AttachVia(socket, "ttl", 0, group->token());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kFailedPrecondition) << third.status();
}

TEST(Client, KeepAliveHoldsTheLeaseBeyondItsTtl) {
  auto fabric = FabricUnderTest::Start(1, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  auto group = CreateGroup(**fabric, "kept", {0});
  ASSERT_TRUE(group.ok()) << group.status();
  const std::string socket = (*fabric)->daemon(0).socket();
  auto lease = AttachVia(socket, "kept", 0, group->token(), {.lease_ttl = absl::Seconds(1)});
  ASSERT_TRUE(lease.ok()) << lease.status();
  absl::SleepFor(absl::Milliseconds(2500));
  EXPECT_TRUE((*lease)->Healthy().ok()) << (*lease)->Healthy();
  auto other = AttachVia(socket, "kept", 0, group->token());
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition) << other.status();
}

TEST(Client, LeaseEndsWhenTheClientProcessIsKilled) {
  auto fabric = FabricUnderTest::Start(2, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  auto group = CreateGroup(**fabric, "killed", {0, 1});
  ASSERT_TRUE(group.ok()) << group.status();
  auto parent = ChildChannel::Listen();
  ASSERT_TRUE(parent.ok()) << parent.status();
  // A five-minute TTL: only the closed connection can explain the lease ending within the test.
  std::vector<Helper> helpers = StartHelpers(*parent, **fabric, "--epf_client_helper", "hold", "killed", group->token(),
                                             {0}, /*lease_ttl_ms=*/300000);
  ASSERT_EQ(helpers.size(), 1u);
  const std::string socket = (*fabric)->daemon(0).socket();
  auto refused = AttachVia(socket, "killed", 0, group->token());
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();

  kill(helpers[0].pid, SIGKILL);
  const absl::Time killed = absl::Now();
  auto exit_code = WaitChild(helpers[0].pid, absl::Seconds(10));
  ASSERT_TRUE(exit_code.ok());
  EXPECT_EQ(*exit_code, 128 + SIGKILL);
  absl::StatusOr<std::unique_ptr<Lease>> again = absl::UnknownError("not tried");
  ASSERT_TRUE(Eventually(
      [&] {
        again = AttachVia(socket, "killed", 0, group->token());
        return again.ok();
      },
      absl::Seconds(5)))
      << again.status();
  std::cout << "[ KILLED   ] rank attachable again " << absl::ToDoubleMilliseconds(absl::Now() - killed)
            << " ms after SIGKILL of its client (lease TTL 300 s)\n";
  EXPECT_EQ(Mismatches((*again)->region(0), kRegionBytes, 0, true), 0u) << "the dead client's pattern was cleaned";
}

// A lease id is not a credential: another process (here the test itself) that learned it cannot detach the lease or
// keep it alive (issue #13); the holder still can.
TEST(Client, OnlyTheHolderDetachesOrKeepsAliveItsLease) {
  auto fabric = FabricUnderTest::Start(1, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  auto group = CreateGroup(**fabric, "held", {0});
  ASSERT_TRUE(group.ok()) << group.status();
  auto parent = ChildChannel::Listen();
  ASSERT_TRUE(parent.ok()) << parent.status();
  std::vector<Helper> helpers =
      StartHelpers(*parent, **fabric, "--epf_client_helper", "hold", "held", group->token(), {0}, 300000);
  ASSERT_EQ(helpers.size(), 1u);
  ASSERT_FALSE(helpers[0].lease_id.empty());
  auto control = (*fabric)->Control(0);
  v1::DetachRequest detach;
  detach.set_lease_id(helpers[0].lease_id);
  v1::DetachResponse detached;
  grpc::ClientContext c1;
  grpc::Status status = control->Detach(&c1, detach, &detached);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr(absl::StrCat("is held by pid ", helpers[0].pid)));
  v1::KeepAliveRequest keep;
  keep.set_lease_id(helpers[0].lease_id);
  v1::KeepAliveResponse kept;
  grpc::ClientContext c2;
  EXPECT_EQ(control->KeepAlive(&c2, keep, &kept).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  // The lease is still the helper's: a second attach of the rank is refused.
  auto refused = AttachVia((*fabric)->daemon(0).socket(), "held", 0, group->token());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  // The holder detaches: the rank is free again.
  ASSERT_TRUE(Say(helpers[0].channel.get(), "detach").ok());
  EXPECT_TRUE(WaitChild(helpers[0].pid, absl::Seconds(10)).ok());
  absl::StatusOr<std::unique_ptr<Lease>> again = absl::UnknownError("not tried");
  EXPECT_TRUE(Eventually(
      [&] {
        again = AttachVia((*fabric)->daemon(0).socket(), "held", 0, group->token());
        return again.ok();
      },
      absl::Seconds(5)))
      << again.status();
}

TEST(Client, DegradedGroupAndLostDaemonMakeHealthyFail) {
  auto fabric = FabricUnderTest::Start(2, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  auto group = CreateGroup(**fabric, "fragile", {0, 1});
  ASSERT_TRUE(group.ok()) << group.status();
  auto lease = AttachVia((*fabric)->daemon(0).socket(), "fragile", 0, group->token(), {.lease_ttl = absl::Seconds(1)});
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE((*lease)->Healthy().ok());
  (*fabric)->Kill(1);
  ASSERT_TRUE(Eventually([&] { return !(*lease)->Healthy().ok(); }, absl::Seconds(5)));
  EXPECT_EQ((*lease)->Healthy().code(), absl::StatusCode::kUnavailable) << (*lease)->Healthy();
  EXPECT_THAT((*lease)->Healthy().message(), HasSubstr("DEGRADED"));
  EXPECT_EQ((*lease)->group_state(), v1::GROUP_STATE_DEGRADED);
  EXPECT_GT((*lease)->epoch(), (*lease)->attach_epoch());
  // Its own daemon gone: the side channel closes, the lease is over.
  (*fabric)->Kill(0);
  ASSERT_TRUE(
      Eventually([&] { return (*lease)->Healthy().code() == absl::StatusCode::kFailedPrecondition; }, absl::Seconds(3)))
      << (*lease)->Healthy();
  EXPECT_THAT((*lease)->Healthy().message(), HasSubstr("closed the lease's side channel"));
  EXPECT_EQ((*lease)->Detach().code(), absl::StatusCode::kUnavailable) << "Detach cannot reach the daemon";
  EXPECT_TRUE((*lease)->Detach().ok()) << "and is done anyway";
}

TEST(Client, AttachTime) {
  auto fabric = FabricUnderTest::Start(4, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  auto group = CreateGroup(**fabric, "timed", {0, 1, 2, 3});
  ASSERT_TRUE(group.ok()) << group.status();
  std::vector<double> total_ms, connect_ms, detach_ms;
  for (int iteration = 0; iteration < 20; ++iteration) {
    for (int rank = 0; rank < 4; ++rank) {
      const absl::Time start = absl::Now();
      auto connected = Client::Connect((*fabric)->daemon(rank).socket());
      const absl::Time connected_at = absl::Now();
      ASSERT_TRUE(connected.ok()) << connected.status();
      auto lease = (*connected)->Attach("timed", rank, group->token());
      const absl::Time attached = absl::Now();
      ASSERT_TRUE(lease.ok()) << lease.status();
      ASSERT_EQ((*lease)->nvl_ranks().size(), 4u);
      ASSERT_TRUE((*lease)->Detach().ok());
      total_ms.push_back(absl::ToDoubleMilliseconds(attached - start));
      connect_ms.push_back(absl::ToDoubleMilliseconds(connected_at - start));
      detach_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - attached));
    }
  }
  std::cout
      << "[ ATTACH   ] in-process re-attach, connect + attach + map 4 same-host 1 MiB regions, 80 samples: median "
      << Median(total_ms) << " ms (connect " << Median(connect_ms) << " ms), min "
      << *std::min_element(total_ms.begin(), total_ms.end()) << " ms, max "
      << *std::max_element(total_ms.begin(), total_ms.end()) << " ms; detach median " << Median(detach_ms) << " ms\n";
  EXPECT_LT(Median(total_ms), 100.0 * kSanitizerSlowdown);
}

}  // namespace

// ---------------------------------------------------------------- helper process

// Attaches to one rank, writes its pattern (seed rank + 1) into its own region, reports to the test; then, by mode:
// "exchange": on "check", checks every same-host rank's pattern through its own mappings; on "detach", detaches.
// "hold": waits (it is killed, or told "detach").
int RunClientHelper(int argc, char** argv) {
  auto parent = ConnectTo(FlagValue(argc, argv, "parent"));
  if (!parent.ok()) return 2;
  const int channel = parent->get();
  int rank = -1, ttl_ms = 0;
  if (!absl::SimpleAtoi(FlagValue(argc, argv, "rank"), &rank) ||
      !absl::SimpleAtoi(FlagValue(argc, argv, "ttl_ms"), &ttl_ms)) {
    (void)Say(channel, "failed bad-arguments");
    return 2;
  }
  const absl::Time start = absl::Now();
  auto lease = AttachVia(FlagValue(argc, argv, "socket"), FlagValue(argc, argv, "group"), rank,
                         FlagValue(argc, argv, "token"), {.lease_ttl = absl::Milliseconds(ttl_ms)});
  const double attach_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  if (!lease.ok()) {
    (void)Say(channel, absl::StrCat("failed ", lease.status().ToString()));
    return 1;
  }
  WritePattern((*lease)->region(rank), (*lease)->region_bytes(rank), static_cast<uint32_t>(rank + 1));
  if (!Say(channel, absl::StrCat("attached ", rank, " ", getpid(), " ", (*lease)->lease_id(), " ", attach_ms)).ok()) {
    return 1;
  }
  while (true) {
    auto said = Hear(channel, absl::Minutes(2));
    if (!said.ok()) return 1;
    if ((*said)[0] == "check") {
      uint64_t wrong = 0;
      int seen = 0;
      for (int peer : (*lease)->nvl_ranks()) {
        if ((*lease)->region(peer) == nullptr) continue;
        ++seen;
        wrong += Mismatches((*lease)->region(peer), (*lease)->region_bytes(peer), static_cast<uint32_t>(peer + 1));
      }
      if (!Say(channel, absl::StrCat("checked ", seen, " ", wrong)).ok()) return 1;
    } else if ((*said)[0] == "detach") {
      return (*lease)->Detach().ok() ? 0 : 1;
    }
  }
}

}  // namespace epfabric::testing

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--epf_client_helper") == 0) return epfabric::testing::RunClientHelper(argc, argv);
    if (std::strcmp(argv[i], "--epf_no_token_probe") == 0) return epfabric::testing::RunNoTokenProbe(argc, argv);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
