// The transport (issue #11) on its socket wire, through the product: 4 real epfabricd daemons (host backend) acting
// as 2 hosts × 2 ranks (--host_id), one epfabric_transport_worker process per rank driving its command rings.
// The workers check what arrives against the model of every source's command stream (tools/transport_worker/), and
// this test asserts on their result lines, the timing of failures, and what a stranger on the data port achieves.
// EPF_TRANSPORT=verbs runs the same suite with --transport=verbs on machines with RDMA NICs (docs/internode.md).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "integration/fabric_under_test.h"
#include "integration/subprocess.h"

namespace epfabric::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kRanks = 4;

const char* WorkerBinary() {
  const char* env = std::getenv("EPF_TRANSPORT_WORKER_BINARY");
  return env != nullptr && *env != '\0' ? env : EPF_TRANSPORT_WORKER_BINARY;
}

std::string TransportFlag() {
  const char* env = std::getenv("EPF_TRANSPORT");
  return absl::StrCat("--transport=", env != nullptr && *env != '\0' ? env : "socket");
}

// Ranks 0, 1 on host "a", ranks 2, 3 on host "b".
std::map<int, std::vector<std::string>> TwoHosts() {
  std::map<int, std::vector<std::string>> flags;
  for (int r = 0; r < kRanks; ++r) flags[r] = {absl::StrCat("--host_id=host-", r < 2 ? "a" : "b")};
  return flags;
}

absl::StatusOr<uint64_t> RegionBytes(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {WorkerBinary(), "--print_region_bytes"};
  argv.insert(argv.end(), args.begin(), args.end());
  RunResult run = RunBinary(argv);
  uint64_t bytes = 0;
  if (run.exit_code != 0 || !absl::SimpleAtoi(absl::StripAsciiWhitespace(run.out), &bytes)) {
    return absl::InternalError(absl::StrCat("--print_region_bytes: ", run.exit_code, " ", run.out, run.err));
  }
  return bytes;
}

class TransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::vector<std::string> flags = DataPathHeartbeatFlags();
    flags.push_back(TransportFlag());
    auto fabric = FabricUnderTest::Start(kRanks, flags, TwoHosts());
    ASSERT_TRUE(fabric.ok()) << fabric.status();
    fabric_ = std::move(*fabric);
    ASSERT_TRUE(fabric_->WaitComplete().ok());
  }

  // Creates `name` over `ranks` with an RDMA region of `rdma_bytes`; returns the token.
  std::string CreateGroup(const std::string& name, const std::vector<int>& ranks, uint64_t rdma_bytes,
                          uint32_t channels = 4, uint32_t slots = 0) {
    v1::CreateGroupRequest request;
    request.set_name(name);
    for (int r : ranks) request.add_ranks(r);
    request.set_num_nvl_bytes(4096);
    request.set_num_rdma_bytes(rdma_bytes);
    request.set_transport_channels(channels);
    request.set_ring_slots(slots);
    v1::CreateGroupResponse response;
    grpc::Status status;
    // ABORTED: a membership change (a member just went down) has not reached every member yet; the answer says
    // to retry.
    for (int attempt = 0; attempt < 20; ++attempt) {
      grpc::ClientContext context;
      status = fabric_->Control(0)->CreateGroup(&context, request, &response);
      if (status.error_code() != grpc::StatusCode::ABORTED) break;
      absl::SleepFor(absl::Milliseconds(100));
    }
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.token();
  }

  absl::StatusOr<Subprocess> StartWorker(int daemon, const std::string& group, int rank, const std::string& token,
                                         const std::vector<std::string>& args) {
    std::vector<std::string> argv = {WorkerBinary(), "--socket=" + fabric_->daemon(daemon).socket(), "--group=" + group,
                                     absl::StrCat("--rank=", rank), "--token=" + token};
    argv.insert(argv.end(), args.begin(), args.end());
    return Subprocess::Start(argv);
  }

  // Runs one worker per rank of a group over all four daemons and expects every one to succeed.
  void RunAll(const std::string& group, const std::string& token, const std::vector<std::string>& args,
              absl::Duration timeout = absl::Seconds(120)) {
    std::vector<Subprocess> workers;
    for (int r = 0; r < kRanks; ++r) {
      auto worker = StartWorker(r, group, r, token, args);
      ASSERT_TRUE(worker.ok()) << worker.status();
      workers.push_back(std::move(*worker));
    }
    for (int r = 0; r < kRanks; ++r) {
      auto code = workers[r].Wait(timeout);
      ASSERT_TRUE(code.ok()) << "rank " << r << ": " << code.status();
      EXPECT_EQ(*code, 0) << "rank " << r << ":\n" << workers[r].Stdout() << workers[r].Stderr();
      EXPECT_THAT(workers[r].Stdout(), HasSubstr("EPF_RESULT ok=1")) << workers[r].Stderr();
      std::cout << workers[r].Stdout();
    }
  }

  // A counter of daemon `rank`'s Ops.GetStats by series key; -1 when absent.
  int64_t Counter(int rank, const std::string& series) {
    grpc::ClientContext context;
    v1::Stats stats;
    if (!fabric_->Ops(rank)->GetStats(&context, v1::GetStatsRequest(), &stats).ok()) return -1;
    auto it = stats.counters().find(series);
    return it == stats.counters().end() ? -1 : static_cast<int64_t>(it->second);
  }

  std::unique_ptr<FabricUnderTest> fabric_;
};

