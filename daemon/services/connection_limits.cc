#include "services/connection_limits.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace epfabric::daemon {
namespace {

ino_t InodeOf(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return 0;
  return st.st_ino;
}

}  // namespace

bool ConnectionLimits::Admit(int fd, uid_t uid, std::string* why) {
  absl::MutexLock lock(&mutex_);
  PruneLocked();
  if (live_.size() >= max_total_) {
    *why = absl::StrCat(live_.size(), " connections are open (limit ", max_total_, ")");
    return false;
  }
  // Never let connections take the descriptors gRPC, the regions and the peer links need: each listener gets at most
  // a third of what the process may open beyond a reserve (read at every accept: `ulimit -n` may change).
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    const size_t budget = limit.rlim_cur > kReservedDescriptors ? (limit.rlim_cur - kReservedDescriptors) / 3 : 0;
    if (live_.size() >= budget) {
      *why = absl::StrCat(live_.size(),
                          " connections are open, the most this listener may hold with a descriptor "
                          "limit of ",
                          limit.rlim_cur);
      return false;
    }
  }
  size_t of_uid = 0;
  for (const auto& [other_fd, entry] : live_) of_uid += entry.uid == uid ? 1 : 0;
  if (of_uid >= max_per_uid_) {
    *why = absl::StrCat("uid ", uid, " has ", of_uid, " connections open (limit ", max_per_uid_, " per uid)");
    return false;
  }
  live_[fd] = Entry{InodeOf(fd), uid};
  return true;
}

void ConnectionLimits::Release(int fd) {
  absl::MutexLock lock(&mutex_);
  live_.erase(fd);
}

size_t ConnectionLimits::live() const {
  absl::MutexLock lock(&mutex_);
  return live_.size();
}

void ConnectionLimits::PruneLocked() {
  for (auto it = live_.begin(); it != live_.end();) {
    if (InodeOf(it->first) != it->second.inode) {
      it = live_.erase(it);
    } else {
      ++it;
    }
  }
}

bool RateLimitedWarning::ShouldLog(int* suppressed) {
  absl::MutexLock lock(&mutex_);
  const absl::Time now = absl::Now();
  if (now - last_ < interval_) {
    ++suppressed_;
    return false;
  }
  last_ = now;
  *suppressed = suppressed_;
  suppressed_ = 0;
  return true;
}

DescriptorReserve::DescriptorReserve() { spare_ = open("/dev/null", O_RDONLY | O_CLOEXEC); }

DescriptorReserve::~DescriptorReserve() {
  if (spare_ >= 0) close(spare_);
}

bool DescriptorReserve::ShedOne(int listen_fd) {
  if (spare_ >= 0) {
    close(spare_);
    spare_ = -1;
  }
  const int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd >= 0) close(fd);
  spare_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  return fd >= 0;
}

}  // namespace epfabric::daemon
