// The test harness's child processes die with the test process, however it ends (integration/subprocess.h).
#include "integration/subprocess.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace epfabric::testing {
namespace {

constexpr char kHelperEnv[] = "EPF_SUBPROCESS_TEST_PID_FILE";

// /proc/<pid>/stat's state: 'Z' for a zombie (dead, not yet reaped by whoever adopted it), '?' when gone.
char ProcessState(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return '?';
  const size_t paren = line.rfind(')');
  return paren == std::string::npos || paren + 2 >= line.size() ? '?' : line[paren + 2];
}

// The helper for the test below, run as a process of its own: a "test process" that starts a child through
// Subprocess, writes its pid, and is then SIGKILLed (no destructor runs). Disabled: only the test below runs it (with
// --gtest_also_run_disabled_tests), so that a plain run of this binary neither runs nor skips it.
TEST(Subprocess, DISABLED_HelperStartsAChildAndIsKilled) {
  const char* pid_file = std::getenv(kHelperEnv);
  if (pid_file == nullptr) GTEST_SKIP() << "only as ChildrenDieWithAKilledTestProcess's helper";
  auto child = Subprocess::Start({"/bin/sleep", "60"});
  ASSERT_TRUE(child.ok()) << child.status();
  std::ofstream(pid_file) << child->pid() << std::endl;
  kill(getpid(), SIGKILL);
}

// A test process SIGKILLed mid-test runs no destructor: its daemons and workers would outlive it and load the
// machine for every test after. Here the helper above is that test
// process; its child must be gone (or a zombie) within a second of its death.
TEST(Subprocess, ChildrenDieWithAKilledTestProcess) {
  const std::string dir = MakeTempDir();
  ASSERT_FALSE(dir.empty());
  const std::string pid_file = dir + "/child.pid";
  setenv(kHelperEnv, pid_file.c_str(), 1);
  auto helper = Subprocess::Start({"/proc/self/exe", "--gtest_also_run_disabled_tests",
                                   "--gtest_filter=Subprocess.DISABLED_HelperStartsAChildAndIsKilled"});
  unsetenv(kHelperEnv);
  ASSERT_TRUE(helper.ok()) << helper.status();
  auto code = helper->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 128 + SIGKILL) << helper->Stdout() << helper->Stderr();
  pid_t child = 0;
  std::ifstream(pid_file) >> child;
  ASSERT_GT(child, 0) << "the helper did not start its child: " << helper->Stdout();
  const absl::Time deadline = absl::Now() + absl::Seconds(1);
  char state = ProcessState(child);
  while (state != '?' && state != 'Z' && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
    state = ProcessState(child);
  }
  EXPECT_TRUE(state == '?' || state == 'Z')
      << "the child " << child << " outlived its test process (state " << state << ")";
  if (state != '?' && state != 'Z') kill(child, SIGKILL);
}

// A binary that cannot run is reported by Start, not later as an exit code.
TEST(Subprocess, ABinaryThatCannotRunIsAnError) {
  auto child = Subprocess::Start({"/nonexistent/epfabric-binary"});
  ASSERT_FALSE(child.ok());
  EXPECT_NE(std::string(child.status().message()).find("No such file"), std::string::npos) << child.status();
}

}  // namespace
}  // namespace epfabric::testing