// --transport=verbs where no RDMA device is usable: exit status 2 and one line saying what is missing.
TEST(TransportFlags, VerbsWithoutADeviceExitsWithStatus2) {
  const std::string dir = MakeTempDir();
  RunResult run = RunBinary({DaemonBinary(), "--client_socket=" + dir + "/d.sock", "--insecure_peer_port",
                             "--backend=host", "--transport=verbs"},
                            absl::Seconds(10));
  if (run.exit_code != 2 && !absl::StrContains(run.err, "--transport=verbs")) {
    GTEST_SKIP() << "this machine has a usable RDMA device (exit " << run.exit_code << ")";
  }
  EXPECT_EQ(run.exit_code, 2) << run.err;
  EXPECT_THAT(run.err, HasSubstr("--transport=verbs: no RDMA device"));
  EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
}

// Every member announces its wire; epctl shows it for the fabric and for one daemon.
TEST_F(TransportTest, EveryMemberShowsItsTransport) {
  auto view = fabric_->Fabric(3);
  ASSERT_TRUE(view.ok());
  for (const v1::MemberInfo& member : view->membership().members()) {
    EXPECT_EQ(member.transport(), v1::TRANSPORT_SOCKET) << "rank " << member.rank();
    EXPECT_THAT(member.data_address(), HasSubstr("127.0.0.1:")) << "rank " << member.rank();
  }
  RunResult fabric = RunBinary({EpctlBinary(), "--socket=" + fabric_->daemon(0).socket(), "fabric"});
  EXPECT_EQ(fabric.exit_code, 0) << fabric.err;
  EXPECT_THAT(fabric.out, HasSubstr("socket 127.0.0.1:"));
  RunResult topology = RunBinary({EpctlBinary(), "--socket=" + fabric_->daemon(2).socket(), "topology", "--json"});
  EXPECT_EQ(topology.exit_code, 0) << topology.err;
  EXPECT_THAT(topology.out, HasSubstr("\"transport\": \"TRANSPORT_SOCKET\""));
}

