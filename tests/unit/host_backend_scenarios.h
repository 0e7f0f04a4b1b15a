// Scenarios shared by the host backend's thread and process tests: deterministic random inputs for every rank, the
// expected results from the host references, and the per-rank sequence of host-backend calls with an element-by-
// element comparison. A rank's function runs in a thread (host_backend_test) or in a child process
// (host_backend_process_test); it returns the mismatches it found (empty = all equal) and always issues the whole
// sequence of calls, so that one rank's mismatch does not leave its peers waiting.
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

// ---------------------------------------------------------------------------------------------------------------
// Intranode.

enum class TopkMode { kIdsAndWeights, kIdsOnly, kNone };

struct IntranodeCase {
  std::vector<int> num_tokens;  // per rank; size = number of ranks
  int hidden = 256;
  int num_topk = 4;
  int num_experts = 16;
  bool fp8 = false;
  TopkMode topk = TopkMode::kIdsAndWeights;
  bool bias = false;
  int num_channels = 3;
  int expert_alignment = 1;
  bool worst_case_capacity = false;  // recv tensors sized for the worst case (no wait for the count), not the count
  // fp8: x_scales as DeepEP's packed UE8M0 int32 words [T, hidden / 512] (4 exponent bytes each; the float vectors
  // then hold the words' bits) instead of float scales [T, hidden / 128]. hidden must be a multiple of 512.
  bool packed_scales = false;
  Routing routing;
  uint64_t seed = 1;
  int num_ranks() const { return static_cast<int>(num_tokens.size()); }
};

struct IntranodeExpected {
  IntranodeCase c;
  ref::DispatchConfig config;
  std::vector<ref::RankInput> inputs;
  std::vector<ref::RankOutput> dispatched;
  std::vector<ref::CombineInput> combine_inputs;
  std::vector<ref::CombineOutput> combined;
};

inline IntranodeExpected MakeIntranodeExpected(const IntranodeCase& c) {
  IntranodeExpected x;
  x.c = c;
  const int R = c.num_ranks();
  x.config.num_ranks = R;
  x.config.row_bytes = c.fp8 ? c.hidden : c.hidden * 2;
  x.config.num_scales = !c.fp8 ? 0 : c.packed_scales ? c.hidden / 512 : c.hidden / 128;
  x.config.num_topk = c.topk == TopkMode::kNone ? 0 : c.num_topk;
  x.config.has_weights = c.topk == TopkMode::kIdsAndWeights;
  x.config.num_experts = c.num_experts;
  x.config.num_channels = c.num_channels;
  x.config.expert_alignment = c.expert_alignment;
  std::mt19937_64 rng(c.seed);
  std::uniform_real_distribution<float> weight(0.0f, 1.0f);
  x.inputs.resize(R);
  for (int r = 0; r < R; ++r) {
    ref::RankInput& in = x.inputs[r];
    in.num_tokens = c.num_tokens[r];
    in.routing_topk = c.num_topk;
    in.topk_idx = RandomTopk(rng, in.num_tokens, c.num_topk, c.num_experts, r, c.routing);
    in.x.resize(static_cast<size_t>(in.num_tokens) * x.config.row_bytes);
    if (c.fp8) {
      for (uint8_t& b : in.x) b = static_cast<uint8_t>(rng());
      in.x_scales.resize(static_cast<size_t>(in.num_tokens) * x.config.num_scales);
      for (float& s : in.x_scales) {
        if (c.packed_scales) {  // exponent bytes around 127 (scales near 1): never a NaN pattern as a float
          const uint32_t word =
              (100u + rng() % 41) | (100u + rng() % 41) << 8 | (100u + rng() % 41) << 16 | (100u + rng() % 41) << 24;
          std::memcpy(&s, &word, sizeof(word));
        } else {
          s = weight(rng) + 0.01f;
        }
      }
    } else {
      for (size_t i = 0; i < in.x.size(); i += 2) {
        const uint16_t v = RandomBf16(rng);
        std::memcpy(&in.x[i], &v, 2);
      }
    }
    in.topk_weights.resize(in.topk_idx.size());
    for (float& w : in.topk_weights) w = weight(rng);
  }
  x.dispatched = ref::Dispatch(x.inputs, x.config);
  x.combine_inputs.resize(R);
  const int combine_topk = x.config.has_weights ? c.num_topk : 0;
  for (int r = 0; r < R; ++r) {
    ref::CombineInput& in = x.combine_inputs[r];
    const size_t rows = x.dispatched[r].num_recv_tokens;
    in.x.resize(rows * c.hidden);
    for (uint16_t& v : in.x) v = RandomWideBf16(rng);
    in.topk_weights.resize(rows * combine_topk);
    for (float& w : in.topk_weights) w = weight(rng);
    if (c.bias) {
      in.bias_0.resize(static_cast<size_t>(c.num_tokens[r]) * c.hidden);
      in.bias_1.resize(in.bias_0.size());
      for (uint16_t& v : in.bias_0) v = RandomBf16(rng);
      for (uint16_t& v : in.bias_1) v = RandomBf16(rng);
    }
  }
  x.combined = ref::Combine(x.dispatched, x.combine_inputs, c.hidden, combine_topk);
  return x;
}

