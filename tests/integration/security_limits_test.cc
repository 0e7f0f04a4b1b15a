// Security regressions that are not about credentials (issue #13): forged group requests from a member's
// credential are refused and crash nothing; Joins carry token digests, not tokens, so an impostor on a dead
// coordinator's port learns none; a member bounds its own region by its own allocation, whatever a Commit claims
// (issue #34); quotas; clipped echoes; connection floods.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <fstream>
#include <mutex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "epfabric/common/fd_passing.h"
#include "epfabric/common/peer_auth.h"
#include "epfabric/v1/peer.grpc.pb.h"
#include "integration/fabric_under_test.h"
#include "integration/peer_channel.h"

namespace epfabric::testing {
namespace {

using ::testing::HasSubstr;
using Code = grpc::StatusCode;

const std::vector<std::string> kFast = {"--heartbeat_ms=100", "--heartbeat_misses=3"};

std::unique_ptr<v1::Peer::Stub> PeerAs(const std::string& address, const std::string& fabric_id,
                                       common::PeerProofClaim claim) {
  return v1::Peer::NewStub(PeerChannel(address, fabric_id, claim));
}

template <typename Call>
grpc::Status Timed(Call call) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return call(&context);
}

grpc::Status Create(FabricUnderTest& fabric, const std::string& name, std::vector<int> ranks,
                    v1::CreateGroupResponse* response) {
  v1::CreateGroupRequest request;
  request.set_name(name);
  for (int r : ranks) request.add_ranks(r);
  request.set_num_nvl_bytes(1 << 20);
  return Timed([&](auto* c) { return fabric.Control(0)->CreateGroup(c, request, response); });
}

TEST(PeerRequests, ForgedGroupRequestsAreRefusedAndCrashNothing) {
  auto fabric = FabricUnderTest::Start(2, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  v1::CreateGroupResponse group;
  ASSERT_TRUE(Create(**fabric, "tenant", {0, 1}, &group).ok());
  const std::string fabric_id = (*fabric)->fabric_id();
  const v1::FabricView view = *(*fabric)->Fabric(0);
  // With the coordinator's credential (a stolen one, or a bug in rank 0), straight to rank 1.
  auto as_zero = PeerAs(view.membership().members(1).peer_address(), fabric_id, {common::PeerRole::kMember, 0});
  v1::PrepareGroupRequest prepare;
  prepare.set_fabric_id(fabric_id);
  prepare.mutable_group()->set_name("forged");
  prepare.mutable_group()->add_ranks(1);
  prepare.mutable_group()->add_ranks(100000);
  prepare.mutable_group()->set_num_nvl_bytes(4096);
  SetGroupSecrets(&prepare, std::string(32, 'a'));
  prepare.set_epoch(view.membership().epoch());
  v1::PrepareGroupResponse prepared;
  grpc::Status status = Timed([&](auto* c) { return as_zero->PrepareGroup(c, prepare, &prepared); });
  EXPECT_EQ(status.error_code(), Code::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("100000 is outside the fabric"));
  prepare.mutable_group()->set_ranks(1, 1);
  status = Timed([&](auto* c) { return as_zero->PrepareGroup(c, prepare, &prepared); });
  EXPECT_THAT(status.error_message(), HasSubstr("appears twice"));
  prepare.mutable_group()->set_ranks(1, 0);
  prepare.set_epoch(view.membership().epoch() + 5);
  status = Timed([&](auto* c) { return as_zero->PrepareGroup(c, prepare, &prepared); });
  EXPECT_EQ(status.error_code(), Code::ABORTED) << status.error_message();
  v1::CommitGroupRequest commit;
  commit.set_fabric_id(fabric_id);
  commit.set_name("tenant");
  commit.add_members();
  v1::CommitGroupResponse committed;
  status = Timed([&](auto* c) { return as_zero->CommitGroup(c, commit, &committed); });
  // A group commits once: a second Commit (even a well-formed one) is refused before its members are looked at.
  EXPECT_EQ(status.error_code(), Code::FAILED_PRECONDITION) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("is GROUP_STATE_READY, not CREATING"));

  // A Join of rank 1 (its own credential, its live incarnation and address) reporting a group with rank 123456:
  // the coordinator ignores the record, and a Retire of it finds nothing.
  v1::JoinRequest join;
  join.set_fabric_id(fabric_id);
  join.set_world_size(2);
  *join.mutable_member() = view.membership().members(1);
  join.set_known_epoch(view.membership().epoch());
  v1::GroupRecord* record = join.add_groups();
  record->mutable_group()->set_name("phantom");
  record->mutable_group()->add_ranks(1);
  record->mutable_group()->add_ranks(123456);
  record->mutable_group()->set_num_nvl_bytes(4096);
  record->set_token_sha256(common::Sha256Hex("x"));
  auto as_one = PeerAs((*fabric)->coordinator(), fabric_id, {common::PeerRole::kMember, 1});
  v1::JoinResponse joined;
  status = Timed([&](auto* c) { return as_one->Join(c, join, &joined); });
  EXPECT_TRUE(status.ok()) << status.error_message();
  // Addresses and socket paths in a Join are checked too (clients connect to the announced fd socket).
  v1::JoinRequest bad_path = join;
  bad_path.clear_groups();
  bad_path.mutable_member()->set_fd_socket("relative/path.fds");
  status = Timed([&](auto* c) { return as_one->Join(c, bad_path, &joined); });
  EXPECT_EQ(status.error_code(), Code::INVALID_ARGUMENT) << status.error_message();
  bad_path.mutable_member()->set_fd_socket(view.membership().members(1).fd_socket());
  bad_path.mutable_member()->set_peer_address("127.0.0.1:1/../x");
  status = Timed([&](auto* c) { return as_one->Join(c, bad_path, &joined); });
  EXPECT_EQ(status.error_code(), Code::INVALID_ARGUMENT) << status.error_message();
  v1::RetireGroupRequest retire;
  retire.set_fabric_id(fabric_id);
  retire.set_name("phantom");
  SetRetireProof(&retire, "x");
  v1::RetireGroupResponse retired;
  status = Timed([&](auto* c) { return as_one->RetireGroup(c, retire, &retired); });
  EXPECT_EQ(status.error_code(), Code::NOT_FOUND) << status.error_message();

  // An ops credential may not call a member's method.
  auto as_ops = PeerAs(view.membership().members(1).peer_address(), fabric_id, {common::PeerRole::kOps, -1});
  v1::ReleaseGroupRequest release;
  release.set_fabric_id(fabric_id);
  release.set_name("tenant");
  v1::ReleaseGroupResponse released;
  status = Timed([&](auto* c) { return as_ops->ReleaseGroup(c, release, &released); });
  EXPECT_EQ(status.error_code(), Code::PERMISSION_DENIED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("needs a member's credential; the caller is ops tooling"));

  absl::SleepFor(absl::Milliseconds(500));  // a membership change after a bad record used to crash the coordinator
  for (int rank : {0, 1}) {
    EXPECT_TRUE((*fabric)->daemon(rank).process().running()) << rank;
    auto now = (*fabric)->Fabric(rank);
    ASSERT_TRUE(now.ok()) << rank;
    bool ready = false;
    for (const auto& g : now->groups()) {
      EXPECT_NE(g.name(), "phantom");
      EXPECT_NE(g.name(), "forged");
      ready |= g.name() == "tenant" && g.state() == v1::GROUP_STATE_READY;
    }
    EXPECT_TRUE(ready) << rank;
  }
}

// Captures what a member sends to whoever listens on the coordinator's port.
class ImpostorCoordinator final : public v1::Peer::Service {
 public:
  grpc::Status Join(grpc::ServerContext*, const v1::JoinRequest* request, v1::JoinResponse*) override {
    std::lock_guard<std::mutex> lock(mutex_);
    joins_.push_back(*request);
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "impostor");
  }
  std::vector<v1::JoinRequest> joins() {
    std::lock_guard<std::mutex> lock(mutex_);
    return joins_;
  }

