// The transport's command rings in one process: the host issuer (kernels/transport/issuer.h) against the daemon's
// CommandRing (daemon/transport/command_ring.h) with a fake link, and the command checks. What the socket wire adds is
// covered by tests/integration/transport_test.cc.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "epfabric/kernels/transport/issuer.h"
#include "transport/command_check.h"
#include "transport/command_ring.h"

namespace epfabric::daemon::transport {
namespace {

using kernels::transport::RingBytes;
using kernels::transport::RingControl;
using kernels::transport::RingIssuer;
using ::testing::HasSubstr;

// Records what the proxy posts; completes on demand (or at once).
class FakeLink : public GroupLink {
 public:
  struct Posted {
    bool put;
    int dst;
    uint64_t dst_offset, src_offset, arg, cookie;
  };
  absl::Status Connect(const std::vector<v1::TransportEndpoint>&) override { return absl::OkStatus(); }
  void Put(int, int dst, uint64_t dst_offset, uint64_t src_offset, uint64_t bytes, uint64_t cookie) override {
    Record({true, dst, dst_offset, src_offset, bytes, cookie});
  }
  void SignalAdd(int, int dst, uint64_t dst_offset, int64_t value, uint64_t cookie) override {
    Record({false, dst, dst_offset, 0, static_cast<uint64_t>(value), cookie});
  }
  void Shutdown() override {}

  void Record(const Posted& p) {
    std::lock_guard<std::mutex> lock(mutex);
    posted.push_back(p);
    if (ring != nullptr && complete_at_once) ring->Complete(p.cookie, absl::OkStatus());
  }
  std::mutex mutex;
  std::vector<Posted> posted;
  CommandRing* ring = nullptr;
  bool complete_at_once = true;
};

class RingTest : public ::testing::Test {
 protected:
  static constexpr uint32_t kSlots = 16;
  void SetUp() override {
    memory_.assign(RingBytes(kSlots) / 8 + 1, 0);
    ring_ = std::make_unique<CommandRing>(memory_.data(), 0, kSlots);
    ring_->Initialize();
    link_.ring = ring_.get();
    bounds_.self_rank = 0;
    bounds_.region_bytes = {1 << 20, 1 << 20, 4096};
    auto issuer = RingIssuer::Create(memory_.data(), 0, kSlots);
    ASSERT_TRUE(issuer.ok()) << issuer.status();
    issuer_.emplace(*issuer);
  }
  RingControl& control() { return *reinterpret_cast<RingControl*>(memory_.data()); }
  int Poll(int budget = 1000) { return ring_->Poll(&link_, bounds_, budget); }

