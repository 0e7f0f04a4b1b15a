#include "epfabric/common/cli.h"

#include <map>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace epfabric::cli {

absl::StatusOr<ParsedArgs> ParseFlags(int argc, const char* const* argv) {
  ParsedArgs parsed;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") {
      for (++i; i < argc; ++i) parsed.positional.emplace_back(argv[i]);
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') {
      parsed.positional.push_back(arg);
      continue;
    }
    std::string name = arg.substr(arg[1] == '-' ? 2 : 1);
    std::string value;
    const size_t eq = name.find('=');
    const bool has_value = eq != std::string::npos;
    if (has_value) {
      value = name.substr(eq + 1);
      name.resize(eq);
    }
    if (name == "help" || name == "h") {
      parsed.help = true;
      continue;
    }
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && !has_value && absl::StartsWith(name, "no")) {
      absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
      if (negated != nullptr && negated->IsOfType<bool>()) {
        flag = negated;
        value = "false";
      }
    } else if (flag != nullptr && !has_value) {
      if (flag->IsOfType<bool>()) {
        value = "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        return absl::InvalidArgumentError(absl::StrCat("--", name, ": needs a value"));
      }
    }
    if (flag == nullptr) return absl::InvalidArgumentError(absl::StrCat("--", name, ": unknown flag"));
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag->Name(), ": ", error));
    }
  }
  return parsed;
}

std::string FlagsHelp(const std::string& file_substring) {
  std::map<std::string, const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::StrContains(flag->Filename(), file_substring)) flags.emplace(std::string(name), flag);
  }
  std::string help;
  for (const auto& [name, flag] : flags) {
    absl::StrAppend(&help, "  --", name, "=", flag->DefaultValue(), "\n      ", flag->Help(), "\n");
  }
  return help;
}

}  // namespace epfabric::cli
