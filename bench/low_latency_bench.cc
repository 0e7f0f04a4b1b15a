// Low-latency dispatch/combine benchmark: 2 ranks (--num_ranks) in one process, 128 tokens per rank, hidden 7168,
// top-8 of 288 experts, FP8 dispatch, BF16 combine (DeepEP's decoding benchmark shape). Rank r runs on GPU r mod
// (visible GPUs): with one GPU per rank every launch uses all SMs; on a shared GPU (a one-GPU machine) each rank's
// grid gets SMs / (ranks per GPU) blocks so that all ranks' cooperative grids are resident together, the JSON says
// "shared_gpu": true and the output says that the figures are not comparable with NVLink figures.
//
// Ordinary calls: each rank's stream replays a CUDA graph of `iters` (dispatch, combine) pairs with an event between
// consecutive kernels, so that the ranks run back to back in lockstep without host launch gaps; a rank's dispatch
// time therefore includes waiting for its peer, as a real call does. Per iteration the slower rank counts.
// Hook mode: each phase is a small graph per rank (event, kernel, event), launched on both ranks, host-synchronised
// before the next phase; each kernel is timed alone by its events.
//
// Usage: low_latency_bench [--out DIR] [--iters N] [--num_ranks N] [--sweep_blocks B1,B2,...]
// (a --sweep_blocks size whose grids cannot all be resident on a shared GPU is skipped with a line saying so)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/report.h"
#include "common/timeline.h"
#include "launch_probe.h"
#include "low_latency_harness.h"

