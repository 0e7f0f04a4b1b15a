// The socket wire's local copies (daemon/transport/local_copies.h): commands to the issuing member itself keep their
// order per channel, large puts are copied in pieces with memmove's meaning (overlaps included), a channel with
// nothing queued runs its command at once whatever other channels have queued, and Close fails what is queued.
#include <gtest/gtest.h>

#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "memory/region.h"
#include "transport/local_copies.h"

namespace epfabric::daemon::transport {
namespace {

class RecordingSink final : public CompletionSink {
 public:
  void Complete(uint64_t cookie, absl::Status status) override {
    std::lock_guard<std::mutex> lock(mutex);
    done.emplace_back(cookie, status);
  }
  size_t count() {
    std::lock_guard<std::mutex> lock(mutex);
    return done.size();
  }
  bool WaitFor(size_t n) {
    for (int i = 0; i < 20000 && count() < n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return count() >= n;
  }
  std::mutex mutex;
  std::vector<std::pair<uint64_t, absl::Status>> done;
};

std::shared_ptr<memory::Region> HostRegion(uint64_t bytes) {
  memory::RegionSpec spec;
  spec.group = "local-copies";
  spec.bytes = bytes;
  spec.kind = v1::RegionDescriptor::KIND_RDMA;
  auto region = memory::MakeHostAllocator("epf-test", 0)->Allocate(spec);
  EXPECT_TRUE(region.ok()) << region.status();
  return region.ok() ? std::shared_ptr<memory::Region>(std::move(*region)) : nullptr;
}

TEST(LocalCopies, PutsAndSignalsOfAChannelApplyInOrderLikeMemmove) {
  constexpr uint64_t kBytes = 48ull << 20;
  auto region = HostRegion(kBytes);
  ASSERT_NE(region, nullptr);
  auto* base = static_cast<uint8_t*>(region->base());
  std::mt19937_64 random(20261129);
  for (uint64_t i = 0; i < kBytes; ++i) base[i] = static_cast<uint8_t>(random());
  std::vector<uint8_t> model(base, base + kBytes);
  LocalCopies copies;
  RecordingSink sink;
  auto io = MakeRegionIo(region.get());
  ASSERT_TRUE(io.ok());
  auto channel = copies.Open(std::move(*io), &sink);
  constexpr int kCommands = 60;
  for (int c = 0; c < kCommands; ++c) {
    if (random() % 4 == 0) {
      const uint64_t offset = 8 * (random() % 1024);
      copies.SignalAdd(*channel, offset, 3, c);
      int64_t word;
      std::memcpy(&word, model.data() + offset, 8);
      word += 3;
      std::memcpy(model.data() + offset, &word, 8);
      continue;
    }
    // Sizes around the inline limit and the chunk, overlapping either way often.
    const uint64_t bytes = random() % 3 == 0 ? 1 + random() % 4096 : 1 + random() % (12ull << 20);
    const uint64_t src = random() % (kBytes - bytes);
    const uint64_t dst =
        random() % 2 == 0 ? random() % (kBytes - bytes) : std::min(kBytes - bytes, src + random() % (bytes + 1));
    copies.Put(*channel, dst, src, bytes, c);
    std::memmove(model.data() + dst, model.data() + src, bytes);
  }
  ASSERT_TRUE(sink.WaitFor(kCommands));
  copies.Close(*channel);
  for (int c = 0; c < kCommands; ++c) {
    EXPECT_EQ(sink.done[c].first, static_cast<uint64_t>(c)) << "completions come in the order of posting";
    EXPECT_TRUE(sink.done[c].second.ok()) << sink.done[c].second;
  }
  EXPECT_EQ(std::memcmp(base, model.data(), kBytes), 0);
}

TEST(LocalCopies, AnotherChannelsSignalDoesNotWaitForQueuedCopies) {
  auto region = HostRegion(96ull << 20);
  ASSERT_NE(region, nullptr);
  LocalCopies copies;
  RecordingSink busy_sink;
  RecordingSink quiet_sink;
  auto busy = copies.Open(*MakeRegionIo(region.get()), &busy_sink);
  auto quiet = copies.Open(*MakeRegionIo(region.get()), &quiet_sink);
  for (int i = 0; i < 16; ++i) copies.Put(*busy, 48ull << 20, 0, 40ull << 20, i);
  // Nothing of the quiet channel is queued: it runs on the poster's thread, before SignalAdd returns.
  copies.SignalAdd(*quiet, 0, 1, 7);
  EXPECT_EQ(quiet_sink.count(), 1u);
  EXPECT_LT(busy_sink.count(), 16u) << "the busy channel's copies were still queued";
  // Close fails what is still queued and nothing completes after it returns.
  copies.Close(*busy);
  const size_t after_close = busy_sink.count();
  EXPECT_EQ(after_close, 16u);
  int cancelled = 0;
  for (const auto& [cookie, status] : busy_sink.done) cancelled += absl::IsCancelled(status) ? 1 : 0;
  EXPECT_GT(cancelled, 0);
  copies.Put(*busy, 0, 8, 8, 99);
  EXPECT_TRUE(absl::IsCancelled(busy_sink.done.back().second));
  copies.Close(*quiet);
}

}  // namespace
}  // namespace epfabric::daemon::transport
