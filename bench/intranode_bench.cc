// Intranode normal-mode benchmark: 2 ranks (--num_ranks) in one process, 4096 tokens per rank, hidden 7168, top-8 of
// 256 experts (distinct experts per token), 24 SMs unless --num_sms says otherwise. Rank r runs on GPU r mod (visible
// GPUs): on a one-GPU machine the ranks share GPU 0, the JSON says "shared_gpu": true and the output says that the
// figures are not comparable with NVLink figures; a channel count whose blocks cannot all be resident with the other
// ranks' is skipped (with a line saying so), and the link probes (NVLink between two GPUs) are skipped.
//
// Every timed iteration queues a start gate (intranode_gate.cu) on both GPUs, then [start event, kernel(s), end
// event] on each, then opens the gate, so host launch skew does not count; the iteration's time is the slower
// rank's. Reported: median (p10/p90) over --iters iterations after --warmup. Bandwidth in DeepEP's metric is the
// bytes of recv_x on a rank (its own share included; FP8: data + scales) over time; "remote" counts only the rows
// that crossed NVLink. Combine moves the same bytes back.
//
// After the timed runs of each kernel, 20 more runs record its timeline (kernels' profile marks, %globaltimer): when
// each warp role finished, relative to the first block's start (--no_profile skips them).
//
// Usage: intranode_bench [--out DIR] [--num_ranks N] [--num_sms N] [--iters N] [--warmup N] [--probes_only]
//                        [--no_probes] [--no_profile] [--extra_results FILE]
//
// --extra_results FILE: key=value lines (numbers) measured elsewhere, added to the JSON `results` map as they are
// (ReadResultsFile in common/report.h; a key this benchmark writes itself keeps the benchmark's value). device-checks
// passes restart.txt, the restart cost of issue #5 (restart_to_first_dispatch_ms, ...), so that both land in one file.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "common/report.h"
#include "common/timeline.h"
#include "epfabric/kernels/intranode.h"
#include "epfabric/kernels/reference/intranode_reference.h"
#include "intranode_gate.h"
#include "intranode_harness.h"