  std::vector<uint64_t> memory_;
  std::unique_ptr<CommandRing> ring_;
  FakeLink link_;
  CommandBounds bounds_;
  std::optional<RingIssuer> issuer_;
};

TEST_F(RingTest, CommandsArriveInOrderAndQuietSeesThemComplete) {
  ASSERT_TRUE(issuer_->Put(1, 64, 128, 100).ok());
  ASSERT_TRUE(issuer_->SignalAdd(2, 8, -5).ok());
  EXPECT_EQ(Poll(), 2);
  ASSERT_EQ(link_.posted.size(), 2u);
  EXPECT_TRUE(link_.posted[0].put);
  EXPECT_EQ(link_.posted[0].dst, 1);
  EXPECT_EQ(link_.posted[0].dst_offset, 64u);
  EXPECT_EQ(link_.posted[0].src_offset, 128u);
  EXPECT_EQ(link_.posted[0].arg, 100u);
  EXPECT_FALSE(link_.posted[1].put);
  EXPECT_EQ(static_cast<int64_t>(link_.posted[1].arg), -5);
  EXPECT_TRUE(issuer_->Quiet(absl::Milliseconds(100)).ok());
  EXPECT_EQ(control().completed, 2u);
  EXPECT_EQ(control().waiting_rank, -1);
}

TEST_F(RingTest, CompletedIsAPrefixAndNamesWhomItWaitsFor) {
  link_.complete_at_once = false;
  ASSERT_TRUE(issuer_->Put(1, 0, 0, 8).ok());
  ASSERT_TRUE(issuer_->Put(2, 0, 0, 8).ok());
  EXPECT_EQ(Poll(), 2);
  ring_->Complete(link_.posted[1].cookie, absl::OkStatus());  // the second first
  EXPECT_EQ(control().completed, 0u);
  EXPECT_EQ(control().waiting_rank, 1);
  const absl::Status waited = issuer_->Quiet(absl::Milliseconds(20));
  EXPECT_TRUE(absl::IsDeadlineExceeded(waited)) << waited;
  EXPECT_THAT(waited.ToString(), HasSubstr("waiting on rank 1"));
  ring_->Complete(link_.posted[0].cookie, absl::OkStatus());
  EXPECT_EQ(control().completed, 2u);
  EXPECT_TRUE(issuer_->Quiet(absl::Milliseconds(20)).ok());
}

TEST_F(RingTest, AFullRingMakesTheIssuerWaitThenGoOn) {
  link_.complete_at_once = false;
  for (uint32_t i = 0; i < kSlots; ++i) ASSERT_TRUE(issuer_->Put(1, 0, 0, 8).ok());
  // The ring is full until the proxy consumes; consuming frees the slots even before completion, but the proxy takes
  // at most `slots` commands in flight.
  const absl::Status full = issuer_->Put(1, 0, 0, 8, absl::Milliseconds(20));
  EXPECT_TRUE(absl::IsDeadlineExceeded(full)) << full;
  EXPECT_THAT(full.ToString(), HasSubstr("no free slot"));
  // The timed-out call reserved nothing: once the proxy drains the ring, the next command goes on and quiet covers
  // every command issued (a reserved, never-written slot would stop the proxy and make this quiet time out).
  EXPECT_EQ(issuer_->issued(), kSlots);
  EXPECT_EQ(Poll(), static_cast<int>(kSlots));
  for (const FakeLink::Posted& posted : link_.posted) ring_->Complete(posted.cookie, absl::OkStatus());
  ASSERT_TRUE(issuer_->SignalAdd(2, 8, 1, absl::Milliseconds(100)).ok());
  EXPECT_EQ(Poll(), 1);
  ASSERT_EQ(link_.posted.size(), kSlots + 1);
  EXPECT_FALSE(link_.posted.back().put);
  ring_->Complete(link_.posted.back().cookie, absl::OkStatus());
  EXPECT_TRUE(issuer_->Quiet(absl::Milliseconds(100)).ok());
  EXPECT_EQ(control().completed, kSlots + 1);
}

TEST_F(RingTest, ManyThreadsManyLapsEveryCommandOnce) {
  std::atomic<bool> stop{false};
  std::thread proxy([&] {
    while (!stop.load()) Poll(8);
    Poll();
  });
  constexpr int kThreads = 4, kPerThread = 2000;
  std::vector<std::thread> issuers;
  for (int t = 0; t < kThreads; ++t) {
    issuers.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) ASSERT_TRUE(issuer_->SignalAdd(1, 8, t * kPerThread + i + 1).ok());
    });
  }
  for (auto& t : issuers) t.join();
  ASSERT_TRUE(issuer_->Quiet(absl::Seconds(10)).ok());
  stop = true;
  proxy.join();
  ASSERT_EQ(link_.posted.size(), static_cast<size_t>(kThreads * kPerThread));
  std::vector<int> seen(kThreads * kPerThread + 1, 0);
  for (const auto& p : link_.posted) ++seen.at(p.arg);
  for (int v = 1; v <= kThreads * kPerThread; ++v) ASSERT_EQ(seen[v], 1) << "value " << v;
}

TEST_F(RingTest, ARefusedCommandStopsTheRingAndIsReportedByQuiet) {
  ASSERT_TRUE(issuer_->Put(2, 4000, 0, 200).ok());  // rank 2's region has 4096 bytes
  ASSERT_TRUE(issuer_->Put(1, 0, 0, 8).ok());       // valid, but after the failure: skipped
  EXPECT_EQ(Poll(), 2);
  EXPECT_TRUE(link_.posted.empty()) << "nothing may be executed after a refused command";
  const absl::Status quiet = issuer_->Quiet(absl::Milliseconds(100));
  EXPECT_TRUE(absl::IsInvalidArgument(quiet)) << quiet;
  EXPECT_THAT(quiet.ToString(), HasSubstr("command 0 (to rank 2): destination range ends at 4200"));
  EXPECT_EQ(ring_->counters().refused, 1u);
  EXPECT_EQ(ring_->counters().skipped, 1u);
  EXPECT_FALSE(issuer_->Put(1, 0, 0, 8).ok()) << "issuing on a failed ring must report the failure";
}

TEST_F(RingTest, APeerLossFailsTheRingNamingThePeer) {
  link_.complete_at_once = false;
  ASSERT_TRUE(issuer_->Put(1, 0, 0, 8).ok());
  Poll();
  ring_->Complete(link_.posted[0].cookie, absl::UnavailableError("connection reset"));
  const absl::Status quiet = issuer_->Quiet(absl::Milliseconds(100));
  EXPECT_TRUE(absl::IsUnavailable(quiet)) << quiet;
  EXPECT_THAT(quiet.ToString(), HasSubstr("rank 1 is unreachable"));
}

TEST_F(RingTest, AnOverwrittenSlotStampStopsTheRing) {
  kernels::transport::Command* slots = reinterpret_cast<kernels::transport::Command*>(memory_.data() + 32);
  slots[0].stamp = 77;  // neither the expected index nor the previous lap
  EXPECT_EQ(Poll(), 0);
  EXPECT_TRUE(absl::IsDataLoss(issuer_->Quiet(absl::Milliseconds(50))));
}

