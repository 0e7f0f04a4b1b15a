#include "transport/verbs/send_queue.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace epfabric::daemon::transport::verbs {

SendQueue::SendQueue(int depth, CompletionSink* sink, std::string describe)
    : depth_(depth < 1 ? 1 : depth), sink_(sink), describe_(std::move(describe)) {}

void SendQueue::Submit(uint64_t cookie, uint64_t work_requests, absl::Time deadline,
                       absl::FunctionRef<absl::Status(uint64_t index)> post) {
  absl::Status early;  // set when the command ends here
  {
    absl::MutexLock lock(&mu_);
    for (uint64_t i = 0; i < work_requests; ++i) {
      auto room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !failure_.ok() || static_cast<int>(pending_.size()) < depth_;
      };
      if (!mu_.AwaitWithDeadline(absl::Condition(&room), deadline)) {
        early = absl::DeadlineExceededError(absl::StrCat("verbs: ", describe_, ": send queue full (", depth_,
                                                         " work requests outstanding) until the deadline"));
        break;
      }
      if (!failure_.ok()) {
        early = Later(failure_, describe_);
        break;
      }
      if (absl::Status posted = post(i); !posted.ok()) {
        early = std::move(posted);
        break;
      }
      pending_.push_back(Pending{cookie, i + 1 == work_requests});
    }
    if (!early.ok() && !pending_.empty() && pending_.back().cookie == cookie) {
      // Some of this command's work requests are on the wire: they complete through the queue, silently.
      for (auto it = pending_.rbegin(); it != pending_.rend() && it->cookie == cookie; ++it) it->last = false;
    }
  }
  if (!early.ok()) sink_->Complete(cookie, std::move(early));
}

bool SendQueue::OnSuccess() {
  Pending done;
  {
    absl::MutexLock lock(&mu_);
    if (pending_.empty()) return false;
    done = pending_.front();
    pending_.pop_front();
  }
  if (done.last) sink_->Complete(done.cookie, absl::OkStatus());
  return true;
}

std::deque<SendQueue::Pending> SendQueue::FailLocked(const absl::Status& status) {
  if (failure_.ok()) failure_ = status;
  std::deque<Pending> failed;
  failed.swap(pending_);
  return failed;
}

void SendQueue::CompleteFailed(std::deque<Pending> failed, const absl::Status& first) {
  bool first_done = false;
  for (const Pending& p : failed) {
    if (!p.last) continue;
    if (!first_done) {
      sink_->Complete(p.cookie, first);
      first_done = true;
    } else {
      sink_->Complete(p.cookie, Later(first, describe_));
    }
  }
}

void SendQueue::Fail(const absl::Status& status) {
  std::deque<Pending> failed;
  absl::Status recorded;
  {
    absl::MutexLock lock(&mu_);
    failed = FailLocked(status.ok() ? absl::InternalError(absl::StrCat("verbs: ", describe_, ": failed")) : status);
    recorded = failure_;
  }
  // The recorded failure (the first one) explains why: a later Fail only flushes what was posted since.
  CompleteFailed(std::move(failed), recorded);
}

void SendQueue::Close() {
  Fail(absl::CancelledError(absl::StrCat("verbs: ", describe_, ": the group's link is shutting down")));
}

absl::Status SendQueue::Later(const absl::Status& first, absl::string_view describe) {
  if (absl::IsCancelled(first)) return first;
  return absl::UnavailableError(
      absl::StrCat("verbs: ", describe, ": peer unreachable after an earlier failure: ", first.message()));
}

absl::Status SendQueue::status() const {
  absl::MutexLock lock(&mu_);
  return failure_;
}

int SendQueue::outstanding() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(pending_.size());
}

}  // namespace epfabric::daemon::transport::verbs