namespace epfabric {
namespace {

using kernels::LowLatencyPhases;
using testing::LowLatencyGroup;

#define CHECK_OK(expr)                                                       \
  do {                                                                       \
    const ::absl::Status s_ = (expr);                                        \
    if (!s_.ok()) {                                                          \
      std::fprintf(stderr, "%s failed: %s\n", #expr, s_.ToString().c_str()); \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)
#define CHECK_CUDA(expr) CHECK_OK(testing::Cuda((expr), #expr))

// Blocks of rank r's launches: its context's num_blocks, or the GPU's SM count when 0.
int NumBlocks(LowLatencyGroup& g, int r);

struct Timings {
  std::vector<double> dispatch, combine, both;
  bool graphs = false;
};

float Elapsed(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  return ms * 1000.0f;
}

// Ordinary (send+recv in one launch) calls, captured as graphs so that the GPUs run them back to back.
Timings TimeOrdinary(LowLatencyGroup& g, int iters) {
  const int R = g.config().num_ranks;
  std::vector<std::vector<cudaEvent_t>> ev(R, std::vector<cudaEvent_t>(2 * iters + 1));
  std::vector<cudaGraphExec_t> exec(R, nullptr);
  // Enqueues the `iters` pairs on rank r's stream (captured into a graph, or directly as a fallback).
  auto enqueue = [&](int r) -> absl::Status {
    auto& k = g.ranks()[r];
    EPF_LL_RETURN_IF_ERROR(
        testing::Cuda(cudaEventRecordWithFlags(ev[r][0], k.stream, cudaEventRecordExternal), "record"));
    for (int i = 0; i < iters; ++i) {
      EPF_LL_RETURN_IF_ERROR(
          kernels::LowLatencyDispatch(k.ctx, g.DispatchArgs(r, 0, LowLatencyPhases::kSendAndRecv), k.stream));
      EPF_LL_RETURN_IF_ERROR(
          testing::Cuda(cudaEventRecordWithFlags(ev[r][2 * i + 1], k.stream, cudaEventRecordExternal), "record"));
      EPF_LL_RETURN_IF_ERROR(
          kernels::LowLatencyCombine(k.ctx, g.CombineArgs(r, 1, LowLatencyPhases::kSendAndRecv, false), k.stream));
      EPF_LL_RETURN_IF_ERROR(
          testing::Cuda(cudaEventRecordWithFlags(ev[r][2 * i + 2], k.stream, cudaEventRecordExternal), "record"));
    }
    return absl::OkStatus();
  };
  bool graphs = true;
  for (int r = 0; r < R && graphs; ++r) {
    auto& k = g.ranks()[r];
    CHECK_CUDA(cudaSetDevice(k.device));
    for (auto& e : ev[r]) CHECK_CUDA(cudaEventCreate(&e));
    CHECK_CUDA(cudaStreamBeginCapture(k.stream, cudaStreamCaptureModeThreadLocal));
    const absl::Status captured = enqueue(r);
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(k.stream, &graph);
    if (!captured.ok() || ended != cudaSuccess || cudaGraphInstantiate(&exec[r], graph, 0) != cudaSuccess) {
      std::fprintf(stderr, "graph capture failed (%s, %s): timing direct launches\n", captured.ToString().c_str(),
                   cudaGetErrorString(ended));
      (void)cudaGetLastError();
      graphs = false;
    }
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
  }
  if (!graphs) {
    for (int r = 0; r < R; ++r) {
      CHECK_CUDA(cudaSetDevice(g.ranks()[r].device));
      for (auto& e : ev[r]) {
        if (e == nullptr) CHECK_CUDA(cudaEventCreate(&e));
      }
    }
  }
  Timings t;
  t.graphs = graphs;
  for (int rep = 0; rep < 3; ++rep) {  // the first replay warms up
    // One host thread per rank: a launch blocks once the device's launch queue is full, and the kernels already
    // queued wait for the peers' kernels, which a single thread would only launch after that launch returned (seen
    // as receive-count timeouts with --iters 300 on 2 x H100).
    std::vector<std::thread> launchers;
    for (int r = 0; r < R; ++r) {
      launchers.emplace_back([&, r] {
        CHECK_CUDA(cudaSetDevice(g.ranks()[r].device));
        if (graphs) {
          CHECK_CUDA(cudaGraphLaunch(exec[r], g.ranks()[r].stream));
        } else {
          CHECK_OK(enqueue(r));
        }
      });
    }
    for (std::thread& t : launchers) t.join();
    CHECK_OK(g.Sync());
    if (rep == 0) continue;
    for (int i = 1; i < iters; ++i) {  // the first pair absorbs the launch skew between the ranks
      double d = 0, c = 0;
      for (int r = 0; r < R; ++r) {
        d = std::max<double>(d, Elapsed(ev[r][2 * i], ev[r][2 * i + 1]));
        c = std::max<double>(c, Elapsed(ev[r][2 * i + 1], ev[r][2 * i + 2]));
      }
      t.dispatch.push_back(d);
      t.combine.push_back(c);
      t.both.push_back(d + c);
    }
  }
  for (int r = 0; r < R; ++r) {
    CHECK_CUDA(cudaSetDevice(g.ranks()[r].device));
    if (exec[r] != nullptr) CHECK_CUDA(cudaGraphExecDestroy(exec[r]));
    for (auto& e : ev[r]) CHECK_CUDA(cudaEventDestroy(e));
  }
  return t;
}

// The fixed cost in every figure: an empty cooperative kernel of the same shape (132 x 512 on an H200; the rank's
// share of the SMs on a shared GPU), timed like the ordinary calls (one graph per rank of back-to-back kernels with
// events in between).
std::vector<double> TimeEmptyKernel(LowLatencyGroup& g, int iters) {
  const int R = g.config().num_ranks;
  std::vector<double> samples;
  for (int r = 0; r < R; ++r) {
    auto& k = g.ranks()[r];
    CHECK_CUDA(cudaSetDevice(k.device));
    const int blocks = NumBlocks(g, r);
    std::vector<cudaEvent_t> ev(iters + 1);
    for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
    CHECK_CUDA(cudaStreamBeginCapture(k.stream, cudaStreamCaptureModeThreadLocal));
    CHECK_CUDA(cudaEventRecordWithFlags(ev[0], k.stream, cudaEventRecordExternal));
    for (int i = 0; i < iters; ++i) {
      CHECK_CUDA(bench::LaunchEmptyCooperative(blocks, 512, k.stream));
      CHECK_CUDA(cudaEventRecordWithFlags(ev[i + 1], k.stream, cudaEventRecordExternal));
    }
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK_CUDA(cudaStreamEndCapture(k.stream, &graph));
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 2; ++rep) {
      CHECK_CUDA(cudaGraphLaunch(exec, k.stream));
      CHECK_CUDA(cudaStreamSynchronize(k.stream));
    }
    for (int i = 1; i < iters; ++i) samples.push_back(Elapsed(ev[i], ev[i + 1]));
    CHECK_CUDA(cudaGraphExecDestroy(exec));
    CHECK_CUDA(cudaGraphDestroy(graph));
    for (auto& e : ev) CHECK_CUDA(cudaEventDestroy(e));
  }
  return samples;
}

struct HookTimings {
  std::vector<double> dispatch_send, dispatch_recv, combine_send, combine_recv, combine_send_later_rank;
  std::vector<std::vector<bench::Timeline>> timelines[4];  // [phase][rank]: kernel timelines of the timed runs
};

int NumBlocks(LowLatencyGroup& g, int r) {
  const auto& k = g.ranks()[r];
  if (k.ctx.num_blocks > 0) return k.ctx.num_blocks;
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, k.device));
  return sms;
}

size_t ProfileSlots(LowLatencyGroup& g, int r) {
  return static_cast<size_t>(NumBlocks(g, r)) * kernels::kProfileSlotsPerBlock;
}

bench::Timeline DownloadTimeline(LowLatencyGroup& g, int r, const uint64_t* device_slots) {
  bench::Timeline t;
  t.num_blocks = NumBlocks(g, r);
  t.slots.resize(ProfileSlots(g, r));
  CHECK_CUDA(cudaSetDevice(g.ranks()[r].device));
  CHECK_CUDA(cudaMemcpy(t.slots.data(), device_slots, t.slots.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  return t;
}

// Kernel timelines of ordinary calls: `runs` dispatch+combine pairs per rank launched directly (the host enqueues
// faster than the GPUs run them, so they run back to back), every kernel with its own profile buffer. The first
// pairs absorb the launch skew between the ranks and are dropped.
// Returns {dispatch, combine} median kernel times; `key_suffix` goes after the result keys; `verbose` prints the
// timelines.
std::pair<double, double> ProfileOrdinary(LowLatencyGroup& g, int runs, bench::Report& report,
                                          const std::string& key_suffix = "", bool verbose = true) {
  const int R = g.config().num_ranks;
  constexpr int kDropped = 5;
  std::vector<uint64_t*> buffers(R, nullptr);
  for (int r = 0; r < R; ++r) {
    auto& k = g.ranks()[r];
    CHECK_CUDA(cudaSetDevice(k.device));
    const size_t bytes = 2 * runs * ProfileSlots(g, r) * sizeof(uint64_t);
    CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&buffers[r]), bytes));
    CHECK_CUDA(cudaMemset(buffers[r], 0, bytes));
  }
  for (int r = 0; r < R; ++r) {
    auto& k = g.ranks()[r];
    CHECK_CUDA(cudaSetDevice(k.device));
    for (int i = 0; i < runs; ++i) {
      kernels::LowLatencyContext ctx = k.ctx;
      ctx.profile_ns = buffers[r] + (2 * i) * ProfileSlots(g, r);
      CHECK_OK(kernels::LowLatencyDispatch(ctx, g.DispatchArgs(r, 0, LowLatencyPhases::kSendAndRecv), k.stream));
      ctx.profile_ns = buffers[r] + (2 * i + 1) * ProfileSlots(g, r);
      CHECK_OK(kernels::LowLatencyCombine(ctx, g.CombineArgs(r, 1, LowLatencyPhases::kSendAndRecv, false), k.stream));
    }
  }
  CHECK_OK(g.Sync());
  const std::vector<bench::WarpRole> dispatch_roles = bench::LowLatencyStepRoles(false);
  const std::vector<bench::WarpRole> combine_roles = bench::LowLatencyStepRoles(true);
  std::vector<double> dispatch_us(runs - kDropped, 0.0), combine_us(runs - kDropped, 0.0);  // slower rank per run
  for (int r = 0; r < R; ++r) {
    std::vector<bench::Timeline> dispatch, combine, before_dispatch, before_combine;
    for (int i = kDropped; i < runs; ++i) {
      dispatch.push_back(DownloadTimeline(g, r, buffers[r] + (2 * i) * ProfileSlots(g, r)));
      combine.push_back(DownloadTimeline(g, r, buffers[r] + (2 * i + 1) * ProfileSlots(g, r)));
      before_dispatch.push_back(DownloadTimeline(g, r, buffers[r] + (2 * i - 1) * ProfileSlots(g, r)));
      before_combine.push_back(dispatch.back());
    }
    for (size_t i = 0; i < dispatch.size(); ++i) {
      dispatch_us[i] = std::max(dispatch_us[i], dispatch[i].DurationUs());
      combine_us[i] = std::max(combine_us[i], combine[i].DurationUs());
    }
    if (verbose) {
      bench::PrintTimelines("dispatch (ordinary, direct launches) rank " + std::to_string(r), dispatch, dispatch_roles,
                            &before_dispatch);
      bench::PrintTimelines("combine (ordinary, direct launches) rank " + std::to_string(r), combine, combine_roles,
                            &before_combine);
    }
    CHECK_CUDA(cudaSetDevice(g.ranks()[r].device));
    CHECK_CUDA(cudaFree(buffers[r]));
  }
  const double d = bench::Summarize(dispatch_us).median, c = bench::Summarize(combine_us).median;
  std::printf("kernel time (in-kernel, slower rank, median)%s: dispatch %.2f us, combine %.2f us\n", key_suffix.c_str(),
              d, c);
  report.SetResult("dispatch_kernel_us" + key_suffix, d);
  report.SetResult("combine_kernel_us" + key_suffix, c);
  return {d, c};
}

// Hook mode: each phase is one small graph per rank (event, kernel, event), so that no host launch gap is timed.
// Phases run one after the other with a host synchronisation in between, so a receive kernel finds its data there.
// The combine send phase waits for the peers' weights (published at the start of their own send phase): the rank
// launched first also waits for the launch skew, so the later-launched rank's time is reported too.
HookTimings TimeHooks(LowLatencyGroup& g, int iters) {
  const int R = g.config().num_ranks;
  constexpr int kPhases = 4;  // dispatch send, dispatch recv, combine send, combine recv
  std::vector<std::vector<cudaEvent_t>> ev(R, std::vector<cudaEvent_t>(2 * kPhases));
  std::vector<std::vector<cudaGraphExec_t>> exec(R, std::vector<cudaGraphExec_t>(kPhases, nullptr));
  std::vector<std::vector<uint64_t*>> profile(R, std::vector<uint64_t*>(kPhases, nullptr));
  for (int r = 0; r < R; ++r) {
    auto& k = g.ranks()[r];
    CHECK_CUDA(cudaSetDevice(k.device));
    for (auto& e : ev[r]) CHECK_CUDA(cudaEventCreate(&e));
    for (auto& p : profile[r]) {
      CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&p), ProfileSlots(g, r) * sizeof(uint64_t)));
      CHECK_CUDA(cudaMemset(p, 0, ProfileSlots(g, r) * sizeof(uint64_t)));
    }
    for (int phase = 0; phase < kPhases; ++phase) {
      const LowLatencyPhases which = phase % 2 == 0 ? LowLatencyPhases::kSend : LowLatencyPhases::kRecv;
      CHECK_CUDA(cudaStreamBeginCapture(k.stream, cudaStreamCaptureModeThreadLocal));
      CHECK_CUDA(cudaEventRecordWithFlags(ev[r][2 * phase], k.stream, cudaEventRecordExternal));
      kernels::LowLatencyContext ctx = k.ctx;
      ctx.profile_ns = profile[r][phase];
      if (phase < 2) {
        CHECK_OK(kernels::LowLatencyDispatch(ctx, g.DispatchArgs(r, 0, which), k.stream));
      } else {
        CHECK_OK(kernels::LowLatencyCombine(ctx, g.CombineArgs(r, 1, which, false), k.stream));
      }
      CHECK_CUDA(cudaEventRecordWithFlags(ev[r][2 * phase + 1], k.stream, cudaEventRecordExternal));
      cudaGraph_t graph;
      CHECK_CUDA(cudaStreamEndCapture(k.stream, &graph));
      CHECK_CUDA(cudaGraphInstantiate(&exec[r][phase], graph, 0));
      CHECK_CUDA(cudaGraphDestroy(graph));
    }
  }
  HookTimings t;
  for (int i = 0; i < iters + 10; ++i) {
    double times[kPhases] = {0, 0, 0, 0};
    double later_rank_combine_send = 0;
    for (int phase = 0; phase < kPhases; ++phase) {
      const int first = i % R;  // alternate which rank is launched first
      for (int n = 0; n < R; ++n) {
        const int r = (first + n) % R;
        CHECK_CUDA(cudaSetDevice(g.ranks()[r].device));
        CHECK_CUDA(cudaGraphLaunch(exec[r][phase], g.ranks()[r].stream));
      }
      CHECK_OK(g.Sync());
      for (int r = 0; r < R; ++r)
        times[phase] = std::max<double>(times[phase], Elapsed(ev[r][2 * phase], ev[r][2 * phase + 1]));
      if (phase == 2) {
        const int last = (first + R - 1) % R;
        later_rank_combine_send = Elapsed(ev[last][4], ev[last][5]);
      }
      if (i >= 10) {
        t.timelines[phase].resize(R);
        for (int r = 0; r < R; ++r) t.timelines[phase][r].push_back(DownloadTimeline(g, r, profile[r][phase]));
      }
    }
    if (i < 10) continue;  // warm-up
    t.dispatch_send.push_back(times[0]);
    t.dispatch_recv.push_back(times[1]);
    t.combine_send.push_back(times[2]);
    t.combine_recv.push_back(times[3]);
    t.combine_send_later_rank.push_back(later_rank_combine_send);
  }
  for (int r = 0; r < R; ++r) {
    CHECK_CUDA(cudaSetDevice(g.ranks()[r].device));
    for (auto& e : exec[r]) CHECK_CUDA(cudaGraphExecDestroy(e));
    for (auto& e : ev[r]) CHECK_CUDA(cudaEventDestroy(e));
    for (auto* p : profile[r]) CHECK_CUDA(cudaFree(p));
  }
  return t;
}