// The transport's CreateGroup fields are checked before anything is allocated.
TEST_F(TransportTest, BadChannelAndSlotCountsAreRefused) {
  const std::vector<std::pair<std::pair<uint32_t, uint32_t>, std::string>> cases = {
      {{33, 0}, "transport_channels: 33 is over the limit of 32"},
      {{4, 3}, "ring_slots: 3 is not a power of two"},
      {{4, 1u << 20}, "ring_slots: 1048576 is not a power of two in [16, 65536]"},
      {{4, 8}, "ring_slots: 8 is not a power of two in [16, 65536]"}};
  for (const auto& [counts, words] : cases) {
    v1::CreateGroupRequest request;
    request.set_name("bad-counts");
    for (int r : {0, 2}) request.add_ranks(r);
    request.set_num_nvl_bytes(4096);
    request.set_num_rdma_bytes(1 << 20);
    request.set_transport_channels(counts.first);
    request.set_ring_slots(counts.second);
    grpc::ClientContext context;
    v1::CreateGroupResponse response;
    const grpc::Status status = fabric_->Control(1)->CreateGroup(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << words;
    EXPECT_THAT(status.error_message(), HasSubstr(words));
  }
  EXPECT_EQ(fabric_->MemfdRegions(), 0) << "a refused create allocated something";
}

// 100 000 random commands (25 000 per rank over 4 channels at once), sizes 1 B .. 256 KiB at unaligned offsets, log
// records whose signals are checked to trail their puts, every byte of every inbox compared with the model.
TEST_F(TransportTest, RandomCommandsOnEveryChannelMatchTheModel) {
  auto bytes = RegionBytes({"--world=4", "--channels=4"});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  const std::string token = CreateGroup("conformance", {0, 1, 2, 3}, *bytes);
  RunAll("conformance", token, {"--commands=6250", "--seed=11"});
}

// The socket wire makes a (rank, channel) connection on its first command: creating a group starts none of the three
// threads each costs across the two daemons (all 3 peers x 4 channels would be 24 issuer threads on every daemon at
// once: groups of many ranks ran a host out of threads), and commands to every peer on every channel still land.
TEST_F(TransportTest, ConnectionsAreMadeOnFirstUse) {
  const Subprocess& daemon = fabric_->daemon(0).process();
  const int before = daemon.Threads();
  auto bytes = RegionBytes({"--world=4", "--channels=4"});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  const std::string token = CreateGroup("lazy", {0, 1, 2, 3}, *bytes);
  absl::SleepFor(absl::Milliseconds(200));  // what eager connections would have started by now
  const int after = daemon.Threads();
  ASSERT_GT(before, 0);
  EXPECT_LT(after - before, 6) << "threads before the group " << before << ", after " << after;
  RunAll("lazy", token, {"--commands=400", "--seed=13"});
  EXPECT_GT(daemon.Threads() - before, 6) << "the commands used every peer and channel";
}

// Rings of 16 slots: issuers keep finding them full and wait for the proxy. The group's name has the longest length
// allowed (64), which the data connections' handshake carries whole.
TEST_F(TransportTest, FullRingsMakeIssuersWaitNotFail) {
  auto bytes = RegionBytes({"--world=4", "--channels=2"});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  const std::string name(64, 'r');
  const std::string token = CreateGroup(name, {0, 1, 2, 3}, *bytes, /*channels=*/2, /*slots=*/16);
  RunAll(name, token, {"--commands=3000", "--seed=12"});
}

// Puts of 1 B, 7 B, 4 KiB + 3, 1 MiB + 1, 16 MiB and 64 MiB between the two hosts, each checked byte for byte.
TEST_F(TransportTest, PutsFromOneByteTo64MiB) {
  auto bytes = RegionBytes({"--world=2", "--channels=2", "--scenario=big"});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  const std::string token = CreateGroup("big", {1, 2}, *bytes, /*channels=*/2);
  auto a = StartWorker(1, "big", 0, token, {"--scenario=big"});
  auto b = StartWorker(2, "big", 1, token, {"--scenario=big"});
  ASSERT_TRUE(a.ok() && b.ok());
  for (Subprocess* w : {&*a, &*b}) {
    auto code = w->Wait(absl::Seconds(120));
    ASSERT_TRUE(code.ok());
    EXPECT_EQ(*code, 0) << w->Stdout() << w->Stderr();
    EXPECT_THAT(w->Stdout(), HasSubstr("EPF_BIG bytes=67108864"));
  }
}

// Refused commands: the issuer's quiet fails with INVALID_ARGUMENT naming the command, the ring executes nothing
// more, another channel of the same rank and the other ranks go on.
TEST_F(TransportTest, BadCommandsAreRefusedAndNameTheCommand) {
  auto bytes = RegionBytes({"--world=4", "--channels=4"});
  ASSERT_TRUE(bytes.ok());
  const std::string token = CreateGroup("bad", {0, 1, 2, 3}, *bytes);
  const std::map<std::string, std::string> expected = {{"dest_range", "destination range ends at"},
                                                       {"src_range", "source range ends at"},
                                                       {"rank", "is not a rank of the group"},
                                                       {"misaligned", "is not 8-byte aligned"}};
  int rank = 0;
  for (const auto& [bad, words] : expected) {
    auto worker = StartWorker(rank, "bad", rank, token, {"--scenario=bad", "--bad=" + bad});
    ASSERT_TRUE(worker.ok());
    auto code = worker->Wait(absl::Seconds(30));
    ASSERT_TRUE(code.ok());
    EXPECT_EQ(*code, 0) << bad << ": " << worker->Stdout() << worker->Stderr();
    EXPECT_THAT(worker->Stdout(), HasSubstr(words)) << bad;
    ++rank;
  }
  // Counted by each issuer's daemon.
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(Counter(r, "epfabric_transport_commands_total{group=\"bad\",outcome=\"refused\"}"), 1) << r;
  }
  // The same ranks attach again (the rings were reset at lease end) and run a clean round.
  RunAll("bad", token, {"--commands=500", "--seed=13"});
}

