#include "epfabric/common/fd_passing.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace epfabric::common {
namespace {

using ::testing::HasSubstr;

struct SocketPair {
  UniqueFd a;
  UniqueFd b;
};

SocketPair MakeSocketPair() {
  int fds[2] = {-1, -1};
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  return {UniqueFd(fds[0]), UniqueFd(fds[1])};
}

struct Pipe {
  UniqueFd read;
  UniqueFd write;
};

Pipe MakePipe() {
  int fds[2] = {-1, -1};
  EXPECT_EQ(pipe2(fds, O_CLOEXEC), 0);
  return {UniqueFd(fds[0]), UniqueFd(fds[1])};
}

int OpenFdCount() {
  int count = 0;
  for (int fd = 0; fd < 1024; ++fd) {
    if (fcntl(fd, F_GETFD) != -1) ++count;
  }
  return count;
}

TEST(FdPassingTest, SendsDescriptorsAndPayload) {
  SocketPair sockets = MakeSocketPair();
  Pipe first = MakePipe();
  Pipe second = MakePipe();
  ASSERT_TRUE(
      SendFds(sockets.a.get(), {first.write.get(), second.read.get()}, "descriptor bytes", absl::Seconds(1)).ok());

  absl::StatusOr<ReceivedFds> received = ReceiveFds(sockets.b.get(), absl::Seconds(1));
  ASSERT_TRUE(received.ok()) << received.status();
  EXPECT_EQ(received->payload, "descriptor bytes");
  ASSERT_EQ(received->fds.size(), 2u);
  // New descriptor numbers for the same open files: what is written through one arrives at the other end.
  EXPECT_NE(received->fds[0].get(), first.write.get());
  EXPECT_EQ(fcntl(received->fds[0].get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  ASSERT_EQ(write(received->fds[0].get(), "x", 1), 1);
  char byte = 0;
  ASSERT_EQ(read(first.read.get(), &byte, 1), 1);
  EXPECT_EQ(byte, 'x');
  ASSERT_EQ(write(second.write.get(), "y", 1), 1);
  ASSERT_EQ(read(received->fds[1].get(), &byte, 1), 1);
  EXPECT_EQ(byte, 'y');
}

TEST(FdPassingTest, PayloadOnlyAndDescriptorsOnly) {
  SocketPair sockets = MakeSocketPair();
  ASSERT_TRUE(SendFds(sockets.a.get(), {}, "just text", absl::Seconds(1)).ok());
  Pipe pipe = MakePipe();
  ASSERT_TRUE(SendFds(sockets.a.get(), {pipe.write.get()}, "", absl::Seconds(1)).ok());

  absl::StatusOr<ReceivedFds> text = ReceiveFds(sockets.b.get(), absl::Seconds(1));
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(text->payload, "just text");
  EXPECT_TRUE(text->fds.empty());
  // The second message's descriptor is not mixed into the first.
  absl::StatusOr<ReceivedFds> fd_only = ReceiveFds(sockets.b.get(), absl::Seconds(1));
  ASSERT_TRUE(fd_only.ok()) << fd_only.status();
  EXPECT_EQ(fd_only->payload, "");
  EXPECT_EQ(fd_only->fds.size(), 1u);
}

TEST(FdPassingTest, LargePayloadCrossesManyWrites) {
  SocketPair sockets = MakeSocketPair();
  // Larger than the default socket buffer on some systems when doubled; the receiver reads concurrently.
  const std::string payload(kMaxPassedPayloadBytes, 'p');
  Pipe pipe = MakePipe();
  absl::StatusOr<ReceivedFds> received;
  std::thread receiver([&] { received = ReceiveFds(sockets.b.get(), absl::Seconds(5)); });
  absl::Status sent = SendFds(sockets.a.get(), {pipe.read.get()}, payload, absl::Seconds(5));
  receiver.join();
  ASSERT_TRUE(sent.ok()) << sent;
  ASSERT_TRUE(received.ok()) << received.status();
  EXPECT_EQ(received->payload, payload);
  EXPECT_EQ(received->fds.size(), 1u);
}

TEST(FdPassingTest, InfiniteTimeoutWaitsForTheMessage) {
  SocketPair sockets = MakeSocketPair();
  std::thread sender([&] {
    absl::SleepFor(absl::Milliseconds(20));
    (void)SendFds(sockets.a.get(), {}, "late", absl::InfiniteDuration());
  });
  absl::StatusOr<ReceivedFds> received = ReceiveFds(sockets.b.get(), absl::InfiniteDuration());
  sender.join();
  ASSERT_TRUE(received.ok()) << received.status();
  EXPECT_EQ(received->payload, "late");
}

TEST(FdPassingTest, ReceiveTimesOut) {
  SocketPair sockets = MakeSocketPair();
  const absl::Time start = absl::Now();
  absl::StatusOr<ReceivedFds> received = ReceiveFds(sockets.b.get(), absl::Milliseconds(50));
  EXPECT_TRUE(absl::IsDeadlineExceeded(received.status())) << received.status();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(45));
}

TEST(FdPassingTest, SendTimesOutWhenNobodyReads) {
  SocketPair sockets = MakeSocketPair();
  const std::string payload(kMaxPassedPayloadBytes, 'p');
  absl::Status status;
  // Fill the socket buffers until a send cannot complete.
  for (int i = 0; i < 1000 && status.ok(); ++i) status = SendFds(sockets.a.get(), {}, payload, absl::Milliseconds(20));
  EXPECT_TRUE(absl::IsDeadlineExceeded(status)) << status;
}

TEST(FdPassingTest, PeerClosedIsUnavailable) {
  SocketPair sockets = MakeSocketPair();
  sockets.a.reset();
  absl::StatusOr<ReceivedFds> received = ReceiveFds(sockets.b.get(), absl::Seconds(1));
  EXPECT_TRUE(absl::IsUnavailable(received.status())) << received.status();
  absl::Status sent = SendFds(sockets.b.get(), {}, "x", absl::Seconds(1));
  EXPECT_TRUE(absl::IsUnavailable(sent)) << sent;  // and no SIGPIPE killed the test
}

TEST(FdPassingTest, PeerClosedMidMessage) {
  SocketPair sockets = MakeSocketPair();
  const unsigned char partial[] = {10, 0, 0, 0, 'a', 'b'};  // announces 10 bytes, sends 2
  ASSERT_EQ(write(sockets.a.get(), partial, sizeof(partial)), static_cast<ssize_t>(sizeof(partial)));
  sockets.a.reset();
  absl::StatusOr<ReceivedFds> received = ReceiveFds(sockets.b.get(), absl::Seconds(1));
  EXPECT_TRUE(absl::IsUnavailable(received.status())) << received.status();
  EXPECT_THAT(received.status().message(), HasSubstr("after 6 bytes"));
}

TEST(FdPassingTest, TooManyDescriptorsAreRefusedAndClosed) {
  SocketPair sockets = MakeSocketPair();
  Pipe pipe = MakePipe();
  const int before = OpenFdCount();
  ASSERT_TRUE(
      SendFds(sockets.a.get(), {pipe.read.get(), pipe.write.get(), pipe.read.get()}, "three", absl::Seconds(1)).ok());
  absl::StatusOr<ReceivedFds> received = ReceiveFds(sockets.b.get(), absl::Seconds(1), /*max_fds=*/2);
  EXPECT_TRUE(absl::IsResourceExhausted(received.status())) << received.status();
  EXPECT_THAT(received.status().message(), HasSubstr("max_fds=2"));
  EXPECT_EQ(OpenFdCount(), before);  // nothing leaked
}

TEST(FdPassingTest, OversizedPayloadIsRefusedAndDescriptorsClosed) {
  SocketPair sockets = MakeSocketPair();
  Pipe pipe = MakePipe();
  const int before = OpenFdCount();
  ASSERT_TRUE(SendFds(sockets.a.get(), {pipe.read.get()}, std::string(100, 'x'), absl::Seconds(1)).ok());
  absl::StatusOr<ReceivedFds> received = ReceiveFds(sockets.b.get(), absl::Seconds(1), kMaxPassedFds, 10);
  EXPECT_TRUE(absl::IsResourceExhausted(received.status())) << received.status();
  EXPECT_THAT(received.status().message(), HasSubstr("100 bytes"));
  EXPECT_EQ(OpenFdCount(), before);
}

TEST(FdPassingTest, SendRefusesBadArguments) {
  SocketPair sockets = MakeSocketPair();
  std::vector<int> many(kMaxPassedFds + 1, sockets.a.get());
  EXPECT_TRUE(absl::IsInvalidArgument(SendFds(sockets.a.get(), many, "", absl::Seconds(1))));
  EXPECT_TRUE(absl::IsInvalidArgument(SendFds(sockets.a.get(), {-1}, "", absl::Seconds(1))));
  EXPECT_TRUE(absl::IsInvalidArgument(
      SendFds(sockets.a.get(), {}, std::string(kMaxPassedPayloadBytes + 1, 'x'), absl::Seconds(1))));
}

TEST(FdPassingTest, PeerCredentialsAreThisProcess) {
  SocketPair sockets = MakeSocketPair();
  absl::StatusOr<PeerCredentials> credentials = GetPeerCredentials(sockets.b.get());
  ASSERT_TRUE(credentials.ok()) << credentials.status();
  EXPECT_EQ(credentials->pid, getpid());
  EXPECT_EQ(credentials->uid, getuid());
  EXPECT_EQ(credentials->gid, getgid());
}

TEST(FdPassingTest, PeerCredentialsOfANonSocketFail) {
  Pipe pipe = MakePipe();
  absl::StatusOr<PeerCredentials> credentials = GetPeerCredentials(pipe.read.get());
  EXPECT_FALSE(credentials.ok());
  EXPECT_THAT(credentials.status().message(), HasSubstr("SO_PEERCRED"));
}

TEST(UniqueFdTest, ClosesAndReleases) {
  Pipe pipe = MakePipe();
  const int raw = pipe.read.get();
  {
    UniqueFd moved = std::move(pipe.read);
    EXPECT_FALSE(pipe.read.valid());
    EXPECT_EQ(moved.get(), raw);
  }
  EXPECT_EQ(fcntl(raw, F_GETFD), -1);  // closed when `moved` went away
  const int kept = pipe.write.release();
  EXPECT_NE(fcntl(kept, F_GETFD), -1);
  close(kept);
}

}  // namespace
}  // namespace epfabric::common