// The region configuration that fits every case of a sequence.
inline IntranodeRegionConfig IntranodeConfigFor(const std::vector<IntranodeCase>& cases) {
  IntranodeRegionConfig config;
  config.num_ranks = cases.front().num_ranks();
  config.num_experts = cases.front().num_experts;
  for (const IntranodeCase& c : cases) {
    for (int n : c.num_tokens) config.max_tokens_per_rank = std::max(config.max_tokens_per_rank, std::max(n, 1));
    config.max_hidden = std::max(config.max_hidden, c.hidden);
    config.max_topk = std::max(config.max_topk, c.num_topk);
    config.max_channels = std::max(config.max_channels, c.num_channels);
  }
  return config;
}

// A call's status: recorded as a mismatch, or, with `first_error` given, stored there (the first one) and the
// sequence stops (returns true) — for tests where an error is an allowed outcome and later calls would only report
// its consequences.
inline bool StopAt(const char* what, int rank, const absl::Status& status, Mismatches* m, absl::Status* first_error) {
  if (status.ok()) return false;
  if (first_error == nullptr) {
    m->Status(what, rank, status);
    return false;
  }
  if (first_error->ok()) *first_error = status;
  return true;
}

// One rank's whole pipeline for one case: layout, notify, dispatch, cached dispatch into re-poisoned outputs, combine.
// With `first_error`, the first failing call ends the sequence (see StopAt).
inline void RunIntranodeCase(const IntranodeGroup& group, const IntranodeExpected& x, Mismatches* m,
                             absl::Status* first_error = nullptr) {
  const IntranodeCase& c = x.c;
  const int rank = group.rank, R = c.num_ranks(), epr = c.num_experts / R;
  const ref::RankInput& in = x.inputs[rank];
  const ref::RankOutput& want = x.dispatched[rank];
  const int T = in.num_tokens;

  // Layout.
  std::vector<int32_t> per_rank(R, -7), per_rdma((R + 7) / 8, -7), per_expert(c.num_experts, -7), invalid(1, -7);
  std::vector<uint8_t> in_rank_bytes(static_cast<size_t>(T) * R + 1, 0xAB);
  bool* is_token_in_rank = reinterpret_cast<bool*>(in_rank_bytes.data());
  DispatchLayoutParams lp;
  lp.topk_idx = in.topk_idx.data();
  lp.num_tokens = T;
  lp.num_topk = c.num_topk;
  lp.num_experts = c.num_experts;
  lp.num_ranks = R;
  lp.num_tokens_per_rank = per_rank.data();
  lp.num_tokens_per_rdma_rank = per_rdma.data();
  lp.num_tokens_per_expert = per_expert.data();
  lp.is_token_in_rank = is_token_in_rank;
  lp.num_invalid_topk = invalid.data();
  if (StopAt("GetDispatchLayout", rank, host_backend::GetDispatchLayout(lp), m, first_error)) return;
  m->CompareArrays("num_tokens_per_rank", rank, per_rank.data(), want.layout.num_tokens_per_rank.data(), R);
  m->CompareArrays("num_tokens_per_rdma_rank", rank, per_rdma.data(), want.layout.num_tokens_per_rdma_rank.data(),
                   per_rdma.size());
  m->CompareArrays("num_tokens_per_expert", rank, per_expert.data(), want.layout.num_tokens_per_expert.data(),
                   c.num_experts);
  m->CompareArrays("is_token_in_rank", rank, in_rank_bytes.data(), want.layout.is_token_in_rank.data(),
                   static_cast<size_t>(T) * R);
  if (invalid[0] != want.layout.num_invalid_topk) m->Add(absl::StrFormat("rank %d: num_invalid_topk", rank));

  // Notify.
  std::vector<int32_t> prefix(R * R, -7), recv_counts(1 + epr, -7), host_per_expert(epr, -1);
  int32_t host_num_recv = -1;
  IntranodeNotifyParams np;
  np.num_tokens_per_rank = per_rank.data();
  np.num_tokens_per_expert = per_expert.data();
  np.num_tokens = T;
  np.num_experts = c.num_experts;
  np.expert_alignment = c.expert_alignment;
  np.rank_prefix_matrix = prefix.data();
  np.recv_counts = recv_counts.data();
  np.host_num_recv_tokens = &host_num_recv;
  np.host_num_recv_tokens_per_expert = host_per_expert.data();
  if (StopAt("IntranodeNotify", rank, host_backend::IntranodeNotify(group, np), m, first_error)) return;
  absl::StatusOr<int32_t> waited = IntranodeWaitRecvCounts(&host_num_recv, 1000000);
  if (!waited.ok() || *waited != want.num_recv_tokens) m->Add(absl::StrFormat("rank %d: host_num_recv_tokens", rank));
  m->CompareArrays("rank_prefix_matrix", rank, prefix.data(), want.rank_prefix_matrix.data(), R * R);
  if (recv_counts[0] != want.num_recv_tokens) m->Add(absl::StrFormat("rank %d: recv_counts[0]", rank));
  m->CompareArrays("recv_counts per expert", rank, recv_counts.data() + 1, want.num_recv_tokens_per_expert.data(), epr);
  m->CompareArrays("host per expert", rank, host_per_expert.data(), want.num_recv_tokens_per_expert.data(), epr);

  // Dispatch, then cached dispatch with the same handle into re-poisoned outputs.
  const int N = want.num_recv_tokens;
  const int capacity = c.worst_case_capacity ? static_cast<int>(IntranodeWorstCaseRecvTokens(group.config)) : N;
  const int K = x.config.num_topk;
  AlignedBuffer recv_x(static_cast<size_t>(capacity) * x.config.row_bytes + 16);
  std::vector<float> recv_scales(static_cast<size_t>(capacity) * x.config.num_scales + 1);
  std::vector<int64_t> recv_topk_idx(static_cast<size_t>(capacity) * K + 1);
  std::vector<float> recv_topk_weights(static_cast<size_t>(capacity) * K + 1);
  std::vector<int32_t> channel_prefix(static_cast<size_t>(R) * c.num_channels),
      send_slot(static_cast<size_t>(T) * R + 1), recv_src_idx(capacity + 1);
  IntranodeHandle handle;
  handle.num_tokens = T;
  handle.num_recv_tokens = N;
  handle.is_token_in_rank = is_token_in_rank;
  handle.rank_prefix_matrix = prefix.data();
  handle.recv_channel_prefix = channel_prefix.data();
  handle.send_slot = send_slot.data();
  handle.recv_src_idx = recv_src_idx.data();
  IntranodeDispatchParams dp;
  dp.x = DataOrDummy(in.x);
  dp.x_dtype = c.fp8 ? DType::kFP8E4M3 : DType::kBF16;
  dp.x_scales = c.fp8 ? DataOrDummy(in.x_scales) : nullptr;
  dp.num_scales = x.config.num_scales;
  dp.hidden = c.hidden;
  dp.topk_idx = K > 0 ? DataOrDummy(in.topk_idx) : nullptr;
  dp.topk_weights = x.config.has_weights ? DataOrDummy(in.topk_weights) : nullptr;
  dp.num_topk = K;
  dp.num_experts = c.num_experts;
  dp.num_sms = c.num_channels;
  dp.recv_capacity = capacity;
  dp.recv_x = recv_x.data;
  dp.recv_x_scales = c.fp8 ? recv_scales.data() : nullptr;
  dp.recv_topk_idx = K > 0 ? recv_topk_idx.data() : nullptr;
  dp.recv_topk_weights = x.config.has_weights ? recv_topk_weights.data() : nullptr;
  for (int pass = 0; pass < 2; ++pass) {
    std::memset(recv_x.data, 0xFF, static_cast<size_t>(capacity) * x.config.row_bytes);
    std::fill(recv_scales.begin(), recv_scales.end(), -1.0f);
    std::fill(recv_topk_idx.begin(), recv_topk_idx.end(), -7);
    std::fill(recv_topk_weights.begin(), recv_topk_weights.end(), -7.0f);
    std::fill(recv_src_idx.begin(), recv_src_idx.end(), -7);
    std::fill(channel_prefix.begin(), channel_prefix.end(), -7);
    std::fill(send_slot.begin(), send_slot.end(), -7);
    const char* what = pass == 0 ? "IntranodeDispatch" : "cached IntranodeDispatch";
    if (StopAt(what, rank, host_backend::IntranodeDispatch(group, dp, &handle), m, first_error)) return;
    m->CompareArrays("recv_x", rank, recv_x.data, want.recv_x.data(), want.recv_x.size());
    for (size_t i = want.recv_x.size(); i < static_cast<size_t>(capacity) * x.config.row_bytes; ++i) {
      if (recv_x.data[i] != 0xFF) {
        m->Add(absl::StrFormat("rank %d: recv_x byte %d past the received rows was written", rank, i));
        break;
      }
    }
    m->CompareArrays("recv_x_scales", rank, recv_scales.data(), want.recv_x_scales.data(), want.recv_x_scales.size());
    m->CompareArrays("recv_topk_idx", rank, recv_topk_idx.data(), want.recv_topk_idx.data(), want.recv_topk_idx.size());
    m->CompareArrays("recv_topk_weights", rank, recv_topk_weights.data(), want.recv_topk_weights.data(),
                     want.recv_topk_weights.size());
    m->CompareArrays("recv_src_idx", rank, recv_src_idx.data(), want.recv_src_idx.data(), N);
    m->CompareArrays("recv_channel_prefix", rank, channel_prefix.data(), want.recv_channel_prefix.data(),
                     channel_prefix.size());
    m->CompareArrays("send_slot", rank, send_slot.data(), want.send_slot.data(), static_cast<size_t>(T) * R);
    if (handle.num_channels != c.num_channels) m->Add(absl::StrFormat("rank %d: handle.num_channels", rank));
  }

  // Combine.
  const ref::CombineInput& cin = x.combine_inputs[rank];
  const ref::CombineOutput& cwant = x.combined[rank];
  const int combine_topk = x.config.has_weights ? c.num_topk : 0;
  AlignedBuffer combined(static_cast<size_t>(T) * c.hidden * 2 + 16);
  std::memset(combined.data, 0xFF, static_cast<size_t>(T) * c.hidden * 2);
  std::vector<float> combined_w(static_cast<size_t>(T) * combine_topk + 1, -7.0f);
  AlignedBuffer combine_x(cin.x.size() * 2 + 16), bias_0(cin.bias_0.size() * 2 + 16),
      bias_1(cin.bias_1.size() * 2 + 16);
  // DataOrDummy: memcpy from an empty vector's null data() is undefined even for 0 bytes (UBSan says so).
  std::memcpy(combine_x.data, DataOrDummy(cin.x), cin.x.size() * 2);
  std::memcpy(bias_0.data, DataOrDummy(cin.bias_0), cin.bias_0.size() * 2);
  std::memcpy(bias_1.data, DataOrDummy(cin.bias_1), cin.bias_1.size() * 2);
  IntranodeCombineParams cp;
  cp.x = combine_x.data;
  cp.hidden = c.hidden;
  cp.topk_weights = combine_topk > 0 ? DataOrDummy(cin.topk_weights) : nullptr;
  cp.num_topk = combine_topk;
  cp.bias_0 = c.bias ? bias_0.data : nullptr;
  cp.bias_1 = c.bias ? bias_1.data : nullptr;
  cp.combined_x = combined.data;
  cp.combined_topk_weights = combine_topk > 0 ? combined_w.data() : nullptr;
  if (StopAt("IntranodeCombine", rank, host_backend::IntranodeCombine(group, cp, handle), m, first_error)) return;
  m->CompareArrays("combined_x", rank, reinterpret_cast<const uint16_t*>(combined.data), cwant.combined_x.data(),
                   cwant.combined_x.size());
  m->CompareArrays("combined_topk_weights", rank, combined_w.data(), cwant.combined_topk_weights.data(),
                   cwant.combined_topk_weights.size());
}

