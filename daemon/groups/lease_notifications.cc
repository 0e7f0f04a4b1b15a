#include "groups/lease_notifications.h"

#include <algorithm>

namespace epfabric::daemon::groups {

void LeaseNotificationRetries::Sent(const v1::NotifyLeaseRequest& request) {
  absl::MutexLock lock(&mutex_);
  uint64_t& newest = newest_[{request.group(), request.group_rank()}];
  newest = std::max(newest, request.sequence());
}

void LeaseNotificationRetries::Add(int member, const v1::NotifyLeaseRequest& request, absl::Time now) {
  absl::MutexLock lock(&mutex_);
  if (SupersededLocked(request)) return;
  const Due due{.member = member, .request = request};
  // One entry per (member, group, rank): a newer notification replaces what was waiting.
  if (Entry* entry = FindLocked(due); entry != nullptr) {
    *entry = {.due = due, .next = now + kFirstRetry, .first = now, .backoff = kFirstRetry};
    return;
  }
  entries_.push_back({.due = due, .next = now + kFirstRetry, .first = now, .backoff = kFirstRetry});
}

std::vector<LeaseNotificationRetries::Due> LeaseNotificationRetries::TakeDue(absl::Time now) {
  absl::MutexLock lock(&mutex_);
  std::vector<Entry> kept;
  std::vector<Due> due;
  for (Entry& entry : entries_) {
    const bool in_flight = entry.next == absl::InfiniteFuture();
    if (SupersededLocked(entry.due.request) || (!in_flight && now - entry.first > kGiveUpAfter)) continue;
    if (!in_flight && entry.next <= now) {
      due.push_back(entry.due);
      entry.next = absl::InfiniteFuture();
    }
    kept.push_back(std::move(entry));
  }
  entries_ = std::move(kept);
  return due;
}

void LeaseNotificationRetries::Delivered(const Due& due) {
  absl::MutexLock lock(&mutex_);
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [&](const Entry& e) {
                                  return e.due.member == due.member &&
                                         e.due.request.sequence() == due.request.sequence() &&
                                         e.due.request.group() == due.request.group() &&
                                         e.due.request.group_rank() == due.request.group_rank();
                                }),
                 entries_.end());
}

void LeaseNotificationRetries::Failed(const Due& due, absl::Time now) {
  absl::MutexLock lock(&mutex_);
  Entry* entry = FindLocked(due);
  if (entry == nullptr || entry->due.request.sequence() != due.request.sequence()) return;  // replaced meanwhile
  entry->backoff = std::min(kLongestBackoff, entry->backoff * 2);
  entry->next = now + entry->backoff;
}

LeaseNotificationRetries::Entry* LeaseNotificationRetries::FindLocked(const Due& due) {
  for (Entry& entry : entries_) {
    if (entry.due.member == due.member && entry.due.request.group() == due.request.group() &&
        entry.due.request.group_rank() == due.request.group_rank()) {
      return &entry;
    }
  }
  return nullptr;
}

bool LeaseNotificationRetries::SupersededLocked(const v1::NotifyLeaseRequest& request) const {
  auto it = newest_.find({request.group(), request.group_rank()});
  return it != newest_.end() && it->second > request.sequence();
}

}  // namespace epfabric::daemon::groups
