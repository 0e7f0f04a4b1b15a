#include "integration/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

extern char** environ;

namespace epfabric::testing {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

int DecodeStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

}  // namespace

std::string MakeTempDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/epf-XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) return "";
  return pattern;
}

// The child dies with the test: a test process killed by a signal (a timeout's SIGTERM or SIGKILL, ^C) runs no
// destructor, and its daemons and workers would otherwise live on and load the machine for the tests after it.
// PR_SET_PDEATHSIG fires when the thread that forked exits, so children are started from threads that outlive them
// (every test here starts them from its main thread). Between fork and exec the child calls only async-signal-safe
// functions (the test process has threads).
absl::StatusOr<Subprocess> Subprocess::Start(const std::vector<std::string>& argv) {
  Subprocess process;
  process.dir_ = MakeTempDir();
  if (process.dir_.empty()) return absl::InternalError("mkdtemp failed");
  const std::string out_path = process.dir_ + "/stdout", err_path = process.dir_ + "/stderr";
  std::vector<char*> args;
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  // A close-on-exec pipe tells the parent why the child could not start (nothing arrives once exec succeeded).
  int report[2];
  if (pipe2(report, O_CLOEXEC) != 0) return absl::InternalError(absl::StrCat("pipe2: ", strerror(errno)));
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    const int fork_errno = errno;
    close(report[0]);
    close(report[1]);
    return absl::InternalError(absl::StrCat("fork for ", argv[0], ": ", strerror(fork_errno)));
  }
  if (pid == 0) {
    close(report[0]);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) _exit(126);  // the test is already gone
    const int in = open("/dev/null", O_RDONLY);
    const int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (in >= 0 && out >= 0 && err >= 0 && dup2(in, STDIN_FILENO) >= 0 && dup2(out, STDOUT_FILENO) >= 0 &&
        dup2(err, STDERR_FILENO) >= 0) {
      execve(args[0], args.data(), environ);
    }
    const int child_errno = errno;
    (void)!write(report[1], &child_errno, sizeof(child_errno));
    _exit(127);
  }
  close(report[1]);
  int child_errno = 0;
  ssize_t got;
  do {
    got = read(report[0], &child_errno, sizeof(child_errno));
  } while (got < 0 && errno == EINTR);
  close(report[0]);
  process.pid_ = pid;
  if (got == static_cast<ssize_t>(sizeof(child_errno))) {
    int status = 0;
    waitpid(pid, &status, 0);
    process.exit_code_ = DecodeStatus(status);
    return absl::InternalError(absl::StrCat("starting ", argv[0], ": ", strerror(child_errno)));
  }
  return process;
}

Subprocess::Subprocess(Subprocess&& other) noexcept
    : pid_(other.pid_), exit_code_(other.exit_code_), dir_(std::move(other.dir_)) {
  other.pid_ = -1;
}

Subprocess::~Subprocess() {
  if (pid_ > 0 && !exit_code_.has_value()) {
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  if (!dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

absl::StatusOr<int> Subprocess::Wait(absl::Duration timeout) {
  if (exit_code_.has_value()) return *exit_code_;
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    const pid_t done = waitpid(pid_, &status, WNOHANG);
    if (done == pid_) {
      exit_code_ = DecodeStatus(status);
      return *exit_code_;
    }
    if (absl::Now() > deadline) return absl::DeadlineExceededError(absl::StrCat("pid ", pid_, " still running"));
    absl::SleepFor(absl::Milliseconds(5));
  }
}

void Subprocess::Signal(int signal_number) {
  if (pid_ > 0 && !exit_code_.has_value()) kill(pid_, signal_number);
}

bool Subprocess::running() { return !Wait(absl::ZeroDuration()).ok(); }

std::string Subprocess::Stdout() const { return ReadFile(dir_ + "/stdout"); }
std::string Subprocess::Stderr() const { return ReadFile(dir_ + "/stderr"); }

RunResult RunBinary(const std::vector<std::string>& argv, absl::Duration timeout) {
  RunResult result;
  auto process = Subprocess::Start(argv);
  if (!process.ok()) {
    result.err = process.status().ToString();
    return result;
  }
  auto code = process->Wait(timeout);
  result.exit_code = code.ok() ? *code : -1;
  result.out = process->Stdout();
  result.err = process->Stderr();
  return result;
}

int Subprocess::Threads() const {
  std::ifstream status("/proc/" + std::to_string(pid_) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    int threads = 0;
    if (absl::StartsWith(line, "Threads:") && absl::SimpleAtoi(absl::StripAsciiWhitespace(line.substr(8)), &threads))
      return threads;
  }
  return -1;
}

}  // namespace epfabric::testing
