// Scenarios shared by the host backend's thread and process tests (host_backend_scenarios.h includes them all): what
// every scenario uses: mismatch reports, aligned buffers and random routings and values.
#pragma once

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "epfabric/kernels/host_backend.h"
#include "epfabric/kernels/reference/fp8.h"
#include "epfabric/kernels/reference/intranode_reference.h"
#include "epfabric/kernels/reference/low_latency_reference.h"

namespace epfabric::kernels::host_backend_test {

namespace ref = ::epfabric::kernels::reference;

// Collects the first mismatches (with enough context to find them) and counts the rest.
class Mismatches {
 public:
  void Add(const std::string& what) {
    if (count_++ < 8) text_ += what + "\n";
  }
  template <typename T>
  void CompareArrays(const char* what, int rank, const T* got, const T* want, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
        Add(absl::StrFormat("rank %d: %s[%d] differs", rank, what, i));
        return;
      }
    }
  }
  void Status(const char* what, int rank, const absl::Status& status) {
    if (!status.ok()) Add(absl::StrFormat("rank %d: %s returned %s", rank, what, status.ToString()));
  }
  bool empty() const { return count_ == 0; }
  std::string str() const { return count_ <= 8 ? text_ : text_ + absl::StrFormat("... %d in all\n", count_); }

 private:
  int count_ = 0;
  std::string text_;
};

// Memory the host backend may use as a region or a tensor: 64-byte aligned, zeroed.
struct AlignedBuffer {
  explicit AlignedBuffer(size_t bytes = 0) { Resize(bytes); }
  void Resize(size_t bytes) {
    storage.assign(bytes + 64, 0);
    const uintptr_t base = reinterpret_cast<uintptr_t>(storage.data());
    data = reinterpret_cast<uint8_t*>((base + 63) & ~uintptr_t{63});
  }
  std::vector<uint8_t> storage;
  uint8_t* data = nullptr;
};

// ---------------------------------------------------------------------------------------------------------------
// Routing shared by both modes.

struct Routing {
  double empty_fraction = 0.1;     // top-k entries set to -1
  double invalid_fraction = 0.0;   // entries >= num_experts (treated as -1 by every function)
  bool all_to_one_expert = false;  // every token: [expert 0, -1, -1, ...] (one rank receives everything)
  int silent_rank = -1;            // this rank's tokens go nowhere (all -1)
  bool allow_duplicates = false;   // an expert may appear twice in a row (low-latency semantics cover it)
};

inline std::vector<int64_t> RandomTopk(std::mt19937_64& rng, int num_tokens, int num_topk, int num_experts, int rank,
                                       const Routing& routing) {
  std::vector<int64_t> idx(static_cast<size_t>(num_tokens) * num_topk, -1);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::uniform_int_distribution<int> expert(0, num_experts - 1);
  for (int t = 0; t < num_tokens; ++t) {
    int64_t* row = &idx[static_cast<size_t>(t) * num_topk];
    if (rank == routing.silent_rank) continue;
    if (routing.all_to_one_expert) {
      row[0] = 0;
      continue;
    }
    for (int k = 0; k < num_topk; ++k) {
      if (unit(rng) < routing.empty_fraction) continue;
      if (unit(rng) < routing.invalid_fraction) {
        row[k] = num_experts + expert(rng) % 5;
        continue;
      }
      int64_t e = expert(rng);
      if (!routing.allow_duplicates || unit(rng) > 0.1) {
        // Distinct experts per row (if there are enough).
        for (int tries = 0; tries < 64 && std::find(row, row + k, e) != row + k; ++tries) e = expert(rng);
        if (std::find(row, row + k, e) != row + k) continue;
      } else if (k > 0 && row[k - 1] >= 0 && row[k - 1] < num_experts) {
        e = row[k - 1];  // a duplicate
      }
      row[k] = e;
    }
  }
  return idx;
}

// A vector's data, never null: an empty input still says "this tensor is given" (a null top-k pointer would mean
// "no top-k" to the receive side as well, on the GPU as here).
template <typename T>
const T* DataOrDummy(const std::vector<T>& v) {
  static const T dummy[16] = {};
  return v.empty() ? dummy : v.data();
}

inline uint16_t RandomBf16(std::mt19937_64& rng, float range = 2.0f) {
  std::uniform_real_distribution<float> dist(-range, range);
  return ref::FloatToBf16(dist(rng));
}

// Values spread over 2^-12 .. 2^12: float sums of such BF16 values are rarely exact, so a reduction in another order
// than the reference's gives other bits (a test that only used values of one magnitude could not tell).
inline uint16_t RandomWideBf16(std::mt19937_64& rng) {
  const uint64_t bits = rng();
  const uint32_t sign = static_cast<uint32_t>(bits & 1u) << 15;
  const uint32_t exponent = 127 - 12 + static_cast<uint32_t>((bits >> 1) % 25);
  const uint32_t mantissa = static_cast<uint32_t>(bits >> 8) & 0x7Fu;
  return static_cast<uint16_t>(sign | (exponent << 7) | mantissa);
}

}  // namespace epfabric::kernels::host_backend_test
