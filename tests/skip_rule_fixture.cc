// skip_rule_test's fixture (tests/CMakeLists.txt): cases that pass, fail, crash and skip, picked with --gtest_filter.
// Never a test of its own: Fails and Crashes fail on purpose.
#include <gtest/gtest.h>

#include <cstdlib>

namespace {

TEST(SkipRuleFixture, Passes) { EXPECT_EQ(1 + 1, 2); }

TEST(SkipRuleFixture, Fails) { EXPECT_EQ(1 + 1, 3) << "fails on purpose"; }

TEST(SkipRuleFixture, Skips) { GTEST_SKIP() << "skips on purpose"; }

// After a skipped case ran (the filter runs this one last): the binary dies before GoogleTest reports anything.
TEST(SkipRuleFixture, Crashes) { std::abort(); }

}  // namespace