// A daemon killed mid-stream: the issuer's wait ends with UNAVAILABLE naming that rank within 2 s, and the issuer's
// daemon keeps serving.
TEST_F(TransportTest, KilledDestinationDaemonEndsTheIssuersWaitNamingIt) {
  auto bytes = RegionBytes({"--world=4", "--channels=4"});
  ASSERT_TRUE(bytes.ok());
  const std::string token = CreateGroup("killed", {0, 1, 2, 3}, *bytes);
  auto worker = StartWorker(0, "killed", 0, token, {"--scenario=stream", "--target=2", "--duration_ms=30000"});
  ASSERT_TRUE(worker.ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!absl::StrContains(worker->Stdout(), "EPF_STREAMING") && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(20));
  ASSERT_THAT(worker->Stdout(), HasSubstr("EPF_STREAMING"));
  const int64_t killed_ms = absl::ToUnixMillis(absl::Now());
  fabric_->Kill(2);
  auto code = worker->Wait(absl::Seconds(10));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 3) << worker->Stdout() << worker->Stderr();
  const std::string out = worker->Stdout();
  EXPECT_THAT(out, HasSubstr("code=UNAVAILABLE"));
  EXPECT_THAT(out, HasSubstr("rank 2"));
  int64_t failed_ms = 0;
  const size_t at = out.find("EPF_TRANSPORT_ERROR unix_ms=");
  ASSERT_NE(at, std::string::npos);
  ASSERT_TRUE(absl::SimpleAtoi(out.substr(at + 28, out.find(' ', at + 28) - at - 28), &failed_ms));
  std::cout << "kill to error: " << failed_ms - killed_ms << " ms\n";
  EXPECT_LT(failed_ms - killed_ms, 2000);
  auto view = fabric_->Fabric(0);
  EXPECT_TRUE(view.ok()) << "the issuer's daemon stopped answering: " << view.status();
  // No proxy thread hangs on the lost peer: the survivors' daemons run a new group's traffic, checked as above.
  view = fabric_->WaitView(
      0, [](const v1::FabricView& v) { return v.membership().members(2).state() == v1::MEMBER_STATE_DOWN; },
      absl::Seconds(10));
  ASSERT_TRUE(view.ok()) << view.status();
  auto bytes3 = RegionBytes({"--world=3", "--channels=4"});
  ASSERT_TRUE(bytes3.ok());
  const std::string survivors = CreateGroup("survivors", {0, 1, 3}, *bytes3);
  std::vector<Subprocess> workers;
  const int daemons[3] = {0, 1, 3};
  for (int r = 0; r < 3; ++r) {
    auto w = StartWorker(daemons[r], "survivors", r, survivors, {"--commands=1000", "--seed=21"});
    ASSERT_TRUE(w.ok()) << w.status();
    workers.push_back(std::move(*w));
  }
  for (int r = 0; r < 3; ++r) {
    auto done = workers[r].Wait(absl::Seconds(60));
    ASSERT_TRUE(done.ok()) << "rank " << r << " of the survivors' group did not finish";
    EXPECT_EQ(*done, 0) << workers[r].Stdout() << workers[r].Stderr();
  }
}

