// Isolation of memory between tenants (issue #13): fabrics that share an id, and a probe process of another uid
// without the token.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "epfabric/client/client.h"
#include "epfabric/v1/fdchannel.pb.h"
#include "integration/client_test_helpers.h"
#include "integration/fabric_under_test.h"
#include "memory_test_util.h"

namespace epfabric::testing {
namespace {

using client::Lease;
using ::testing::HasSubstr;

// ---------------------------------------------------------------- isolation of memory (issue #13)

// Two fabrics with the same --fabric_id on one host, each with a group "moe": every (fabric, group, rank, kind) label
// is the same in both, which used to be the same /dev/shm name (the second daemon removed the first's object as
// "stale" and the first then handed out the second's). Each tenant must see only its own memory.
TEST(Isolation, TwoFabricsWithTheSameIdOnOneHostKeepTheirMemoryApart) {
  const std::string id = UniqueFabricId();
  auto first = FabricUnderTest::Start(2, kFast, {}, id);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = FabricUnderTest::Start(2, kFast, {}, id);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE((*first)->WaitComplete().ok());
  ASSERT_TRUE((*second)->WaitComplete().ok());
  auto group_a = CreateGroup(**first, "moe", {0, 1});
  ASSERT_TRUE(group_a.ok()) << group_a.status();
  auto group_b = CreateGroup(**second, "moe", {0, 1});
  ASSERT_TRUE(group_b.ok()) << group_b.status();
  // An NVL region and a counters page per member.
  EXPECT_EQ((*first)->MemfdRegions(), 4) << "same labels in both fabrics, distinct memory";
  EXPECT_EQ((*second)->MemfdRegions(), 4);

  // Each rank of each tenant writes its own pattern through its own lease's mapping: seed 100 * tenant + rank.
  struct Tenant {
    FabricUnderTest* fabric;
    std::string token;
    uint32_t seed;
    std::vector<std::unique_ptr<Lease>> leases;
  };
  std::vector<Tenant> tenants;
  tenants.push_back({first->get(), group_a->token(), 100, {}});
  tenants.push_back({second->get(), group_b->token(), 200, {}});
  for (Tenant& tenant : tenants) {
    for (int rank : {0, 1}) {
      auto lease = AttachVia(tenant.fabric->daemon(rank).socket(), "moe", rank, tenant.token);
      ASSERT_TRUE(lease.ok()) << lease.status();
      WritePattern((*lease)->region(rank), kRegionBytes, tenant.seed + rank);
      tenant.leases.push_back(std::move(*lease));
    }
  }
  auto check_own = [](const Tenant& tenant) {
    for (const auto& lease : tenant.leases) {
      for (int rank : {0, 1}) {
        ASSERT_NE(lease->region(rank), nullptr);
        EXPECT_EQ(Mismatches(lease->region(rank), kRegionBytes, tenant.seed + rank), 0u)
            << "tenant " << tenant.seed << ", lease of rank " << lease->rank() << ", region of rank " << rank;
      }
    }
  };
  for (const Tenant& tenant : tenants) check_own(tenant);

  // The second fabric's daemons die without cleaning up (SIGKILL) and a third one with the same id takes their
  // place: nothing of theirs is "stale" and replaced, the first tenant's memory is untouched.
  tenants[1].leases.clear();
  (*second)->Kill(0);
  (*second)->Kill(1);
  second->reset();
  auto third = FabricUnderTest::Start(2, kFast, {}, id);
  ASSERT_TRUE(third.ok()) << third.status();
  ASSERT_TRUE((*third)->WaitComplete().ok());
  auto group_c = CreateGroup(**third, "moe", {0, 1});
  ASSERT_TRUE(group_c.ok()) << group_c.status();
  auto lease_c = AttachVia((*third)->daemon(0).socket(), "moe", 0, group_c->token());
  ASSERT_TRUE(lease_c.ok()) << lease_c.status();
  EXPECT_EQ(Mismatches((*lease_c)->region(0), kRegionBytes, 0, /*expected_zero=*/true), 0u) << "fresh memory";
  WritePattern((*lease_c)->region(0), kRegionBytes, 300);
  check_own(tenants[0]);
  // A client attaching to the first fabric now still gets the first fabric's memory.
  tenants[0].leases[1]->Detach().IgnoreError();
  tenants[0].leases.pop_back();
  auto again = AttachVia((*first)->daemon(1).socket(), "moe", 1, group_a->token());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(Mismatches((*again)->region(0), kRegionBytes, 100), 0u);
  EXPECT_EQ(Mismatches((*again)->region(1), kRegionBytes, 0, /*expected_zero=*/true), 0u) << "zeroed at Detach";

  // Nothing of any of them is in /dev/shm.
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    EXPECT_EQ(entry.path().filename().string().find(id), std::string::npos) << entry.path();
  }
}

}  // namespace