namespace epfabric::bench {
namespace {

using testing::CaseConfig;
using testing::IntranodeTestGroup;
using testing::PipelineRunner;
namespace ref = kernels::reference;

struct Options {
  std::string out = "bench/results";
  int num_ranks = 2;
  int num_sms = 24;
  int iters = 100;
  int warmup = 10;
  bool probes_only = false;
  bool probes = true;
  bool profile = true;
  std::vector<std::pair<std::string, double>> extra_results;
};

#define BENCH_CHECK(expr)                                                    \
  do {                                                                       \
    absl::Status s_ = (expr);                                                \
    if (!s_.ok()) {                                                          \
      std::fprintf(stderr, "%s failed: %s\n", #expr, s_.ToString().c_str()); \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)

#define BENCH_CUDA(expr)                                                      \
  do {                                                                        \
    cudaError_t e_ = (expr);                                                  \
    if (e_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)

// Times `launch(rank)` on all ranks together, `iters` times after `warmup`; returns microseconds per iteration
// (the slower rank).
template <typename Launch>
std::vector<double> TimeGated(IntranodeTestGroup& group, int32_t* gate_flag, int warmup, int iters, Launch launch) {
  const int R = group.num_ranks();
  std::vector<cudaEvent_t> start(R), stop(R);
  for (int r = 0; r < R; ++r) {
    BENCH_CUDA(cudaSetDevice(group.rank(r).device));
    BENCH_CUDA(cudaEventCreate(&start[r]));
    BENCH_CUDA(cudaEventCreate(&stop[r]));
  }
  std::vector<double> samples;
  for (int it = 0; it < warmup + iters; ++it) {
    *reinterpret_cast<volatile int32_t*>(gate_flag) = 0;
    for (int r = 0; r < R; ++r) {
      testing::RankContext& ctx = group.rank(r);
      BENCH_CUDA(cudaSetDevice(ctx.device));
      BENCH_CUDA(LaunchGate(gate_flag, 2ull * 1000 * 1000 * 1000, ctx.stream));
      BENCH_CUDA(cudaEventRecord(start[r], ctx.stream));
      BENCH_CHECK(launch(r));
      BENCH_CUDA(cudaEventRecord(stop[r], ctx.stream));
    }
    *reinterpret_cast<volatile int32_t*>(gate_flag) = 1;
    BENCH_CHECK(group.SyncAndCheck());
    double slowest = 0;
    for (int r = 0; r < R; ++r) {
      float ms = 0;
      BENCH_CUDA(cudaEventElapsedTime(&ms, start[r], stop[r]));
      slowest = std::max(slowest, 1000.0 * ms);
    }
    if (it >= warmup) samples.push_back(slowest);
  }
  for (int r = 0; r < R; ++r) {
    cudaEventDestroy(start[r]);
    cudaEventDestroy(stop[r]);
  }
  return samples;
}

// Kernel timelines of `launch` on every rank (one gated run at a time, `runs` times), rank by rank.
template <typename Launch>
std::vector<std::vector<Timeline>> ProfileGated(IntranodeTestGroup& group, int32_t* gate_flag, int runs, int blocks,
                                                Launch launch) {
  const int R = group.num_ranks();
  const size_t slots = static_cast<size_t>(blocks) * kernels::kProfileSlotsPerBlock;
  std::vector<testing::DeviceBuffer> profile(R);
  for (int r = 0; r < R; ++r) {
    BENCH_CHECK(profile[r].Allocate(group.rank(r).device, slots * sizeof(uint64_t)));
    group.rank(r).group.profile_ns = profile[r].as<uint64_t>();
  }
  std::vector<std::vector<Timeline>> out(R);
  for (int run = 0; run < runs; ++run) {
    for (int r = 0; r < R; ++r) {
      BENCH_CUDA(cudaSetDevice(group.rank(r).device));
      BENCH_CUDA(cudaMemset(profile[r].get(), 0, slots * sizeof(uint64_t)));
    }
    TimeGated(group, gate_flag, 0, 1, launch);
    for (int r = 0; r < R; ++r) {
      Timeline t;
      t.num_blocks = blocks;
      t.slots.resize(slots);
      BENCH_CHECK(profile[r].Download(t.slots.data(), slots * sizeof(uint64_t)));
      out[r].push_back(std::move(t));
    }
  }
  for (int r = 0; r < R; ++r) group.rank(r).group.profile_ns = nullptr;
  return out;
}

// The warp roles of dispatch (IntranodeDispatchCopyWarps) and combine (intranode_combine.cu).
std::vector<WarpRole> DispatchRoles(int num_ranks, int row_bytes, int num_sms) {
  const int copy = kernels::IntranodeDispatchCopyWarps(num_ranks, row_bytes, num_sms, kernels::CurrentTunedGpu());
  return {{"copy warps", 0, copy}, {"publisher warp", copy, copy + 1}, {"receiver warps", copy + 1, 32}};
}
const std::vector<WarpRole> kCombineRoles = {{"sender warp", 0, 1}, {"publisher warp", 1, 2}, {"reducer warps", 2, 32}};

void PrintProfile(const std::string& title, const std::vector<std::vector<Timeline>>& per_rank,
                  const std::vector<WarpRole>& roles) {
  for (size_t r = 0; r < per_rank.size(); ++r) PrintTimelines(absl::StrCat(title, ", rank ", r), per_rank[r], roles);
}

CaseConfig BenchCase(bool fp8, int num_sms, int num_ranks) {
  CaseConfig c;
  c.hidden = 7168;
  c.num_tokens.assign(num_ranks, 4096);
  c.num_topk = 8;
  c.num_experts = 256;
  c.fp8 = fp8;
  c.send_topk = true;
  c.send_weights = true;
  c.num_sms = num_sms;
  return c;
}

struct Bytes {
  double recv = 0;    // mean over ranks of recv_x bytes (DeepEP's metric)
  double remote = 0;  // mean over ranks of bytes that crossed NVLink
};

Bytes RecvBytes(PipelineRunner& runner, const std::vector<ref::RankOutput>& want) {
  const ref::DispatchConfig d = testing::MakeReferenceConfig(runner.config());
  const double row = d.row_bytes + d.num_scales * 4.0;
  Bytes b;
  const int R = static_cast<int>(want.size());
  for (int r = 0; r < R; ++r) {
    const int own = want[r].rank_prefix_matrix[r * R + r] - (r > 0 ? want[r].rank_prefix_matrix[(r - 1) * R + r] : 0);
    b.recv += want[r].num_recv_tokens * row / R;
    b.remote += (want[r].num_recv_tokens - own) * row / R;
  }
  return b;
}

void Print(const char* name, const Summary& s, double bytes, double remote_bytes) {
  if (bytes > 0) {
    std::printf("%-34s %9.1f us  (p10 %7.1f, p90 %7.1f)  %7.1f GB/s  remote %7.1f GB/s\n", name, s.median, s.p10, s.p90,
                bytes / s.median / 1e3, remote_bytes / s.median / 1e3);
  } else {
    std::printf("%-34s %9.1f us  (p10 %7.1f, p90 %7.1f)\n", name, s.median, s.p10, s.p90);
  }
}

void Record(Report& report, const std::string& key, const Summary& s, double bytes, double remote_bytes) {
  report.SetResult(key + "_us", s.median);
  report.SetResult(key + "_p10_us", s.p10);
  report.SetResult(key + "_p90_us", s.p90);
  if (bytes > 0) {
    report.SetResult(key + "_gbps", bytes / s.median / 1e3);
    report.SetResult(key + "_remote_gbps", remote_bytes / s.median / 1e3);
  }
}

// The kernels' own duration (first block entry to last warp end, %globaltimer) of the slower rank per run, without
// the gate's release, the launch and the events that the event times include (~5 us here): the lower bound of any
// event-based timing (DeepEP's intranode test averages events around back-to-back calls).
Summary KernelTimes(const std::vector<std::vector<Timeline>>& per_rank) {
  std::vector<double> slower(per_rank.empty() ? 0 : per_rank[0].size(), 0.0);
  for (const std::vector<Timeline>& runs : per_rank) {
    for (size_t i = 0; i < runs.size() && i < slower.size(); ++i) slower[i] = std::max(slower[i], runs[i].DurationUs());
  }
  return Summarize(std::move(slower));
}

// Prints the timelines of `per_rank` and records the kernel times as `key`_kernel_us (and GB/s from them).
void ProfileAndRecord(Report& report, const std::string& title, const std::string& key,
                      const std::vector<std::vector<Timeline>>& per_rank, const std::vector<WarpRole>& roles,
                      double bytes, double remote_bytes) {
  PrintProfile(title, per_rank, roles);
  const Summary kernel = KernelTimes(per_rank);
  Print(absl::StrCat(title, " kernel time").c_str(), kernel, bytes, remote_bytes);
  Record(report, key + "_kernel", kernel, bytes, remote_bytes);
}

// Runs layout + notify + dispatch once (checked against the reference), then times cached dispatch, notify +
// dispatch, and (BF16) combine.
void BenchDtype(IntranodeTestGroup& group, int32_t* gate, const Options& o, bool fp8, int num_sms, bool full,
                Report& report) {
  if (absl::Status fits = testing::CheckBlocksFit(group.placement(), num_sms); !fits.ok()) {
    std::printf("%s sms %d: skipped: %s\n", fp8 ? "fp8" : "bf16", num_sms, std::string(fits.message()).c_str());
    return;
  }
  const CaseConfig c = BenchCase(fp8, num_sms, group.num_ranks());
  std::mt19937_64 rng(12345 + num_sms + (fp8 ? 1 : 0));
  const std::vector<ref::RankInput> inputs = testing::MakeInputs(c, rng);
  const std::vector<ref::RankOutput> want = ref::Dispatch(inputs, testing::MakeReferenceConfig(c));
  PipelineRunner runner(&group, c);
  BENCH_CHECK(runner.Prepare(inputs));
  BENCH_CHECK(runner.RunLayout());
  BENCH_CHECK(runner.RunNotify());
  BENCH_CHECK(runner.RunDispatch());
  for (int r = 0; r < group.num_ranks(); ++r) {
    auto got = testing::DownloadVector<uint8_t>(runner.buffers(r).recv_x, want[r].recv_x.size());
    BENCH_CHECK(got.status());
    if (*got != want[r].recv_x) {
      std::fprintf(stderr, "recv_x of rank %d differs from the reference: not timing a wrong result\n", r);
      std::exit(1);
    }
  }
  const Bytes bytes = RecvBytes(runner, want);
  const std::string dtype = fp8 ? "fp8" : "bf16";
  const std::string suffix = num_sms == o.num_sms ? "" : absl::StrCat("_sms", num_sms);

  if (full) {
    const Summary layout =
        Summarize(TimeGated(group, gate, o.warmup, o.iters, [&](int r) { return runner.LaunchLayout(r); }));
    Print("layout", layout, 0, 0);
    report.SetResult("layout_us", layout.median);
    report.SetResult("layout_p90_us", layout.p90);
    const Summary notify =
        Summarize(TimeGated(group, gate, o.warmup, o.iters, [&](int r) { return runner.LaunchNotify(r); }));
    Print("notify", notify, 0, 0);
    report.SetResult("notify_us", notify.median);
  }
  const Summary dispatch =
      Summarize(TimeGated(group, gate, o.warmup, o.iters, [&](int r) { return runner.LaunchDispatch(r); }));
  Print(absl::StrCat("dispatch ", dtype, " (cached) sms ", num_sms).c_str(), dispatch, bytes.recv, bytes.remote);
  if (o.profile && num_sms == o.num_sms) {
    ProfileAndRecord(report, absl::StrCat("dispatch ", dtype, " sms ", num_sms), "dispatch_" + dtype,
                     ProfileGated(group, gate, 20, num_sms, [&](int r) { return runner.LaunchDispatch(r); }),
                     DispatchRoles(group.num_ranks(), fp8 ? c.hidden : c.hidden * 2, num_sms), bytes.recv,
                     bytes.remote);
  }
  Record(report, absl::StrCat("dispatch_", dtype) + suffix, dispatch, bytes.recv, bytes.remote);
  if (full) {
    const Summary with_notify = Summarize(TimeGated(group, gate, o.warmup, o.iters, [&](int r) {
      absl::Status s = runner.LaunchNotify(r);
      return s.ok() ? runner.LaunchDispatch(r) : s;
    }));
    Print(absl::StrCat("notify + dispatch ", dtype).c_str(), with_notify, bytes.recv, bytes.remote);
    Record(report, absl::StrCat("dispatch_", dtype, "_with_notify"), with_notify, bytes.recv, bytes.remote);
  }
  if (!fp8) {
    // Combine the received rows back (x = random BF16 rows in the received order, the received weights).
    std::vector<ref::CombineInput> cin(group.num_ranks());
    uint64_t state = 88172645463325252ull;
    for (int r = 0; r < group.num_ranks(); ++r) {
      cin[r].x.resize(static_cast<size_t>(want[r].num_recv_tokens) * c.hidden);
      for (uint16_t& v : cin[r].x) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        v = ref::FloatToBf16(static_cast<float>(static_cast<int64_t>(state % 2001) - 1000) / 1000.0f);
      }
      cin[r].topk_weights = want[r].recv_topk_weights;
    }
    BENCH_CHECK(runner.PrepareCombine(cin));
    const Summary combine =
        Summarize(TimeGated(group, gate, o.warmup, o.iters, [&](int r) { return runner.LaunchCombine(r); }));
    Print(absl::StrCat("combine bf16 sms ", num_sms).c_str(), combine, bytes.recv, bytes.remote);
    Record(report, "combine_bf16" + suffix, combine, bytes.recv, bytes.remote);
    if (o.profile && num_sms == o.num_sms) {
      ProfileAndRecord(report, absl::StrCat("combine bf16 sms ", num_sms), "combine_bf16",
                       ProfileGated(group, gate, 20, num_sms, [&](int r) { return runner.LaunchCombine(r); }),
                       kCombineRoles, bytes.recv, bytes.remote);
    }
  }
}

// What copies get through NVLink per GPU, one way (rank 0 only) and both ways at once (each rank to/from the other,
// as in dispatch and combine): the ceiling the kernels are measured against. `launch(src, dst, bytes, stream)` is
// one probe kernel; `name` goes into the result keys.
template <typename Launch>
void ProbeLink(IntranodeTestGroup& group, int32_t* gate, const Options& o, const std::string& name, Report& report,
               Launch launch) {
  const size_t bytes = size_t{4096} * 7168 * 2;
  const kernels::IntranodeRegionLayout layout = *kernels::ComputeIntranodeRegionLayout(group.config());
  std::vector<testing::DeviceBuffer> local(group.num_ranks());
  for (int r = 0; r < group.num_ranks(); ++r) BENCH_CHECK(local[r].Allocate(group.rank(r).device, bytes));
  auto peer_staging = [&](int r) {
    return static_cast<char*>(group.rank(r).group.peer_regions[1 - r]) + layout.staging_x;
  };
  for (const bool store : {true, false}) {
    for (const bool both : {false, true}) {
      const Summary s = Summarize(TimeGated(group, gate, o.warmup, o.iters, [&](int r) -> absl::Status {
        if (!both && r != 0) return absl::OkStatus();
        const void* src = store ? local[r].get() : peer_staging(r);
        void* dst = store ? static_cast<void*>(peer_staging(r)) : local[r].get();
        const cudaError_t err = launch(src, dst, bytes, group.rank(r).stream);
        return err == cudaSuccess ? absl::OkStatus() : absl::InternalError(cudaGetErrorString(err));
      }));
      const std::string key =
          absl::StrCat("probe_", name, store ? "_store" : "_load", both ? "_bidir" : "_unidir", "_gbps");
      std::printf("%-44s %9.1f us  (p10 %7.1f, p90 %7.1f)  %7.1f GB/s per direction\n", key.c_str(), s.median, s.p10,
                  s.p90, bytes / s.median / 1e3);
      report.SetResult(key, bytes / s.median / 1e3);
    }
  }
}

void ProbeLinks(IntranodeTestGroup& group, int32_t* gate, const Options& o, Report& report) {
  // What the probes measure is the link between two GPUs, both ways: 2 ranks on 2 distinct GPUs.
  if (group.num_ranks() != 2 || group.placement().shared()) {
    std::printf("link probes: skipped (%s): they measure the NVLink between 2 ranks on 2 distinct GPUs\n",
                group.placement().ToString().c_str());
    return;
  }
  for (int blocks : {24, 132}) {
    ProbeLink(group, gate, o, absl::StrCat("sm_copy_sms", blocks), report,
              [&](const void* src, void* dst, size_t bytes, cudaStream_t stream) {
                return LaunchCopyProbe(src, dst, bytes, blocks, 512, stream);
              });
  }
  struct Bulk {
    int blocks, pipelines, stages, chunk;
  };
  for (const Bulk b : {Bulk{24, 1, 4, 16384}, Bulk{24, 2, 4, 16384}, Bulk{24, 4, 4, 8192}, Bulk{24, 8, 3, 8192},
                       Bulk{16, 4, 4, 8192}, Bulk{8, 4, 4, 8192}, Bulk{132, 1, 4, 16384}}) {
    ProbeLink(group, gate, o,
              absl::StrCat("bulk_sms", b.blocks, "_pipes", b.pipelines, "_stages", b.stages, "_chunk", b.chunk), report,
              [&](const void* src, void* dst, size_t bytes, cudaStream_t stream) {
                return LaunchBulkCopyProbe(src, dst, bytes, b.blocks, b.pipelines, b.stages, b.chunk, stream);
              });
  }
}

int Main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--out") {
      o.out = value();
    } else if (arg == "--num_ranks") {
      o.num_ranks = std::atoi(value().c_str());
    } else if (arg == "--num_sms") {
      o.num_sms = std::atoi(value().c_str());
    } else if (arg == "--iters") {
      o.iters = std::atoi(value().c_str());
    } else if (arg == "--warmup") {
      o.warmup = std::atoi(value().c_str());
    } else if (arg == "--probes_only") {
      o.probes_only = true;
    } else if (arg == "--no_probes") {
      o.probes = false;
    } else if (arg == "--no_profile") {
      o.profile = false;
    } else if (arg == "--extra_results") {
      auto extra = ReadResultsFile(value());
      if (!extra.ok()) {
        std::fprintf(stderr, "--extra_results: %s\n", extra.status().ToString().c_str());
        return 2;
      }
      o.extra_results = *std::move(extra);
    } else {
      std::fprintf(stderr,
                   "usage: intranode_bench [--out DIR] [--num_ranks N] [--num_sms N] [--iters N] [--warmup N] "
                   "[--probes_only] [--no_probes] [--no_profile] [--extra_results FILE]\n");
      return 2;
    }
  }
  const int devices = testing::CudaDeviceCount();
  if (devices < 1) {
    std::printf("intranode_bench needs a CUDA device, found none: nothing to measure\n");
    return 0;
  }
  if (o.num_ranks < 1 || o.num_ranks > kernels::kMaxNvlPeers || 256 % o.num_ranks != 0) {
    std::fprintf(stderr, "--num_ranks %d: must divide the 256 experts and be 1..%d\n", o.num_ranks,
                 kernels::kMaxNvlPeers);
    return 2;
  }
  kernels::IntranodeRegionConfig config;
  config.num_ranks = o.num_ranks;
  config.max_tokens_per_rank = 4096;
  config.max_hidden = 7168;
  config.max_topk = 8;
  config.num_experts = 256;
  config.max_channels = 32;
  auto group = IntranodeTestGroup::Create(config);
  BENCH_CHECK(group.status());
  int32_t* gate = nullptr;
  BENCH_CUDA(
      cudaHostAlloc(reinterpret_cast<void**>(&gate), sizeof(int32_t), cudaHostAllocMapped | cudaHostAllocPortable));

  const testing::GpuPlacement& placement = (*group)->placement();
  const std::string shared_note = SharedGpuNote(placement.num_ranks, placement.num_gpus);
  Report report("intranode");
  report.SetPlacement(placement.num_ranks, placement.num_gpus);
  report.SetConfig("num_ranks", static_cast<double>(o.num_ranks));
  report.SetConfig("num_tokens_per_rank", 4096.0);
  report.SetConfig("hidden", 7168.0);
  report.SetConfig("num_topk", 8.0);
  report.SetConfig("num_experts", 256.0);
  report.SetConfig("num_sms", static_cast<double>(o.num_sms));
  report.SetConfig("iters", static_cast<double>(o.iters));
  report.SetConfig("warmup", static_cast<double>(o.warmup));
  report.SetConfig("timing", "CUDA events per rank behind a start gate; slower rank per iteration; median");
  // Which measured settings (copy warps, combine chunks) the kernels took on this GPU.
  const bool h200 = kernels::CurrentTunedGpu() == kernels::TunedGpu::kH200;
  report.SetConfig("tuned_gpu", h200 ? "H200" : "H100");
  // Set before this benchmark's own results, so that a key both write keeps the value measured here.
  for (const auto& [key, value] : o.extra_results) report.SetResult(key, value);
  report.SetResult("num_sms", o.num_sms);
  std::printf("device: %s, %s, %d SMs per kernel, %d iterations (median, p10, p90), %s settings\n",
              CudaDeviceName(0).c_str(), placement.ToString().c_str(), o.num_sms, o.iters, h200 ? "H200" : "H100");
  if (!shared_note.empty()) std::printf("%s\n", shared_note.c_str());

  if (!o.probes_only) {
    BenchDtype(**group, gate, o, /*fp8=*/false, o.num_sms, /*full=*/true, report);
    BenchDtype(**group, gate, o, /*fp8=*/true, o.num_sms, /*full=*/false, report);
    for (int sms : {16, 20, 32}) {
      if (sms != o.num_sms) BenchDtype(**group, gate, o, /*fp8=*/false, sms, /*full=*/false, report);
    }
  }
  if (o.probes) ProbeLinks(**group, gate, o, report);
  cudaFreeHost(gate);
  absl::StatusOr<std::string> path = report.WriteTo(o.out);
  BENCH_CHECK(path.status());
  std::printf("wrote %s\n", path->c_str());
  if (!shared_note.empty()) std::printf("%s\n", shared_note.c_str());
  return 0;
}

}  // namespace
}  // namespace epfabric::bench

int main(int argc, char** argv) { return epfabric::bench::Main(argc, argv); }