// ---------------------------------------------------------------------------------------------------------------
// Low latency.

struct LowLatencyCase {
  int num_ranks = 2;
  int max_tokens = 16;
  int hidden = 256;
  int num_experts = 8;
  int num_topk = 4;
  bool fp8 = true;
  bool round_scale = false;
  bool ue8m0 = false;
  bool zero_copy = false;
  bool hook = false;
  bool cumulative_stats = true;
  int iterations = 1;           // dispatch + combine pairs, back to back (the halves alternate)
  std::vector<bool> masked;     // ranks masked from the start (they run nothing; ctx.rank_mask says so)
  std::vector<int> num_tokens;  // per rank for every iteration; empty = random in [0, max_tokens] per iteration
  Routing routing;
  uint64_t seed = 1;
};

struct LowLatencyIteration {
  std::vector<host::LowLatencyRankInput> inputs;
  std::vector<host::LowLatencyDispatchOutput> dispatched;
  std::vector<std::vector<uint16_t>> expert_outputs;  // per rank bf16 [L][R*M][H]
  std::vector<std::vector<uint16_t>> combined;
};

inline host::LowLatencyShape ShapeOf(const LowLatencyCase& c) {
  return {.num_ranks = c.num_ranks,
          .num_experts = c.num_experts,
          .hidden = c.hidden,
          .max_tokens_per_rank = c.max_tokens,
          .num_topk = c.num_topk};
}