// Helper mode --epf_no_token_probe, run as another uid in the socket's group (the finding: "any member of the socket
// group reads and writes another tenant's region directly"). Everything it tries must fail; prints what it did.
int RunNoTokenProbe(int argc, char** argv) {
  const std::string id = FlagValue(argc, argv, "fabric_id");
  const std::string socket = FlagValue(argc, argv, "socket");
  int daemon_pid = 0;
  if (id.empty() || socket.empty() || !absl::SimpleAtoi(FlagValue(argc, argv, "daemon_pid"), &daemon_pid)) return 2;
  int failures = 0;
  auto fail = [&failures](const std::string& what) {
    std::cerr << "probe: " << what << "\n";
    ++failures;
  };
  std::cout << "probe uid " << getuid() << " gid " << getgid() << "\n";
  // 1. No name to open.
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    if (entry.path().filename().string().find(id) != std::string::npos) fail("found " + entry.path().string());
  }
  for (const char* kind : {"nvl", "rdma"}) {
    const std::string old_name = absl::StrCat("/epf.", id, ".d0.moe.0.", kind);  // what the name used to be
    const int fd = shm_open(old_name.c_str(), O_RDWR, 0);
    if (fd >= 0 || errno != ENOENT) fail(absl::StrCat("shm_open(", old_name, "): fd ", fd, " errno ", errno));
    if (fd >= 0) close(fd);
  }
  // 2. Not through the daemon's descriptors either (another uid may not look into its /proc/<pid>/fd).
  int opened = 0;
  for (int n = 0; n < 1024; ++n) {
    const int fd = open(absl::StrCat("/proc/", daemon_pid, "/fd/", n).c_str(), O_RDWR | O_CLOEXEC);
    if (fd >= 0) {
      ++opened;
      close(fd);
    }
  }
  if (opened != 0) fail(absl::StrCat("opened ", opened, " of the daemon's descriptors through /proc"));
  // 3. The side channel answers, but not without the token.
  auto connection = ConnectTo(socket + ".fds");
  if (!connection.ok()) {
    fail("cannot reach the fd side channel: " + connection.status().ToString());
  } else {
    v1::FdRequest request;
    request.set_group("moe");
    request.set_rank(0);
    request.set_kind(v1::RegionDescriptor::KIND_NVL);
    request.set_token(std::string(32, '0'));
    auto answer = Ask(connection->get(), request);
    if (!answer.ok()) {
      fail("fd side channel: " + answer.status().ToString());
    } else if (answer->response.code() != static_cast<int>(absl::StatusCode::kPermissionDenied) ||
               !answer->fds.empty()) {
      fail(absl::StrCat("fd side channel without the token: code ", answer->response.code(), ", ", answer->fds.size(),
                        " fds"));
    } else {
      std::cout << "side channel: " << answer->response.message() << "\n";
    }
  }
  return failures == 0 ? 0 : 1;
}

namespace {

TEST(Isolation, AnotherUidInTheSocketGroupWithoutTheTokenCannotReachTheRegion) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run the probe as another uid";
  if (access("/usr/bin/setpriv", X_OK) != 0) GTEST_SKIP() << "needs setpriv (util-linux)";
  auto fabric = FabricUnderTest::Start(1, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  auto group = CreateGroup(**fabric, "moe", {0}, /*rdma_bytes=*/65536);
  ASSERT_TRUE(group.ok()) << group.status();
  auto lease = AttachVia((*fabric)->daemon(0).socket(), "moe", 0, group->token());
  ASSERT_TRUE(lease.ok()) << lease.status();
  WritePattern((*lease)->region(0), kRegionBytes, 7);

  // The probe gets what a member of the socket's group has: the group (gid of the sockets) and a way to them.
  const std::string socket = (*fabric)->daemon(0).socket();
  struct stat info {};
  ASSERT_EQ(stat(socket.c_str(), &info), 0);
  ASSERT_EQ(chmod(std::filesystem::path(socket).parent_path().c_str(), 0750), 0);
  ASSERT_EQ(chown(std::filesystem::path(socket).parent_path().c_str(), 0, info.st_gid), 0);
  char self[4096] = {};
  ASSERT_GT(readlink("/proc/self/exe", self, sizeof(self) - 1), 0);
  RunResult probe =
      RunBinary({"/usr/bin/setpriv", "--reuid=65534", absl::StrCat("--regid=", info.st_gid), "--clear-groups", self,
                 "--epf_no_token_probe", "--fabric_id=" + (*fabric)->fabric_id(), "--socket=" + socket,
                 absl::StrCat("--daemon_pid=", (*fabric)->daemon(0).process().pid())});
  EXPECT_EQ(probe.exit_code, 0) << probe.out << probe.err;
  EXPECT_THAT(probe.out, HasSubstr("probe uid 65534"));
  EXPECT_THAT(probe.out, HasSubstr("wrong token for group 'moe'"));
  EXPECT_EQ(Mismatches((*lease)->region(0), kRegionBytes, 7), 0u) << "the tenant's memory is as it wrote it";
}

}  // namespace
}  // namespace epfabric::testing
