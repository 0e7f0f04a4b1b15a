#include "integration/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
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

absl::StatusOr<Subprocess> Subprocess::Start(const std::vector<std::string>& argv) {
  Subprocess process;
  process.dir_ = MakeTempDir();
  if (process.dir_.empty()) return absl::InternalError("mkdtemp failed");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, (process.dir_ + "/stdout").c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, (process.dir_ + "/stderr").c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<char*> args;
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  const int rc = posix_spawn(&process.pid_, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return absl::InternalError(absl::StrCat("posix_spawn ", argv[0], ": ", strerror(rc)));
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

}  // namespace epfabric::testing
