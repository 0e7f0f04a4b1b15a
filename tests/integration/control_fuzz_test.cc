// Fuzzes the client-facing surfaces of a live fabric (issue #14): every Control and Ops method on the client socket
// and the fd side channel, with mutated valid requests (proto_mutator.h) and, on the side channel, raw garbage
// frames. Afterwards every daemon is alive and answers, a clean Attach of the seed group still works, and what the
// fuzzing created can be deleted. Time-boxed: EPF_FUZZ_SECONDS (default 8) per surface; the sanitizer builds run it
// too.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "epfabric/common/fd_passing.h"
#include "epfabric/v1/control.grpc.pb.h"
#include "epfabric/v1/fdchannel.pb.h"
#include "epfabric/v1/ops.grpc.pb.h"
#include "integration/fabric_under_test.h"
#include "integration/proto_mutator.h"

namespace epfabric::testing {
namespace {

absl::Duration Budget() {
  const char* env = std::getenv("EPF_FUZZ_SECONDS");
  return absl::Seconds(env != nullptr ? std::atoi(env) : 8);
}

class ControlFuzz : public ::testing::Test {
 protected:
  void SetUp() override {
    // Quotas keep what valid-looking mutations create small; the fuzzing must not be able to exhaust the machine.
    auto fabric = FabricUnderTest::Start(
        2, {"--heartbeat_ms=100", "--heartbeat_misses=10", "--max_groups=32", "--max_total_region_bytes=67108864"});
    ASSERT_TRUE(fabric.ok()) << fabric.status();
    fabric_ = std::move(*fabric);
    ASSERT_TRUE(fabric_->WaitComplete().ok());
    create_.set_name("seed");
    for (int r : {0, 1}) create_.add_ranks(r);
    create_.set_num_nvl_bytes(1 << 16);
    create_.set_num_rdma_bytes(1 << 16);
    grpc::ClientContext context;
    v1::CreateGroupResponse created;
    ASSERT_TRUE(fabric_->Control(0)->CreateGroup(&context, create_, &created).ok());
    token_ = created.token();
  }

  // After fuzzing: every daemon alive and answering, a clean Attach of the seed group works.
  void ExpectHealthy() {
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_TRUE(fabric_->daemon(rank).process().running()) << "rank " << rank << " died:\n"
                                                             << fabric_->daemon(rank).process().Stderr();
      EXPECT_TRUE(fabric_->Fabric(rank).ok()) << "rank " << rank << " does not answer";
    }
    v1::AttachRequest attach;
    attach.set_group("seed");
    attach.set_rank(1);
    attach.set_token(token_);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::AttachResponse attached;
    const grpc::Status status = fabric_->Control(1)->Attach(&context, attach, &attached);
    EXPECT_TRUE(status.ok() || status.error_code() == grpc::StatusCode::FAILED_PRECONDITION)
        << "a clean Attach after fuzzing: " << status.error_message();
  }

