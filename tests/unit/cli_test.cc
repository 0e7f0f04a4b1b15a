#include <gtest/gtest.h>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "epfabric/common/cli.h"

ABSL_FLAG(int, cli_test_count, 1, "test flag");
ABSL_FLAG(bool, cli_test_verbose, false, "test flag");
ABSL_FLAG(std::string, cli_test_name, "", "test flag");

namespace epfabric::cli {
namespace {

absl::StatusOr<ParsedArgs> Parse(std::vector<const char*> args) {
  args.insert(args.begin(), "prog");
  return ParseFlags(static_cast<int>(args.size()), args.data());
}

TEST(ParseFlags, FormsOfValues) {
  absl::FlagSaver saver;
  auto parsed = Parse({"--cli_test_count=7", "verb", "--cli_test_name", "abc", "--cli_test_verbose", "tail"});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_count), 7);
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_name), "abc");
  EXPECT_TRUE(absl::GetFlag(FLAGS_cli_test_verbose));
  EXPECT_EQ(parsed->positional, (std::vector<std::string>{"verb", "tail"}));
  EXPECT_FALSE(parsed->help);
}

TEST(ParseFlags, NegatedBoolAndSingleDash) {
  absl::FlagSaver saver;
  absl::SetFlag(&FLAGS_cli_test_verbose, true);
  ASSERT_TRUE(Parse({"--nocli_test_verbose", "-cli_test_count=3"}).ok());
  EXPECT_FALSE(absl::GetFlag(FLAGS_cli_test_verbose));
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_count), 3);
}

TEST(ParseFlags, HelpAndDoubleDash) {
  absl::FlagSaver saver;
  auto parsed = Parse({"verb", "--help", "--", "--cli_test_count=9"});
  ASSERT_TRUE(parsed.ok());
  EXPECT_TRUE(parsed->help);
  EXPECT_EQ(parsed->positional, (std::vector<std::string>{"verb", "--cli_test_count=9"}));
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_count), 1);
}

TEST(ParseFlags, ErrorsNameTheFlag) {
  absl::FlagSaver saver;
  EXPECT_EQ(Parse({"--cli_test_nope=1"}).status().message(), "--cli_test_nope: unknown flag");
  EXPECT_EQ(Parse({"--cli_test_count"}).status().message(), "--cli_test_count: needs a value");
  EXPECT_EQ(Parse({"--cli_test_count=x"}).status().message(),
            "--cli_test_count: Illegal value 'x' specified for flag 'cli_test_count'");
  EXPECT_EQ(Parse({"--nocli_test_count"}).status().message(), "--nocli_test_count: unknown flag");
  EXPECT_EQ(Parse({"--cli_test_verbose=maybe"}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(FlagsHelp, ListsOnlyFlagsOfTheGivenFile) {
  const std::string help = FlagsHelp("unit/cli_test.cc");
  EXPECT_NE(help.find("--cli_test_count=1"), std::string::npos) << help;
  EXPECT_NE(help.find("--cli_test_name="), std::string::npos);
  EXPECT_EQ(FlagsHelp("no/such/file.cc"), "");
}

}  // namespace
}  // namespace epfabric::cli