inline std::vector<LowLatencyIteration> MakeLowLatencyExpected(const LowLatencyCase& c) {
  const host::LowLatencyShape shape = ShapeOf(c);
  std::mt19937_64 rng(c.seed);
  std::uniform_real_distribution<float> weight(-1.0f, 1.0f);
  std::uniform_int_distribution<int> tokens(0, c.max_tokens);
  std::vector<LowLatencyIteration> its(c.iterations);
  for (LowLatencyIteration& it : its) {
    it.inputs.resize(c.num_ranks);
    for (int r = 0; r < c.num_ranks; ++r) {
      host::LowLatencyRankInput& in = it.inputs[r];
      in.num_tokens = c.num_tokens.empty() ? tokens(rng) : c.num_tokens[r];
      in.topk_idx = RandomTopk(rng, in.num_tokens, c.num_topk, c.num_experts, r, c.routing);
      in.x.resize(static_cast<size_t>(in.num_tokens) * c.hidden);
      // Per-row magnitudes vary so that FP8 scales differ between groups.
      for (size_t i = 0; i < in.x.size(); ++i) in.x[i] = RandomBf16(rng, (i / 128) % 3 == 0 ? 0.001f : 50.0f);
      in.topk_weights.resize(in.topk_idx.size());
      for (float& w : in.topk_weights) w = weight(rng);
    }
    it.dispatched = host::LowLatencyDispatchReference(
        shape, {.use_fp8 = c.fp8, .round_scale = c.round_scale, .use_ue8m0 = c.ue8m0}, it.inputs, c.masked);
    it.expert_outputs.resize(c.num_ranks);
    for (auto& out : it.expert_outputs) {
      out.resize(static_cast<size_t>(shape.num_local_experts()) * shape.recv_slots() * c.hidden);
      for (uint16_t& v : out) v = RandomWideBf16(rng);
    }
    it.combined = host::LowLatencyCombineReference(shape, it.inputs, it.expert_outputs, it.dispatched, c.masked);
  }
  return its;
}

