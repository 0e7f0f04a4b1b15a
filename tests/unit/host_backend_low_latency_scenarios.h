// Low-latency scenarios of the host backend's tests: a case's inputs for every rank, the expected results from the
// low-latency reference, and one rank's iterations compared element by element (host_backend_scenarios.h).
#pragma once

#include <time.h>

#include <chrono>

#include "host_backend_common_scenarios.h"

namespace epfabric::kernels::host_backend_test {

namespace ref = ::epfabric::kernels::reference;

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
