// One rank's checked sequence of Buffer calls, shared by the host-backend test (ranks as threads, host memory) and
// the cuda test (ranks as processes, device memory): inputs and expected outputs come from the host references
// (tests/unit/host_backend_scenarios.h, seeded, so every rank computes the same), outputs are read back and compared
// element by element. A rank that sees an error stops issuing calls (its peers then time out and say so).
#pragma once

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "epfabric/client/buffer.h"
#include "unit/host_backend_scenarios.h"

namespace epfabric::testing {

namespace hbt = ::epfabric::kernels::host_backend_test;
namespace ref = ::epfabric::kernels::reference;

// Where the inputs live and how outputs are read: host memory as is, or device memory (copies).
class TestMemory {
 public:
  virtual ~TestMemory() = default;
  // A view of a copy of (or, on the host, the very) `bytes` at `data`; valid until the TestMemory goes.
  virtual client::TensorView Upload(const void* data, size_t bytes, kernels::DType dtype,
                                    std::vector<int64_t> shape) = 0;
  virtual void Read(void* to, const void* from, size_t bytes) = 0;   // device/host -> host
  virtual void Write(void* to, const void* from, size_t bytes) = 0;  // host -> device/host
};

class HostTestMemory final : public TestMemory {
 public:
  client::TensorView Upload(const void* data, size_t /*bytes*/, kernels::DType dtype,
                            std::vector<int64_t> shape) override {
    return client::TensorView{const_cast<void*>(data), dtype, std::move(shape)};
  }
  void Read(void* to, const void* from, size_t bytes) override { std::memcpy(to, from, bytes); }
  void Write(void* to, const void* from, size_t bytes) override { std::memcpy(to, from, bytes); }
};

template <typename T>
client::TensorView Put(TestMemory& memory, const std::vector<T>& v, kernels::DType dtype, std::vector<int64_t> shape) {
  return memory.Upload(v.data(), v.size() * sizeof(T), dtype, std::move(shape));
}

template <typename T>
std::vector<T> Get(TestMemory& memory, const client::TensorView& view, size_t n) {
  std::vector<T> out(n);
  if (n > 0) memory.Read(out.data(), view.data, n * sizeof(T));
  return out;
}

template <typename T>
void CompareTensor(TestMemory& memory, hbt::Mismatches* m, const char* what, int rank, const client::Tensor& got,
                   const std::vector<T>& want, size_t n) {
  if (static_cast<size_t>(got.view.numel()) * kernels::DTypeSize(got.view.dtype) < n * sizeof(T)) {
    m->Add(absl::StrCat("rank ", rank, ": ", what, " has ", got.view.numel(), " elements, want at least ", n));
    return;
  }
  const std::vector<T> host = Get<T>(memory, got.view, n);
  m->CompareArrays(what, rank, host.data(), want.data(), n);
}

// ---------------------------------------------------------------------------------------------------------------
// Normal mode: layout, dispatch, cached dispatch, combine of one case on this rank.

// `rows` rows of `width` elements: `v` (its first rows) and then `fill` (padding that must not matter).
template <typename T>
std::vector<T> PadRows(const std::vector<T>& v, size_t width, int64_t rows, T fill) {
  std::vector<T> out(v);
  out.resize(static_cast<size_t>(rows) * width, fill);
  return out;
}

// Worst-case mode (num_worst_tokens): the padding rows past the `n` received ones have top-k -1 and weight 0.
inline void CheckWorstCasePadding(TestMemory& mem, hbt::Mismatches* m, int rank, const client::DispatchResult& got,
                                  int n, int rows, int K, bool weights) {
  if (got.recv_x.view.shape.empty() || got.recv_x.view.shape[0] != rows) {
    m->Add(absl::StrCat("rank ", rank, ": worst-case recv_x does not have num_worst_tokens = ", rows, " rows"));
  }
  if (!got.num_recv_tokens_per_expert.empty()) m->Add(absl::StrCat("rank ", rank, ": worst-case per-expert counts"));
  if (K == 0 || n > rows) return;
  const size_t pad = static_cast<size_t>(rows - n) * K;
  const std::vector<int64_t> idx = Get<int64_t>(mem, got.recv_topk_idx.view, static_cast<size_t>(rows) * K);
  m->CompareArrays("padding recv_topk_idx", rank, idx.data() + static_cast<size_t>(n) * K,
                   std::vector<int64_t>(pad, -1).data(), pad);
  if (weights) {
    const std::vector<float> w = Get<float>(mem, got.recv_topk_weights.view, static_cast<size_t>(rows) * K);
    m->CompareArrays("padding recv_topk_weights", rank, w.data() + static_cast<size_t>(n) * K,
                     std::vector<float>(pad, 0.0f).data(), pad);
  }
}

// num_worst_tokens > 0: both dispatches in worst-case mode (the cached one through the worst-case handle), outputs
// of num_worst_tokens rows whose first rows equal the reference, and a combine whose x has num_worst_tokens rows
// (the padding rows hold garbage that must be ignored).
inline void RunNormalCase(TestMemory& mem, int rank, client::Buffer& buffer, const hbt::IntranodeExpected& x,
                          hbt::Mismatches* m, cudaStream_t stream = nullptr, int num_worst_tokens = 0) {
  using kernels::DType;
  const hbt::IntranodeCase& c = x.c;
  const int R = c.num_ranks();
  const ref::RankInput& in = x.inputs[rank];
  const ref::RankOutput& want = x.dispatched[rank];
  const int64_t T = in.num_tokens;
  const int K = x.config.num_topk;

  const client::TensorView topk_idx = Put(mem, in.topk_idx, DType::kInt64, {T, c.num_topk});
  auto layout = buffer.GetDispatchLayout(topk_idx, stream);
  if (!layout.ok()) return m->Status("GetDispatchLayout", rank, layout.status());
  CompareTensor(mem, m, "num_tokens_per_rank", rank, layout->num_tokens_per_rank, want.layout.num_tokens_per_rank, R);
  CompareTensor(mem, m, "num_tokens_per_expert", rank, layout->num_tokens_per_expert, want.layout.num_tokens_per_expert,
                c.num_experts);
  CompareTensor(mem, m, "is_token_in_rank", rank, layout->is_token_in_rank, want.layout.is_token_in_rank, T * R);

  client::DispatchArgs args;
  args.x = Put(mem, in.x, c.fp8 ? DType::kFP8E4M3 : DType::kBF16, {T, c.hidden});
  if (c.fp8) {
    args.x_scales = Put(mem, in.x_scales, c.packed_scales ? DType::kInt32 : DType::kFloat32, {T, x.config.num_scales});
  }
  if (K > 0) args.topk_idx = topk_idx;
  if (x.config.has_weights) args.topk_weights = Put(mem, in.topk_weights, DType::kFloat32, {T, K});
  args.layout = &*layout;
  args.expert_alignment = c.expert_alignment;
  args.num_worst_tokens = num_worst_tokens;
  const bool worst = num_worst_tokens > 0;
  const int rows = worst ? num_worst_tokens : want.num_recv_tokens;
  std::shared_ptr<const client::DispatchHandle> handle;
  for (int pass = 0; pass < 2; ++pass) {
    const char* what = pass == 0 ? "Dispatch" : "cached Dispatch";
    if (pass == 1) {
      args.cached = handle;
      args.layout = nullptr;
      args.num_worst_tokens = 0;  // the worst-case handle keeps its rows
    }
    auto got = buffer.Dispatch(args, stream);
    if (!got.ok()) return m->Status(what, rank, got.status());
    if (worst) m->Status("Check after worst-case dispatch", rank, buffer.Check(stream));
    const int N = want.num_recv_tokens;
    if (got->handle->num_recv_tokens != rows || got->handle->worst_case != worst) {
      m->Add(absl::StrCat("rank ", rank, ": ", what, " num_recv_tokens ", got->handle->num_recv_tokens));
    }
    if (got->recv_x.view.shape != std::vector<int64_t>{rows, c.hidden}) {
      m->Add(absl::StrCat("rank ", rank, ": ", what, " recv_x shape"));
    }
    if (worst) CheckWorstCasePadding(mem, m, rank, *got, N, rows, K, x.config.has_weights);
    CompareTensor(mem, m, "recv_x", rank, got->recv_x, want.recv_x, want.recv_x.size());
    if (c.fp8) {
      if (got->recv_x_scales.view.dtype != args.x_scales.dtype ||
          got->recv_x_scales.view.shape != std::vector<int64_t>{rows, x.config.num_scales}) {
        m->Add(absl::StrCat("rank ", rank, ": ", what, " recv_x_scales dtype or shape"));
      }
      CompareTensor(mem, m, "recv_x_scales", rank, got->recv_x_scales, want.recv_x_scales, want.recv_x_scales.size());
    }
    if (K > 0) {
      CompareTensor(mem, m, "recv_topk_idx", rank, got->recv_topk_idx, want.recv_topk_idx, want.recv_topk_idx.size());
    }
    if (x.config.has_weights) {
      CompareTensor(mem, m, "recv_topk_weights", rank, got->recv_topk_weights, want.recv_topk_weights,
                    want.recv_topk_weights.size());
    }
    // Cached mode does not exchange counts, so it returns no per-expert counts (as DeepEP).
    if (pass == 0 && !worst && got->num_recv_tokens_per_expert != want.num_recv_tokens_per_expert) {
      m->Add(absl::StrCat("rank ", rank, ": num_recv_tokens_per_expert"));
    }
    const client::DispatchHandle& h = *got->handle;
    CompareTensor(mem, m, "rank_prefix_matrix", rank, h.rank_prefix_matrix, want.rank_prefix_matrix, R * R);
    CompareTensor(mem, m, "recv_channel_prefix", rank, h.recv_channel_prefix, want.recv_channel_prefix,
                  want.recv_channel_prefix.size());
    CompareTensor(mem, m, "send_slot", rank, h.send_slot, want.send_slot, T * R);
    CompareTensor(mem, m, "recv_src_idx", rank, h.recv_src_idx, want.recv_src_idx, N);
    handle = got->handle;
  }

  const ref::CombineInput& cin = x.combine_inputs[rank];
  const ref::CombineOutput& cwant = x.combined[rank];
  const int combine_topk = x.config.has_weights ? c.num_topk : 0;
  client::CombineArgs cargs;
  cargs.handle = handle;
  // Worst case: x has the handle's rows; the padding is NaN (0x7fc0) and 1e30 weights, which must be ignored.
  const std::vector<uint16_t> combine_x = PadRows<uint16_t>(cin.x, c.hidden, rows, 0x7fc0);
  const std::vector<float> combine_w = PadRows<float>(cin.topk_weights, combine_topk, rows, 1e30f);
  cargs.x = Put(mem, combine_x, DType::kBF16, {handle->num_recv_tokens, c.hidden});
  if (combine_topk > 0) {
    cargs.topk_weights = Put(mem, combine_w, DType::kFloat32, {handle->num_recv_tokens, combine_topk});
  }
  if (c.bias) {
    cargs.bias_0 = Put(mem, cin.bias_0, DType::kBF16, {T, c.hidden});
    cargs.bias_1 = Put(mem, cin.bias_1, DType::kBF16, {T, c.hidden});
  }
  auto combined = buffer.Combine(cargs, stream);
  if (!combined.ok()) return m->Status("Combine", rank, combined.status());
  m->Status("Check after combine", rank, buffer.Check(stream));
  CompareTensor(mem, m, "combined_x", rank, combined->combined_x, cwant.combined_x, cwant.combined_x.size());
  if (combine_topk > 0) {
    CompareTensor(mem, m, "combined_topk_weights", rank, combined->combined_topk_weights, cwant.combined_topk_weights,
                  cwant.combined_topk_weights.size());
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Low latency: `its` dispatch + combine pairs back to back (the halves alternate), each checked.

// Wait-cost statistics (int64 [R], ns, added to): every call adds at least `min_per_call` to every rank's entry
// (each wait counts at least 1 ns, and no rank is masked here); `last` holds the values after the previous call.
inline void CheckWaitCost(TestMemory& mem, hbt::Mismatches* m, int rank, const char* what,
                          const client::TensorView& cost, std::vector<int64_t>* last, int64_t min_per_call) {
  const std::vector<int64_t> now = Get<int64_t>(mem, cost, last->size());
  for (size_t r = 0; r < now.size(); ++r) {
    if (now[r] - (*last)[r] < min_per_call) {
      m->Add(absl::StrCat("rank ", rank, ": ", what, " wait_recv_cost_stats[", r, "] went from ", (*last)[r], " to ",
                          now[r], ": expected an increase of at least ", min_per_call));
    }
  }
  *last = now;
}

inline void RunLowLatencyIterations(TestMemory& mem, int rank, client::Buffer& buffer, const hbt::LowLatencyCase& c,
                                    const std::vector<hbt::LowLatencyIteration>& its, hbt::Mismatches* m,
                                    cudaStream_t stream = nullptr) {
  using kernels::DType;
  const int R = c.num_ranks, M = c.max_tokens, H = c.hidden, L = c.num_experts / R, G = H / 128;
  const size_t slots = static_cast<size_t>(R) * M;
  const size_t elem = c.fp8 ? 1 : 2;
  const std::vector<int32_t> zero_stats(L, 0);
  std::vector<int32_t> want_stats(L, 0);
  const client::TensorView stats = Put(mem, zero_stats, DType::kInt32, {L});
  // The wait costs go with the cumulative statistics (separate vectors: the host memory is used in place).
  std::vector<int64_t> dispatch_cost_init(R, 0), combine_cost_init(R, 0), last_dispatch(R, 0), last_combine(R, 0);
  const client::TensorView dispatch_cost = Put(mem, dispatch_cost_init, DType::kInt64, {R});
  const client::TensorView combine_cost = Put(mem, combine_cost_init, DType::kInt64, {R});
  for (size_t i = 0; i < its.size(); ++i) {
    const hbt::LowLatencyIteration& it = its[i];
    const kernels::host::LowLatencyRankInput& in = it.inputs[rank];
    const kernels::host::LowLatencyDispatchOutput& want = it.dispatched[rank];
    const int64_t T = in.num_tokens;
    client::LowLatencyDispatchArgs d;
    d.x = Put(mem, in.x, DType::kBF16, {T, H});
    d.topk_idx = Put(mem, in.topk_idx, DType::kInt64, {T, c.num_topk});
    d.use_fp8 = c.fp8;
    d.round_scale = c.round_scale;
    d.use_ue8m0 = c.ue8m0;
    if (c.cumulative_stats) {
      d.cumulative_stats = stats;
      d.wait_recv_cost_stats = dispatch_cost;
    }
    d.return_recv_hook = c.hook;
    auto got = buffer.LowLatencyDispatch(d, stream);
    if (!got.ok()) return m->Status("LowLatencyDispatch", rank, got.status());
    if (c.hook) {
      if (!got->recv_hook) return m->Add("no recv_hook");
      m->Status("dispatch recv_hook", rank, got->recv_hook(stream));
      if (got->recv_hook(stream).ok()) m->Add("a recv_hook ran twice");
    }
    m->Status("Check after low-latency dispatch", rank, buffer.Check(stream));
    if (c.cumulative_stats) CheckWaitCost(mem, m, rank, "dispatch", dispatch_cost, &last_dispatch, L);
    CompareTensor(mem, m, "packed_recv_count", rank, got->packed_recv_count, want.packed_recv_count, L);
    CompareTensor(mem, m, "layout_range", rank, got->packed_recv_layout_range, want.layout_range,
                  want.layout_range.size());
    CompareTensor(mem, m, "token_map", rank, got->handle->token_map, want.token_map, want.token_map.size());
    const std::vector<int32_t> count = Get<int32_t>(mem, got->packed_recv_count.view, L);
    const std::vector<uint8_t> packed_x = Get<uint8_t>(mem, got->packed_recv_x.view, L * slots * H * elem);
    const std::vector<int32_t> src_info = Get<int32_t>(mem, got->packed_recv_src_info.view, L * slots);
    const std::vector<int32_t> topk_slot = Get<int32_t>(mem, got->handle->topk_slot.view, L * slots);
    std::vector<uint8_t> scales;
    if (c.fp8) scales = Get<uint8_t>(mem, got->packed_recv_x_scales.view, got->packed_recv_x_scales.view.bytes());
    for (int e = 0; e < L; ++e) {
      want_stats[e] += want.packed_recv_count[e];
      const size_t n = std::max(0, std::min<int>(count[e], want.packed_recv_count[e]));
      const size_t base = static_cast<size_t>(e) * slots;
      m->CompareArrays("packed_recv_x", rank, packed_x.data() + base * H * elem,
                       want.packed_recv_x.data() + base * H * elem, n * H * elem);
      m->CompareArrays("src_info", rank, src_info.data() + base, want.src_info.data() + base, n);
      m->CompareArrays("topk_slot", rank, topk_slot.data() + base, want.topk_slot.data() + base, n);
      if (c.fp8 && !c.ue8m0) {
        const float* f = reinterpret_cast<const float*>(scales.data());
        for (int g = 0; g < G; ++g) {
          const size_t at = (static_cast<size_t>(e) * G + g) * slots;
          m->CompareArrays("scales", rank, f + at, want.scales.data() + at, n);
        }
      } else if (c.ue8m0) {
        for (int pack = 0; pack < G / 4; ++pack) {
          const size_t at = ((static_cast<size_t>(e) * (G / 4) + pack) * slots) * 4;
          m->CompareArrays("ue8m0 scales", rank, scales.data() + at, want.ue8m0_scales.data() + at, n * 4);
        }
      }
    }
    client::LowLatencyCombineArgs cb;
    if (c.zero_copy) {
      const client::TensorView into = buffer.NextLowLatencyCombineBuffer();
      if (into.bytes() != it.expert_outputs[rank].size() * 2) m->Add("NextLowLatencyCombineBuffer size");
      mem.Write(into.data, it.expert_outputs[rank].data(), it.expert_outputs[rank].size() * 2);
    } else {
      cb.x = Put(mem, it.expert_outputs[rank], DType::kBF16, {L, static_cast<int64_t>(slots), H});
    }
    cb.topk_idx = d.topk_idx;
    cb.topk_weights = Put(mem, in.topk_weights, DType::kFloat32, {T, c.num_topk});
    cb.handle = got->handle;
    cb.zero_copy = c.zero_copy;
    cb.return_recv_hook = c.hook;
    if (c.cumulative_stats) cb.wait_recv_cost_stats = combine_cost;
    auto combined = buffer.LowLatencyCombine(cb, stream);
    if (!combined.ok()) return m->Status("LowLatencyCombine", rank, combined.status());
    if (c.hook) m->Status("combine recv_hook", rank, combined->recv_hook(stream));
    m->Status("Check after low-latency combine", rank, buffer.Check(stream));
    if (c.cumulative_stats) CheckWaitCost(mem, m, rank, "combine", combine_cost, &last_combine, 1);
    CompareTensor(mem, m, "combined_x", rank, combined->combined_x, it.combined[rank], it.combined[rank].size());
  }
  if (c.cumulative_stats) {
    const std::vector<int32_t> got_stats = Get<int32_t>(mem, stats, L);
    m->CompareArrays("cumulative_stats", rank, got_stats.data(), want_stats.data(), L);
  }
}

}  // namespace epfabric::testing
