#include "metrics/registry.h"

#include <cmath>
#include <cstdlib>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace epfabric::daemon::metrics {
namespace {

bool NameChar(char c, bool first, bool colon) {
  const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colon && c == ':');
  return alpha || (!first && c >= '0' && c <= '9');
}

bool ValidName(const std::string& name, bool colon) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    if (!NameChar(name[i], i == 0, colon)) return false;
  }
  return true;
}

// Integers exactly (counters of bytes must not turn into 1.04858e+06), others with full precision.
std::string FormatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  if (std::floor(value) == value && std::fabs(value) < 9007199254740992.0) {
    return absl::StrCat(static_cast<int64_t>(value));
  }
  // The shortest form that reads back as the same double (0.001, not 0.0010000000000000000208).
  std::string text;
  for (int precision = 15; precision <= 17; ++precision) {
    text = absl::StrFormat("%.*g", precision, value);
    if (std::strtod(text.c_str(), nullptr) == value) break;
  }
  return text;
}

std::string EscapeHelp(const std::string& help) {
  std::string out;
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

Labels Zip(const std::vector<std::string>& names, const std::vector<std::string>& values) {
  Labels labels;
  labels.reserve(names.size());
  for (size_t i = 0; i < names.size(); ++i) labels.emplace_back(names[i], values[i]);
  return labels;
}

}  // namespace

const char* MetricTypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

bool ValidMetricName(const std::string& name) { return ValidName(name, true); }
bool ValidLabelName(const std::string& name) { return ValidName(name, false) && name.rfind("__", 0) != 0; }

std::string EscapeLabelValue(const std::string& value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

absl::Status Registry::CheckNew(const std::string& name, const std::vector<std::string>& label_names) const {
  if (!ValidMetricName(name)) return absl::InvalidArgumentError(absl::StrCat("metric name '", name, "' is not valid"));
  for (const Owned& family : families_) {
    if (family.name == name) return absl::InvalidArgumentError(absl::StrCat("metric '", name, "' registered twice"));
  }
  std::set<std::string> seen;
  for (const std::string& label : label_names) {
    if (!ValidLabelName(label) || label == "le" || !seen.insert(label).second) {
      return absl::InvalidArgumentError(absl::StrCat("metric '", name, "': label name '", label, "' is not valid"));
    }
  }
  return absl::OkStatus();
}

absl::Status Registry::AddCounter(const std::string& name, const std::string& help,
                                  std::vector<std::string> label_names, CounterVec* out) {
  absl::MutexLock lock(&mutex_);
  if (absl::Status ok = CheckNew(name, label_names); !ok.ok()) return ok;
  families_.push_back(Owned{name, help, MetricType::kCounter, std::move(label_names), {}, {}});
  *out = CounterVec(this, families_.size() - 1);
  return absl::OkStatus();
}

absl::Status Registry::AddHistogram(const std::string& name, const std::string& help,
                                    std::vector<std::string> label_names, std::vector<double> buckets,
                                    HistogramVec* out) {
  absl::MutexLock lock(&mutex_);
  if (absl::Status ok = CheckNew(name, label_names); !ok.ok()) return ok;
  if (buckets.empty()) return absl::InvalidArgumentError(absl::StrCat("histogram '", name, "': no buckets"));
  for (size_t i = 1; i < buckets.size(); ++i) {
    if (!(buckets[i] > buckets[i - 1])) {
      return absl::InvalidArgumentError(absl::StrCat("histogram '", name, "': buckets must increase"));
    }
  }
  families_.push_back(Owned{name, help, MetricType::kHistogram, std::move(label_names), std::move(buckets), {}});
  *out = HistogramVec(this, families_.size() - 1);
  return absl::OkStatus();
}

void Registry::AddCollector(Collector collector) {
  absl::MutexLock lock(&mutex_);
  collectors_.push_back(std::move(collector));
}

Registry::Series& Registry::SeriesLocked(Owned& family, const std::vector<std::string>& label_values) {
  std::vector<std::string> key = label_values;
  key.resize(family.label_names.size());
  Series& series = family.series[key];
  if (family.type == MetricType::kHistogram && series.bucket_counts.empty()) {
    series.bucket_counts.assign(family.buckets.size() + 1, 0);
  }
  return series;
}

void CounterVec::Increment(const std::vector<std::string>& label_values, double by) const {
  if (registry_ == nullptr || !(by >= 0)) return;
  absl::MutexLock lock(&registry_->mutex_);
  registry_->SeriesLocked(registry_->families_[index_], label_values).value += by;
}

double CounterVec::Value(const std::vector<std::string>& label_values) const {
  if (registry_ == nullptr) return 0;
  absl::MutexLock lock(&registry_->mutex_);
  return registry_->SeriesLocked(registry_->families_[index_], label_values).value;
}

void HistogramVec::Observe(const std::vector<std::string>& label_values, double value) const {
  if (registry_ == nullptr || std::isnan(value)) return;
  absl::MutexLock lock(&registry_->mutex_);
  Registry::Owned& family = registry_->families_[index_];
  Registry::Series& series = registry_->SeriesLocked(family, label_values);
  size_t bucket = 0;
  while (bucket < family.buckets.size() && value > family.buckets[bucket]) ++bucket;
  ++series.bucket_counts[bucket];
  series.sum += value;
  ++series.count;
}

std::vector<Family> Registry::Collect() const {
  std::vector<Family> families;
  std::vector<Collector> collectors;
  {
    absl::MutexLock lock(&mutex_);
    for (const Owned& owned : families_) {
      Family family{owned.name, owned.help, owned.type, {}};
      for (const auto& [values, series] : owned.series) {
        Labels labels = Zip(owned.label_names, values);
        if (owned.type != MetricType::kHistogram) {
          family.samples.push_back(Sample{owned.name, std::move(labels), series.value});
          continue;
        }
        uint64_t cumulative = 0;
        for (size_t b = 0; b <= owned.buckets.size(); ++b) {
          cumulative += series.bucket_counts[b];
          Labels with_le = labels;
          with_le.emplace_back("le", b < owned.buckets.size() ? FormatValue(owned.buckets[b]) : "+Inf");
          family.samples.push_back(Sample{owned.name + "_bucket", std::move(with_le), static_cast<double>(cumulative)});
        }
        family.samples.push_back(Sample{owned.name + "_sum", labels, series.sum});
        family.samples.push_back(Sample{owned.name + "_count", std::move(labels), static_cast<double>(series.count)});
      }
      families.push_back(std::move(family));
    }
    collectors = collectors_;
  }
  for (const Collector& collector : collectors) {
    for (Family& family : collector()) families.push_back(std::move(family));
  }
  return families;
}

std::string Exposition(const std::vector<Family>& families) {
  std::string out;
  for (const Family& family : families) {
    absl::StrAppend(&out, "# HELP ", family.name, " ", EscapeHelp(family.help), "\n");
    absl::StrAppend(&out, "# TYPE ", family.name, " ", MetricTypeName(family.type), "\n");
    for (const Sample& sample : family.samples) {
      out += sample.name;
      if (!sample.labels.empty()) {
        out += '{';
        for (size_t i = 0; i < sample.labels.size(); ++i) {
          absl::StrAppend(&out, i ? "," : "", sample.labels[i].first, "=\"", EscapeLabelValue(sample.labels[i].second),
                          "\"");
        }
        out += '}';
      }
      absl::StrAppend(&out, " ", FormatValue(sample.value), "\n");
    }
  }
  return out;
}

}  // namespace epfabric::daemon::metrics