// Wall time of each call of a rank (the benchmark reads it; the checks are not timed).
struct LowLatencyTimes {
  std::vector<double> dispatch_ms, combine_ms;          // wall time
  std::vector<double> dispatch_cpu_ms, combine_cpu_ms;  // CPU time of the calling thread (excludes waiting)
  std::function<void()> before_each_call;  // e.g. a barrier of all ranks, so that no rank waits for a peer's checks
};

inline double ThreadCpuMs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

inline double MillisecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// One rank's sequence of low-latency dispatch + combine pairs, each checked against the reference. With
// `first_error`, the first failing call ends the sequence (see StopAt).
inline void RunLowLatencyCase(const LowLatencyContext& ctx, const LowLatencyCase& c,
                              const std::vector<LowLatencyIteration>& its, Mismatches* m,
                              LowLatencyTimes* times = nullptr, absl::Status* first_error = nullptr) {
  const int rank = ctx.rank, R = c.num_ranks, M = c.max_tokens, H = c.hidden, L = c.num_experts / R;
  const size_t slots = static_cast<size_t>(R) * M;
  const int G = H / 128;
  const size_t elem = c.fp8 ? 1 : 2;
  AlignedBuffer packed_x(L * slots * H * elem);
  std::vector<uint32_t> scales(L * slots * G + 1);  // float bits or UE8M0 bytes
  std::vector<int32_t> count(L), src_info(L * slots), topk_slot(L * slots), token_map(slots * kLowLatencyMaxTopk);
  std::vector<int64_t> layout_range(static_cast<size_t>(L) * R);
  std::vector<int32_t> stats(L, 0), want_stats(L, 0);
  AlignedBuffer combined(static_cast<size_t>(M) * H * 2 + 16), expert_x(L * slots * H * 2);
  LowLatencyBufferCursor cursor;
  for (size_t i = 0; i < its.size(); ++i) {
    const LowLatencyIteration& it = its[i];
    const host::LowLatencyRankInput& in = it.inputs[rank];
    const host::LowLatencyDispatchOutput& want = it.dispatched[rank];
    std::memset(packed_x.data, 0xFF, L * slots * H * elem);
    std::fill(scales.begin(), scales.end(), 0xFFFFFFFFu);
    std::fill(count.begin(), count.end(), -7);
    std::fill(src_info.begin(), src_info.end(), -7);
    std::fill(topk_slot.begin(), topk_slot.end(), -7);
    std::fill(token_map.begin(), token_map.end(), -7);
    std::fill(layout_range.begin(), layout_range.end(), -7);
    LowLatencyDispatchArgs d;
    d.x = in.x.empty() ? nullptr : in.x.data();
    d.topk_idx = in.topk_idx.empty() ? nullptr : in.topk_idx.data();
    d.num_tokens = in.num_tokens;
    d.num_topk = c.num_topk;
    d.hidden = H;
    d.max_tokens_per_rank = M;
    d.num_experts = c.num_experts;
    d.use_fp8 = c.fp8;
    d.round_scale = c.round_scale;
    d.use_ue8m0 = c.ue8m0;
    d.cumulative_stats = c.cumulative_stats ? stats.data() : nullptr;
    d.packed_recv_x = packed_x.data;
    d.packed_recv_x_scales = c.fp8 ? scales.data() : nullptr;
    d.packed_recv_count = count.data();
    d.packed_recv_src_info = src_info.data();
    d.packed_recv_layout_range = layout_range.data();
    d.packed_recv_topk_slot = topk_slot.data();
    d.packed_recv_token_map = token_map.data();
    d.buffer_half = cursor.Next();
    if (times != nullptr && times->before_each_call) times->before_each_call();
    auto start = std::chrono::steady_clock::now();
    double cpu_start = ThreadCpuMs();
    if (c.hook) {
      d.phases = LowLatencyPhases::kSend;
      if (StopAt("LowLatencyDispatch send", rank, host_backend::LowLatencyDispatch(ctx, d), m, first_error)) return;
      d.phases = LowLatencyPhases::kRecv;
      if (StopAt("LowLatencyDispatch recv", rank, host_backend::LowLatencyDispatch(ctx, d), m, first_error)) return;
    } else {
      if (StopAt("LowLatencyDispatch", rank, host_backend::LowLatencyDispatch(ctx, d), m, first_error)) return;
    }
    if (times != nullptr) {
      times->dispatch_ms.push_back(MillisecondsSince(start));
      times->dispatch_cpu_ms.push_back(ThreadCpuMs() - cpu_start);
    }
    m->CompareArrays("packed_recv_count", rank, count.data(), want.packed_recv_count.data(), L);
    m->CompareArrays("layout_range", rank, layout_range.data(), want.layout_range.data(), layout_range.size());
    m->CompareArrays("token_map", rank, token_map.data(), want.token_map.data(), token_map.size());
    for (int e = 0; e < L; ++e) {
      want_stats[e] += want.packed_recv_count[e];
      const size_t n = std::max(0, std::min<int>(count[e], want.packed_recv_count[e]));
      const size_t base = static_cast<size_t>(e) * slots;
      m->CompareArrays("packed_recv_x", rank, packed_x.data + base * H * elem,
                       want.packed_recv_x.data() + base * H * elem, n * H * elem);
      m->CompareArrays("src_info", rank, src_info.data() + base, want.src_info.data() + base, n);
      m->CompareArrays("topk_slot", rank, topk_slot.data() + base, want.topk_slot.data() + base, n);
      if (c.fp8 && !c.ue8m0) {
        for (int g = 0; g < G; ++g) {
          const size_t at = (static_cast<size_t>(e) * G + g) * slots;
          m->CompareArrays("scales", rank, reinterpret_cast<const float*>(scales.data()) + at, want.scales.data() + at,
                           n);
        }
      } else if (c.ue8m0) {
        const uint8_t* got = reinterpret_cast<const uint8_t*>(scales.data());
        for (int pack = 0; pack < G / 4; ++pack) {
          const size_t at = ((static_cast<size_t>(e) * (G / 4) + pack) * slots) * 4;
          m->CompareArrays("ue8m0 scales", rank, got + at, want.ue8m0_scales.data() + at, n * 4);
        }
      }
    }
    // Combine.
    std::memset(combined.data, 0xFF, static_cast<size_t>(M) * H * 2);
    LowLatencyCombineArgs cb;
    if (c.zero_copy) {
      std::memcpy(LowLatencyCombineInputBuffer(ctx), it.expert_outputs[rank].data(),
                  it.expert_outputs[rank].size() * 2);
    } else {
      std::memcpy(expert_x.data, it.expert_outputs[rank].data(), it.expert_outputs[rank].size() * 2);
      cb.x = expert_x.data;
    }
    cb.topk_idx = d.topk_idx;
    cb.topk_weights = in.topk_weights.empty() ? nullptr : in.topk_weights.data();
    cb.num_tokens = in.num_tokens;
    cb.num_topk = c.num_topk;
    cb.hidden = H;
    cb.max_tokens_per_rank = M;
    cb.num_experts = c.num_experts;
    cb.handle.packed_recv_src_info = src_info.data();
    cb.handle.packed_recv_layout_range = layout_range.data();
    cb.handle.packed_recv_topk_slot = topk_slot.data();
    cb.handle.packed_recv_token_map = token_map.data();
    cb.handle.num_tokens = in.num_tokens;
    cb.zero_copy = c.zero_copy;
    cb.combined_x = combined.data;
    cb.buffer_half = cursor.Next();
    if (times != nullptr && times->before_each_call) times->before_each_call();
    start = std::chrono::steady_clock::now();
    cpu_start = ThreadCpuMs();
    if (c.hook) {
      cb.phases = LowLatencyPhases::kSend;
      if (StopAt("LowLatencyCombine send", rank, host_backend::LowLatencyCombine(ctx, cb), m, first_error)) return;
      cb.phases = LowLatencyPhases::kRecv;
      if (StopAt("LowLatencyCombine recv", rank, host_backend::LowLatencyCombine(ctx, cb), m, first_error)) return;
    } else {
      if (StopAt("LowLatencyCombine", rank, host_backend::LowLatencyCombine(ctx, cb), m, first_error)) return;
    }
    if (times != nullptr) {
      times->combine_ms.push_back(MillisecondsSince(start));
      times->combine_cpu_ms.push_back(ThreadCpuMs() - cpu_start);
    }
    m->CompareArrays("combined_x", rank, reinterpret_cast<const uint16_t*>(combined.data), it.combined[rank].data(),
                     it.combined[rank].size());
  }
  if (c.cumulative_stats) m->CompareArrays("cumulative_stats", rank, stats.data(), want_stats.data(), L);
}

}  // namespace epfabric::kernels::host_backend_test