  std::unique_ptr<FabricUnderTest> fabric_;
  v1::CreateGroupRequest create_;
  std::string token_;
};

TEST_F(ControlFuzz, MutatedControlAndOpsRequestsCrashNothing) {
  Mutator mutator(0xc0de ^ static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())));
  v1::DeleteGroupRequest remove;
  remove.set_name("seed");
  remove.set_token(token_);
  v1::AttachRequest attach;
  attach.set_group("seed");
  attach.set_rank(0);
  attach.set_token(token_);
  attach.set_client_name("fuzz");
  v1::DetachRequest detach;
  detach.set_lease_id("0123456789abcdef0123456789abcdef");
  v1::KeepAliveRequest keep;
  keep.set_lease_id("0123456789abcdef0123456789abcdef");
  v1::GetStatsRequest stats;
  stats.set_group("seed");
  std::map<std::string, int> sent;
  auto stubs = std::make_pair(fabric_->Control(0), fabric_->Ops(0));
  const absl::Time deadline = absl::Now() + Budget();
  while (absl::Now() < deadline) {
    auto mutate = [&](auto seed) {
      for (int i = 1 + mutator.Pick(3); i > 0; --i) mutator.Mutate(&seed);
      return seed;
    };
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
    switch (mutator.Pick(11)) {
      case 0: {
        v1::CreateGroupRequest request = mutate(create_);
        if (request.name() == "seed") request.set_name("fuzzed");  // the seed group stays for the final check
        v1::CreateGroupResponse out;
        (void)stubs.first->CreateGroup(&context, request, &out);
        ++sent["CreateGroup"];
        break;
      }
      case 1: {
        v1::DeleteGroupRequest request = mutate(remove);
        if (request.name() == "seed") request.set_name("fuzzed");
        v1::DeleteGroupResponse out;
        (void)stubs.first->DeleteGroup(&context, request, &out);
        ++sent["DeleteGroup"];
        break;
      }
      case 2: {
        v1::ListGroupsResponse out;
        (void)stubs.first->ListGroups(&context, mutate(v1::ListGroupsRequest()), &out);
        ++sent["ListGroups"];
        break;
      }
      case 3: {
        v1::AttachResponse out;
        if (stubs.first->Attach(&context, mutate(attach), &out).ok()) {
          // Keep the seed rank free: end what a mutation managed to attach.
          grpc::ClientContext end;
          v1::DetachRequest request;
          request.set_lease_id(out.lease_id());
          v1::DetachResponse ignored;
          (void)fabric_->Control(0)->Detach(&end, request, &ignored);
        }
        ++sent["Attach"];
        break;
      }
      case 4: {
        v1::DetachResponse out;
        (void)stubs.first->Detach(&context, mutate(detach), &out);
        ++sent["Detach"];
        break;
      }
      case 5: {
        v1::KeepAliveResponse out;
        (void)stubs.first->KeepAlive(&context, mutate(keep), &out);
        ++sent["KeepAlive"];
        break;
      }
      case 6: {
        v1::Topology out;
        (void)stubs.second->GetTopology(&context, mutate(v1::GetTopologyRequest()), &out);
        ++sent["GetTopology"];
        break;
      }
      case 7: {
        v1::HealthReport out;
        (void)stubs.second->GetHealth(&context, mutate(v1::GetHealthRequest()), &out);
        ++sent["GetHealth"];
        break;
      }
      case 8: {
        v1::Stats out;
        (void)stubs.second->GetStats(&context, mutate(stats), &out);
        ++sent["GetStats"];
        break;
      }
      case 9: {
        v1::ListClientsResponse out;
        (void)stubs.second->ListClients(&context, mutate(v1::ListClientsRequest()), &out);
        ++sent["ListClients"];
        break;
      }
      default: {
        v1::FabricView out;
        (void)stubs.second->GetFabric(&context, mutate(v1::GetFabricRequest()), &out);
        ++sent["GetFabric"];
        break;
      }
    }
  }
  int total = 0;
  for (const auto& [name, count] : sent) total += count;
  std::cout << "[ FUZZ     ] " << total << " mutated Control/Ops requests in " << absl::FormatDuration(Budget()) << ":";
  for (const auto& [name, count] : sent) std::cout << " " << name << "=" << count;
  std::cout << "\n";
  EXPECT_GT(total, 100);
  ExpectHealthy();
}

// The fd side channel: mutated FdRequests (framed as the protocol says) and raw garbage (any length prefix, bytes
// that are not a message, a connection closed mid-frame). Every connection gets an error answer or is closed.
TEST_F(ControlFuzz, MutatedAndGarbageFdChannelFramesCrashNothing) {
  Mutator mutator(0xfd ^ static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())));
  std::mt19937_64 rng(mutator.Pick(1 << 30));
  const std::string path = fabric_->daemon(0).socket() + ".fds";
  v1::FdRequest seed;
  seed.set_group("seed");
  seed.set_rank(0);
  seed.set_kind(v1::RegionDescriptor::KIND_NVL);
  seed.set_token(token_);
  int requests = 0, answers = 0;
  const absl::Time deadline = absl::Now() + Budget();
  while (absl::Now() < deadline) {
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address = {};
    address.sun_family = AF_UNIX;
    std::snprintf(address.sun_path, sizeof(address.sun_path), "%s", path.c_str());
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0) << path;
    for (int i = 0, n = 1 + mutator.Pick(4); i < n; ++i) {
      ++requests;
      if (mutator.Pick(4) == 0) {
        // Garbage: a random length prefix and random bytes (possibly fewer than announced), no descriptors.
        std::string frame(4 + static_cast<size_t>(mutator.Pick(64)), '\0');
        for (char& c : frame) c = static_cast<char>(rng());
        (void)send(fd, frame.data(), frame.size(), MSG_NOSIGNAL);
        break;  // the daemon may now wait for the rest of the frame: close
      }
      v1::FdRequest request = seed;
      for (int m = 1 + mutator.Pick(3); m > 0; --m) mutator.Mutate(&request);
      if (!common::SendFds(fd, {}, request.SerializeAsString(), absl::Seconds(2)).ok()) break;
      auto answer = common::ReceiveFds(fd, absl::Seconds(6));
      if (!answer.ok()) break;
      ++answers;
    }
    close(fd);
  }
  std::cout << "[ FUZZ     ] " << requests << " fd-channel frames (" << answers << " answered) in "
            << absl::FormatDuration(Budget()) << "\n";
  EXPECT_GT(answers, 50);
  ExpectHealthy();
}

}  // namespace
}  // namespace epfabric::testing