 private:
  std::mutex mutex_;
  std::vector<v1::JoinRequest> joins_;
};

TEST(PeerRequests, AnImpostorOnADeadCoordinatorsPortGetsNoTokens) {
  auto fabric = FabricUnderTest::Start(2, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  v1::CreateGroupResponse group;
  ASSERT_TRUE(Create(**fabric, "tenant", {0, 1}, &group).ok());
  const std::string address = (*fabric)->coordinator();
  (*fabric)->Kill(0);
  ImpostorCoordinator impostor;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials());
  builder.RegisterService(&impostor);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr) << "cannot listen on " << address;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (impostor.joins().empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
  server->Shutdown();
  const std::vector<v1::JoinRequest> joins = impostor.joins();
  ASSERT_FALSE(joins.empty()) << "rank 1 never tried to rejoin";
  bool reported = false;
  for (const v1::JoinRequest& join : joins) {
    for (const v1::GroupRecord& record : join.groups()) {
      reported = true;
      EXPECT_TRUE(record.token().empty()) << "a token reached the impostor";
      EXPECT_EQ(record.token_sha256(), common::Sha256Hex(group.token()));
    }
  }
  EXPECT_TRUE(reported) << "rank 1 reported its group (as a digest)";
}

// Whether rank 1 lists group `name` as READY.
bool ReadyOnRankOne(FabricUnderTest& fabric, const std::string& name) {
  auto view = fabric.Fabric(1);
  if (!view.ok()) return false;
  for (const auto& group : view->groups()) {
    if (group.name() == name) return group.state() == v1::GROUP_STATE_READY;
  }
  return false;
}

