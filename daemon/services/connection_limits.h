// What keeps one local caller from exhausting a daemon's sockets: caps on live connections (in all and per uid),
// a reserve descriptor to shed connections when the process runs out of descriptors instead of spinning on
// EMFILE, and warnings that are rate-limited so that a flood cannot fill the log.
#pragma once

#include <sys/types.h>

#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace epfabric::daemon {

class ConnectionLimits {
 public:
  // Descriptors kept out of every listener's share (gRPC's own, regions, peer channels, logs).
  static constexpr size_t kReservedDescriptors = 64;

  ConnectionLimits(size_t max_total, size_t max_per_uid) : max_total_(max_total), max_per_uid_(max_per_uid) {}

  // Records the accepted connection `fd` of `uid`; false, with `*why` saying which cap, when a cap is reached.
  bool Admit(int fd, uid_t uid, std::string* why) ABSL_LOCKS_EXCLUDED(mutex_);
  // The connection `fd` closed (for listeners that see their connections close).
  void Release(int fd) ABSL_LOCKS_EXCLUDED(mutex_);
  size_t live() const ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  struct Entry {
    ino_t inode = 0;  // the socket's inode: a reused descriptor number names another socket
    uid_t uid = 0;
  };
  // Forgets connections whose descriptor was closed by someone else (gRPC owns the client socket's connections).
  void PruneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  const size_t max_total_;
  const size_t max_per_uid_;
  mutable absl::Mutex mutex_;
  std::map<int, Entry> live_ ABSL_GUARDED_BY(mutex_);
};

// One warning per `interval` at most; the next one says how many were dropped meanwhile.
class RateLimitedWarning {
 public:
  explicit RateLimitedWarning(absl::Duration interval = absl::Seconds(10)) : interval_(interval) {}
  // True when the caller should log now; `*suppressed` is the number of warnings dropped since the last one.
  bool ShouldLog(int* suppressed) ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  const absl::Duration interval_;
  absl::Mutex mutex_;
  absl::Time last_ ABSL_GUARDED_BY(mutex_) = absl::InfinitePast();
  int suppressed_ ABSL_GUARDED_BY(mutex_) = 0;
};

// A spare descriptor held for the moment accept() fails with EMFILE/ENFILE: it is closed, the pending connection is
// accepted and closed at once (so it leaves the backlog and the loop does not spin), and the spare is reopened.
class DescriptorReserve {
 public:
  DescriptorReserve();
  ~DescriptorReserve();
  DescriptorReserve(const DescriptorReserve&) = delete;
  DescriptorReserve& operator=(const DescriptorReserve&) = delete;
  // Sheds one pending connection of `listen_fd`; returns true when one was shed.
  bool ShedOne(int listen_fd);

 private:
  int spare_ = -1;
};

}  // namespace epfabric::daemon
