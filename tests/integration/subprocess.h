// Runs a real binary for integration tests: stdout and stderr go to files (no pipe can fill up and block the
// child), and the child is killed if the test forgets it.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace epfabric::testing {

class Subprocess {
 public:
  // Starts argv[0] with the given arguments (no shell).
  static absl::StatusOr<Subprocess> Start(const std::vector<std::string>& argv);

  Subprocess(Subprocess&& other) noexcept;
  Subprocess& operator=(Subprocess&&) = delete;
  ~Subprocess();

  // Waits for the exit status (WEXITSTATUS, or 128+signal) for at most `timeout`; DeadlineExceeded otherwise.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  void Signal(int signal_number);
  bool running();

  std::string Stdout() const;
  std::string Stderr() const;
  pid_t pid() const { return pid_; }
  // The process' thread count now (/proc/<pid>/status), -1 when it cannot be read.
  int Threads() const;

 private:
  Subprocess() = default;
  pid_t pid_ = -1;
  std::optional<int> exit_code_;
  std::string dir_;
};

// Runs a binary to completion and returns its exit code with what it printed.
struct RunResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};
RunResult RunBinary(const std::vector<std::string>& argv, absl::Duration timeout = absl::Seconds(20));

// A fresh directory under $TMPDIR (short: Unix socket paths are limited to 107 bytes).
std::string MakeTempDir();

}  // namespace epfabric::testing
