// Bugs the chaos test found (chaos_test.cc), each replayed on its own, deterministically.
#include <gtest/gtest.h>
#include <signal.h>

#include "absl/time/clock.h"
#include "integration/fabric_test_util.h"
#include "integration/fabric_under_test.h"

namespace epfabric::testing {
namespace {

// EPF_CHAOS_SEED=11, iteration 10: a DeleteGroup that the coordinator handled while it counted a member DOWN (a
// coordinator that was itself paused counts everyone silent when it resumes) skipped that member and answered OK. The
// member, only paused, kept the group READY with its memory for good, and the coordinator no longer knew the name.
// Now the release reaches it when it answers again.
TEST(ChaosRegressions, DeleteReleasesAMemberThatWasDownWhenItComesBack) {
  auto fabric = FabricUnderTest::Start(3, {"--heartbeat_ms=100", "--heartbeat_misses=3"});
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  v1::CreateGroupResponse group;
  ASSERT_TRUE(CreateGroup(**fabric, 0, "paused-at-delete", {0, 1, 2}, 1 << 20, &group).ok());
  (*fabric)->daemon(2).process().Signal(SIGSTOP);
  auto down = (*fabric)->WaitView(
      0, [](const v1::FabricView& v) { return StateOf(v, 2) == v1::MEMBER_STATE_DOWN; }, absl::Seconds(5));
  ASSERT_TRUE(down.ok()) << down.status();
  EXPECT_TRUE(DeleteGroup(**fabric, 1, "paused-at-delete", group.token()).ok());
  (*fabric)->daemon(2).process().Signal(SIGCONT);
  auto released = (*fabric)->WaitView(
      2, [](const v1::FabricView& v) { return FindGroup(v, "paused-at-delete") == nullptr; }, absl::Seconds(5));
  EXPECT_TRUE(released.ok()) << "rank 2 still holds the deleted group: " << released.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  while ((*fabric)->MemfdRegions() != 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ((*fabric)->MemfdRegions(), 0);
  // And the name is free again once every member has released it.
  grpc::Status again;
  for (int attempt = 0; attempt < 50; ++attempt) {
    again = CreateGroup(**fabric, 0, "paused-at-delete", {0, 1, 2}, 1 << 20, &group);
    // UNAVAILABLE: a release still pending; ABORTED: a member has not seen the membership epoch of the resume yet.
    if (again.error_code() != grpc::StatusCode::UNAVAILABLE && again.error_code() != grpc::StatusCode::ABORTED) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(again.ok()) << again.error_message();
}

}  // namespace
}  // namespace epfabric::testing
