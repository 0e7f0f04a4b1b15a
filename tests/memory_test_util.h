// Helpers for the region memory tests: a second process (this test binary started again in a helper mode, with
// posix_spawn + exec, so that it is a fresh process even after CUDA was initialised here), a Unix socket to hand
// it a descriptor and file descriptors, and the data pattern both sides write and check.
#pragma once

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "epfabric/common/fd_passing.h"
#include "memory_pattern.h"

extern char** environ;

namespace epfabric::testing {

// A listening Unix stream socket in a fresh private directory, removed on destruction.
class ChildChannel {
 public:
  static absl::StatusOr<ChildChannel> Listen() {
    const char* tmp = getenv("TMPDIR");
    std::string dir_template = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/epfmem.XXXXXX");
    if (mkdtemp(dir_template.data()) == nullptr) return absl::InternalError(absl::StrCat("mkdtemp: ", errno));
    ChildChannel channel;
    channel.dir_ = dir_template;
    channel.path_ = dir_template + "/s";
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
    channel.listener_.reset(fd);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    if (channel.path_.size() >= sizeof(address.sun_path)) return absl::InternalError("socket path too long");
    std::memcpy(address.sun_path, channel.path_.c_str(), channel.path_.size() + 1);
    if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 || listen(fd, 4) != 0) {
      return absl::InternalError(absl::StrCat("bind/listen ", channel.path_, ": ", std::strerror(errno)));
    }
    return channel;
  }

  ChildChannel(ChildChannel&&) = default;
  ChildChannel& operator=(ChildChannel&&) = default;
  ~ChildChannel() {
    if (!path_.empty()) unlink(path_.c_str());
    if (!dir_.empty()) rmdir(dir_.c_str());
  }

  const std::string& path() const { return path_; }

  absl::StatusOr<common::UniqueFd> Accept(absl::Duration timeout) {
    pollfd entry{.fd = listener_.get(), .events = POLLIN, .revents = 0};
    if (poll(&entry, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) != 1) {
      return absl::DeadlineExceededError(
          absl::StrCat("no connection on ", path_, " within ", absl::FormatDuration(timeout)));
    }
    const int fd = accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return absl::InternalError(absl::StrCat("accept: ", std::strerror(errno)));
    return common::UniqueFd(fd);
  }

 private:
  ChildChannel() = default;
  std::string dir_;
  std::string path_;
  common::UniqueFd listener_;
};

inline absl::StatusOr<common::UniqueFd> ConnectTo(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  common::UniqueFd owned(fd);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.c_str(), std::min(path.size() + 1, sizeof(address.sun_path) - 1));
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    return absl::UnavailableError(absl::StrCat("connect ", path, ": ", std::strerror(errno)));
  }
  return owned;
}

// Words of $EPF_TEST_CHILD_WRAPPER (e.g. "unshare --pid --ipc --fork"), put in front of the helper's command line
// to run it in other namespaces.
inline std::vector<std::string> ChildWrapper() {
  const char* wrapper = getenv("EPF_TEST_CHILD_WRAPPER");
  if (wrapper == nullptr) return {};
  return absl::StrSplit(wrapper, ' ', absl::SkipEmpty());
}

// Starts this executable again with `args` (and `extra_env` entries "NAME=value" added to the environment).
inline absl::StatusOr<pid_t> SpawnSelf(const std::vector<std::string>& args,
                                       const std::vector<std::string>& extra_env = {}) {
  char self[4096];
  const ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (length <= 0) return absl::InternalError("readlink /proc/self/exe failed");
  self[length] = '\0';
  std::vector<std::string> argv = ChildWrapper();
  argv.push_back(self);
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> raw_argv;
  for (std::string& arg : argv) raw_argv.push_back(arg.data());
  raw_argv.push_back(nullptr);
  std::vector<std::string> env(extra_env);
  for (char** entry = environ; *entry != nullptr; ++entry) env.emplace_back(*entry);  // first one of a name wins
  std::vector<char*> raw_env;
  for (std::string& entry : env) raw_env.push_back(entry.data());
  raw_env.push_back(nullptr);
  pid_t pid = -1;
  const int error = posix_spawnp(&pid, raw_argv[0], nullptr, nullptr, raw_argv.data(), raw_env.data());
  if (error != 0) return absl::InternalError(absl::StrCat("posix_spawn ", argv[0], ": ", std::strerror(error)));
  return pid;
}

// The child's exit status (128 + signal when killed); kills it and returns DeadlineExceeded after `timeout`.
inline absl::StatusOr<int> WaitChild(pid_t pid, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (done < 0) return absl::InternalError(absl::StrCat("waitpid: ", std::strerror(errno)));
    if (absl::Now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return absl::DeadlineExceededError(
          absl::StrCat("child ", pid, " did not exit within ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
}

// "--name=value" from argv, or "" when absent.
inline std::string FlagValue(int argc, char** argv, const std::string& name) {
  const std::string prefix = "--" + name + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]).rfind(prefix, 0) == 0) return std::string(argv[i] + prefix.size());
  }
  return "";
}

}  // namespace epfabric::testing
