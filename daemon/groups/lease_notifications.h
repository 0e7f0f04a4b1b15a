// Lease notifications (NotifyLease) that did not reach a member, kept to be sent again. A member that misses the
// announcement of an attach publishes a stale lease serial for that rank (docs/data-layout.md, "Generations"), so a
// low-latency Buffer there would wait for it; one that misses an end keeps the rank's old serial and lost bit. The
// housekeeping thread resends what is due (GroupManager::RetryLeaseNotifications) until it lands, a newer
// notification about the same rank supersedes it, or it is kGiveUpAfter old.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "epfabric/v1/peer.pb.h"

namespace epfabric::daemon::groups {

class LeaseNotificationRetries {
 public:
  static constexpr absl::Duration kFirstRetry = absl::Milliseconds(200);
  static constexpr absl::Duration kLongestBackoff = absl::Seconds(5);
  static constexpr absl::Duration kGiveUpAfter = absl::Minutes(2);

  struct Due {
    int member = -1;  // fabric rank
    v1::NotifyLeaseRequest request;
  };

  // Every notification this daemon sends, so that an older one still waiting here is dropped.
  void Sent(const v1::NotifyLeaseRequest& request) ABSL_LOCKS_EXCLUDED(mutex_);
  // `request` did not reach fabric rank `member`.
  void Add(int member, const v1::NotifyLeaseRequest& request, absl::Time now) ABSL_LOCKS_EXCLUDED(mutex_);
  // What is due at `now`, minus what a newer notification about the same rank superseded or what is too old. Each
  // is in flight until the caller reports it with Delivered or Failed (then due again after a growing backoff).
  std::vector<Due> TakeDue(absl::Time now) ABSL_LOCKS_EXCLUDED(mutex_);
  void Delivered(const Due& due) ABSL_LOCKS_EXCLUDED(mutex_);
  void Failed(const Due& due, absl::Time now) ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  struct Entry {
    Due due;
    absl::Time next, first;  // next: InfiniteFuture while in flight
    absl::Duration backoff;
  };
  Entry* FindLocked(const Due& due) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  bool SupersededLocked(const v1::NotifyLeaseRequest& request) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  mutable absl::Mutex mutex_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mutex_);
  std::map<std::pair<std::string, int>, uint64_t> newest_ ABSL_GUARDED_BY(mutex_);  // (group, rank) -> sequence
};

}  // namespace epfabric::daemon::groups