void Row(bench::Report& report, const char* key, const std::vector<double>& samples) {
  const bench::Summary s = bench::Summarize(samples);
  std::printf("%-20s %9.2f %9.2f %9.2f %9.2f %6zu\n", key, s.median, s.p10, s.p90, s.min, s.count);
  report.SetResult(std::string(key) + "_us", s.median);
  report.SetResult(std::string(key) + "_p10_us", s.p10);
  report.SetResult(std::string(key) + "_p90_us", s.p90);
}

int Main(int argc, char** argv) {
  std::string out_dir = "bench/results";
  int iters = 200;
  int num_ranks = 2;
  std::vector<int> sweep_blocks;  // --sweep_blocks 64,96: also time ordinary calls with these grid sizes
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--out") == 0 && i + 1 < argc) out_dir = argv[++i];
    if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc) iters = std::atoi(argv[++i]);
    if (std::strcmp(argv[i], "--num_ranks") == 0 && i + 1 < argc) num_ranks = std::atoi(argv[++i]);
    if (std::strcmp(argv[i], "--sweep_blocks") == 0 && i + 1 < argc) {
      sweep_blocks.clear();
      for (const char* p = argv[++i]; *p != 0;) {
        sweep_blocks.push_back(std::atoi(p));
        while (*p != 0 && *p != ',') ++p;
        if (*p == ',') ++p;
      }
    }
  }
  if (testing::CudaDeviceCount() < 1) {
    std::printf("low_latency_bench needs a CUDA device, found none: nothing to measure\n");
    return 0;
  }
  if (num_ranks < 1 || num_ranks > kernels::kMaxNvlPeers || 288 % num_ranks != 0) {
    std::fprintf(stderr, "--num_ranks %d: must divide the 288 experts and be 1..%d\n", num_ranks,
                 kernels::kMaxNvlPeers);
    return 2;
  }
  testing::LowLatencyCase c{.num_ranks = num_ranks,
                            .num_experts = 288,
                            .hidden = 7168,
                            .max_tokens_per_rank = 128,
                            .num_topk = 8,
                            .use_fp8 = true,
                            .none_fraction = 0.0,
                            .min_tokens = 128};
  LowLatencyGroup g;
  CHECK_OK(g.Init(c));
  const testing::GpuPlacement& placement = g.placement();
  const std::string shared_note = bench::SharedGpuNote(placement.num_ranks, placement.num_gpus);
  std::printf("%s, %d blocks per launch (0 = all SMs)\n", placement.ToString().c_str(), g.default_num_blocks());
  if (!shared_note.empty()) std::printf("%s\n", shared_note.c_str());
  CHECK_OK(g.RandomInputs(2026));
  const auto ref = kernels::host::LowLatencyDispatchReference(g.shape(), {.use_fp8 = true}, g.inputs());
  CHECK_OK(g.RandomExpertOutputs(2027, ref, false));

  const Timings ordinary = TimeOrdinary(g, iters);
  const HookTimings hooks = TimeHooks(g, iters);
  const std::vector<double> empty = TimeEmptyKernel(g, iters);
  // The design choice of the issue: DeepEP's traffic (a message per (token, expert)), same outputs.
  g.set_message_per_expert(true);
  const Timings per_expert = TimeOrdinary(g, iters);
  const HookTimings per_expert_hooks = TimeHooks(g, iters / 2);
  g.set_message_per_expert(false);
  for (int r = 0; r < c.num_ranks; ++r) CHECK_OK(g.ReadStatus(r));

  // Bytes, DeepEP's metric: the received tensor on a rank (local share included); and what crossed NVLink.
  const size_t fp8_token_bytes = c.hidden + c.hidden / 128 * 4;
  // What one message carries over NVLink (header + FP8 data + scales; the slot is sized for BF16).
  const size_t msg_bytes = kernels::kLowLatencyMessageHeaderBytes + fp8_token_bytes;
  size_t recv_pairs = 0, remote_messages = 0, remote_pairs = 0;
  const int L = c.num_experts / c.num_ranks;
  for (int r = 0; r < c.num_ranks; ++r) {
    for (int e = 0; e < L; ++e) recv_pairs += ref[r].packed_recv_count[e];
    const auto& in = g.inputs()[r];
    for (int t = 0; t < in.num_tokens; ++t) {
      bool to_peer = false;
      for (int k = 0; k < c.num_topk; ++k) {
        const int64_t e = in.topk_idx[t * c.num_topk + k];
        if (e >= 0 && e / L != r) {
          to_peer = true;
          ++remote_pairs;
        }
      }
      remote_messages += to_peer;
    }
  }
  recv_pairs /= c.num_ranks;
  remote_messages /= c.num_ranks;
  remote_pairs /= c.num_ranks;

  bench::Report report("low-latency");
  report.SetPlacement(placement.num_ranks, placement.num_gpus);
  report.SetConfig("num_ranks", static_cast<double>(c.num_ranks));
  report.SetConfig("num_blocks", static_cast<double>(NumBlocks(g, 0)));
  report.SetConfig("tokens_per_rank", static_cast<double>(c.max_tokens_per_rank));
  report.SetConfig("hidden", static_cast<double>(c.hidden));
  report.SetConfig("num_experts", static_cast<double>(c.num_experts));
  report.SetConfig("num_topk", static_cast<double>(c.num_topk));
  report.SetConfig("dispatch_dtype", "fp8_e4m3 (scales float, round_scale off)");
  report.SetConfig("combine_dtype", "bf16");
  report.SetConfig("iterations", static_cast<double>(iters));
  report.SetConfig("ordinary_launch", ordinary.graphs ? "cuda_graph" : "direct");
  report.SetConfig("timing",
                   "ordinary: per-rank CUDA-graph replay of back-to-back dispatch+combine pairs, CUDA events between "
                   "kernels, per iteration the slower rank; hook: each phase a per-rank graph (event, kernel, event), "
                   "phases separated by host synchronisation, per iteration the slower rank");
  report.SetConfig("message_per_expert",
                   "the *_message_per_expert rows: the same dispatch sending DeepEP's traffic, one message per "
                   "(token, expert) (identical outputs)");
  report.SetConfig("kernel_us",
                   "*_kernel_us: in-kernel duration from the kernels' profile marks (first block entry to last warp "
                   "end, %globaltimer), the slower rank, as a profiler reports kernel time (DeepEP's figures are "
                   "kernel times); the other *_us are CUDA-event times including launch");
  report.SetConfig("message_scheme",
                   "dispatch: one message per (token, destination rank) + receiver fan-out; "
                   "combine: expert rank sums its experts per token (fmaf, weights published by the token's rank), one "
                   "bf16 partial row per (token, expert rank)");

  std::printf("low-latency, %d ranks, %d tokens/rank, hidden %d, top-%d of %d experts, %s\n", c.num_ranks,
              c.max_tokens_per_rank, c.hidden, c.num_topk, c.num_experts, bench::CudaDeviceName(0).c_str());
  std::printf("%-20s %9s %9s %9s %9s %6s\n", "us", "median", "p10", "p90", "min", "n");
  Row(report, "dispatch", ordinary.dispatch);
  Row(report, "combine", ordinary.combine);
  Row(report, "both", ordinary.both);
  Row(report, "dispatch_send", hooks.dispatch_send);
  Row(report, "dispatch_recv", hooks.dispatch_recv);
  Row(report, "combine_send", hooks.combine_send);
  Row(report, "combine_recv", hooks.combine_recv);
  Row(report, "combine_send_later_rank", hooks.combine_send_later_rank);
  Row(report, "empty_kernel", empty);
  Row(report, "dispatch_message_per_expert", per_expert.dispatch);
  Row(report, "combine_after_message_per_expert", per_expert.combine);
  Row(report, "dispatch_send_message_per_expert", per_expert_hooks.dispatch_send);

  // Where the time goes inside the kernels (profile marks): one timeline per kernel.
  const char* phase_names[4] = {"dispatch send (hook)", "dispatch recv (hook)", "combine send (hook)",
                                "combine recv (hook)"};
  const char* phase_keys[4] = {"dispatch_send", "dispatch_recv", "combine_send", "combine_recv"};
  for (int phase = 0; phase < 4; ++phase) {
    std::vector<double> slowest;  // per run, the slower rank's kernel duration
    for (int r = 0; r < c.num_ranks; ++r) {
      bench::PrintTimelines(std::string(phase_names[phase]) + " rank " + std::to_string(r), hooks.timelines[phase][r],
                            bench::LowLatencyStepRoles(/*combine=*/phase >= 2));
      for (size_t i = 0; i < hooks.timelines[phase][r].size(); ++i) {
        if (slowest.size() <= i) slowest.push_back(0);
        slowest[i] = std::max(slowest[i], hooks.timelines[phase][r][i].DurationUs());
      }
    }
    report.SetResult(std::string(phase_keys[phase]) + "_kernel_us", bench::Summarize(slowest).median);
  }
  ProfileOrdinary(g, 60, report);
  // Fewer blocks than SMs: less grid start-up and fewer warps to wait for, fewer warps per item.
  for (int blocks : sweep_blocks) {
    if (absl::Status fits = testing::CheckBlocksFit(placement, blocks); !fits.ok()) {
      std::printf("%d blocks: skipped: %s\n", blocks, std::string(fits.message()).c_str());
      continue;
    }
    for (auto& k : g.ranks()) k.ctx.num_blocks = blocks;
    const Timings t = TimeOrdinary(g, iters / 2);
    const std::string suffix = "_blocks" + std::to_string(blocks);
    std::printf("%d blocks: events dispatch %.2f us, combine %.2f us; ", blocks, bench::Summarize(t.dispatch).median,
                bench::Summarize(t.combine).median);
    report.SetResult("dispatch" + suffix + "_us", bench::Summarize(t.dispatch).median);
    report.SetResult("combine" + suffix + "_us", bench::Summarize(t.combine).median);
    ProfileOrdinary(g, 40, report, suffix, /*verbose=*/false);
  }
  for (auto& k : g.ranks()) k.ctx.num_blocks = g.default_num_blocks();

  const double dispatch_us = bench::Summarize(ordinary.dispatch).median;
  const double combine_us = bench::Summarize(ordinary.combine).median;
  const double dispatch_bytes = static_cast<double>(recv_pairs) * fp8_token_bytes;
  const double combine_bytes = static_cast<double>(recv_pairs) * c.hidden * 2;
  report.SetResult("dispatch_recv_gbps", dispatch_bytes / dispatch_us / 1e3);
  report.SetResult("combine_gbps", combine_bytes / combine_us / 1e3);
  report.SetResult("dispatch_remote_mb", remote_messages * static_cast<double>(msg_bytes) / 1e6);
  report.SetResult("dispatch_remote_mb_if_per_expert", remote_pairs * static_cast<double>(msg_bytes) / 1e6);
  report.SetResult("combine_remote_mb", remote_messages * static_cast<double>(c.hidden) * 2 / 1e6);
  report.SetResult("combine_remote_mb_if_per_expert", remote_pairs * static_cast<double>(c.hidden) * 2 / 1e6);
  report.SetResult("received_pairs_per_rank", static_cast<double>(recv_pairs));
  std::printf(
      "dispatch %.1f GB/s (DeepEP metric), combine %.1f GB/s; remote bytes per rank: dispatch %.2f MB "
      "(%.2f MB with a message per (token, expert)), combine %.2f MB (%.2f MB per (token, expert))\n",
      dispatch_bytes / dispatch_us / 1e3, combine_bytes / combine_us / 1e3,
      remote_messages * static_cast<double>(msg_bytes) / 1e6, remote_pairs * static_cast<double>(msg_bytes) / 1e6,
      remote_messages * static_cast<double>(c.hidden) * 2 / 1e6,
      remote_pairs * static_cast<double>(c.hidden) * 2 / 1e6);
  absl::StatusOr<std::string> path = report.WriteTo(out_dir);
  if (!path.ok()) {
    std::fprintf(stderr, "writing the report: %s\n", path.status().ToString().c_str());
    return 1;
  }
  std::printf("wrote %s\n", path->c_str());
  if (!shared_note.empty()) std::printf("%s\n", shared_note.c_str());
  return 0;
}

}  // namespace
}  // namespace epfabric

int main(int argc, char** argv) { return epfabric::Main(argc, argv); }