TEST_F(RingTest, StopAndResetStartAFreshGenerationAndIgnoreLateCompletions) {
  link_.complete_at_once = false;
  ASSERT_TRUE(issuer_->Put(1, 0, 0, 8).ok());
  Poll();
  EXPECT_FALSE(ring_->Stop(absl::Milliseconds(10))) << "one command was still in flight";
  std::memset(memory_.data(), 0, RingBytes(kSlots));
  ring_->Reset();
  ring_->Complete(link_.posted[0].cookie, absl::OkStatus());  // from the old generation: ignored
  EXPECT_EQ(control().completed, 0u);
  auto fresh = RingIssuer::Create(memory_.data(), 0, kSlots);
  ASSERT_TRUE(fresh.ok());
  link_.complete_at_once = true;
  ASSERT_TRUE(fresh->Put(1, 0, 0, 8).ok());
  EXPECT_EQ(Poll(), 1);
  EXPECT_TRUE(fresh->Quiet(absl::Milliseconds(100)).ok());
}

TEST(CommandCheck, RefusesEverythingOutsideTheGroupsRegions) {
  CommandBounds bounds;
  bounds.self_rank = 0;
  bounds.region_bytes = {1000, 2000};
  auto put = [](int dst, uint64_t dst_offset, uint64_t src_offset, uint64_t bytes) {
    Command c = {};
    c.opcode = static_cast<uint8_t>(Opcode::kPut);
    c.dst_rank = static_cast<uint16_t>(dst);
    c.dst_offset = dst_offset;
    c.src_offset = src_offset;
    c.arg = bytes;
    return c;
  };
  EXPECT_FALSE(CheckCommand(put(1, 1999, 999, 1), bounds).has_value());
  EXPECT_EQ(CheckCommand(put(1, 1999, 0, 2), bounds)->code, RingErrorCode::kDestOutOfRange);
  EXPECT_EQ(CheckCommand(put(1, 0, 999, 2), bounds)->code, RingErrorCode::kSourceOutOfRange);
  EXPECT_EQ(CheckCommand(put(1, UINT64_MAX - 1, 0, 4), bounds)->code, RingErrorCode::kDestOutOfRange);
  EXPECT_EQ(CheckCommand(put(1, 0, 4, UINT64_MAX), bounds)->code, RingErrorCode::kSourceOutOfRange);
  EXPECT_EQ(CheckCommand(put(2, 0, 0, 1), bounds)->code, RingErrorCode::kBadRank);
  EXPECT_EQ(CheckCommand(put(1, 0, 0, 0), bounds)->code, RingErrorCode::kBadSize);
  Command signal = put(1, 12, 0, 1);
  signal.opcode = static_cast<uint8_t>(Opcode::kSignalAdd);
  EXPECT_EQ(CheckCommand(signal, bounds)->code, RingErrorCode::kMisaligned);
  signal.dst_offset = 1992;
  EXPECT_FALSE(CheckCommand(signal, bounds).has_value());
  signal.dst_offset = 2000;
  EXPECT_EQ(CheckCommand(signal, bounds)->code, RingErrorCode::kDestOutOfRange);
  Command junk = put(1, 0, 0, 1);
  junk.opcode = 9;
  EXPECT_EQ(CheckCommand(junk, bounds)->code, RingErrorCode::kBadOpcode);
}

// Random commands against an independent model of the rules.
TEST(CommandCheck, AgreesWithAModelOnRandomCommands) {
  std::mt19937_64 rng(7);
  CommandBounds bounds;
  bounds.self_rank = 1;
  bounds.region_bytes = {4096, 8192, 100};
  for (int i = 0; i < 100000; ++i) {
    Command c = {};
    c.opcode = static_cast<uint8_t>(rng() % 4);
    c.dst_rank = static_cast<uint16_t>(rng() % 4);
    const uint64_t pick = rng() % 3;
    c.dst_offset = pick == 0 ? rng() : rng() % 9000;
    c.src_offset = pick == 1 ? rng() : rng() % 9000;
    c.arg = pick == 2 ? rng() : rng() % 9000;
    bool valid = false;
    if (c.dst_rank < 3 && c.opcode == 1) {
      const unsigned __int128 dst_end = static_cast<unsigned __int128>(c.dst_offset) + c.arg;
      const unsigned __int128 src_end = static_cast<unsigned __int128>(c.src_offset) + c.arg;
      valid = c.arg > 0 && dst_end <= bounds.region_bytes[c.dst_rank] && src_end <= 8192;
    } else if (c.dst_rank < 3 && c.opcode == 2) {
      valid = c.dst_offset % 8 == 0 && c.dst_offset + 8 <= bounds.region_bytes[c.dst_rank];
    }
    ASSERT_EQ(!CheckCommand(c, bounds).has_value(), valid)
        << "opcode " << int(c.opcode) << " rank " << c.dst_rank << " dst " << c.dst_offset << " src " << c.src_offset
        << " arg " << c.arg;
  }
}

}  // namespace
}  // namespace epfabric::daemon::transport
