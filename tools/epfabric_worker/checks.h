// epfabric_worker: comparisons of outputs with the host reference and the weighted sum.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "worker.h"

namespace epfabric::worker {

class Checks {
 public:
  explicit Checks(int rank) : rank_(rank) {}

  void Fail(const std::string& what) {
    if (failures_++ < 6) std::cerr << "worker rank " << rank_ << ": " << what << "\n";
  }
  template <typename T>
  void Exact(const std::string& what, const std::vector<T>& got, const T* want, size_t n) {
    if (got.size() < n) {
      Fail(absl::StrFormat("%s: %d elements, expected %d", what, got.size(), n));
      return;
    }
    for (size_t i = 0; i < n; ++i) {
      if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
        Fail(absl::StrFormat("%s[%d] differs from the reference", what, i));
        return;
      }
    }
  }
  template <typename T>
  void Exact(const std::string& what, const std::vector<T>& got, const std::vector<T>& want) {
    if (got.size() != want.size()) {
      Fail(absl::StrFormat("%s: %d elements, expected %d", what, got.size(), want.size()));
      return;
    }
    Exact(what, got, want.data(), want.size());
  }
  // combined (bf16) against the weighted sum in double, with its magnitude.
  void WeightedSum(const std::string& what, const std::vector<uint16_t>& got, const std::vector<double>& want,
                   const std::vector<double>& magnitude) {
    if (got.size() != want.size()) {
      Fail(absl::StrFormat("%s: %d elements, expected %d", what, got.size(), want.size()));
      return;
    }
    for (size_t i = 0; i < got.size(); ++i) {
      const double value = ref::Bf16ToFloat(got[i]);
      const double err = std::fabs(value - want[i]);
      const double tolerance = std::ldexp(magnitude[i], -6) + 1e-6;
      if (!(err <= tolerance)) {
        Fail(absl::StrFormat("%s[%d] = %g, expected weighted sum %g (tolerance %g)", what, i, value, want[i],
                             tolerance));
        return;
      }
      if (magnitude[i] > 0) max_rel_err_ = std::max(max_rel_err_, err / magnitude[i]);
    }
  }
  void Status(const std::string& what, const absl::Status& status) {
    if (!status.ok()) Fail(absl::StrCat(what, ": ", status.ToString()));
  }

  int rank() const { return rank_; }
  int failures() const { return failures_; }
  double max_rel_err() const { return max_rel_err_; }
  double max_rel_err_vs_bf16 = 0;

 private:
  int rank_;
  int failures_ = 0;
  double max_rel_err_ = 0;
};

}  // namespace epfabric::worker
