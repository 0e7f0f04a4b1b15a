// Listeners do not share their ports (issue #34): gRPC and cpp-httplib set SO_REUSEPORT by default, which let a second
// process bind a live daemon's peer port or /metrics and take a share of the connections. A second daemon on a taken
// --peer_listen or --metrics_listen must fail at start-up, saying which flag. And /metrics answers a scrape while
// other connections trickle bytes or sit idle.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "epfabric/v1/ops.grpc.pb.h"
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

// A TCP connection to 127.0.0.1:`port` (-1 on failure).
int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// GET /metrics on a fresh connection; the whole answer (the server closes after it), or "" after `timeout`.
std::string Scrape(int port, absl::Duration timeout) {
  const int fd = Connect(port);
  if (fd < 0) return "";
  const timeval tv = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  const std::string request = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  std::string answer;
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(request.size())) {
    char buffer[4096];
    ssize_t got = 0;
    while ((got = recv(fd, buffer, sizeof(buffer), 0)) > 0) answer.append(buffer, static_cast<size_t>(got));
    if (got < 0) answer.clear();  // timed out before the end
  }
  close(fd);
  return answer;
}

TEST(MetricsListener, TricklingAndIdleConnectionsDoNotHoldAScrape) {
  auto daemon = DaemonUnderTest::Start({"--metrics_listen=127.0.0.1:0"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto ops = v1::Ops::NewStub((*daemon)->SocketChannel());
  grpc::ClientContext context;
  v1::Topology topology;
  ASSERT_TRUE(ops->GetTopology(&context, v1::GetTopologyRequest(), &topology).ok());
  const std::vector<std::string> host_port = absl::StrSplit(topology.daemon().metrics_address(), ':');
  ASSERT_EQ(host_port.size(), 2u);
  const int port = std::stoi(host_port[1]);
  ASSERT_THAT(Scrape(port, absl::Seconds(5)), HasSubstr("HTTP/1.1 200"));

  // Two clients that send one byte of a request every 0.5 s, and 200 that connect and say nothing.
  std::atomic<bool> stop{false};
  std::vector<std::thread> tricklers;
  for (int i = 0; i < 2; ++i) {
    tricklers.emplace_back([port, &stop] {
      while (!stop.load()) {
        const int fd = Connect(port);
        for (int sent = 0; fd >= 0 && !stop.load() && sent < 1000; ++sent) {
          if (send(fd, "G", 1, MSG_NOSIGNAL) != 1) break;
          absl::SleepFor(absl::Milliseconds(500));
        }
        if (fd >= 0) close(fd);
      }
    });
  }
  std::vector<int> idle;
  for (int i = 0; i < 200; ++i) {
    const int fd = Connect(port);
    if (fd >= 0) idle.push_back(fd);
  }
  absl::SleepFor(absl::Milliseconds(200));

  // Every scrape answers within a second.
  for (int i = 0; i < 5; ++i) {
    const absl::Time start = absl::Now();
    const std::string answer = Scrape(port, absl::Seconds(3));
    EXPECT_THAT(answer, HasSubstr("HTTP/1.1 200")) << "scrape " << i;
    EXPECT_THAT(answer, HasSubstr("epfabric_"));
    EXPECT_LT(absl::Now() - start, absl::Seconds(1)) << "scrape " << i;
  }
  stop = true;
  for (std::thread& t : tricklers) t.join();
  for (int fd : idle) close(fd);
}

}  // namespace
}  // namespace epfabric::testing
