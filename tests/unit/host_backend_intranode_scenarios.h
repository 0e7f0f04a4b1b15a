// Intranode scenarios of the host backend's tests: a case's inputs for every rank, the expected results from the
// intranode reference, and one rank's sequence of calls compared element by element (host_backend_scenarios.h).
#pragma once

#include "host_backend_common_scenarios.h"

namespace epfabric::kernels::host_backend_test {

namespace ref = ::epfabric::kernels::reference;

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

}  // namespace epfabric::kernels::host_backend_test
