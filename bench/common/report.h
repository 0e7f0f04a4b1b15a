// What every benchmark writes: a JSON file in bench/results/ with the device name, the date, the commit, the
// configuration and a flat map of results whose keys carry their unit (`dispatch_bf16_gbps`, `layout_us`).
#pragma once

#include <map>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace epfabric::bench {

// Median and spread of repeated measurements.
struct Summary {
  double median = 0;
  double p10 = 0;
  double p90 = 0;
  double min = 0;
  double max = 0;
  size_t count = 0;
};

// Summarises `samples` (any order). An empty input gives a zero Summary.
Summary Summarize(std::vector<double> samples);

class Report {
 public:
  // `name` prefixes the output file: bench/results/<name>-<date>.json.
  explicit Report(std::string name);

  void SetConfig(const std::string& key, std::variant<double, std::string> value);
  void SetResult(const std::string& key, double value);

  // The device that ran the benchmark (default: the name of CUDA device 0, or "host" without one).
  void SetDevice(std::string device) { device_ = std::move(device); }

  // Where the ranks ran: adds "num_ranks", "num_gpus" and "shared_gpu" (num_ranks > num_gpus) to the document. On a
  // shared GPU the ranks' traffic stays in one GPU's memory and they split its SMs: such figures are not comparable
  // with NVLink figures (SharedGpuNote). Not set: the fields are left out (a benchmark without GPU ranks).
  void SetPlacement(int num_ranks, int num_gpus);
  bool shared_gpu() const { return placement_set_ && num_ranks_ > num_gpus_; }

  // The JSON document. The commit comes from $EPF_COMMIT (scripts/epf sets it; the device bundle records it).
  absl::StatusOr<std::string> ToJson() const;

  // Writes <dir>/<name>-<UTC date and time>.json and returns the path.
  absl::StatusOr<std::string> WriteTo(const std::string& dir) const;

 private:
  std::string name_;
  std::string device_;
  std::string date_;
  bool placement_set_ = false;
  int num_ranks_ = 0;
  int num_gpus_ = 0;
  std::map<std::string, std::variant<double, std::string>> config_;
  std::map<std::string, double> results_;
};

// Results measured by another program that belong in a benchmark's report (device-checks' restart.txt): `key=value`
// lines, each value a number; blank lines and lines starting with '#' are skipped. Errors name the file and line.
absl::StatusOr<std::vector<std::pair<std::string, double>>> ReadResultsFile(const std::string& path);

// The line a benchmark prints when its ranks share GPUs (empty when they do not): the figures are not comparable with
// NVLink figures.
std::string SharedGpuNote(int num_ranks, int num_gpus);

// Name of CUDA device `ordinal`, or "host" when no device is visible.
std::string CudaDeviceName(int ordinal = 0);

}  // namespace epfabric::bench