TEST(PeerRequests, ACommitThatMisstatesThisMembersOwnRegionIsRefused) {
  auto fabric = FabricUnderTest::Start(2, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  const std::string fabric_id = (*fabric)->fabric_id();
  // The coordinator's credential (a replayed or stolen one): Prepare on rank 1, then a Commit whose record for rank 1
  // claims a region of 2^40 bytes, which rank 1 would take as the bound of its own region for ring puts.
  auto as_zero =
      PeerAs((*fabric)->Fabric(0)->membership().members(1).peer_address(), fabric_id, {common::PeerRole::kMember, 0});
  v1::PrepareGroupRequest prepare;
  prepare.set_fabric_id(fabric_id);
  SetGroupSecrets(&prepare, std::string(32, 't'));
  prepare.set_epoch((*fabric)->Fabric(1)->membership().epoch());
  v1::GroupInfo* group = prepare.mutable_group();
  group->set_name("forged");
  group->add_ranks(0);
  group->add_ranks(1);
  group->set_num_nvl_bytes(1 << 20);
  group->set_num_rdma_bytes(1 << 20);
  group->set_transport_channels(1);
  group->set_ring_slots(16);
  v1::PrepareGroupResponse prepared;
  grpc::Status status = Timed([&](auto* c) { return as_zero->PrepareGroup(c, prepare, &prepared); });
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(prepared.transport().region_bytes(), uint64_t{1} << 20);

  v1::CommitGroupRequest commit;
  commit.set_fabric_id(fabric_id);
  commit.set_name("forged");
  commit.set_epoch(prepare.epoch());
  v1::PrepareGroupResponse* other = commit.add_members();
  *other = prepared;
  for (v1::RegionDescriptor& region : *other->mutable_regions()) region.set_rank(0);
  v1::PrepareGroupResponse* own = commit.add_members();
  *own = prepared;
  own->mutable_transport()->set_region_bytes(uint64_t{1} << 40);
  v1::CommitGroupResponse committed;
  status = Timed([&](auto* c) { return as_zero->CommitGroup(c, commit, &committed); });
  EXPECT_EQ(status.error_code(), Code::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("members[1].transport.region_bytes: 1099511627776 bytes"));
  EXPECT_FALSE(ReadyOnRankOne(**fabric, "forged"));

  // The true size commits.
  own->mutable_transport()->set_region_bytes(prepared.transport().region_bytes());
  status = Timed([&](auto* c) { return as_zero->CommitGroup(c, commit, &committed); });
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(ReadyOnRankOne(**fabric, "forged"));
}

TEST(Limits, GroupQuotaAndClippedNames) {
  std::vector<std::string> flags = kFast;
  flags.push_back("--max_groups=2");
  auto fabric = FabricUnderTest::Start(1, flags);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  v1::CreateGroupResponse response;
  ASSERT_TRUE(Create(**fabric, "a", {0}, &response).ok());
  ASSERT_TRUE(Create(**fabric, "b", {0}, &response).ok());
  grpc::Status status = Create(**fabric, "c", {0}, &response);
  EXPECT_EQ(status.error_code(), Code::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("limit 2, --max_groups"));
  EXPECT_EQ((*fabric)->Fabric(0)->groups_size(), 2) << "the refused create left nothing behind";
  status = Create(**fabric, std::string(10240, 'n'), {0}, &response);
  EXPECT_EQ(status.error_code(), Code::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("(10240 bytes)"));
  EXPECT_LT(status.error_message().size(), 400u);
}

double CpuSeconds(pid_t pid) {
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const std::vector<std::string> fields = absl::StrSplit(text.substr(text.rfind(')') + 2), ' ');
  int64_t utime = 0, stime = 0;
  if (fields.size() < 15 || !absl::SimpleAtoi(fields[11], &utime) || !absl::SimpleAtoi(fields[12], &stime)) return -1;
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

std::vector<common::UniqueFd> Flood(const std::string& path, int count) {
  std::vector<common::UniqueFd> fds;
  for (int i = 0; i < count; ++i) {
    common::UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
    if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) fds.push_back(std::move(fd));
  }
  return fds;
}

TEST(Limits, ConnectionFloodsAreCappedAndTheDaemonRecovers) {
  // Few descriptors, as under `ulimit -n`: the flood runs the daemon out of them.
  const std::string dir = MakeTempDir();
  auto daemon = DaemonUnderTest::Start({"--log_level=info"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const pid_t pid = (*daemon)->process().pid();
  RunResult limited = RunBinary({"/usr/bin/prlimit", absl::StrCat("--pid=", pid), "--nofile=160:160"});
  ASSERT_EQ(limited.exit_code, 0) << limited.err;
  const int threads_before = (*daemon)->process().Threads();
  const double cpu_before = CpuSeconds(pid);
  std::vector<common::UniqueFd> side = Flood((*daemon)->socket() + ".fds", 300);
  std::vector<common::UniqueFd> main = Flood((*daemon)->socket(), 300);
  absl::SleepFor(absl::Seconds(2));
  const double cpu = CpuSeconds(pid) - cpu_before;
  const int threads = (*daemon)->process().Threads();
  std::cout << "[ FLOOD    ] 300+300 connections: daemon threads " << threads_before << " -> " << threads << ", CPU "
            << cpu << " s in 2 s, stderr " << (*daemon)->process().Stderr().size() << " bytes\n";
  EXPECT_TRUE((*daemon)->process().running());
  EXPECT_LT(threads, threads_before + 80) << "one thread per connection is capped (64 per uid on the side channel)";
  EXPECT_LT(cpu, 1.0) << "the accept loops do not spin on EMFILE";
  EXPECT_LT((*daemon)->process().Stderr().size(), 64u * 1024) << "warnings are rate-limited";
  side.clear();
  main.clear();
  // Once the flood is gone, a real client is served again.
  absl::StatusOr<v1::FabricView> view = absl::UnknownError("not asked");
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    v1::FabricView answer;
    if (v1::Ops::NewStub((*daemon)->SocketChannel())->GetFabric(&context, v1::GetFabricRequest(), &answer).ok()) {
      view = answer;
      break;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(view.ok()) << "the daemon serves clients again after the flood";
}

}  // namespace
}  // namespace epfabric::testing
