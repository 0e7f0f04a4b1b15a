// LeaseNotificationRetries: when a missed NotifyLease is sent again, what supersedes it, its backoff and its end.
#include "groups/lease_notifications.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/time/time.h"

namespace epfabric::daemon::groups {
namespace {

using Retries = LeaseNotificationRetries;

v1::NotifyLeaseRequest Notice(const std::string& group, int rank, uint64_t sequence, bool attached = true) {
  v1::NotifyLeaseRequest request;
  request.set_group(group);
  request.set_group_rank(rank);
  request.set_sequence(sequence);
  request.set_attached(attached);
  return request;
}

const absl::Time kStart = absl::FromUnixSeconds(1'000'000);

TEST(LeaseNotificationRetries, AMissedNoticeIsDueAfterTheFirstRetryDelayAndOnlyOnceInFlight) {
  Retries retries;
  retries.Sent(Notice("g", 1, 7));
  retries.Add(/*member=*/2, Notice("g", 1, 7), kStart);
  EXPECT_TRUE(retries.TakeDue(kStart + Retries::kFirstRetry - absl::Milliseconds(1)).empty());
  std::vector<Retries::Due> due = retries.TakeDue(kStart + Retries::kFirstRetry);
  ASSERT_EQ(due.size(), 1u);
  EXPECT_EQ(due[0].member, 2);
  EXPECT_EQ(due[0].request.sequence(), 7u);
  // In flight until reported: not due again, however late it is.
  EXPECT_TRUE(retries.TakeDue(kStart + absl::Seconds(30)).empty());
  retries.Delivered(due[0]);
  EXPECT_TRUE(retries.TakeDue(kStart + absl::Minutes(1)).empty());
}

TEST(LeaseNotificationRetries, EachFailureDoublesTheWaitUpToTheLongestBackoff) {
  Retries retries;
  retries.Add(3, Notice("g", 0, 1), kStart);
  absl::Time now = kStart + Retries::kFirstRetry;
  absl::Duration expected = Retries::kFirstRetry;
  for (int attempt = 0; attempt < 8; ++attempt) {
    std::vector<Retries::Due> due = retries.TakeDue(now);
    ASSERT_EQ(due.size(), 1u) << "attempt " << attempt;
    retries.Failed(due[0], now);
    expected = std::min(Retries::kLongestBackoff, expected * 2);
    EXPECT_TRUE(retries.TakeDue(now + expected - absl::Milliseconds(1)).empty()) << "attempt " << attempt;
    now += expected;
  }
  EXPECT_EQ(expected, Retries::kLongestBackoff);
}

TEST(LeaseNotificationRetries, ANewerNoticeAboutTheSameRankSupersedesTheWaitingOne) {
  Retries retries;
  retries.Add(1, Notice("g", 0, 4, /*attached=*/true), kStart);
  retries.Sent(Notice("g", 0, 5, /*attached=*/false));  // the client left meanwhile: the attach notice is stale
  EXPECT_TRUE(retries.TakeDue(kStart + absl::Seconds(1)).empty());
  // An older notice than one already sent is never kept.
  retries.Add(1, Notice("g", 0, 3), kStart);
  EXPECT_TRUE(retries.TakeDue(kStart + absl::Seconds(1)).empty());
  // Other ranks and groups are not affected.
  retries.Add(1, Notice("g", 1, 2), kStart);
  retries.Add(1, Notice("h", 0, 2), kStart);
  EXPECT_EQ(retries.TakeDue(kStart + absl::Seconds(1)).size(), 2u);
}

TEST(LeaseNotificationRetries, OneEntryPerMemberAndRankTheNewestReplacesTheOlder) {
  Retries retries;
  retries.Add(1, Notice("g", 0, 4), kStart);
  retries.Add(1, Notice("g", 0, 6), kStart);
  retries.Add(2, Notice("g", 0, 6), kStart);  // another member: its own entry
  std::vector<Retries::Due> due = retries.TakeDue(kStart + absl::Seconds(1));
  ASSERT_EQ(due.size(), 2u);
  for (const Retries::Due& d : due) EXPECT_EQ(d.request.sequence(), 6u);
  // A failure reported for a notice that was replaced while in flight does not touch the newer one.
  retries.Add(1, Notice("g", 0, 8), kStart + absl::Seconds(1));
  retries.Failed({.member = 1, .request = Notice("g", 0, 6)}, kStart + absl::Seconds(1));
  due = retries.TakeDue(kStart + absl::Seconds(1) + Retries::kFirstRetry);
  ASSERT_EQ(due.size(), 1u);
  EXPECT_EQ(due[0].request.sequence(), 8u);
}

TEST(LeaseNotificationRetries, ANoticeIsDroppedWhenItIsTooOld) {
  Retries retries;
  retries.Add(1, Notice("g", 0, 1), kStart);
  std::vector<Retries::Due> due = retries.TakeDue(kStart + Retries::kFirstRetry);
  ASSERT_EQ(due.size(), 1u);
  retries.Failed(due[0], kStart + Retries::kFirstRetry);
  EXPECT_TRUE(retries.TakeDue(kStart + Retries::kGiveUpAfter + absl::Seconds(1)).empty());
  EXPECT_TRUE(retries.TakeDue(kStart + Retries::kGiveUpAfter + absl::Minutes(10)).empty());
}

}  // namespace
}  // namespace epfabric::daemon::groups
