// ReadResultsFile: the key=value files that device-checks hands to a benchmark (restart.txt -> intranode_bench).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/report.h"
#include "common/timeline.h"
#include "epfabric/kernels/status_word.h"

namespace epfabric::bench {
namespace {

using ::testing::HasSubstr;
using ::testing::Pair;

std::string WriteTemp(const std::string& text) {
  char path[] = "/tmp/epf-report-test.XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << text;
  return path;
}

TEST(ReadResultsFile, ReadsNumbersAndSkipsBlankAndCommentLines) {
  const std::string path = WriteTemp(
      "# restart cost\n"
      "restart_to_first_dispatch_ms=41.25\n"
      "\n"
      "  restart_trials = 10  \n"
      "restart_attach_ms=-1e-3\n");
  auto results = ReadResultsFile(path);
  ASSERT_TRUE(results.ok()) << results.status();
  EXPECT_THAT(*results, ::testing::ElementsAre(Pair("restart_to_first_dispatch_ms", 41.25),
                                               Pair("restart_trials", 10.0), Pair("restart_attach_ms", -1e-3)));
  Report report("test");
  for (const auto& [key, value] : *results) report.SetResult(key, value);
  report.SetDevice("host");
  auto json = report.ToJson();
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_THAT(*json, HasSubstr("\"restart_to_first_dispatch_ms\": 41.25"));
  std::remove(path.c_str());
}

TEST(ReadResultsFile, RefusesALineThatIsNotKeyEqualsNumberNamingIt) {
  for (const std::string bad : {"restart_ms=fast", "restart_ms", "=3", "restart_ms=nan", "restart_ms=1 ms"}) {
    const std::string path = WriteTemp("ok=1\n" + bad + "\n");
    auto results = ReadResultsFile(path);
    EXPECT_TRUE(absl::IsInvalidArgument(results.status())) << bad << ": " << results.status();
    EXPECT_THAT(results.status().message(), HasSubstr(path + ":2:")) << bad;
    std::remove(path.c_str());
  }
}

TEST(Report, PlacementSaysWhetherTheGpuWasShared) {
  Report shared("test");
  shared.SetDevice("host");
  shared.SetPlacement(2, 1);
  EXPECT_TRUE(shared.shared_gpu());
  auto json = shared.ToJson();
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_THAT(*json, HasSubstr("\"shared_gpu\": true"));
  EXPECT_THAT(*json, HasSubstr("\"num_ranks\": 2"));
  EXPECT_THAT(*json, HasSubstr("\"num_gpus\": 1"));
  EXPECT_THAT(SharedGpuNote(2, 1), HasSubstr("NOT comparable with NVLink"));

  Report own("test");
  own.SetDevice("host");
  own.SetPlacement(2, 2);
  EXPECT_FALSE(own.shared_gpu());
  json = own.ToJson();
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_THAT(*json, HasSubstr("\"shared_gpu\": false"));
  EXPECT_EQ(SharedGpuNote(2, 2), "");

  Report none("test");
  none.SetDevice("host");
  json = none.ToJson();
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_THAT(*json, ::testing::Not(HasSubstr("shared_gpu")));
}

// The commit in the JSON: EPF_COMMIT, else the COMMIT file of the bundle the binary runs from (bin/../COMMIT).
TEST(Report, CommitComesFromTheEnvironmentOrTheBundle) {
  Report report("test");
  report.SetDevice("host");
  ASSERT_EQ(setenv("EPF_COMMIT", "abc1234", 1), 0);
  auto json = report.ToJson();
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_THAT(*json, HasSubstr("\"commit\": \"abc1234\""));

  ASSERT_EQ(unsetenv("EPF_COMMIT"), 0);
  const std::filesystem::path commit_file =
      std::filesystem::read_symlink("/proc/self/exe").parent_path().parent_path() / "COMMIT";
  ASSERT_FALSE(std::filesystem::exists(commit_file)) << commit_file;
  json = report.ToJson();
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_THAT(*json, HasSubstr("\"commit\": \"unknown\""));

  std::ofstream(commit_file) << "def5678\n";
  json = report.ToJson();
  std::filesystem::remove(commit_file);
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_THAT(*json, HasSubstr("\"commit\": \"def5678\""));
}

// Timelines: the step rows of a low-latency kernel read the step's slot (latest over blocks), and a row that no run
// recorded is left out.
TEST(Timeline, StepRowsReadTheirSlotsAndUnreachedRowsAreLeftOut) {
  constexpr int kSlots = kernels::kProfileSlotsPerBlock;
  Timeline t;
  t.num_blocks = 2;
  t.slots.assign(2 * kSlots, 0);
  t.slots[0] = 1000;           // block 0 entry
  t.slots[kSlots] = 1500;      // block 1 entry
  t.slots[2 + 3] = 9000;       // block 0, warp 3 ends
  t.slots[kSlots + 2] = 7000;  // block 1, warp 0 ends
  const int stored = static_cast<int>(kernels::LowLatencyStep::kDispatchDataStored);
  t.slots[stored] = 4000;
  t.slots[kSlots + stored] = 5000;
  EXPECT_DOUBLE_EQ(t.DurationUs(), 8.0);
  EXPECT_DOUBLE_EQ(t.WarpsEndUs(0, 16), 8.0);
  EXPECT_DOUBLE_EQ(t.Slot1MaxUs(), 0.0);

  const std::vector<WarpRole> roles = LowLatencyStepRoles(/*combine=*/false);
  ASSERT_FALSE(roles.empty());
  EXPECT_EQ(roles[0].first_warp + 2, stored);
  EXPECT_EQ(roles.back().name, "all warps");
  EXPECT_DOUBLE_EQ(t.WarpsEndUs(roles[0].first_warp, roles[0].last_warp), 4.0);

  ::testing::internal::CaptureStdout();
  PrintTimelines("test", {t}, roles);
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_THAT(out, HasSubstr("data pieces stored"));
  EXPECT_THAT(out, ::testing::Not(HasSubstr("counts published")));  // no run reached it
  EXPECT_THAT(out, ::testing::Not(HasSubstr("slot 1")));
  EXPECT_THAT(out, HasSubstr("kernel (first entry to last warp end)"));
}

TEST(ReadResultsFile, AMissingFileIsNotFound) {
  EXPECT_TRUE(absl::IsNotFound(ReadResultsFile("/nonexistent/restart.txt").status()));
}

}  // namespace
}  // namespace epfabric::bench
