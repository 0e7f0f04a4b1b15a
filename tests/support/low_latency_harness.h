// A low-latency group of N ranks inside one process: regions, per-rank streams, inputs and outputs, helpers to launch
// every rank's dispatch/combine and to read results back. Shared by the GPU tests and the benchmark.
// Rank r runs on GPU r mod (visible GPUs) (gpu_placement.h). Ranks on different GPUs reach each other through peer
// access; ranks that share a GPU use plain device pointers (no peer access to the own device, no IPC in one process).
// The kernels are cooperative grids whose blocks wait for peers' blocks, so ranks on one GPU must run concurrently:
// each rank has its own non-blocking stream, and when GPUs are shared every rank's grid is capped at
// SMs / (ranks per GPU) blocks (LowLatencyContext::num_blocks), so that all ranks' grids are resident together.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "epfabric/kernels/low_latency.h"
#include "epfabric/kernels/reference/fp8.h"
#include "epfabric/kernels/reference/low_latency_reference.h"
#include "gpu_placement.h"

namespace epfabric::testing {

#define EPF_LL_RETURN_IF_ERROR(expr)       \
  do {                                     \
    ::absl::Status epf_ll_s_ = (expr);     \
    if (!epf_ll_s_.ok()) return epf_ll_s_; \
  } while (0)

struct LowLatencyCase {
  int num_ranks = 2;
  int num_experts = 288;
  int hidden = 7168;
  int max_tokens_per_rank = 128;
  int num_topk = 8;
  bool use_fp8 = true;
  bool round_scale = false;
  bool use_ue8m0 = false;
  double none_fraction = 0.1;  // share of top-k entries set to -1
  // Share of top-k weights set to exactly +0.0f (the combine sends a zero weight as a special value, decision 95).
  double zero_weight_fraction = 0.0;
  int min_tokens = 1;  // tokens per rank drawn from [min_tokens, max_tokens]
  int max_tokens = 0;  // 0 = max_tokens_per_rank
  uint64_t seed = 1;
  bool message_per_expert = false;  // LowLatencyDispatchArgs::message_per_expert (DeepEP's traffic, same results)
};

struct LowLatencyRank {
  int device = 0;
  cudaStream_t stream = nullptr;
  kernels::LowLatencyContext ctx;
  kernels::LowLatencyRegionTable region_table;  // ctx.peer_region_table of a wide group (more than 8 ranks)
  void* region = nullptr;
  kernels::KernelStatus* status = nullptr;
  int32_t* mask = nullptr;
  // Inputs.
  uint16_t* x = nullptr;
  int64_t* topk_idx = nullptr;
  float* topk_weights = nullptr;
  uint16_t* expert_out = nullptr;
  // Outputs.
  uint8_t* recv_x = nullptr;
  void* recv_scales = nullptr;
  int32_t* recv_count = nullptr;
  int32_t* src_info = nullptr;
  int64_t* layout_range = nullptr;
  int32_t* topk_slot = nullptr;
  int32_t* token_map = nullptr;
  int32_t* cumulative_stats = nullptr;
  uint16_t* combined = nullptr;
};

inline absl::Status Cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrFormat("%s: %s", what, cudaGetErrorString(err)));
}

class LowLatencyGroup {
 public:
  ~LowLatencyGroup() { Free(); }

