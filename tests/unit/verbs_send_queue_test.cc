// The verbs wire's send-queue bookkeeping without a NIC (a fake poster stands for ibv_post_send, OnSuccess / Fail
// for the completion thread): post-order completion once per command, waiting for room with a deadline, failure of
// pending and later commands, shutdown, refused posts.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "transport/verbs/send_queue.h"
#include "transport/verbs/verbs_logic.h"

namespace epfabric::daemon::transport::verbs {
namespace {

using ::testing::HasSubstr;

class RecordingSink : public CompletionSink {
 public:
  void Complete(uint64_t cookie, absl::Status status) override {
    absl::MutexLock lock(&mu_);
    done_.emplace_back(cookie, std::move(status));
  }
  std::vector<std::pair<uint64_t, absl::Status>> done() {
    absl::MutexLock lock(&mu_);
    return done_;
  }
  bool WaitFor(size_t count, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_.size() >= count; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
  }

 private:
  absl::Mutex mu_;
  std::vector<std::pair<uint64_t, absl::Status>> done_ ABSL_GUARDED_BY(mu_);
};

// Stands for ibv_post_send: records what was posted.

absl::Time Soon() { return absl::Now() + absl::Seconds(5); }

TEST(SendQueueTest, CompletesInPostOrderAndOncePerCommand) {
  RecordingSink sink;
  SendQueue queue(8, &sink, "group g, rank 1, channel 0");
  std::vector<uint64_t> posted;
  auto post_for = [&](uint64_t cookie) {
    return [&posted, cookie](uint64_t i) {
      posted.push_back(cookie * 100 + i);
      return absl::OkStatus();
    };
  };
  queue.Submit(1, 1, Soon(), post_for(1));
  queue.Submit(2, 3, Soon(), post_for(2));  // a put split into three writes
  queue.Submit(3, 1, Soon(), post_for(3));
  EXPECT_EQ(posted, (std::vector<uint64_t>{100, 200, 201, 202, 300}));
  EXPECT_EQ(queue.outstanding(), 5);
  EXPECT_TRUE(sink.done().empty());

  EXPECT_TRUE(queue.OnSuccess());  // command 1
  ASSERT_EQ(sink.done().size(), 1u);
  EXPECT_EQ(sink.done()[0].first, 1u);
  EXPECT_TRUE(queue.OnSuccess());
  EXPECT_TRUE(queue.OnSuccess());
  EXPECT_EQ(sink.done().size(), 1u);  // command 2 has one write left
  EXPECT_TRUE(queue.OnSuccess());
  EXPECT_TRUE(queue.OnSuccess());
  const auto done = sink.done();
  ASSERT_EQ(done.size(), 3u);
  EXPECT_EQ(done[1].first, 2u);
  EXPECT_EQ(done[2].first, 3u);
  for (const auto& [cookie, status] : done) EXPECT_TRUE(status.ok()) << cookie << ": " << status;
  EXPECT_FALSE(queue.OnSuccess());  // nothing pending
}

TEST(SendQueueTest, FullQueueWaitsUntilTheDeadline) {
  RecordingSink sink;
  SendQueue queue(2, &sink, "group g, rank 1, channel 0");
  auto ok = [](uint64_t) { return absl::OkStatus(); };
  queue.Submit(1, 1, Soon(), ok);
  queue.Submit(2, 1, Soon(), ok);
  const absl::Time start = absl::Now();
  queue.Submit(3, 1, start + absl::Milliseconds(50), ok);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(45));
  ASSERT_EQ(sink.done().size(), 1u);
  EXPECT_EQ(sink.done()[0].first, 3u);
  EXPECT_EQ(sink.done()[0].second.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(sink.done()[0].second.message(), HasSubstr("rank 1"));
  EXPECT_EQ(queue.outstanding(), 2);
}

TEST(SendQueueTest, FullQueueResumesWhenACompletionFreesASlot) {
  RecordingSink sink;
  SendQueue queue(1, &sink, "q");
  auto ok = [](uint64_t) { return absl::OkStatus(); };
  queue.Submit(1, 1, Soon(), ok);
  std::thread completer([&] {
    absl::SleepFor(absl::Milliseconds(20));
    queue.OnSuccess();
  });
  queue.Submit(2, 1, Soon(), ok);  // blocks until the completer frees the slot
  completer.join();
  EXPECT_EQ(queue.outstanding(), 1);
  ASSERT_EQ(sink.done().size(), 1u);
  EXPECT_EQ(sink.done()[0].first, 1u);
  EXPECT_TRUE(sink.done()[0].second.ok());
}

TEST(SendQueueTest, FailureFailsPendingAndEveryLaterCommandAtOnce) {
  RecordingSink sink;
  SendQueue queue(8, &sink, "group g, rank 3, channel 1");
  auto ok = [](uint64_t) { return absl::OkStatus(); };
  queue.Submit(1, 1, Soon(), ok);
  queue.Submit(2, 2, Soon(), ok);
  queue.Submit(3, 1, Soon(), ok);
  queue.OnSuccess();  // command 1 done
  const absl::Status error = WcStatusToStatus(IBV_WC_REM_ACCESS_ERR, 0, "g", 3, 1, "RDMA WRITE");
  queue.Fail(error);
  EXPECT_EQ(queue.outstanding(), 0);
  auto done = sink.done();
  ASSERT_EQ(done.size(), 3u);
  EXPECT_TRUE(done[0].second.ok());
  EXPECT_EQ(done[1].first, 2u);
  EXPECT_EQ(done[1].second, error);  // the command whose completion failed
  EXPECT_EQ(done[2].first, 3u);
  EXPECT_EQ(done[2].second.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(done[2].second.message(), HasSubstr("rank 3"));

  bool posted = false;
  const absl::Time start = absl::Now();
  queue.Submit(4, 1, start + absl::Seconds(30), [&](uint64_t) {
    posted = true;
    return absl::OkStatus();
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  EXPECT_FALSE(posted);
  done = sink.done();
  ASSERT_EQ(done.size(), 4u);
  EXPECT_EQ(done[3].second.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(done[3].second.message(), HasSubstr(ibv_wc_status_str(IBV_WC_REM_ACCESS_ERR)));
  EXPECT_EQ(queue.status(), error);
}

TEST(SendQueueTest, FailureWakesAWaitingSubmit) {
  RecordingSink sink;
  SendQueue queue(1, &sink, "q");
  auto ok = [](uint64_t) { return absl::OkStatus(); };
  queue.Submit(1, 1, Soon(), ok);
  std::thread failer([&] {
    absl::SleepFor(absl::Milliseconds(20));
    queue.Fail(absl::UnavailableError("peer lost"));
  });
  const absl::Time start = absl::Now();
  queue.Submit(2, 1, start + absl::Seconds(30), ok);
  failer.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ASSERT_TRUE(sink.WaitFor(2, absl::Seconds(5)));
  for (const auto& [cookie, status] : sink.done()) EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << cookie;
}

TEST(SendQueueTest, CloseCancelsPendingAndLater) {
  RecordingSink sink;
  SendQueue queue(4, &sink, "q");
  auto ok = [](uint64_t) { return absl::OkStatus(); };
  queue.Submit(1, 1, Soon(), ok);
  queue.Submit(2, 1, Soon(), ok);
  queue.Close();
  queue.Submit(3, 1, Soon(), ok);
  auto done = sink.done();
  ASSERT_EQ(done.size(), 3u);
  for (const auto& [cookie, status] : done) EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << cookie;
  // Completions that arrive after the failure (flushes) find nothing and tell nobody.
  EXPECT_FALSE(queue.OnSuccess());
  EXPECT_EQ(sink.done().size(), 3u);
}

TEST(SendQueueTest, PostErrorFailsOnlyThatCommandOnce) {
  RecordingSink sink;
  SendQueue queue(8, &sink, "q");
  // The second of three writes cannot be posted: the command fails now; its first write completes silently later.
  queue.Submit(7, 3, Soon(), [](uint64_t i) {
    return i == 1 ? absl::ResourceExhaustedError("ibv_post_send: ENOMEM") : absl::OkStatus();
  });
  auto done = sink.done();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].first, 7u);
  EXPECT_EQ(done[0].second.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(queue.outstanding(), 1);
  EXPECT_TRUE(queue.OnSuccess());
  EXPECT_EQ(sink.done().size(), 1u);
  EXPECT_TRUE(queue.status().ok());  // a refused post is not a lost peer
  queue.Submit(8, 1, Soon(), [](uint64_t) { return absl::OkStatus(); });
  queue.OnSuccess();
  ASSERT_EQ(sink.done().size(), 2u);
  EXPECT_TRUE(sink.done()[1].second.ok());
}

}  // namespace
}  // namespace epfabric::daemon::transport::verbs
