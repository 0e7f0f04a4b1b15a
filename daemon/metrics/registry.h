// A small Prometheus metrics registry: counters and histograms with labels that the daemon updates as things happen,
// plus collectors that read state (groups, leases, membership) through the owners' accessors at scrape time, and the
// text exposition format (version 0.0.4). Debian 12 has no prometheus-cpp; this is the part of it we need.
//
// Locking: one mutex guards every series of the registry; collectors run outside it (they take their owners' locks).
// Updates are rare events (RPCs, attaches, refusals), never the data path.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace epfabric::daemon::metrics {

enum class MetricType { kCounter, kGauge, kHistogram };
const char* MetricTypeName(MetricType type);

// Label (name, value) pairs in the order the family declares the names.
using Labels = std::vector<std::pair<std::string, std::string>>;

// One line of the exposition: `name` carries the histogram suffix (_bucket, _sum, _count) where there is one.
struct Sample {
  std::string name;
  Labels labels;
  double value = 0;
};

struct Family {
  std::string name;
  std::string help;
  MetricType type = MetricType::kGauge;
  std::vector<Sample> samples;
};

// Builds a gauge (or counter) family inside a collector.
class FamilyBuilder {
 public:
  FamilyBuilder(std::string name, std::string help, MetricType type = MetricType::kGauge) {
    family_.name = std::move(name);
    family_.help = std::move(help);
    family_.type = type;
  }
  FamilyBuilder& Add(Labels labels, double value) {
    family_.samples.push_back(Sample{family_.name, std::move(labels), value});
    return *this;
  }
  Family Build() { return std::move(family_); }  // once

 private:
  Family family_;
};

// [a-zA-Z_:][a-zA-Z0-9_:]* (metric names) and [a-zA-Z_][a-zA-Z0-9_]* (label names).
bool ValidMetricName(const std::string& name);
bool ValidLabelName(const std::string& name);

class Registry;

// A counter family: one monotonically increasing value per combination of label values.
class CounterVec {
 public:
  CounterVec() = default;  // unregistered: updates do nothing
  // `label_values` in the order of the family's label names (missing ones are empty).
  void Increment(const std::vector<std::string>& label_values, double by = 1) const;
  double Value(const std::vector<std::string>& label_values) const;

 private:
  friend class Registry;
  CounterVec(Registry* registry, size_t index) : registry_(registry), index_(index) {}
  Registry* registry_ = nullptr;
  size_t index_ = 0;
};

// A histogram family (cumulative buckets, _sum and _count per combination of label values).
class HistogramVec {
 public:
  HistogramVec() = default;  // unregistered: updates do nothing
  void Observe(const std::vector<std::string>& label_values, double value) const;

 private:
  friend class Registry;
  HistogramVec(Registry* registry, size_t index) : registry_(registry), index_(index) {}
  Registry* registry_ = nullptr;
  size_t index_ = 0;
};

class Registry {
 public:
  // Produces families from state owned elsewhere, at scrape time (called outside the registry's lock).
  using Collector = std::function<std::vector<Family>()>;

  // Registration happens while the daemon starts; a bad or repeated name is a programming error (InvalidArgument).
  absl::Status AddCounter(const std::string& name, const std::string& help, std::vector<std::string> label_names,
                          CounterVec* out);
  // `buckets`: strictly increasing upper bounds; +Inf is implied.
  absl::Status AddHistogram(const std::string& name, const std::string& help, std::vector<std::string> label_names,
                            std::vector<double> buckets, HistogramVec* out);
  void AddCollector(Collector collector);

  // Every family: the registry's own (in registration order), then each collector's.
  std::vector<Family> Collect() const;

 private:
  friend class CounterVec;
  friend class HistogramVec;
  struct Series {
    double value = 0;                     // counter
    std::vector<uint64_t> bucket_counts;  // histogram: per bucket, not cumulative (the last one is +Inf)
    double sum = 0;
    uint64_t count = 0;
  };
  struct Owned {
    std::string name;
    std::string help;
    MetricType type;
    std::vector<std::string> label_names;
    std::vector<double> buckets;
    std::map<std::vector<std::string>, Series> series;
  };
  absl::Status CheckNew(const std::string& name, const std::vector<std::string>& label_names) const
      ABSL_SHARED_LOCKS_REQUIRED(mutex_);
  Series& SeriesLocked(Owned& family, const std::vector<std::string>& label_values)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  mutable absl::Mutex mutex_;
  std::vector<Owned> families_ ABSL_GUARDED_BY(mutex_);
  std::vector<Collector> collectors_ ABSL_GUARDED_BY(mutex_);
};

// The Prometheus text format (version 0.0.4) of `families`: # HELP, # TYPE, then one line per sample.
std::string Exposition(const std::vector<Family>& families);

// Label value escaping of the text format: backslash, double quote and newline.
std::string EscapeLabelValue(const std::string& value);

}  // namespace epfabric::daemon::metrics