  absl::Status Init(const LowLatencyCase& c, uint64_t timeout_ns = 2'000'000'000ull) {
    c_ = c;
    absl::StatusOr<kernels::LowLatencyLayout> layout =
        kernels::MakeLowLatencyLayout(c.max_tokens_per_rank, c.hidden, c.num_ranks, c.num_experts);
    if (!layout.ok()) return layout.status();
    layout_ = *layout;
    absl::StatusOr<GpuPlacement> placement = PlaceRanks(c.num_ranks);
    if (!placement.ok()) return placement.status();
    placement_ = *placement;
    // Blocks per launch: all SMs (0) when every rank has its own GPU, else the share that lets every rank's
    // cooperative grid on the GPU be resident at once.
    default_num_blocks_ = placement_.shared() ? MaxBlocksPerRank(placement_) : 0;
    if (placement_.shared() && default_num_blocks_ < 1) {
      return absl::FailedPreconditionError("cannot read the SM count of GPU 0 to share it between ranks");
    }
    ranks_.resize(c.num_ranks);
    // Enabled once per process and pair of distinct GPUs (a second enable is an API error that compute-sanitizer
    // reports; enabling access to the own device is an error too).
    static bool peer_enabled[kernels::kMaxNvlPeers][kernels::kMaxNvlPeers] = {};
    for (int a = 0; a < placement_.num_gpus; ++a) {
      for (int b = 0; b < placement_.num_gpus; ++b) {
        if (a == b || peer_enabled[a][b]) continue;
        peer_enabled[a][b] = true;
        EPF_LL_RETURN_IF_ERROR(Cuda(cudaSetDevice(a), "cudaSetDevice"));
        const cudaError_t err = cudaDeviceEnablePeerAccess(b, 0);
        if (err != cudaSuccess && err != cudaErrorPeerAccessAlreadyEnabled) return Cuda(err, "enable peer access");
        (void)cudaGetLastError();
      }
    }
    const size_t L = layout_.num_local_experts, slots = static_cast<size_t>(c.num_ranks) * c.max_tokens_per_rank;
    const size_t M = c.max_tokens_per_rank, H = c.hidden, K = c.num_topk, G = H / 128;
    for (int r = 0; r < c.num_ranks; ++r) {
      LowLatencyRank& k = ranks_[r];
      k.device = placement_.device(r);
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaSetDevice(k.device), "cudaSetDevice"));
      EPF_LL_RETURN_IF_ERROR(kernels::LowLatencyPreloadKernels());
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&k.stream, cudaStreamNonBlocking), "stream"));
      EPF_LL_RETURN_IF_ERROR(Alloc(&k.region, layout_.total_bytes));
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaMemset(k.region, 0, layout_.total_bytes), "memset region"));
      EPF_LL_RETURN_IF_ERROR(Alloc(&k.status, sizeof(kernels::KernelStatus)));
      EPF_LL_RETURN_IF_ERROR(Alloc(&k.mask, sizeof(int32_t) * kernels::kMaxLowLatencyRanks));
      EPF_LL_RETURN_IF_ERROR(Alloc(&k.x, M * H * 2));
      EPF_LL_RETURN_IF_ERROR(Alloc(&k.topk_idx, M * K * 8));
      EPF_LL_RETURN_IF_ERROR(Alloc(&k.topk_weights, M * K * 4));
      EPF_LL_RETURN_IF_ERROR(Alloc(&k.expert_out, L * slots * H * 2));
      EPF_LL_RETURN_IF_ERROR(Alloc(&k.recv_x, L * slots * H * 2));
      EPF_LL_RETURN_IF_ERROR(Alloc(&k.recv_scales, L * slots * G * 4));
      EPF_LL_RETURN_IF_ERROR(Alloc(&k.recv_count, L * 4));
      EPF_LL_RETURN_IF_ERROR(Alloc(&k.src_info, L * slots * 4));
      EPF_LL_RETURN_IF_ERROR(Alloc(&k.layout_range, L * c.num_ranks * 8));
      EPF_LL_RETURN_IF_ERROR(Alloc(&k.topk_slot, L * slots * 4));
      EPF_LL_RETURN_IF_ERROR(Alloc(&k.token_map, slots * kernels::kLowLatencyMaxTopk * 4));
      EPF_LL_RETURN_IF_ERROR(Alloc(&k.cumulative_stats, L * 4));
      EPF_LL_RETURN_IF_ERROR(Alloc(&k.combined, M * H * 2));
      EPF_LL_RETURN_IF_ERROR(ResetStatus(r));
      k.ctx.rank = r;
      k.ctx.num_ranks = c.num_ranks;
      k.ctx.layout = layout_;
      k.ctx.rank_mask = k.mask;
      k.ctx.status = k.status;
      k.ctx.timeout_ns = timeout_ns;
      k.ctx.num_blocks = default_num_blocks_;
    }
    for (int r = 0; r < c.num_ranks; ++r) {
      LowLatencyRank& k = ranks_[r];
      for (int q = 0; q < c.num_ranks; ++q) k.ctx.peer_regions[q] = ranks_[q].region;
      if (!kernels::LowLatencyWideGroup(k.ctx)) continue;
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaSetDevice(k.device), "cudaSetDevice"));
      absl::StatusOr<kernels::LowLatencyRegionTable> table = kernels::LowLatencyRegionTable::Create(k.ctx, k.stream);
      if (!table.ok()) return table.status();
      k.region_table = std::move(*table);
      k.ctx.peer_region_table = k.region_table.get();
    }
    return Sync();
  }

  // Fresh random inputs (tokens, routing, weights) on the host and on the devices.
  absl::Status RandomInputs(uint64_t seed) {
    std::mt19937_64 rng(seed);
    const int R = c_.num_ranks, H = c_.hidden, K = c_.num_topk, E = c_.num_experts;
    inputs_.assign(R, {});
    std::uniform_int_distribution<int> tokens(c_.min_tokens,
                                              c_.max_tokens > 0 ? c_.max_tokens : c_.max_tokens_per_rank);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    for (int r = 0; r < R; ++r) {
      kernels::host::LowLatencyRankInput& in = inputs_[r];
      in.num_tokens = tokens(rng);
      in.x.resize(static_cast<size_t>(in.num_tokens) * H);
      for (int t = 0; t < in.num_tokens; ++t) {
        for (int g = 0; g < H / 128; ++g) {
          // Magnitudes vary per group so that scales differ; an occasional all-zero group exercises the clamp.
          const float magnitude = std::ldexp(1.0f, static_cast<int>(uniform(rng) * 24) - 12);
          const bool zero = uniform(rng) < 0.01f;
          for (int i = 0; i < 128; ++i) {
            in.x[static_cast<size_t>(t) * H + g * 128 + i] =
                kernels::host::FloatToBf16(zero ? 0.0f : normal(rng) * magnitude);
          }
        }
      }
      in.topk_idx.assign(static_cast<size_t>(in.num_tokens) * K, -1);
      in.topk_weights.assign(static_cast<size_t>(in.num_tokens) * K, 0.0f);
      std::vector<int> experts(E);
      for (int t = 0; t < in.num_tokens; ++t) {
        for (int e = 0; e < E; ++e) experts[e] = e;
        for (int k = 0; k < K; ++k) {
          std::uniform_int_distribution<int> pick(k, E - 1);
          std::swap(experts[k], experts[pick(rng)]);
          in.topk_idx[static_cast<size_t>(t) * K + k] = uniform(rng) < c_.none_fraction ? -1 : experts[k];
          in.topk_weights[static_cast<size_t>(t) * K + k] = uniform(rng);
          if (c_.zero_weight_fraction > 0 && uniform(rng) < c_.zero_weight_fraction)
            in.topk_weights[static_cast<size_t>(t) * K + k] = 0.0f;
        }
      }
      LowLatencyRank& k = ranks_[r];
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaSetDevice(k.device), "cudaSetDevice"));
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaMemcpy(x(r), in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice), "x"));
      EPF_LL_RETURN_IF_ERROR(
          Cuda(cudaMemcpy(topk_idx(r), in.topk_idx.data(), in.topk_idx.size() * 8, cudaMemcpyHostToDevice), "topk"));
      EPF_LL_RETURN_IF_ERROR(
          Cuda(cudaMemcpy(topk_weights(r), in.topk_weights.data(), in.topk_weights.size() * 4, cudaMemcpyHostToDevice),
               "weights"));
    }
    return absl::OkStatus();
  }

  // Random expert outputs for the valid slots of `dispatched` (the rest is zero); uploaded to expert_out, or to the
  // zero-copy buffer too when `also_zero_copy`.
  absl::Status RandomExpertOutputs(uint64_t seed,
                                   const std::vector<kernels::host::LowLatencyDispatchOutput>& dispatched,
                                   bool also_zero_copy) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const size_t L = layout_.num_local_experts, slots = static_cast<size_t>(c_.num_ranks) * c_.max_tokens_per_rank;
    const size_t H = c_.hidden;
    expert_outputs_.assign(c_.num_ranks, {});
    for (int r = 0; r < c_.num_ranks; ++r) {
      expert_outputs_[r].assign(L * slots * H, 0);
      for (size_t local = 0; local < L; ++local) {
        for (int p = 0; p < dispatched[r].packed_recv_count[local]; ++p) {
          uint16_t* row = &expert_outputs_[r][(local * slots + p) * H];
          for (size_t i = 0; i < H; ++i) row[i] = kernels::host::FloatToBf16(normal(rng));
        }
      }
      LowLatencyRank& k = ranks_[r];
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaSetDevice(k.device), "cudaSetDevice"));
      EPF_LL_RETURN_IF_ERROR(
          Cuda(cudaMemcpy(k.expert_out, expert_outputs_[r].data(), L * slots * H * 2, cudaMemcpyHostToDevice),
               "expert outputs"));
      if (also_zero_copy) {
        EPF_LL_RETURN_IF_ERROR(Cuda(cudaMemcpy(kernels::LowLatencyCombineInputBuffer(k.ctx), expert_outputs_[r].data(),
                                               L * slots * H * 2, cudaMemcpyHostToDevice),
                                    "zero-copy buffer"));
      }
    }
    return absl::OkStatus();
  }

  // Fills every output with a pattern no kernel writes, so that an unwritten element cannot pass.
  absl::Status PoisonOutputs() {
    const size_t L = layout_.num_local_experts, slots = static_cast<size_t>(c_.num_ranks) * c_.max_tokens_per_rank;
    const size_t H = c_.hidden, G = H / 128;
    for (LowLatencyRank& k : ranks_) {
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaSetDevice(k.device), "cudaSetDevice"));
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaMemset(k.recv_x, 0xA5, L * slots * H * 2), "poison"));
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaMemset(k.recv_scales, 0xA5, L * slots * G * 4), "poison"));
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaMemset(k.recv_count, 0xA5, L * 4), "poison"));
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaMemset(k.src_info, 0xA5, L * slots * 4), "poison"));
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaMemset(k.layout_range, 0xA5, L * c_.num_ranks * 8), "poison"));
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaMemset(k.topk_slot, 0xA5, L * slots * 4), "poison"));
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaMemset(k.token_map, 0xA5, slots * kernels::kLowLatencyMaxTopk * 4), "poison"));
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaMemset(k.combined, 0xA5, c_.max_tokens_per_rank * H * 2), "poison"));
    }
    return Sync();
  }

  kernels::LowLatencyDispatchArgs DispatchArgs(int r, int half, kernels::LowLatencyPhases phases) const {
    const LowLatencyRank& k = ranks_[r];
    kernels::LowLatencyDispatchArgs a;
    a.x = x(r);
    a.topk_idx = topk_idx(r);
    a.num_tokens = inputs_[r].num_tokens;
    a.num_topk = c_.num_topk;
    a.hidden = c_.hidden;
    a.max_tokens_per_rank = c_.max_tokens_per_rank;
    a.num_experts = c_.num_experts;
    a.use_fp8 = c_.use_fp8;
    a.round_scale = c_.round_scale;
    a.use_ue8m0 = c_.use_ue8m0;
    a.cumulative_stats = k.cumulative_stats;
    a.packed_recv_x = k.recv_x;
    a.packed_recv_x_scales = c_.use_fp8 ? k.recv_scales : nullptr;
    a.packed_recv_count = k.recv_count;
    a.packed_recv_src_info = k.src_info;
    a.packed_recv_layout_range = k.layout_range;
    a.packed_recv_topk_slot = k.topk_slot;
    a.packed_recv_token_map = k.token_map;
    a.buffer_half = half;
    a.phases = phases;
    a.message_per_expert = c_.message_per_expert;
    return a;
  }

  // Switches the dispatch traffic scheme of later calls (benchmark of the design choice).
  void set_message_per_expert(bool on) { c_.message_per_expert = on; }

  kernels::LowLatencyCombineArgs CombineArgs(int r, int half, kernels::LowLatencyPhases phases, bool zero_copy) const {
    const LowLatencyRank& k = ranks_[r];
    kernels::LowLatencyCombineArgs a;
    a.x = k.expert_out;
    a.topk_idx = topk_idx(r);
    a.topk_weights = topk_weights(r);
    a.num_tokens = inputs_[r].num_tokens;
    a.num_topk = c_.num_topk;
    a.hidden = c_.hidden;
    a.max_tokens_per_rank = c_.max_tokens_per_rank;
    a.num_experts = c_.num_experts;
    a.handle.packed_recv_src_info = k.src_info;
    a.handle.packed_recv_layout_range = k.layout_range;
    a.handle.packed_recv_topk_slot = k.topk_slot;
    a.handle.packed_recv_token_map = k.token_map;
    a.handle.num_tokens = inputs_[r].num_tokens;
    a.zero_copy = zero_copy;
    a.combined_x = combined(r);
    a.buffer_half = half;
    a.phases = phases;
    return a;
  }

  // Launches dispatch on every rank listed (all by default), each on its own stream, without waiting.
  absl::Status Dispatch(int half, kernels::LowLatencyPhases phases, const std::vector<int>& only = {}) {
    for (int r = 0; r < c_.num_ranks; ++r) {
      if (!only.empty() && std::find(only.begin(), only.end(), r) == only.end()) continue;
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaSetDevice(ranks_[r].device), "cudaSetDevice"));
      EPF_LL_RETURN_IF_ERROR(
          kernels::LowLatencyDispatch(ranks_[r].ctx, DispatchArgs(r, half, phases), ranks_[r].stream));
    }
    return absl::OkStatus();
  }

  absl::Status Combine(int half, kernels::LowLatencyPhases phases, bool zero_copy) {
    for (int r = 0; r < c_.num_ranks; ++r) {
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaSetDevice(ranks_[r].device), "cudaSetDevice"));
      EPF_LL_RETURN_IF_ERROR(
          kernels::LowLatencyCombine(ranks_[r].ctx, CombineArgs(r, half, phases, zero_copy), ranks_[r].stream));
    }
    return absl::OkStatus();
  }

  absl::Status Sync() {
    for (LowLatencyRank& k : ranks_) {
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaSetDevice(k.device), "cudaSetDevice"));
      EPF_LL_RETURN_IF_ERROR(Cuda(cudaDeviceSynchronize(), "synchronize"));
    }
    return absl::OkStatus();
  }

  absl::Status ReadStatus(int r) {
    kernels::KernelStatus s{};
    EPF_LL_RETURN_IF_ERROR(Cuda(cudaSetDevice(ranks_[r].device), "cudaSetDevice"));
    EPF_LL_RETURN_IF_ERROR(Cuda(cudaMemcpy(&s, ranks_[r].status, sizeof(s), cudaMemcpyDeviceToHost), "status"));
    return kernels::KernelStatusToStatus(s);
  }

  absl::Status ResetStatus(int r) {
    EPF_LL_RETURN_IF_ERROR(Cuda(cudaSetDevice(ranks_[r].device), "cudaSetDevice"));
    EPF_LL_RETURN_IF_ERROR(Cuda(cudaMemset(ranks_[r].status, 0, sizeof(kernels::KernelStatus)), "status"));
    EPF_LL_RETURN_IF_ERROR(Cuda(cudaMemset(ranks_[r].mask, 0, sizeof(int32_t) * kernels::kMaxLowLatencyRanks), "mask"));
    return Cuda(cudaMemset(ranks_[r].cumulative_stats, 0, sizeof(int32_t) * layout_.num_local_experts), "stats");
  }

  template <typename T>
  std::vector<T> Download(int r, const void* ptr, size_t count) {
    std::vector<T> v(count);
    (void)cudaSetDevice(ranks_[r].device);
    (void)cudaMemcpy(v.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }

  // A call's token tensors (x, top-k rows, combined output) end where their allocation ends (to 16 bytes), as a
  // client's tensors of exactly num_tokens rows do: a kernel that touches a row past the call's tokens leaves the
  // allocation, which compute-sanitizer memcheck reports (device-checks memcheck), instead of reading the unused
  // rows of a max_tokens_per_rank buffer.
  uint16_t* x(int r) const { return TokenRows(ranks_[r].x, c_.hidden, r); }
  int64_t* topk_idx(int r) const { return TokenRows(ranks_[r].topk_idx, c_.num_topk, r); }
  float* topk_weights(int r) const { return TokenRows(ranks_[r].topk_weights, c_.num_topk, r); }
  uint16_t* combined(int r) const { return TokenRows(ranks_[r].combined, c_.hidden, r); }

  const LowLatencyCase& config() const { return c_; }
  const GpuPlacement& placement() const { return placement_; }
  // LowLatencyContext::num_blocks that Init gave every rank: 0 (all SMs) unless ranks share a GPU.
  int default_num_blocks() const { return default_num_blocks_; }
  const kernels::LowLatencyLayout& layout() const { return layout_; }
  std::vector<LowLatencyRank>& ranks() { return ranks_; }
  const std::vector<kernels::host::LowLatencyRankInput>& inputs() const { return inputs_; }
  const std::vector<std::vector<uint16_t>>& expert_outputs() const { return expert_outputs_; }
  kernels::host::LowLatencyShape shape() const {
    return {.num_ranks = c_.num_ranks,
            .num_experts = c_.num_experts,
            .hidden = c_.hidden,
            .max_tokens_per_rank = c_.max_tokens_per_rank,
            .num_topk = c_.num_topk};
  }

 private:
  template <typename T>
  absl::Status Alloc(T** ptr, size_t bytes) {
    void* p = nullptr;
    EPF_LL_RETURN_IF_ERROR(Cuda(cudaMalloc(&p, bytes), "cudaMalloc"));
    allocations_.push_back({ranks_.empty() ? 0 : current_device(), p});
    *ptr = static_cast<T*>(p);
    return absl::OkStatus();
  }
  // The last inputs_[r].num_tokens rows of a max_tokens_per_rank x `row` buffer, 16-byte aligned.
  template <typename T>
  T* TokenRows(T* base, size_t row, int r) const {
    const size_t unused_bytes = (c_.max_tokens_per_rank - static_cast<size_t>(inputs_[r].num_tokens)) * row * sizeof(T);
    return reinterpret_cast<T*>(reinterpret_cast<char*>(base) + unused_bytes / 16 * 16);
  }
  static int current_device() {
    int d = 0;
    (void)cudaGetDevice(&d);
    return d;
  }
  void Free() {
    for (auto& [device, p] : allocations_) {
      (void)cudaSetDevice(device);
      (void)cudaFree(p);
    }
    allocations_.clear();
    for (LowLatencyRank& k : ranks_) {
      if (k.stream != nullptr) {
        (void)cudaSetDevice(k.device);
        (void)cudaStreamDestroy(k.stream);
      }
    }
  }

  LowLatencyCase c_;
  GpuPlacement placement_;
  int default_num_blocks_ = 0;
  kernels::LowLatencyLayout layout_;
  std::vector<LowLatencyRank> ranks_;
  std::vector<std::pair<int, void*>> allocations_;
  std::vector<kernels::host::LowLatencyRankInput> inputs_;
  std::vector<std::vector<uint16_t>> expert_outputs_;
};

}  // namespace epfabric::testing
