// The daemons' fd side channel (regions handed over to lease holders), spoken directly: wrong tokens, malformed
// and random requests.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <random>

#include "absl/strings/str_cat.h"
#include "epfabric/client/client.h"
#include "epfabric/common/fd_passing.h"
#include "epfabric/v1/fdchannel.pb.h"
#include "integration/client_test_helpers.h"
#include "integration/client_test_util.h"
#include "integration/fabric_under_test.h"
#include "memory_test_util.h"

namespace epfabric::testing {
namespace {

using ::testing::HasSubstr;

// ---------------------------------------------------------------- the fd side channel

TEST(FdChannel, WrongTokenIsPermissionDeniedAndNothingLeaks) {
  auto fabric = FabricUnderTest::Start(1, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  auto group = CreateGroup(**fabric, "guarded", {0});
  ASSERT_TRUE(group.ok()) << group.status();
  const std::string fd_socket = (*fabric)->daemon(0).socket() + ".fds";
  struct stat st {};
  ASSERT_EQ(stat(fd_socket.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u) << "same mode as the client socket";
  const pid_t daemon = (*fabric)->daemon(0).process().pid();
  const int daemon_fds = OpenFdCount(daemon);
  const int own_fds = OpenFdCount(getpid());
  v1::FdRequest request;
  request.set_group("guarded");
  request.set_rank(0);
  request.set_kind(v1::RegionDescriptor::KIND_NVL);
  request.set_token(std::string(group->token().size(), '0'));
  for (int i = 0; i < 200; ++i) {
    auto connection = ConnectTo(fd_socket);
    ASSERT_TRUE(connection.ok()) << connection.status();
    auto answer = Ask(connection->get(), request);
    ASSERT_TRUE(answer.ok()) << answer.status();
    ASSERT_EQ(answer->response.code(), static_cast<int>(absl::StatusCode::kPermissionDenied));
    ASSERT_THAT(answer->response.message(), HasSubstr("wrong token for group 'guarded'"));
    ASSERT_TRUE(answer->fds.empty());
    ASSERT_FALSE(answer->response.has_region());
  }
  request.set_token(group->token().substr(0, 8));  // shorter: also refused, same message
  auto connection = ConnectTo(fd_socket);
  ASSERT_TRUE(connection.ok());
  auto answer = Ask(connection->get(), request);
  ASSERT_TRUE(answer.ok());
  EXPECT_EQ(answer->response.code(), static_cast<int>(absl::StatusCode::kPermissionDenied));
  connection->reset();
  // gRPC opens and closes descriptors of its own in both processes now and then (the baseline may include the
  // CreateGroup connection, still closing): wait for them to settle, and count only growth as a leak.
  EXPECT_TRUE(Eventually([&] { return OpenFdCount(getpid()) <= own_fds; }, absl::Seconds(3)))
      << "test process fds " << OpenFdCount(getpid()) << " vs " << own_fds << " before";
  EXPECT_TRUE(Eventually([&] { return OpenFdCount(daemon) <= daemon_fds; }, absl::Seconds(3)))
      << "daemon fds " << OpenFdCount(daemon) << " vs " << daemon_fds << " before";
  // The right token gets the region (host backend: the descriptor and the region's memfd, sealed).
  request.set_token(group->token());
  connection = ConnectTo(fd_socket);
  ASSERT_TRUE(connection.ok());
  answer = Ask(connection->get(), request);
  ASSERT_TRUE(answer.ok());
  EXPECT_EQ(answer->response.code(), 0) << answer->response.message();
  EXPECT_EQ(answer->response.region().sharing(), v1::MEMORY_SHARING_POSIX_SHM);
  EXPECT_FALSE(answer->response.holds_lease());
  ASSERT_EQ(answer->fds.size(), 1u);
  EXPECT_EQ(fcntl(answer->fds[0].get(), F_GET_SEALS), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  errno = 0;
  EXPECT_NE(ftruncate(answer->fds[0].get(), 0), 0) << "a client cannot shrink the region under the others";
  EXPECT_EQ(errno, EPERM);
}

TEST(FdChannel, MalformedRequestsGetErrorsAndTheDaemonKeepsServing) {
  auto fabric = FabricUnderTest::Start(2, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  auto group = CreateGroup(**fabric, "strict", {0, 1});
  ASSERT_TRUE(group.ok()) << group.status();
  auto other = CreateGroup(**fabric, "other", {0});
  ASSERT_TRUE(other.ok()) << other.status();
  const std::string socket = (*fabric)->daemon(0).socket();
  const std::string fd_socket = socket + ".fds";
  auto parent = ChildChannel::Listen();
  ASSERT_TRUE(parent.ok());
  // A lease held by another process (rank 0 of "strict"), and one held by this process (rank 0 of "other").
  std::vector<Helper> helpers =
      StartHelpers(*parent, **fabric, "--epf_client_helper", "hold", "strict", group->token(), {0});
  ASSERT_EQ(helpers.size(), 1u);
  auto mine = AttachVia(socket, "other", 0, other->token());
  ASSERT_TRUE(mine.ok()) << mine.status();

  auto connection = ConnectTo(fd_socket);
  ASSERT_TRUE(connection.ok());
  const int fd = connection->get();
  auto base = [&] {
    v1::FdRequest request;
    request.set_group("strict");
    request.set_rank(0);
    request.set_kind(v1::RegionDescriptor::KIND_NVL);
    request.set_token(group->token());
    return request;
  };
  using Code = absl::StatusCode;
  struct Case {
    const char* what;
    v1::FdRequest request;
    Code code;
    const char* message;
  };
  std::vector<Case> cases;
  auto add = [&](const char* what, auto mutate, Code code, const char* message) {
    v1::FdRequest request = base();
    mutate(request);
    cases.push_back({what, request, code, message});
  };
  add(
      "empty group", [](auto& r) { r.clear_group(); }, Code::kInvalidArgument, "group: empty");
  add(
      "empty token", [](auto& r) { r.clear_token(); }, Code::kInvalidArgument, "token: empty");
  add(
      "unknown group", [](auto& r) { r.set_group("nope"); }, Code::kNotFound, "'nope' has no region on this daemon");
  add(
      "kind unspecified", [](auto& r) { r.set_kind(v1::RegionDescriptor::KIND_UNSPECIFIED); }, Code::kInvalidArgument,
      "kind: 0 is not KIND_NVL, KIND_RDMA, KIND_COMMANDS or KIND_STATS");
  add(
      "kind out of range", [](auto& r) { r.set_kind(static_cast<v1::RegionDescriptor::Kind>(77)); },
      Code::kInvalidArgument, "kind: 77");
  add(
      "rank outside", [](auto& r) { r.set_rank(9); }, Code::kInvalidArgument, "rank: 9 is not a rank of group");
  add(
      "negative rank", [](auto& r) { r.set_rank(-1); }, Code::kInvalidArgument, "rank: -1");
  add(
      "rank of another daemon", [](auto& r) { r.set_rank(1); }, Code::kFailedPrecondition, "served by daemon rank 1");
  add(
      "rdma without lease", [](auto& r) { r.set_kind(v1::RegionDescriptor::KIND_RDMA); }, Code::kNotFound,
      "has no KIND_RDMA region");
  add(
      "unknown lease", [](auto& r) { r.set_lease_id("feedface"); }, Code::kNotFound, "'feedface' is not a live lease");
  add(
      "lease of another process", [&](auto& r) { r.set_lease_id(helpers[0].lease_id); }, Code::kPermissionDenied,
      "was taken by pid");
  add(
      "lease of another group", [&](auto& r) { r.set_lease_id((*mine)->lease_id()); }, Code::kPermissionDenied,
      "is for group 'other' rank 0");
  add(
      "lease held by another connection",
      [&](auto& r) {
        r.set_group("other");
        r.set_token(other->token());
        r.set_lease_id((*mine)->lease_id());
      },
      Code::kFailedPrecondition, "already held by another connection");
  for (const Case& c : cases) {
    auto answer = Ask(fd, c.request);
    ASSERT_TRUE(answer.ok()) << c.what << ": " << answer.status();
    EXPECT_EQ(answer->response.code(), static_cast<int>(c.code)) << c.what << ": " << answer->response.message();
    EXPECT_THAT(answer->response.message(), HasSubstr(c.message)) << c.what;
    EXPECT_TRUE(answer->fds.empty()) << c.what;
  }
  // Not a protobuf: refused, and the connection stays usable.
  ASSERT_TRUE(common::SendFds(fd, {}, std::string("\xff\xff\xff\xff garbage", 12), absl::Seconds(5)).ok());
  auto garbage = common::ReceiveFds(fd, absl::Seconds(5));
  ASSERT_TRUE(garbage.ok()) << garbage.status();
  v1::FdResponse refused;
  ASSERT_TRUE(refused.ParseFromString(garbage->payload));
  EXPECT_EQ(refused.code(), static_cast<int>(Code::kInvalidArgument));
  EXPECT_THAT(refused.message(), HasSubstr("not an epfabric.v1.FdRequest"));
  auto fine = Ask(fd, base());
  ASSERT_TRUE(fine.ok());
  EXPECT_EQ(fine->response.code(), 0) << fine->response.message();

  // A client that sends a descriptor, or announces a huge message: an error, then the connection is closed.
  {
    // Counted before connecting: the daemon accepts a connection some time after connect() returns.
    const int daemon_fds = OpenFdCount((*fabric)->daemon(0).process().pid());
    auto sender = ConnectTo(fd_socket);
    ASSERT_TRUE(sender.ok());
    const int passed = STDIN_FILENO;
    ASSERT_TRUE(common::SendFds(sender->get(), {&passed, 1}, base().SerializeAsString(), absl::Seconds(5)).ok());
    auto answer = common::ReceiveFds(sender->get(), absl::Seconds(5));
    ASSERT_TRUE(answer.ok()) << answer.status();
    v1::FdResponse response;
    ASSERT_TRUE(response.ParseFromString(answer->payload));
    EXPECT_EQ(response.code(), static_cast<int>(Code::kInvalidArgument)) << response.message();
    EXPECT_THAT(response.message(), HasSubstr("closing the connection"));
    EXPECT_EQ(common::ReceiveFds(sender->get(), absl::Seconds(5)).status().code(), Code::kUnavailable);
    EXPECT_TRUE(
        Eventually([&] { return OpenFdCount((*fabric)->daemon(0).process().pid()) <= daemon_fds; }, absl::Seconds(3)))
        << "the descriptor the client sent was closed with the connection";
  }
  {
    auto huge = ConnectTo(fd_socket);
    ASSERT_TRUE(huge.ok());
    const unsigned char header[4] = {0xff, 0xff, 0xff, 0x7f};
    ASSERT_EQ(send(huge->get(), header, 4, MSG_NOSIGNAL), 4);
    auto answer = common::ReceiveFds(huge->get(), absl::Seconds(5));
    ASSERT_TRUE(answer.ok()) << answer.status();
    v1::FdResponse response;
    ASSERT_TRUE(response.ParseFromString(answer->payload));
    EXPECT_EQ(response.code(), static_cast<int>(Code::kInvalidArgument)) << response.message();
    EXPECT_EQ(common::ReceiveFds(huge->get(), absl::Seconds(5)).status().code(), Code::kUnavailable);
  }
  {
    auto partial = ConnectTo(fd_socket);  // half a header, then gone
    ASSERT_TRUE(partial.ok());
    ASSERT_EQ(send(partial->get(), "\x10\x00", 2, MSG_NOSIGNAL), 2);
  }
  // Still serving: the helper's lease is intact, and a new client attaches rank 1 through the other daemon.
  auto refused_attach = AttachVia(socket, "strict", 0, group->token());
  EXPECT_EQ(refused_attach.status().code(), Code::kFailedPrecondition) << refused_attach.status();
  auto one = AttachVia((*fabric)->daemon(1).socket(), "strict", 1, group->token());
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_TRUE((*mine)->Healthy().ok());
  ASSERT_TRUE(Say(helpers[0].channel.get(), "detach").ok());
  auto exit_code = WaitChild(helpers[0].pid, absl::Seconds(10));
  EXPECT_TRUE(exit_code.ok() && *exit_code == 0);
}

// Random bytes and random field values: every request gets an answer, none gets a region, the daemon lives on.
TEST(FdChannel, RandomRequestsAreRefusedAndTheDaemonKeepsServing) {
  auto fabric = FabricUnderTest::Start(1, kFast);
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  auto group = CreateGroup(**fabric, "fuzzed", {0}, /*rdma_bytes=*/4096);
  ASSERT_TRUE(group.ok()) << group.status();
  const std::string socket = (*fabric)->daemon(0).socket();
  auto connection = ConnectTo(socket + ".fds");
  ASSERT_TRUE(connection.ok());
  std::mt19937 random(20261122);
  auto bytes = [&random](size_t max) {
    std::string text(random() % (max + 1), '\0');
    for (char& c : text) c = static_cast<char>(random());
    return text;
  };
  auto printable = [&random](size_t max) {  // string fields must hold UTF-8; random bytes are sent raw below
    std::string text(random() % (max + 1), 'a');
    for (char& c : text) c = static_cast<char>(' ' + random() % 95);
    return text;
  };
  const std::vector<std::string> groups = {"fuzzed", "", "nope", std::string(300, 'g')};
  for (int i = 0; i < 1000; ++i) {
    std::string payload;
    if (i % 2 == 0) {
      payload = bytes(300);
    } else {
      v1::FdRequest request;
      request.set_group(groups[random() % groups.size()]);
      request.set_rank(static_cast<int32_t>(random() % 5) - 2);
      request.set_kind(static_cast<v1::RegionDescriptor::Kind>(random() % 4));
      request.set_token(random() % 4 == 0 ? "" : printable(40));
      if (random() % 2 == 0) request.set_lease_id(printable(40));
      payload = request.SerializeAsString();
    }
    ASSERT_TRUE(common::SendFds(connection->get(), {}, payload, absl::Seconds(5)).ok()) << i;
    auto answer = common::ReceiveFds(connection->get(), absl::Seconds(5));
    ASSERT_TRUE(answer.ok()) << i << ": " << answer.status();
    v1::FdResponse response;
    ASSERT_TRUE(response.ParseFromString(answer->payload)) << i;
    ASSERT_NE(response.code(), 0) << i << ": a random request got a region";
    ASSERT_TRUE(answer->fds.empty()) << i;
  }
  auto lease = AttachVia(socket, "fuzzed", 0, group->token());
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_TRUE((*lease)->Healthy().ok());
}

}  // namespace
}  // namespace epfabric::testing
