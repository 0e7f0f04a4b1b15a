// The bookkeeping of one queue pair's send queue, apart from the queue pair itself so that it is unit-tested
// without a NIC: which commands are posted and not yet complete (in post order: an RC send queue completes in
// order), room for new work requests (wait with a deadline when full), and failure (every pending and later command
// fails at once). The verbs link owns one per queue pair and gives it the function that really posts.
//
// Threads: any number of posting threads (the proxy's) and one completion thread. CompletionSink::Complete is always
// called after the queue's lock is released.
#pragma once

#include <cstdint>
#include <deque>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "transport/wire.h"

namespace epfabric::daemon::transport::verbs {

class SendQueue {
 public:
  // `depth`: work requests the send queue holds (and that may be outstanding). `describe` names the queue in
  // messages ("group g, rank 3, channel 1").
  SendQueue(int depth, CompletionSink* sink, std::string describe);
  SendQueue(const SendQueue&) = delete;
  SendQueue& operator=(const SendQueue&) = delete;

  // Posts a command made of `work_requests` work requests: for each i, waits (until `deadline`) for a free slot,
  // then calls post(i) under the queue's lock (so that the pending list and the send queue stay in the same order).
  // The command completes later through OnSuccess / Fail, or here, at once, when the queue has failed or is closed
  // (the failure status), the deadline passes (DeadlineExceeded) or post() fails (its status). Work requests that
  // were posted before such an early end still complete through the queue, without telling the sink again.
  void Submit(uint64_t cookie, uint64_t work_requests, absl::Time deadline,
              absl::FunctionRef<absl::Status(uint64_t index)> post);

  // The oldest pending work request completed successfully (completion thread). False when nothing was pending
  // (a completion for a work request the queue already failed).
  bool OnSuccess();

  // Marks the queue failed with `status` (the first failure wins) and fails every pending command: the oldest with
  // `status`, the others, and every later Submit, with Later(status): the queue pair is in the error state and
  // nothing more reaches that peer through it.
  void Fail(const absl::Status& status);

  // Shutdown: like Fail, with Cancelled for pending and later commands (unless already failed).
  void Close();

  // What commands after the failing one get: Unavailable naming the queue and the first failure (Cancelled stays
  // Cancelled: a shutdown is not a lost peer).
  static absl::Status Later(const absl::Status& first, absl::string_view describe);

  // OK while usable.
  absl::Status status() const;
  int outstanding() const;
  int depth() const { return depth_; }

 private:
  struct Pending {
    uint64_t cookie = 0;
    bool last = false;  // the command's last work request: completing it completes the command
  };

  // Takes every pending command out (their cookies, oldest first) and records `status` as the failure.
  std::deque<Pending> FailLocked(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CompleteFailed(std::deque<Pending> failed, const absl::Status& first);

  const int depth_;
  CompletionSink* const sink_;
  const std::string describe_;
  mutable absl::Mutex mu_;
  std::deque<Pending> pending_ ABSL_GUARDED_BY(mu_);
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
};

}  // namespace epfabric::daemon::transport::verbs
