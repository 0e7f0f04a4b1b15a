// Pieces of the fabric: CreateGroup validation, token comparison, the health report, and how leases end (regions
// zeroed outside the locks, the rank kept until they are zero) on one in-process daemon with a fake allocator.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "absl/synchronization/notification.h"
#include "fabric/membership.h"
#include "groups/group_checks.h"
#include "groups/group_manager.h"
#include "security/group_secrets.h"
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

// A low-latency group that serves both modes: the parts of the NVL region and, across hosts, of the RDMA region.
TEST(ValidateCreateGroup, ChecksTheNormalModeParts) {
  auto both = [](uint64_t nvl, uint64_t rdma, uint64_t normal, uint64_t normal_rdma) {
    v1::CreateGroupRequest request = Valid();
    request.set_low_latency(true);
    request.set_num_nvl_bytes(nvl);
    request.set_num_rdma_bytes(rdma);
    request.set_num_normal_bytes(normal);
    request.set_num_normal_rdma_bytes(normal_rdma);
    return request;
  };
  EXPECT_TRUE(groups::ValidateCreateGroup(both(1 << 20, 0, 1 << 16, 0), 4).ok());
  EXPECT_TRUE(groups::ValidateCreateGroup(both(1 << 20, 1 << 22, 1 << 16, 1 << 21), 4).ok());
  const std::vector<std::pair<v1::CreateGroupRequest, std::string>> refused = {
      {both(1 << 20, 1 << 22, 0, 1 << 21), "num_normal_rdma_bytes: 2097152 needs num_normal_bytes > 0"},
      {both(1 << 20, 0, 1 << 16, 4096), "num_normal_rdma_bytes: 4096 needs num_rdma_bytes > 0"},
      {both(1 << 20, 1 << 22, 1 << 16, 0),
       "num_normal_rdma_bytes: 0 must be a positive multiple of 4096 below "
       "num_rdma_bytes (4194304)"},
      {both(1 << 20, 1 << 22, 1 << 16, 4097), "num_normal_rdma_bytes: 4097 must be a positive multiple of 4096"},
      {both(1 << 20, 1 << 22, 1 << 16, 1 << 22), "num_normal_rdma_bytes: 4194304 must be a positive multiple"},
      {both(1 << 20, 0, 4095, 0), "num_normal_bytes: 4095 must be a multiple of 4096 below num_nvl_bytes"},
  };
  for (const auto& [request, message] : refused) {
    const absl::Status status = groups::ValidateCreateGroup(request, 4);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_THAT(status.message(), testing::HasSubstr(message));
  }
  // A peer's description of a group is held to the same rule.
  v1::GroupInfo info;
  info.set_name("g");
  info.add_ranks(0);
  info.set_num_nvl_bytes(1 << 20);
  info.set_num_rdma_bytes(1 << 22);
  info.set_transport_channels(1);
  info.set_ring_slots(1024);
  info.set_low_latency(true);
  info.set_num_normal_bytes(1 << 16);
  EXPECT_THAT(groups::ValidateGroupInfo(info, 4).message(), testing::HasSubstr("group.num_normal_rdma_bytes: 0"));
  info.set_num_normal_rdma_bytes(1 << 21);
  EXPECT_TRUE(groups::ValidateGroupInfo(info, 4).ok()) << groups::ValidateGroupInfo(info, 4);
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

// ---- leases: one daemon (rank 0 of 1, not started), a fake allocator whose Zero can be held up ----

struct FakeMemory {
  std::atomic<int> zeroed{0};
  std::atomic<int> freed{0};
  absl::Notification zero_started;
  absl::Notification* hold_zero = nullptr;  // when set, Zero waits for it
};

class FakeRegion final : public memory::Region {
 public:
  FakeRegion(FakeMemory* memory, v1::RegionDescriptor descriptor)
      : memory_(memory), descriptor_(std::move(descriptor)) {}
  ~FakeRegion() override { ++memory_->freed; }
  const v1::RegionDescriptor& descriptor() const override { return descriptor_; }
  void* base() const override { return nullptr; }
  absl::Status Zero(uint64_t, uint64_t) override {
    if (!memory_->zero_started.HasBeenNotified()) memory_->zero_started.Notify();
    if (memory_->hold_zero != nullptr) memory_->hold_zero->WaitForNotification();
    ++memory_->zeroed;
    return absl::OkStatus();
  }

 private:
  FakeMemory* const memory_;
  const v1::RegionDescriptor descriptor_;
};

class FakeAllocator final : public memory::RegionAllocator {
 public:
  explicit FakeAllocator(FakeMemory* memory) : memory_(memory) {}
  absl::StatusOr<std::unique_ptr<memory::Region>> Allocate(const memory::RegionSpec& spec) override {
    v1::RegionDescriptor descriptor;
    descriptor.set_rank(spec.rank);
    descriptor.set_kind(spec.kind);
    descriptor.set_size_bytes(spec.bytes);
    descriptor.set_sharing(v1::MEMORY_SHARING_POSIX_SHM);
    return std::make_unique<FakeRegion>(memory_, std::move(descriptor));
  }
  v1::Backend backend() const override { return v1::BACKEND_HOST; }

 private:
  FakeMemory* const memory_;
};

v1::MemberInfo Self() {
  v1::MemberInfo self;
  self.set_rank(0);
  self.set_incarnation(1);
  self.set_state(v1::MEMBER_STATE_UP);
  self.set_backend(v1::BACKEND_HOST);
  return self;
}

// A group token as the coordinator makes them (128 random bits, hex); members get its digest and keys.
constexpr char kToken[] = "0123456789abcdef0123456789abcdef";

class LeasesTest : public ::testing::Test {
 protected:
  LeasesTest()
      : membership_(fabric::FabricConfig{.world_size = 1}, Self(), nullptr),
        allocator_(&memory_),
        groups_(&membership_, nullptr, &allocator_, groups::LeaseLimits{}) {}

  void SetUp() override {
    v1::PrepareGroupRequest prepare;
    prepare.mutable_group()->set_name("g");
    prepare.mutable_group()->add_ranks(0);
    prepare.mutable_group()->set_num_nvl_bytes(4096);
    prepare.set_token_sha256(security::TokenDigest(kToken));
    prepare.set_data_key(security::DataKey(kToken));
    prepare.set_deletion_key(security::DeletionKey(kToken));
    prepare.set_epoch(membership_.View().epoch());
    auto prepared = groups_.Prepare(prepare);
    ASSERT_TRUE(prepared.ok()) << prepared.status();
    v1::CommitGroupRequest commit;
    commit.set_name("g");
    *commit.add_members() = *prepared;
    ASSERT_TRUE(groups_.Commit(commit).ok());
  }

  absl::StatusOr<v1::AttachResponse> Attach() {
    v1::AttachRequest request;
    request.set_group("g");
    request.set_rank(0);
    request.set_token(kToken);
    return groups_.Attach(request, groups::ClientIdentity{});
  }

  FakeMemory memory_;
  fabric::Membership membership_;
  FakeAllocator allocator_;
  groups::GroupManager groups_;
};

TEST_F(LeasesTest, AnAttachOfTheRankWaitsUntilTheEndedLeaseIsZeroed) {
  auto first = Attach();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(Attach().status().code(), absl::StatusCode::kFailedPrecondition) << "one lease per rank";
  absl::Notification zero_may_finish;
  memory_.hold_zero = &zero_may_finish;
  std::thread ender([&] { EXPECT_TRUE(groups_.EndLease(first->lease_id(), "test").ok()); });
  memory_.zero_started.WaitForNotification();

  // The region is being zeroed and no lock is held: lookups answer, and the ending lease is not live any more.
  EXPECT_EQ(groups_.LeaseInfo(first->lease_id()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(groups_.EndLease(first->lease_id(), "again").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(groups_.Clients().empty());
  ASSERT_EQ(groups_.ListGroups().groups_size(), 1);
  EXPECT_TRUE(groups_.ListGroups().groups(0).attached_ranks().empty());

  std::atomic<bool> attached{false};
  std::thread attacher([&] {
    auto second = Attach();
    EXPECT_TRUE(second.ok()) << second.status();
    EXPECT_EQ(memory_.zeroed.load(), 1) << "attached before the region was zero";
    attached = true;
  });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(attached.load());
  zero_may_finish.Notify();
  ender.join();
  attacher.join();
  EXPECT_TRUE(attached.load());
  EXPECT_EQ(groups_.Clients().size(), 1u);
}

TEST_F(LeasesTest, ReleaseFreesTheRegionsAfterAnEndingLeaseIsDone) {
  auto lease = Attach();
  ASSERT_TRUE(lease.ok()) << lease.status();
  absl::Notification zero_may_finish;
  memory_.hold_zero = &zero_may_finish;
  std::thread ender([&] { EXPECT_TRUE(groups_.EndLease(lease->lease_id(), "test").ok()); });
  memory_.zero_started.WaitForNotification();

  std::atomic<bool> released{false};
  std::thread releaser([&] {
    v1::ReleaseGroupRequest release;
    release.set_name("g");
    EXPECT_TRUE(groups_.Release(release).ok());
    EXPECT_EQ(memory_.freed.load(), 1) << "Release answered before the memory was freed";
    released = true;
  });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(released.load());
  EXPECT_EQ(memory_.freed.load(), 0);
  zero_may_finish.Notify();
  ender.join();
  releaser.join();
  EXPECT_TRUE(groups_.ListGroups().groups().empty());
  EXPECT_EQ(Attach().status().code(), absl::StatusCode::kNotFound);
}

TEST_F(LeasesTest, ExpiredLeasesAreZeroedAndEnded) {
  auto lease = Attach();
  ASSERT_TRUE(lease.ok()) << lease.status();
  groups_.ExpireLeases(absl::Now());
  EXPECT_EQ(groups_.Clients().size(), 1u) << "not expired yet";
  groups_.ExpireLeases(absl::Now() + absl::Minutes(1));
  EXPECT_EQ(memory_.zeroed.load(), 1);
  EXPECT_TRUE(groups_.Clients().empty());
  EXPECT_TRUE(Attach().ok());
}

}  // namespace
}  // namespace epfabric::daemon

namespace epfabric::daemon {
namespace {

// A Commit's descriptors: one set per group rank, each of that rank and at least the group's sizes (the cuda
// allocator rounds a region up to the cuMem granularity; never down).
TEST(GroupChecks, CommitMembersMustDescribeEachRanksRegions) {
  v1::GroupInfo info;
  info.set_name("g");
  info.add_ranks(0);
  info.add_ranks(1);
  info.set_num_nvl_bytes(3 << 20);
  google::protobuf::RepeatedPtrField<v1::PrepareGroupResponse> members;
  for (int rank : {0, 1}) {
    v1::RegionDescriptor* region = members.Add()->add_regions();
    region->set_kind(v1::RegionDescriptor::KIND_NVL);
    region->set_rank(rank);
    region->set_size_bytes(4 << 20);  // rounded up
  }
  EXPECT_TRUE(groups::ValidateCommitMembers(info, members).ok());
  members[1].mutable_regions(0)->set_size_bytes(1 << 20);
  EXPECT_THAT(groups::ValidateCommitMembers(info, members).message(),
              testing::HasSubstr("does not describe group rank 1"));
  members[1].mutable_regions(0)->set_size_bytes(4 << 20);
  members[1].mutable_regions(0)->set_rank(0);
  EXPECT_FALSE(groups::ValidateCommitMembers(info, members).ok());
  members.RemoveLast();
  EXPECT_THAT(groups::ValidateCommitMembers(info, members).message(), testing::HasSubstr("1 descriptors for 2 ranks"));
  info.add_ranks(1);
  EXPECT_THAT(groups::ValidateGroupInfo(info, 4).message(), testing::HasSubstr("appears twice"));
  info.set_ranks(2, 7);
  EXPECT_THAT(groups::ValidateGroupInfo(info, 4).message(), testing::HasSubstr("outside the fabric"));
}

}  // namespace
}  // namespace epfabric::daemon
