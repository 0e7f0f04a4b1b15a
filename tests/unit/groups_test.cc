// Pure pieces of the fabric: CreateGroup validation, token comparison, the health report.
#include <gtest/gtest.h>

#include "groups/group_manager.h"
#include "services/ops_service.h"

namespace epfabric::daemon {
namespace {

v1::CreateGroupRequest Valid() {
  v1::CreateGroupRequest request;
  request.set_name("moe.layer-0_a");
  request.add_ranks(0);
  request.add_ranks(3);
  request.set_num_nvl_bytes(1 << 30);
  return request;
}

TEST(ValidateCreateGroup, AcceptsAValidRequest) { EXPECT_TRUE(groups::ValidateCreateGroup(Valid(), 4).ok()); }

TEST(ValidateCreateGroup, NamesTheField) {
  struct Case {
    std::function<void(v1::CreateGroupRequest&)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](auto& r) { r.set_name(std::string(65, 'a')); },
       "name: '" + std::string(65, 'a') + "' must be 1-64 characters of [A-Za-z0-9._-]"},
      {[](auto& r) { r.set_name("slash/name"); }, "name: 'slash/name' must be 1-64 characters of [A-Za-z0-9._-]"},
      {[](auto& r) { r.clear_ranks(); }, "ranks: a group needs at least one rank"},
      {[](auto& r) { r.add_ranks(4); }, "ranks: 4 is outside the fabric (ranks 0..3)"},
      {[](auto& r) { r.add_ranks(-1); }, "ranks: -1 is outside the fabric (ranks 0..3)"},
      {[](auto& r) { r.add_ranks(3); }, "ranks: 3 appears twice"},
      {[](auto& r) { r.set_num_nvl_bytes(0); }, "num_nvl_bytes: must be positive"},
      {[](auto& r) { r.set_num_nvl_bytes(groups::kMaxRegionBytes + 1); },
       "num_nvl_bytes: 1099511627777 bytes is over the limit of one region (1099511627776)"},
      {[](auto& r) { r.set_num_rdma_bytes(groups::kMaxRegionBytes + 1); },
       "num_rdma_bytes: 1099511627777 bytes is over the limit of one region (1099511627776)"},
      {[](auto& r) { r.set_memory_sharing(static_cast<v1::MemorySharing>(9)); }, "memory_sharing: 9 is not a value"},
  };
  for (const Case& c : cases) {
    v1::CreateGroupRequest request = Valid();
    c.mutate(request);
    const absl::Status status = groups::ValidateCreateGroup(request, 4);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_EQ(status.message(), c.message);
  }
}

TEST(ConstantTimeEquals, ComparesContentAndLength) {
  EXPECT_TRUE(groups::ConstantTimeEquals("", ""));
  EXPECT_TRUE(groups::ConstantTimeEquals("0123abcd", "0123abcd"));
  EXPECT_FALSE(groups::ConstantTimeEquals("0123abcd", "0123abce"));
  EXPECT_FALSE(groups::ConstantTimeEquals("0123abcd", "0123abc"));
  EXPECT_FALSE(groups::ConstantTimeEquals("x0123abc", "y0123abc"));
}

v1::FabricView View(std::vector<v1::MemberState> states) {
  v1::FabricView view;
  view.set_self_rank(0);
  for (size_t r = 0; r < states.size(); ++r) {
    v1::MemberInfo* m = view.mutable_membership()->add_members();
    m->set_rank(static_cast<int>(r));
    m->set_state(states[r]);
  }
  return view;
}

TEST(BuildHealthReport, PassWhenEverythingIsUp) {
  const v1::HealthReport report = BuildHealthReport(View({v1::MEMBER_STATE_UP, v1::MEMBER_STATE_UP}), true);
  EXPECT_EQ(report.overall(), v1::HealthReport::PASS);
  EXPECT_EQ(report.incidents_size(), 0);
}

TEST(BuildHealthReport, WarnsPerDownOrMissingRankAndDegradedGroup) {
  v1::FabricView view = View({v1::MEMBER_STATE_UP, v1::MEMBER_STATE_DOWN, v1::MEMBER_STATE_MISSING});
  v1::GroupInfo* group = view.add_groups();
  group->set_name("g");
  group->set_state(v1::GROUP_STATE_DEGRADED);
  const v1::HealthReport report = BuildHealthReport(view, true);
  EXPECT_EQ(report.overall(), v1::HealthReport::WARN);
  ASSERT_EQ(report.incidents_size(), 3);
  EXPECT_EQ(report.incidents(0).code(), "PEER_DOWN");
  EXPECT_EQ(report.incidents(0).entity(), "rank 1");
  EXPECT_EQ(report.incidents(1).code(), "PEER_MISSING");
  EXPECT_EQ(report.incidents(2).code(), "GROUP_DEGRADED");
  EXPECT_EQ(report.incidents(2).entity(), "group g");
}

TEST(BuildHealthReport, FailsWhenThisDaemonIsNotCounted) {
  v1::FabricView view = View({v1::MEMBER_STATE_UP, v1::MEMBER_STATE_MISSING});
  view.set_self_rank(1);
  const v1::HealthReport report = BuildHealthReport(view, false);
  EXPECT_EQ(report.overall(), v1::HealthReport::FAIL);
  EXPECT_EQ(report.incidents(0).code(), "NOT_A_MEMBER");
  EXPECT_EQ(report.incidents(1).code(), "COORDINATOR_UNREACHABLE");
  EXPECT_EQ(report.incidents_size(), 2) << "rank 0 is reported once, as the coordinator";
}

}  // namespace
}  // namespace epfabric::daemon