// A stopped (SIGSTOP) destination: the issuer's quiet is bounded and names the rank it waits on.
TEST_F(TransportTest, StoppedDestinationGivesABoundedWaitNamingIt) {
  auto bytes = RegionBytes({"--world=4", "--channels=4"});
  ASSERT_TRUE(bytes.ok());
  const std::string token = CreateGroup("stopped", {0, 1, 2, 3}, *bytes);
  auto worker = StartWorker(0, "stopped", 0, token,
                            {"--scenario=stream", "--target=3", "--duration_ms=30000", "--timeout_ms=1500"});
  ASSERT_TRUE(worker.ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!absl::StrContains(worker->Stdout(), "EPF_STREAMING") && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(20));
  ASSERT_THAT(worker->Stdout(), HasSubstr("EPF_STREAMING"));
  fabric_->daemon(3).process().Signal(SIGSTOP);
  auto code = worker->Wait(absl::Seconds(10));
  fabric_->daemon(3).process().Signal(SIGCONT);
  ASSERT_TRUE(code.ok()) << "the issuer's wait was not bounded";
  EXPECT_EQ(*code, 3) << worker->Stdout() << worker->Stderr();
  EXPECT_THAT(worker->Stdout(), HasSubstr("code=DEADLINE_EXCEEDED"));
  EXPECT_THAT(worker->Stdout(), HasSubstr("waiting on rank 3"));
}

// A stranger on the data port (no group key): a hello naming the group, a guessed proof and a put frame change
// nothing in the region, and the listener closes the connection.
TEST_F(TransportTest, AStrangerOnTheDataPortWritesNothing) {
  auto bytes = RegionBytes({"--world=4", "--channels=4"});
  ASSERT_TRUE(bytes.ok());
  const std::string token = CreateGroup("guarded", {0, 1, 2, 3}, *bytes);
  auto view = fabric_->Fabric(1);
  ASSERT_TRUE(view.ok());
  const std::string address = view->membership().members(1).data_address();
  ASSERT_FALSE(address.empty());
  std::vector<std::string> host_port = absl::StrSplit(address, ':');
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(host_port.back(), &port));
  for (int attempt = 0; attempt < 3; ++attempt) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in to = {};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<uint16_t>(port));
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0);
    // Hello (magic "EPFD", version 2, group, issuer 0, destination 1, channel 0, nonce), then a guessed proof, then
    // a put frame of 64 bytes at offset 0 and its payload.
    std::string hello(100, '\0');
    const uint32_t words[2] = {0x44465045, 2};
    std::memcpy(hello.data(), words, 8);
    std::memcpy(hello.data() + 8, "guarded", 7);
    const int32_t ranks[3] = {0, 1, 0};
    std::memcpy(hello.data() + 72, ranks, 12);
    std::string message = hello + std::string(64, attempt == 0 ? 'a' : '0');
    const uint64_t frame[4] = {1, 1, 0, 64};
    message.append(reinterpret_cast<const char*>(frame), sizeof(frame));
    message.append(64, '\x5a');
    (void)send(fd, message.data(), message.size(), MSG_NOSIGNAL);
    timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char sink[256];
    ssize_t got = 0;
    ssize_t r;
    while ((r = recv(fd, sink, sizeof(sink), 0)) > 0) got += r;
    const int error = r < 0 ? errno : 0;
    // Closed: an orderly end, or a reset because the listener closed with our unread frame still queued.
    EXPECT_TRUE(r == 0 || error == ECONNRESET) << "the listener did not close the connection: " << strerror(error);
    EXPECT_LE(got, 16 + 64) << "the listener answered more than its half of the handshake";
    close(fd);
  }
  EXPECT_EQ(Counter(1, "epfabric_transport_data_refusals_total{what=\"handshake\"}"), 3);
  EXPECT_EQ(Counter(1, "epfabric_transport_frames_applied_total"), 0);
  auto zero = StartWorker(1, "guarded", 1, token, {"--scenario=zero"});
  ASSERT_TRUE(zero.ok());
  auto code = zero->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0) << zero->Stdout() << zero->Stderr();
}

}  // namespace
}  // namespace epfabric::testing
