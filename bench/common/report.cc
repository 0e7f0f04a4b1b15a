#include "common/report.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include <cuda_runtime_api.h>
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace epfabric::bench {

Summary Summarize(std::vector<double> samples) {
  Summary s;
  if (samples.empty()) return s;
  std::sort(samples.begin(), samples.end());
  auto at = [&](double q) { return samples[static_cast<size_t>(q * (samples.size() - 1) + 0.5)]; };
  s.median = at(0.5);
  s.p10 = at(0.1);
  s.p90 = at(0.9);
  s.min = samples.front();
  s.max = samples.back();
  s.count = samples.size();
  return s;
}

absl::StatusOr<std::vector<std::pair<std::string, double>>> ReadResultsFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::vector<std::pair<std::string, double>> results;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    const absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty() || text[0] == '#') continue;
    const size_t eq = text.find('=');
    const absl::string_view key = eq == absl::string_view::npos ? text : absl::StripAsciiWhitespace(text.substr(0, eq));
    double value = 0;
    if (eq == absl::string_view::npos || key.empty() ||
        !absl::SimpleAtod(absl::StripAsciiWhitespace(text.substr(eq + 1)), &value) || !std::isfinite(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", number, ": '", text, "' is not key=value with a finite numeric value"));
    }
    results.emplace_back(std::string(key), value);
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", path));
  return results;
}

std::string CudaDeviceName(int ordinal) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, ordinal) != cudaSuccess) {
    (void)cudaGetLastError();
    return "host";
  }
  return prop.name;
}

Report::Report(std::string name)
    : name_(std::move(name)), date_(absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(), absl::UTCTimeZone())) {}

void Report::SetConfig(const std::string& key, std::variant<double, std::string> value) { config_[key] = value; }

void Report::SetResult(const std::string& key, double value) { results_[key] = value; }

void Report::SetPlacement(int num_ranks, int num_gpus) {
  placement_set_ = true;
  num_ranks_ = num_ranks;
  num_gpus_ = num_gpus;
}

std::string SharedGpuNote(int num_ranks, int num_gpus) {
  if (num_ranks <= num_gpus) return "";
  return absl::StrCat("shared GPU: ", num_ranks, " ranks on ", num_gpus,
                      " GPU(s); peer traffic stays in one GPU's memory and the ranks split its SMs, so these figures "
                      "are NOT comparable with NVLink figures (\"shared_gpu\": true in the JSON)");
}

namespace {

// The commit the binary was built from: EPF_COMMIT, else the COMMIT file of the bundle it runs from (scripts/epf
// bundle writes it beside bin/), else "unknown".
std::string BuildCommit() {
  if (const char* commit = std::getenv("EPF_COMMIT"); commit != nullptr && *commit != '\0') return commit;
  std::error_code error;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", error);
  if (!error) {
    std::ifstream in(exe.parent_path().parent_path() / "COMMIT");
    std::string line;
    if (in && std::getline(in, line) && !absl::StripAsciiWhitespace(line).empty()) {
      return std::string(absl::StripAsciiWhitespace(line));
    }
  }
  return "unknown";
}

}  // namespace

absl::StatusOr<std::string> Report::ToJson() const {
  google::protobuf::Struct doc;
  auto& fields = *doc.mutable_fields();
  fields["name"].set_string_value(name_);
  fields["device"].set_string_value(device_.empty() ? CudaDeviceName() : device_);
  fields["date"].set_string_value(date_);
  fields["commit"].set_string_value(BuildCommit());
  if (placement_set_) {
    fields["num_ranks"].set_number_value(num_ranks_);
    fields["num_gpus"].set_number_value(num_gpus_);
    fields["shared_gpu"].set_bool_value(num_ranks_ > num_gpus_);
  }
  auto& config = *fields["config"].mutable_struct_value()->mutable_fields();
  for (const auto& [key, value] : config_) {
    if (const double* d = std::get_if<double>(&value)) {
      config[key].set_number_value(*d);
    } else {
      config[key].set_string_value(std::get<std::string>(value));
    }
  }
  auto& results = *fields["results"].mutable_struct_value()->mutable_fields();
  for (const auto& [key, value] : results_) results[key].set_number_value(value);

  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  const auto status = google::protobuf::util::MessageToJsonString(doc, &json, options);
  if (!status.ok()) return absl::InternalError(absl::StrCat("cannot render JSON: ", status.ToString()));
  return json;
}

absl::StatusOr<std::string> Report::WriteTo(const std::string& dir) const {
  absl::StatusOr<std::string> json = ToJson();
  if (!json.ok()) return json.status();
  std::string stamp = date_;
  std::replace(stamp.begin(), stamp.end(), ':', '-');
  const std::string path = absl::StrCat(dir, "/", name_, "-", stamp, ".json");
  std::ofstream out(path);
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  out << *json;
  if (!out.good()) return absl::DataLossError(absl::StrCat("short write to ", path));
  return path;
}

}  // namespace epfabric::bench
