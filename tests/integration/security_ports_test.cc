// Listeners do not share their ports (issue #34): gRPC and cpp-httplib set SO_REUSEPORT by default, which let a second
// process bind a live daemon's peer port or /metrics and take a share of the connections. A second daemon on a taken
// --peer_listen or --metrics_listen must fail at start-up, saying which flag.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "integration/daemon_under_test.h"

namespace epfabric::testing {
namespace {

using ::testing::HasSubstr;

// A loopback port that was free a moment ago.
int FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t size = sizeof(address);
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), size) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size) != 0) {
    close(fd);
    return 0;
  }
  close(fd);
  return ntohs(address.sin_port);
}

class TakenPort : public ::testing::TestWithParam<std::string> {};

TEST_P(TakenPort, ASecondDaemonFailsAtStartUp) {
  const std::string flag = GetParam();
  const int port = FreeLoopbackPort();
  ASSERT_NE(port, 0);
  const std::string address = absl::StrCat("127.0.0.1:", port);
  auto first = DaemonUnderTest::Start({absl::StrCat("--", flag, "=", address)});
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = DaemonUnderTest::Start({absl::StrCat("--", flag, "=", address)});
  ASSERT_FALSE(second.ok()) << "a second daemon started on " << flag << "=" << address;
  EXPECT_THAT(second.status().message(), HasSubstr(absl::StrCat(flag, ": cannot listen on ", address)));
}

INSTANTIATE_TEST_SUITE_P(Listeners, TakenPort, ::testing::Values("peer_listen", "metrics_listen"));

}  // namespace
}  // namespace epfabric::testing
