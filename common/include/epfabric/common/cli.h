// Command-line parsing for epfabric's binaries on top of Abseil flags. absl::ParseCommandLine exits with status 1
// and prints its own usage on a bad flag; our binaries must instead exit with status 2 and a one-line message
// naming the flag, and support `VERB --help`. Values are still parsed and stored by Abseil's flag registry.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace epfabric::cli {

struct ParsedArgs {
  // Arguments that are not flags, in order (argv[0] excluded); everything after "--" is positional too.
  std::vector<std::string> positional;
  // --help or -h appeared anywhere.
  bool help = false;
};

// Parses `--name=value`, `--name value`, `--flag` / `--noflag` (booleans) into the registered Abseil flags.
// Returns InvalidArgumentError("--name: reason") for an unknown flag, a missing value or a value that does not
// parse. Flags that do not appear keep their current values.
absl::StatusOr<ParsedArgs> ParseFlags(int argc, const char* const* argv);

// "  --name=default  help" lines for every registered flag defined in a file whose path contains
// `file_substring`, sorted by name: the flag part of a --help text.
std::string FlagsHelp(const std::string& file_substring);

// Unix exit codes our binaries use.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

}  // namespace epfabric::cli
