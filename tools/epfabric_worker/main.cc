// epfabric_worker: one client process = one rank of a group. It connects to its daemon, attaches, creates a Buffer
// and runs rounds of dispatch + combine (normal or low-latency mode, the group's). Every worker generates ALL ranks'
// inputs of a round from the seed, so it computes the single-process expected results itself with the host
// references (kernels/host/*_reference.h) and compares its own outputs element by element:
//   - dispatch outputs (layout, received rows, scales, top-k, counts) exactly;
//   - combine exactly against the reference (which applies the kernels' operations in the kernels' order), unless
//     --exact=false, and always against the weighted sum computed in double precision:
//       experts: f_e(x) = x * (1 + (e % 8) / 8)   (exact in binary)
//       expected combined[t] = sum over valid k of w[t][k] * f_{e[t][k]}(x[t])
//     within |got - expected| <= 2^-6 * sum_k |w * f_e(x)| + 1e-6: up to three BF16 roundings of at most 2^-8 each
//     (the expert output, the per-rank partial sum, the combined value). In low-latency FP8 mode x is the FP8 value the
//     dispatch sent (host emulation of the kernel's quantisation); the error against the unquantised BF16 x is reported
//     as max_rel_err_vs_bf16.
// Output: one line `EPF_RESULT key=value ...` (ok=1 only when everything matched), `EPF_EVENT ...` lines for
// timeouts; exit code 0 only when everything matched. Usage errors: exit code 2.
//
//   epfabric_worker --socket=S --group=G --rank=R --token=T --mode=normal --tokens=64 --hidden=7168 --topk=8
//                   --experts=32 [--fp8] [--seed=1] [--repeats=3]
//   epfabric_worker --region_bytes --ranks=4 --mode=... --tokens=... ...   (prints RequiredRegionBytes and exits)
//
// --restart_probe (restart cost, issue #5): no checks, no host reference, no other rank's inputs. Timed from
// --launch_unix_ns (the launcher's `date +%s%N`) to the completion of this process' first dispatch:
//   main -> Connect -> Attach (every same-host rank's region mapped) -> Buffer::Create -> inputs (this rank's only:
//   random expert ids, x and weights set by a memset) -> GetDispatchLayout + Dispatch -> Check()
// and printed, as milliseconds since launch at each boundary, on one line
//   EPF_RESTART rank=R restart_to_first_dispatch_ms=X main_ms=.. connect_ms=.. attach_ms=.. buffer_ms=..
//               dispatch_ms=.. inputs_ms=.. context_ms=.. ...
// (restart_to_first_dispatch_ms == dispatch_ms). A rank's dispatch stage includes waiting for its peers to reach
// theirs, so a launcher takes the slowest rank. An unchecked combine follows (so every rank leaves the group as a
// normal round would), then exit 0; any failure: `EPF_RESTART rank=R ok=0 stage=.. error=".."`, exit 1.
#include <cuda_runtime_api.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/time/time.h"
#include "epfabric/client/buffer.h"
#include "epfabric/client/client.h"
#include "fp8.h"
#include "intranode_reference.h"
#include "low_latency_reference.h"

ABSL_FLAG(std::string, socket, "", "Unix socket of this rank's daemon (its --client_socket).");
ABSL_FLAG(std::string, group, "", "Group name.");
ABSL_FLAG(int, rank, -1, "Group rank to attach as.");
ABSL_FLAG(std::string, token, "", "The group's token.");
ABSL_FLAG(std::string, mode, "normal", "normal or low_latency (must be the group's mode).");
ABSL_FLAG(int, tokens, 64, "Most tokens a rank dispatches per call (BufferConfig.max_tokens_per_rank).");
ABSL_FLAG(bool, fixed_tokens, false, "Every rank dispatches exactly --tokens (else a random count in [0, tokens]).");
ABSL_FLAG(int, hidden, 256, "Hidden size.");
ABSL_FLAG(int, topk, 4, "Top-k slots per token.");
ABSL_FLAG(int, experts, 16, "Number of experts (a multiple of the number of ranks).");
ABSL_FLAG(bool, fp8, false, "FP8 e4m3 activations (normal: x given in FP8 with scales; low latency: use_fp8).");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the inputs (the same on every rank of a run).");
ABSL_FLAG(int, repeats, 1, "Rounds of dispatch + combine, each on fresh inputs.");
ABSL_FLAG(std::string, routing, "random",
          "random | silent (rank --silent_rank dispatches 0 tokens) | nowhere (its tokens choose no expert) | "
          "one_expert (every token: expert 0 only)");
ABSL_FLAG(int, silent_rank, 0, "The rank of --routing=silent|nowhere.");
ABSL_FLAG(double, empty_fraction, 0.1, "Fraction of top-k entries set to -1.");
ABSL_FLAG(int, num_sms, 4, "Normal mode: channels (BufferConfig.num_sms).");
ABSL_FLAG(int, timeout_ms, 5000, "BufferConfig.timeout in milliseconds.");
ABSL_FLAG(bool, exact, true, "Also compare combine bit for bit with the host reference.");
ABSL_FLAG(bool, bad_input, false, "First make calls with bad input; each must be refused with InvalidArgument.");
ABSL_FLAG(bool, until_timeout, false,
          "Run rounds until a call fails with DeadlineExceeded (a peer died); then recover with --recover_dir.");
ABSL_FLAG(int, max_seconds, 60, "--until_timeout: give up (and fail) after this long without a timeout.");
ABSL_FLAG(std::string, recover_dir, "",
          "After a timeout: write DIR/timedout.<rank>, wait for DIR/reset, Reset(), write DIR/reset.<rank>, wait for "
          "DIR/go, then run --repeats rounds again from round 0.");
ABSL_FLAG(int, sigkill_in_dispatch, 0,
          "Failure tests: SIGKILL this process --sigkill_delay_us after its N-th dispatch call started (0: never).");
ABSL_FLAG(int, sigkill_delay_us, 500, "See --sigkill_in_dispatch.");
ABSL_FLAG(bool, reset_first, false, "Call Buffer::Reset() before the first round (a rank that rejoins).");
ABSL_FLAG(bool, flip_one_output, false,
          "Tests of the checks: flip one bit of this rank's first combined value before comparing (must fail).");
ABSL_FLAG(bool, region_bytes, false, "Print RequiredRegionBytes for the scenario and --ranks, then exit.");
ABSL_FLAG(int, ranks, 4, "--region_bytes: number of same-host ranks.");
ABSL_FLAG(int64_t, launch_unix_ns, 0,
          "When the launcher started this process (CLOCK_REALTIME ns, e.g. `date +%s%N`). Checked modes report "
          "restart_to_first_dispatch_ms from it to the first completed dispatch, which there also includes making "
          "every rank's inputs and the host reference; --restart_probe measures the restart path alone.");
ABSL_FLAG(int, device, -1, "CUDA device when devices are visible; -1: rank modulo the visible devices.");
ABSL_FLAG(bool, restart_probe, false,
          "Measure only what a restarted serving process pays before its first dispatch (needs --launch_unix_ns): "
          "connect, attach (maps every same-host region), Buffer::Create, one layout + dispatch of this rank's own "
          "cheaply made inputs, completion; then one unchecked combine. Prints `EPF_RESTART ...` and exits 0.");

namespace epfabric::worker {
namespace {

namespace ref = ::epfabric::kernels::reference;
namespace host = ::epfabric::kernels::host;
using client::Buffer;
using client::BufferConfig;
using client::Tensor;
using client::TensorView;
using kernels::DType;

constexpr int kExitMismatch = 1;
constexpr int kExitUsage = 2;

struct Scenario {
  bool low_latency = false;
  int tokens = 0;
  bool fixed_tokens = false;
  int hidden = 0;
  int topk = 0;
  int experts = 0;
  bool fp8 = false;
  uint64_t seed = 1;
  std::string routing;
  int silent_rank = 0;
  double empty_fraction = 0;
  int num_sms = 0;
  bool exact = true;
  bool flip_one_output = false;
};

float ExpertScale(int64_t expert) { return 1.0f + static_cast<float>(expert % 8) * 0.125f; }

// ---- inputs, identical on every rank ----

std::mt19937_64 RoundRng(const Scenario& s, int round) {
  return std::mt19937_64(s.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(round) * 0x2545F4914F6CDD1Dull + 17);
}

int TokensOf(std::mt19937_64& rng, const Scenario& s, int rank) {
  const int n = s.fixed_tokens ? s.tokens : std::uniform_int_distribution<int>(0, s.tokens)(rng);
  return s.routing == "silent" && rank == s.silent_rank ? 0 : n;
}

std::vector<int64_t> RandomTopk(std::mt19937_64& rng, const Scenario& s, int rank, int num_tokens) {
  std::vector<int64_t> idx(static_cast<size_t>(num_tokens) * s.topk, -1);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::uniform_int_distribution<int64_t> expert(0, s.experts - 1);
  for (int t = 0; t < num_tokens; ++t) {
    int64_t* row = &idx[static_cast<size_t>(t) * s.topk];
    if (s.routing == "nowhere" && rank == s.silent_rank) continue;
    if (s.routing == "one_expert") {
      row[0] = 0;
      continue;
    }
    for (int k = 0; k < s.topk; ++k) {
      if (unit(rng) < s.empty_fraction) continue;
      int64_t e = expert(rng);
      for (int tries = 0; tries < 64 && std::find(row, row + k, e) != row + k; ++tries) e = expert(rng);
      if (std::find(row, row + k, e) == row + k) row[k] = e;  // distinct experts per token
    }
  }
  return idx;
}

uint16_t RandomBf16(std::mt19937_64& rng, float range) {
  return ref::FloatToBf16(std::uniform_real_distribution<float>(-range, range)(rng));
}

// ---- memory of the Buffer's backend ----

class Memory {
 public:
  explicit Memory(bool device) : device_(device) {}

  absl::StatusOr<TensorView> Upload(const void* src, size_t bytes, DType dtype, std::vector<int64_t> shape) {
    auto ptr = Allocate(bytes);
    if (!ptr.ok()) return ptr.status();
    if (device_) {
      if (bytes > 0 && cudaMemcpy(*ptr, src, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
        return absl::InternalError("cudaMemcpy to the device");
      }
    } else if (bytes > 0) {
      std::memcpy(*ptr, src, bytes);
    }
    return TensorView{.data = *ptr, .dtype = dtype, .shape = std::move(shape)};
  }

  // `bytes` bytes all equal to `byte`, set where the memory lives (cudaMemset on the device): inputs for
  // --restart_probe that cost no host loop and no host-to-device copy.
  absl::StatusOr<TensorView> Filled(size_t bytes, uint8_t byte, DType dtype, std::vector<int64_t> shape) {
    auto ptr = Allocate(bytes);
    if (!ptr.ok()) return ptr.status();
    if (device_) {
      if (bytes > 0 && cudaMemset(*ptr, byte, bytes) != cudaSuccess) return absl::InternalError("cudaMemset");
    } else if (bytes > 0) {
      std::memset(*ptr, byte, bytes);
    }
    return TensorView{.data = *ptr, .dtype = dtype, .shape = std::move(shape)};
  }

  template <typename T>
  absl::StatusOr<TensorView> Upload(const std::vector<T>& v, DType dtype, std::vector<int64_t> shape) {
    return Upload(v.data(), v.size() * sizeof(T), dtype, std::move(shape));
  }

  // The first `count` elements of `view` (fewer when the view is smaller).
  template <typename T>
  std::vector<T> Download(const TensorView& view, size_t count) const {
    std::vector<T> out;
    if (view.empty()) return out;
    count = std::min(count, view.bytes() / sizeof(T));
    out.resize(count);
    if (count == 0) return out;
    if (device_) {
      if (cudaMemcpy(out.data(), view.data, count * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess) out.clear();
    } else {
      std::memcpy(out.data(), view.data, count * sizeof(T));
    }
    return out;
  }

  void Clear() { owned_.clear(); }

 private:
  // Never null, even for zero rows: an empty view means "not given". Owned until Clear().
  absl::StatusOr<void*> Allocate(size_t bytes) {
    const size_t alloc = std::max<size_t>(256, (bytes + 255) / 256 * 256);
    void* ptr = nullptr;
    if (device_) {
      if (cudaMalloc(&ptr, alloc) != cudaSuccess) return absl::ResourceExhaustedError("cudaMalloc");
      owned_.push_back(std::shared_ptr<void>(ptr, [](void* p) { cudaFree(p); }));
    } else {
      ptr = std::aligned_alloc(256, alloc);
      if (ptr == nullptr) return absl::ResourceExhaustedError("aligned_alloc");
      owned_.push_back(std::shared_ptr<void>(ptr, [](void* p) { std::free(p); }));
    }
    return ptr;
  }

  bool device_;
  std::vector<std::shared_ptr<void>> owned_;
};

// ---- comparison ----

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

struct RoundStats {
  double dispatch_ms = 0, combine_ms = 0;
  uint64_t bytes = 0;  // payload this rank sent: dispatched rows + combined rows
};

// Milliseconds from --launch_unix_ns to the end of this process' first completed dispatch; -1 until then (or
// without the flag). Restarting a serving process and being back at its first dispatch is what the daemon saves.
double g_restart_to_first_dispatch_ms = -1;

void NoteDispatchCompleted() {
  const int64_t launched = absl::GetFlag(FLAGS_launch_unix_ns);
  if (launched <= 0 || g_restart_to_first_dispatch_ms >= 0) return;
  const int64_t now = absl::ToUnixNanos(absl::Now());
  g_restart_to_first_dispatch_ms = static_cast<double>(now - launched) / 1e6;
}

double MsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// --sigkill_in_dispatch: dies like a crash (no clean-up) while the N-th dispatch call is running.
void MaybeDieDuringThisDispatch() {
  static int calls = 0;
  if (++calls != absl::GetFlag(FLAGS_sigkill_in_dispatch)) return;
  std::cout << "EPF_EVENT rank=" << absl::GetFlag(FLAGS_rank) << " dying in dispatch " << calls << std::endl;
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::microseconds(absl::GetFlag(FLAGS_sigkill_delay_us)));
    raise(SIGKILL);
  }).detach();
}

// ---- normal mode ----

struct NormalRound {
  ref::DispatchConfig config;
  std::vector<ref::RankInput> inputs;
  std::vector<ref::RankOutput> dispatched;
  std::vector<ref::CombineInput> combine_inputs;
  std::vector<ref::CombineOutput> combined;
  std::vector<double> exact, magnitude;  // this rank's weighted sums [T][hidden]
};

float NormalValue(const ref::DispatchConfig& c, const uint8_t* rows, const float* scales, size_t row, int h) {
  if (c.num_scales == 0) {
    uint16_t bits;
    std::memcpy(&bits, rows + row * c.row_bytes + 2 * h, 2);
    return ref::Bf16ToFloat(bits);
  }
  return host::Fp8E4M3ToFloat(rows[row * c.row_bytes + h]) * scales[row * c.num_scales + h / 128];
}

// What the experts of one rank return for its received rows: per row the sum over its local experts of
// w * f_e(x), accumulated in float (k ascending) and rounded to BF16 — DeepEP's convention (weights applied on the
// expert side, combine sums).
std::vector<uint16_t> NormalExpertOutputs(const ref::DispatchConfig& c, int hidden, int rank, int num_rows,
                                          const uint8_t* recv_x, const float* recv_scales, const int64_t* recv_topk_idx,
                                          const float* recv_topk_weights) {
  const int experts_per_rank = c.num_experts / c.num_ranks;
  std::vector<uint16_t> out(static_cast<size_t>(num_rows) * hidden);
  for (int row = 0; row < num_rows; ++row) {
    for (int h = 0; h < hidden; ++h) {
      const float x = NormalValue(c, recv_x, recv_scales, row, h);
      float acc = 0;
      for (int k = 0; k < c.num_topk; ++k) {
        const int64_t local = recv_topk_idx[static_cast<size_t>(row) * c.num_topk + k];
        if (local < 0) continue;
        acc += recv_topk_weights[static_cast<size_t>(row) * c.num_topk + k] * x *
               ExpertScale(rank * experts_per_rank + local);
      }
      out[static_cast<size_t>(row) * hidden + h] = ref::FloatToBf16(acc);
    }
  }
  return out;
}

NormalRound MakeNormalRound(const Scenario& s, int num_ranks, int rank, int round) {
  NormalRound x;
  ref::DispatchConfig& c = x.config;
  c.num_ranks = num_ranks;
  c.row_bytes = s.fp8 ? s.hidden : s.hidden * 2;
  c.num_scales = s.fp8 ? s.hidden / 128 : 0;
  c.num_topk = s.topk;
  c.has_weights = true;
  c.num_experts = s.experts;
  c.num_channels = s.num_sms;
  c.expert_alignment = 1;
  std::mt19937_64 rng = RoundRng(s, round);
  std::uniform_real_distribution<float> weight(0.0f, 1.0f);
  x.inputs.resize(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    ref::RankInput& in = x.inputs[r];
    in.num_tokens = TokensOf(rng, s, r);
    in.routing_topk = s.topk;
    in.topk_idx = RandomTopk(rng, s, r, in.num_tokens);
    in.x.resize(static_cast<size_t>(in.num_tokens) * c.row_bytes);
    if (s.fp8) {
      for (uint8_t& b : in.x) b = host::FloatToFp8E4M3(std::uniform_real_distribution<float>(-4.0f, 4.0f)(rng));
      in.x_scales.resize(static_cast<size_t>(in.num_tokens) * c.num_scales);
      for (float& scale : in.x_scales) scale = weight(rng) + 0.01f;
    } else {
      for (size_t i = 0; i < in.x.size(); i += 2) {
        const uint16_t v = RandomBf16(rng, 2.0f);
        std::memcpy(&in.x[i], &v, 2);
      }
    }
    in.topk_weights.resize(in.topk_idx.size());
    for (float& w : in.topk_weights) w = weight(rng);
  }
  x.dispatched = ref::Dispatch(x.inputs, c);
  x.combine_inputs.resize(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    const ref::RankOutput& o = x.dispatched[r];
    x.combine_inputs[r].x =
        NormalExpertOutputs(c, s.hidden, r, o.num_recv_tokens, o.recv_x.data(), o.recv_x_scales.data(),
                            o.recv_topk_idx.data(), o.recv_topk_weights.data());
    x.combine_inputs[r].topk_weights = o.recv_topk_weights;
  }
  x.combined = ref::Combine(x.dispatched, x.combine_inputs, s.hidden, s.topk);
  // The weighted sum this rank expects, in double.
  const ref::RankInput& in = x.inputs[rank];
  x.exact.assign(static_cast<size_t>(in.num_tokens) * s.hidden, 0.0);
  x.magnitude.assign(x.exact.size(), 0.0);
  for (int t = 0; t < in.num_tokens; ++t) {
    for (int h = 0; h < s.hidden; ++h) {
      const double v = NormalValue(c, in.x.data(), in.x_scales.data(), t, h);
      for (int k = 0; k < s.topk; ++k) {
        const int64_t e = in.topk_idx[static_cast<size_t>(t) * s.topk + k];
        if (e < 0 || e >= s.experts) continue;
        const double term = double{in.topk_weights[static_cast<size_t>(t) * s.topk + k]} * ExpertScale(e) * v;
        x.exact[static_cast<size_t>(t) * s.hidden + h] += term;
        x.magnitude[static_cast<size_t>(t) * s.hidden + h] += std::fabs(term);
      }
    }
  }
  return x;
}

// One checked normal round. Returns the first failing call's status (then the round stops: the peers see the same
// failure or time out), OK otherwise; mismatches go to `checks`.
absl::Status RunNormalRound(Buffer& buffer, Memory& mem, const Scenario& s, int round, Checks& checks,
                            RoundStats* stats) {
  const int R = buffer.num_ranks(), rank = buffer.rank();
  const NormalRound x = MakeNormalRound(s, R, rank, round);
  const ref::DispatchConfig& c = x.config;
  const ref::RankInput& in = x.inputs[rank];
  const ref::RankOutput& want = x.dispatched[rank];
  const int T = in.num_tokens, K = s.topk, H = s.hidden;
  mem.Clear();
  auto x_view = mem.Upload(in.x, s.fp8 ? DType::kFP8E4M3 : DType::kBF16, {T, H});
  auto scales_view = mem.Upload(in.x_scales, DType::kFloat32, {T, c.num_scales});
  auto idx_view = mem.Upload(in.topk_idx, DType::kInt64, {T, K});
  auto w_view = mem.Upload(in.topk_weights, DType::kFloat32, {T, K});
  for (const auto* v : {&x_view, &scales_view, &idx_view, &w_view}) {
    if (!v->ok()) return v->status();
  }

  auto start = std::chrono::steady_clock::now();
  auto layout = buffer.GetDispatchLayout(*idx_view);
  if (!layout.ok()) return layout.status();
  MaybeDieDuringThisDispatch();
  auto recv = buffer.Dispatch({.x = *x_view,
                               .x_scales = s.fp8 ? *scales_view : TensorView{},
                               .topk_idx = *idx_view,
                               .topk_weights = *w_view,
                               .layout = &*layout});
  if (!recv.ok()) return recv.status();
  if (absl::Status done = buffer.Check(); !done.ok()) return done;
  stats->dispatch_ms = MsSince(start);
  NoteDispatchCompleted();

  checks.Exact("num_tokens_per_rank", mem.Download<int32_t>(layout->num_tokens_per_rank.view, R),
               want.layout.num_tokens_per_rank);
  checks.Exact("num_tokens_per_expert", mem.Download<int32_t>(layout->num_tokens_per_expert.view, s.experts),
               want.layout.num_tokens_per_expert);
  checks.Exact("is_token_in_rank", mem.Download<uint8_t>(layout->is_token_in_rank.view, static_cast<size_t>(T) * R),
               want.layout.is_token_in_rank);
  const int N = recv->handle != nullptr ? recv->handle->num_recv_tokens : -1;
  if (N < 0) return absl::InternalError("Dispatch returned no handle");
  // On a wrong count the comparisons below fail on sizes; the combine still runs (the peers wait for it).
  if (N != want.num_recv_tokens) {
    checks.Fail(absl::StrFormat("num_recv_tokens = %d, expected %d", N, want.num_recv_tokens));
  }
  checks.Exact("num_recv_tokens_per_expert", recv->num_recv_tokens_per_expert, want.num_recv_tokens_per_expert);
  const auto recv_x = mem.Download<uint8_t>(recv->recv_x.view, static_cast<size_t>(N) * c.row_bytes);
  const auto recv_scales = mem.Download<float>(recv->recv_x_scales.view, static_cast<size_t>(N) * c.num_scales);
  const auto recv_idx = mem.Download<int64_t>(recv->recv_topk_idx.view, static_cast<size_t>(N) * K);
  const auto recv_w = mem.Download<float>(recv->recv_topk_weights.view, static_cast<size_t>(N) * K);
  checks.Exact("recv_x", recv_x, want.recv_x);
  checks.Exact("recv_x_scales", recv_scales, want.recv_x_scales);
  checks.Exact("recv_topk_idx", recv_idx, want.recv_topk_idx);
  checks.Exact("recv_topk_weights", recv_w, want.recv_topk_weights);
  for (int d = 0; d < R; ++d) {
    stats->bytes += static_cast<uint64_t>(want.layout.num_tokens_per_rank[d]) * c.row_bytes;
  }
  stats->bytes += static_cast<uint64_t>(N) * H * 2;

  // The experts, on what this rank received (when that matched the reference, these equal the reference's).
  std::vector<uint16_t> expert_out;
  if (recv_x.size() == want.recv_x.size() && recv_idx.size() == want.recv_topk_idx.size() &&
      recv_w.size() == want.recv_topk_weights.size() && recv_scales.size() == want.recv_x_scales.size()) {
    expert_out = NormalExpertOutputs(c, H, rank, N, recv_x.data(), recv_scales.data(), recv_idx.data(), recv_w.data());
  } else {
    expert_out.assign(static_cast<size_t>(N) * H, 0);
  }
  auto expert_view = mem.Upload(expert_out, DType::kBF16, {N, H});
  if (!expert_view.ok()) return expert_view.status();
  start = std::chrono::steady_clock::now();
  auto combined =
      buffer.Combine({.x = *expert_view, .topk_weights = recv->recv_topk_weights.view, .handle = recv->handle});
  if (!combined.ok()) return combined.status();
  if (absl::Status done = buffer.Check(); !done.ok()) return done;
  stats->combine_ms = MsSince(start);

  auto got = mem.Download<uint16_t>(combined->combined_x.view, static_cast<size_t>(T) * H);
  if (s.flip_one_output && !got.empty()) got[0] ^= 0x0100;
  if (s.exact) {
    checks.Exact("combined_x", got, x.combined[rank].combined_x);
    checks.Exact("combined_topk_weights",
                 mem.Download<float>(combined->combined_topk_weights.view, static_cast<size_t>(T) * K),
                 x.combined[rank].combined_topk_weights);
  }
  checks.WeightedSum("combined_x (weighted sum)", got, x.exact, x.magnitude);
  return absl::OkStatus();
}

// ---- low-latency mode ----

struct LowLatencyRound {
  host::LowLatencyShape shape;
  std::vector<host::LowLatencyRankInput> inputs;
  std::vector<host::LowLatencyDispatchOutput> dispatched;
  std::vector<std::vector<uint16_t>> expert_outputs;
  std::vector<std::vector<uint16_t>> combined;
  std::vector<double> exact, magnitude, exact_bf16;  // this rank's [T][hidden]
};

// The experts of `rank`: f_e of every valid packed row, BF16 [L][R*M][hidden]; rows past the counts are zero.
std::vector<uint16_t> LowLatencyExpertOutputs(const host::LowLatencyShape& shape, bool fp8, int rank,
                                              const int32_t* count, const uint8_t* packed_x, const float* scales) {
  const int L = shape.num_local_experts(), H = shape.hidden, G = H / 128;
  const size_t slots = shape.recv_slots();
  std::vector<uint16_t> out(static_cast<size_t>(L) * slots * H, 0);
  for (int e = 0; e < L; ++e) {
    const float scale = ExpertScale(static_cast<int64_t>(rank) * L + e);
    for (int j = 0; j < std::min<int>(count[e], static_cast<int>(slots)); ++j) {
      const size_t row = static_cast<size_t>(e) * slots + j;
      for (int h = 0; h < H; ++h) {
        float v;
        if (fp8) {
          v = host::Fp8E4M3ToFloat(packed_x[row * H + h]) * scales[(static_cast<size_t>(e) * G + h / 128) * slots + j];
        } else {
          uint16_t bits;
          std::memcpy(&bits, packed_x + (row * H + h) * 2, 2);
          v = ref::Bf16ToFloat(bits);
        }
        out[row * H + h] = ref::FloatToBf16(v * scale);
      }
    }
  }
  return out;
}

LowLatencyRound MakeLowLatencyRound(const Scenario& s, int num_ranks, int rank, int round) {
  LowLatencyRound x;
  x.shape = {.num_ranks = num_ranks,
             .num_experts = s.experts,
             .hidden = s.hidden,
             .max_tokens_per_rank = s.tokens,
             .num_topk = s.topk};
  std::mt19937_64 rng = RoundRng(s, round);
  std::uniform_real_distribution<float> weight(0.0f, 1.0f);
  x.inputs.resize(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    host::LowLatencyRankInput& in = x.inputs[r];
    in.num_tokens = TokensOf(rng, s, r);
    in.topk_idx = RandomTopk(rng, s, r, in.num_tokens);
    in.x.resize(static_cast<size_t>(in.num_tokens) * s.hidden);
    // Magnitudes differ between 128-channel groups, so that the FP8 scales differ.
    for (size_t i = 0; i < in.x.size(); ++i) in.x[i] = RandomBf16(rng, (i / 128) % 3 == 0 ? 0.01f : 8.0f);
    in.topk_weights.resize(in.topk_idx.size());
    for (float& w : in.topk_weights) w = weight(rng);
  }
  x.dispatched = host::LowLatencyDispatchReference(x.shape, {.use_fp8 = s.fp8}, x.inputs);
  x.expert_outputs.resize(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    const host::LowLatencyDispatchOutput& o = x.dispatched[r];
    x.expert_outputs[r] =
        LowLatencyExpertOutputs(x.shape, s.fp8, r, o.packed_recv_count.data(), o.packed_recv_x.data(), o.scales.data());
  }
  x.combined = host::LowLatencyCombineReference(x.shape, x.inputs, x.expert_outputs, x.dispatched);
  const host::LowLatencyRankInput& in = x.inputs[rank];
  const int T = in.num_tokens, H = s.hidden;
  x.exact.assign(static_cast<size_t>(T) * H, 0.0);
  x.magnitude.assign(x.exact.size(), 0.0);
  x.exact_bf16.assign(x.exact.size(), 0.0);
  std::vector<uint8_t> q(H);
  std::vector<float> q_scales(H / 128);
  for (int t = 0; t < T; ++t) {
    const uint16_t* row = &in.x[static_cast<size_t>(t) * H];
    if (s.fp8) host::QuantizeRowFp8(row, H, /*round_scale=*/false, q.data(), q_scales.data());
    for (int h = 0; h < H; ++h) {
      const double original = ref::Bf16ToFloat(row[h]);
      const double sent = s.fp8 ? double{host::Fp8E4M3ToFloat(q[h]) * q_scales[h / 128]} : original;
      for (int k = 0; k < s.topk; ++k) {
        const int64_t e = in.topk_idx[static_cast<size_t>(t) * s.topk + k];
        if (e < 0 || e >= s.experts) continue;
        const double w = in.topk_weights[static_cast<size_t>(t) * s.topk + k];
        x.exact[static_cast<size_t>(t) * H + h] += w * ExpertScale(e) * sent;
        x.magnitude[static_cast<size_t>(t) * H + h] += std::fabs(w * ExpertScale(e) * sent);
        x.exact_bf16[static_cast<size_t>(t) * H + h] += w * ExpertScale(e) * original;
      }
    }
  }
  return x;
}

absl::Status RunLowLatencyRound(Buffer& buffer, Memory& mem, const Scenario& s, int round, Checks& checks,
                                RoundStats* stats) {
  const int R = buffer.num_ranks(), rank = buffer.rank();
  const LowLatencyRound x = MakeLowLatencyRound(s, R, rank, round);
  const host::LowLatencyRankInput& in = x.inputs[rank];
  const host::LowLatencyDispatchOutput& want = x.dispatched[rank];
  const int T = in.num_tokens, K = s.topk, H = s.hidden, L = x.shape.num_local_experts(), G = H / 128;
  const size_t slots = x.shape.recv_slots();
  const size_t elem = s.fp8 ? 1 : 2;
  mem.Clear();
  auto x_view = mem.Upload(in.x, DType::kBF16, {T, H});
  auto idx_view = mem.Upload(in.topk_idx, DType::kInt64, {T, K});
  auto w_view = mem.Upload(in.topk_weights, DType::kFloat32, {T, K});
  for (const auto* v : {&x_view, &idx_view, &w_view}) {
    if (!v->ok()) return v->status();
  }
  auto start = std::chrono::steady_clock::now();
  MaybeDieDuringThisDispatch();
  auto recv = buffer.LowLatencyDispatch({.x = *x_view, .topk_idx = *idx_view, .use_fp8 = s.fp8});
  if (!recv.ok()) return recv.status();
  if (absl::Status done = buffer.Check(); !done.ok()) return done;
  stats->dispatch_ms = MsSince(start);
  NoteDispatchCompleted();

  const auto count = mem.Download<int32_t>(recv->packed_recv_count.view, L);
  checks.Exact("packed_recv_count", count, want.packed_recv_count);
  checks.Exact("packed_recv_layout_range", mem.Download<int64_t>(recv->packed_recv_layout_range.view, L * R),
               want.layout_range);
  const auto packed_x = mem.Download<uint8_t>(recv->packed_recv_x.view, L * slots * H * elem);
  const auto scales = mem.Download<float>(recv->packed_recv_x_scales.view, s.fp8 ? L * slots * G : 0);
  const auto src_info = mem.Download<int32_t>(recv->packed_recv_src_info.view, L * slots);
  const bool usable = count.size() == static_cast<size_t>(L) && packed_x.size() == L * slots * H * elem &&
                      src_info.size() == L * slots && scales.size() == (s.fp8 ? L * slots * G : 0);
  // When the outputs are too small nothing is compared; the combine still runs (the peers wait for it).
  if (!usable) checks.Fail("low-latency dispatch outputs are smaller than [L, R*M, hidden]");
  uint64_t received = 0;
  for (int e = 0; usable && e < L; ++e) {
    const size_t n = static_cast<size_t>(std::max(0, std::min(count[e], want.packed_recv_count[e])));
    received += n;
    const size_t base = static_cast<size_t>(e) * slots;
    checks.Exact(absl::StrCat("packed_recv_x[expert ", e, "]"),
                 std::vector<uint8_t>(packed_x.begin() + base * H * elem, packed_x.begin() + (base + n) * H * elem),
                 want.packed_recv_x.data() + base * H * elem, n * H * elem);
    checks.Exact(absl::StrCat("packed_recv_src_info[expert ", e, "]"),
                 std::vector<int32_t>(src_info.begin() + base, src_info.begin() + base + n),
                 want.src_info.data() + base, n);
    for (int g = 0; s.fp8 && g < G; ++g) {
      const size_t at = (static_cast<size_t>(e) * G + g) * slots;
      checks.Exact(absl::StrCat("packed_recv_x_scales[expert ", e, "][group ", g, "]"),
                   std::vector<float>(scales.begin() + at, scales.begin() + at + n), want.scales.data() + at, n);
    }
  }
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) stats->bytes += in.topk_idx[static_cast<size_t>(t) * K + k] >= 0 ? H * elem : 0;
  }
  stats->bytes += received * H * 2;

  const std::vector<uint16_t> expert_out =
      usable ? LowLatencyExpertOutputs(x.shape, s.fp8, rank, count.data(), packed_x.data(), scales.data())
             : std::vector<uint16_t>(static_cast<size_t>(L) * slots * H, 0);
  auto expert_view = mem.Upload(expert_out, DType::kBF16, {L, static_cast<int64_t>(slots), H});
  if (!expert_view.ok()) return expert_view.status();
  start = std::chrono::steady_clock::now();
  auto combined = buffer.LowLatencyCombine(
      {.x = *expert_view, .topk_idx = *idx_view, .topk_weights = *w_view, .handle = recv->handle});
  if (!combined.ok()) return combined.status();
  if (absl::Status done = buffer.Check(); !done.ok()) return done;
  stats->combine_ms = MsSince(start);

  auto got = mem.Download<uint16_t>(combined->combined_x.view, static_cast<size_t>(T) * H);
  if (s.flip_one_output && !got.empty()) got[0] ^= 0x0100;
  if (s.exact) checks.Exact("combined_x", got, x.combined[rank]);
  checks.WeightedSum("combined_x (weighted sum)", got, x.exact, x.magnitude);
  for (size_t i = 0; i < got.size() && i < x.exact_bf16.size(); ++i) {
    const double err = std::fabs(ref::Bf16ToFloat(got[i]) - x.exact_bf16[i]);
    if (x.magnitude[i] > 0) checks.max_rel_err_vs_bf16 = std::max(checks.max_rel_err_vs_bf16, err / x.magnitude[i]);
  }
  return absl::OkStatus();
}

// ---- bad input: every call must be refused with InvalidArgument, before anything runs ----

void ExpectRefused(Checks& checks, const std::string& what, const absl::Status& status, int* refused) {
  if (absl::IsInvalidArgument(status)) {
    ++*refused;
    std::cout << "EPF_EVENT rank=" << checks.rank() << " refused case=\"" << what << "\""
              << " status=\"" << absl::StrReplaceAll(status.message(), {{"\"", "'"}, {"\n", " "}}) << "\"\n";
  } else {
    checks.Fail(absl::StrCat("bad input '", what, "' was not refused with InvalidArgument: ", status.ToString()));
  }
}

// Normal mode: refused by GetDispatchLayout, or else by Dispatch.
absl::Status NormalDispatchStatus(Buffer& buffer, const TensorView& x, const TensorView& idx, const TensorView& w) {
  auto layout = buffer.GetDispatchLayout(idx);
  if (!layout.ok()) return layout.status();
  auto recv = buffer.Dispatch({.x = x, .topk_idx = idx, .topk_weights = w, .layout = &*layout});
  return recv.status();
}

absl::Status RunBadInput(Buffer& buffer, Memory& mem, const Scenario& s, Checks& checks, int* refused, int* cases) {
  const int T = std::max(1, std::min(4, s.tokens)), K = s.topk, H = s.hidden, M = s.tokens;
  mem.Clear();
  const std::vector<uint16_t> x_small(static_cast<size_t>(M + 1) * (H + 128), ref::FloatToBf16(1.0f));
  std::vector<int64_t> idx_ok(static_cast<size_t>(M + 1) * K, -1), idx_bad(static_cast<size_t>(T) * K, -1);
  for (size_t i = 0; i < idx_ok.size(); i += K) idx_ok[i] = static_cast<int64_t>(i / K) % s.experts;
  for (size_t i = 0; i < idx_bad.size(); i += K) idx_bad[i] = i == 0 ? s.experts : 0;  // expert index == num_experts
  const std::vector<float> w(static_cast<size_t>(M + 1) * K, 0.5f);
  auto x = [&](DType dtype, int rows, int hidden) { return mem.Upload(x_small, dtype, {rows, hidden}); };
  auto idx = [&](const std::vector<int64_t>& v, int rows) { return mem.Upload(v, DType::kInt64, {rows, K}); };
  auto weights = [&](int rows) { return mem.Upload(w, DType::kFloat32, {rows, K}); };
  struct Case {
    std::string name;
    absl::StatusOr<TensorView> x, idx, w;
  };
  std::vector<Case> bad;
  bad.push_back({"dtype: float32 x", x(DType::kFloat32, T, H), idx(idx_ok, T), weights(T)});
  bad.push_back({"shape: topk_idx rows != x rows", x(DType::kBF16, T, H), idx(idx_ok, T + 1), weights(T + 1)});
  bad.push_back({"expert index >= num_experts", x(DType::kBF16, T, H), idx(idx_bad, T), weights(T)});
  bad.push_back(
      {"more tokens than max_tokens_per_rank", x(DType::kBF16, M + 1, H), idx(idx_ok, M + 1), weights(M + 1)});
  if (s.low_latency) {
    bad.push_back({"hidden != the buffer's hidden", x(DType::kBF16, T, H + 128), idx(idx_ok, T), weights(T)});
  } else {
    bad.push_back({"unaligned hidden (not a multiple of 8)", x(DType::kBF16, T, 12), idx(idx_ok, T), weights(T)});
    bad.push_back({"hidden wider than the buffer's", x(DType::kBF16, T, H + 128), idx(idx_ok, T), weights(T)});
  }
  for (Case& c : bad) {
    for (const auto* v : {&c.x, &c.idx, &c.w}) {
      if (!v->ok()) return v->status();
    }
    ++*cases;
    if (s.low_latency) {
      ExpectRefused(checks, c.name,
                    buffer.LowLatencyDispatch({.x = *c.x, .topk_idx = *c.idx, .use_fp8 = s.fp8}).status(), refused);
    } else {
      ExpectRefused(checks, c.name, NormalDispatchStatus(buffer, *c.x, *c.idx, *c.w), refused);
    }
  }
  return absl::OkStatus();
}

// ---- the process ----

bool WaitForFile(const std::string& path, absl::Duration timeout) {
  const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoMilliseconds(timeout);
  while (!std::filesystem::exists(path)) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

void Touch(const std::string& path) { std::ofstream(path).put('\n'); }

std::string Quote(const absl::Status& status) {
  return absl::StrCat("\"", absl::StrReplaceAll(status.ToString(), {{"\"", "'"}, {"\n", " "}}), "\"");
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// ---- --restart_probe ----

// This rank's CUDA device: --device, else the rank modulo the visible devices; -1 when none is visible (no GPU or no
// driver: then nothing CUDA is called again). The checked modes and the probe choose it the same way.
int ChooseDevice(int rank) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count <= 0) {
    (void)cudaGetLastError();
    return -1;
  }
  const int device = absl::GetFlag(FLAGS_device);
  return device >= 0 ? device : rank % count;
}

// Creates the CUDA context of this rank's device on a thread of its own, started first thing in main(): context
// creation is the largest single cost of a fresh CUDA process (docs/memory.md: 120-160 ms), and nothing before the
// region imports at the end of Attach needs it, so it runs while the main thread connects and makes the Attach RPC
// instead of after them. The imports' own cudaSetDevice on the main thread waits for it inside the runtime (primary
// context creation is serialised there); Buffer::Create runs after Wait(). A serving process can do the same.
class EarlyCudaContext {
 public:
  explicit EarlyCudaContext(int rank) : thread_([this, rank] { Run(rank); }) {}
  ~EarlyCudaContext() {
    if (thread_.joinable()) thread_.join();
  }
  EarlyCudaContext(const EarlyCudaContext&) = delete;
  EarlyCudaContext& operator=(const EarlyCudaContext&) = delete;

  // The device (ChooseDevice), known once the driver is initialised, before the context exists.
  int device() const { return device_.get(); }
  // Waits for the context; the status of its creation.
  absl::Status Wait() {
    if (thread_.joinable()) thread_.join();
    return status_;
  }
  // After Wait(): when the context was ready (CLOCK_REALTIME ns), 0 without a device.
  int64_t ready_unix_ns() const { return ready_unix_ns_; }

 private:
  void Run(int rank) {
    const int device = ChooseDevice(rank);
    device_promise_.set_value(device);
    if (device < 0) return;
    cudaError_t error = cudaSetDevice(device);
    if (error == cudaSuccess) error = cudaFree(nullptr);  // forces the context into existence
    if (error != cudaSuccess) {
      status_ = absl::UnavailableError(absl::StrCat("creating the CUDA context of device ", device, ": ",
                                                    cudaGetErrorName(error), ": ", cudaGetErrorString(error)));
      return;
    }
    ready_unix_ns_ = absl::ToUnixNanos(absl::Now());
  }

  std::promise<int> device_promise_;
  std::shared_future<int> device_ = device_promise_.get_future().share();
  absl::Status status_;
  int64_t ready_unix_ns_ = 0;
  std::thread thread_;  // last: it starts once the members it writes exist
};

// This rank's probe inputs: random expert ids (the --routing/--empty_fraction rules of the checked modes), weights
// 1/k, x (and FP8 scales) set by a memset where the memory lives. Nothing is computed on the host per element of x.
struct ProbeInputs {
  TensorView x, x_scales, topk_idx, topk_weights;
};

absl::StatusOr<ProbeInputs> MakeProbeInputs(const Scenario& s, int rank, Memory& mem) {
  std::mt19937_64 rng(s.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(rank) + 1);
  const int T = TokensOf(rng, s, rank), K = s.topk, H = s.hidden;
  const std::vector<int64_t> idx = RandomTopk(rng, s, rank, T);
  const std::vector<float> weights(idx.size(), 1.0f / static_cast<float>(K));
  // Low latency quantises BF16 x itself; normal mode takes FP8 x with scales. 0x3C in every byte: BF16 0.0115,
  // FP8 e4m3 1.5, float scales 0.0115.
  const bool fp8_x = s.fp8 && !s.low_latency;
  auto idx_view = mem.Upload(idx, DType::kInt64, {T, K});
  auto w_view = mem.Upload(weights, DType::kFloat32, {T, K});
  auto x_view =
      mem.Filled(static_cast<size_t>(T) * H * (fp8_x ? 1 : 2), 0x3C, fp8_x ? DType::kFP8E4M3 : DType::kBF16, {T, H});
  for (const auto* v : {&idx_view, &w_view, &x_view}) {
    if (!v->ok()) return v->status();
  }
  ProbeInputs in{.x = *x_view, .topk_idx = *idx_view, .topk_weights = *w_view};
  if (fp8_x) {
    auto scales = mem.Filled(static_cast<size_t>(T) * (H / 128) * sizeof(float), 0x3C, DType::kFloat32, {T, H / 128});
    if (!scales.ok()) return scales.status();
    in.x_scales = *scales;
  }
  return in;
}

// The first dispatch (layout + dispatch + Check: complete on this rank), `dispatched()` right after it, then one
// unchecked combine of zeros / the received rows. Returns the rows this rank received.
absl::StatusOr<int64_t> ProbeDispatchAndCombine(Buffer& buffer, Memory& mem, const Scenario& s, const ProbeInputs& in,
                                                const std::function<void()>& dispatched) {
  if (s.low_latency) {
    auto recv = buffer.LowLatencyDispatch({.x = in.x, .topk_idx = in.topk_idx, .use_fp8 = s.fp8});
    if (!recv.ok()) return recv.status();
    if (absl::Status done = buffer.Check(); !done.ok()) return done;
    dispatched();
    const int64_t L = s.experts / buffer.num_ranks(), slots = static_cast<int64_t>(buffer.num_ranks()) * s.tokens;
    auto expert_out = mem.Filled(static_cast<size_t>(L * slots) * s.hidden * 2, 0, DType::kBF16, {L, slots, s.hidden});
    if (!expert_out.ok()) return expert_out.status();
    auto combined = buffer.LowLatencyCombine(
        {.x = *expert_out, .topk_idx = in.topk_idx, .topk_weights = in.topk_weights, .handle = recv->handle});
    if (!combined.ok()) return combined.status();
    if (absl::Status done = buffer.Check(); !done.ok()) return done;
    const std::vector<int32_t> count = mem.Download<int32_t>(recv->packed_recv_count.view, L);
    int64_t received = 0;
    for (int32_t c : count) received += c;
    return received;
  }
  auto layout = buffer.GetDispatchLayout(in.topk_idx);
  if (!layout.ok()) return layout.status();
  auto recv = buffer.Dispatch({.x = in.x,
                               .x_scales = in.x_scales,
                               .topk_idx = in.topk_idx,
                               .topk_weights = in.topk_weights,
                               .layout = &*layout});
  if (!recv.ok()) return recv.status();
  if (absl::Status done = buffer.Check(); !done.ok()) return done;
  dispatched();
  if (recv->handle == nullptr) return absl::InternalError("Dispatch returned no handle");
  const int64_t N = recv->handle->num_recv_tokens;
  TensorView expert_out = recv->recv_x.view;  // BF16 rows as received: the experts are the identity here
  if (s.fp8) {
    auto zeros = mem.Filled(static_cast<size_t>(N) * s.hidden * 2, 0, DType::kBF16, {N, s.hidden});
    if (!zeros.ok()) return zeros.status();
    expert_out = *zeros;
  }
  auto combined =
      buffer.Combine({.x = expert_out, .topk_weights = recv->recv_topk_weights.view, .handle = recv->handle});
  if (!combined.ok()) return combined.status();
  if (absl::Status done = buffer.Check(); !done.ok()) return done;
  return N;
}

// --restart_probe: see the file comment. Every stage is stamped as milliseconds since --launch_unix_ns.
int RunRestartProbe(const Scenario& s, const BufferConfig& config, int64_t main_unix_ns, EarlyCudaContext& early) {
  const int rank = absl::GetFlag(FLAGS_rank);
  const int64_t launched = absl::GetFlag(FLAGS_launch_unix_ns);
  auto since_launch = [launched](int64_t unix_ns) { return static_cast<double>(unix_ns - launched) / 1e6; };
  auto now = [&] { return since_launch(absl::ToUnixNanos(absl::Now())); };
  auto fail = [&](const std::string& stage, const absl::Status& status) {
    std::cout << "EPF_RESTART rank=" << rank << " ok=0 stage=" << stage << " error=" << Quote(status) << std::endl;
    std::cerr << "epfabric_worker --restart_probe rank " << rank << ": " << stage << " failed: " << status << "\n";
    return kExitMismatch;
  };
  const double main_ms = since_launch(main_unix_ns);

  auto connected =
      client::Client::Connect(absl::GetFlag(FLAGS_socket), {.client_name = absl::StrCat("epfabric_worker-", rank)});
  if (!connected.ok()) return fail("connect", connected.status());
  const double connect_ms = now();

  client::AttachOptions attach_options;
  const int device = early.device();  // waits for the driver's initialisation only, not for the context
  if (device >= 0) attach_options.accessing_device = device;
  const std::string group = absl::GetFlag(FLAGS_group), token = absl::GetFlag(FLAGS_token);
  auto lease = (*connected)->Attach(group, rank, token, attach_options);
  // The previous process of this rank may have exited a moment ago: its lease ends when the daemon sees its side
  // channel close. Counted, so that a run where this happened can be told apart.
  int attach_retries = 0;
  for (; attach_retries < 100 && absl::IsFailedPrecondition(lease.status()); ++attach_retries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    lease = (*connected)->Attach(group, rank, token, attach_options);
  }
  if (!lease.ok()) return fail("attach", lease.status());
  if ((*lease)->group().low_latency() != s.low_latency) {
    return fail("attach", absl::InvalidArgumentError("--mode is not the group's mode"));
  }
  const double attach_ms = now();

  if (absl::Status context = early.Wait(); !context.ok()) return fail("cuda context", context);
  if (device >= 0 && cudaSetDevice(device) != cudaSuccess) {  // Buffer::Create allocates on the current device
    return fail("cuda context", absl::InternalError(absl::StrCat("cudaSetDevice(", device, ")")));
  }
  auto buffer = Buffer::Create(lease->get(), config);
  if (!buffer.ok()) return fail("buffer", buffer.status());
  const double buffer_ms = now();

  Memory mem((*buffer)->backend() == v1::BACKEND_CUDA);
  auto inputs = MakeProbeInputs(s, rank, mem);
  if (!inputs.ok()) return fail("inputs", inputs.status());
  const double inputs_ms = now();

  double dispatch_ms = -1;
  auto received = ProbeDispatchAndCombine(**buffer, mem, s, *inputs, [&] { dispatch_ms = now(); });
  if (!received.ok()) return fail(dispatch_ms < 0 ? "dispatch" : "combine", received.status());

  const double context_ms = early.ready_unix_ns() > 0 ? since_launch(early.ready_unix_ns()) : -1;
  std::cout << absl::StrFormat(
                   "EPF_RESTART rank=%d restart_to_first_dispatch_ms=%.2f main_ms=%.2f connect_ms=%.2f "
                   "attach_ms=%.2f buffer_ms=%.2f dispatch_ms=%.2f inputs_ms=%.2f context_ms=%.2f backend=%s "
                   "device=%d mode=%s tokens=%d hidden=%d topk=%d experts=%d fp8=%d received=%d attach_retries=%d "
                   "ok=1",
                   rank, dispatch_ms, main_ms, connect_ms, attach_ms, buffer_ms, dispatch_ms, inputs_ms, context_ms,
                   (*buffer)->backend() == v1::BACKEND_CUDA ? "cuda" : "host", device,
                   s.low_latency ? "low_latency" : "normal", static_cast<int>(inputs->topk_idx.shape[0]), s.hidden,
                   s.topk, s.experts, s.fp8 ? 1 : 0, *received, attach_retries)
            << std::endl;
  return 0;
}

int Main(int64_t main_unix_ns, EarlyCudaContext* early) {
  Scenario s;
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode != "normal" && mode != "low_latency") {
    std::cerr << "--mode must be normal or low_latency\n";
    return kExitUsage;
  }
  s.low_latency = mode == "low_latency";
  s.tokens = absl::GetFlag(FLAGS_tokens);
  s.fixed_tokens = absl::GetFlag(FLAGS_fixed_tokens);
  s.hidden = absl::GetFlag(FLAGS_hidden);
  s.topk = absl::GetFlag(FLAGS_topk);
  s.experts = absl::GetFlag(FLAGS_experts);
  s.fp8 = absl::GetFlag(FLAGS_fp8);
  s.seed = absl::GetFlag(FLAGS_seed);
  s.routing = absl::GetFlag(FLAGS_routing);
  s.silent_rank = absl::GetFlag(FLAGS_silent_rank);
  s.empty_fraction = absl::GetFlag(FLAGS_empty_fraction);
  s.num_sms = absl::GetFlag(FLAGS_num_sms);
  s.exact = absl::GetFlag(FLAGS_exact);
  s.flip_one_output = absl::GetFlag(FLAGS_flip_one_output);
  if (s.routing != "random" && s.routing != "silent" && s.routing != "nowhere" && s.routing != "one_expert") {
    std::cerr << "unknown --routing=" << s.routing << "\n";
    return kExitUsage;
  }
  if (s.tokens < 1 || s.hidden < 1 || s.topk < 1 || s.experts < 1 || (s.fp8 && s.hidden % 128 != 0)) {
    std::cerr << "--tokens, --hidden, --topk and --experts must be positive (--fp8: hidden a multiple of 128)\n";
    return kExitUsage;
  }
  const BufferConfig config{.max_tokens_per_rank = s.tokens,
                            .hidden = s.hidden,
                            .max_topk = s.topk,
                            .num_experts = s.experts,
                            .num_sms = s.num_sms,
                            .low_latency = s.low_latency,
                            .timeout = absl::Milliseconds(absl::GetFlag(FLAGS_timeout_ms))};
  if (absl::GetFlag(FLAGS_region_bytes)) {
    auto bytes = client::RequiredRegionBytes(config, absl::GetFlag(FLAGS_ranks));
    if (!bytes.ok()) {
      std::cerr << "RequiredRegionBytes: " << bytes.status() << "\n";
      return kExitUsage;
    }
    std::cout << *bytes << "\n";
    return 0;
  }
  if (early != nullptr) {
    if (absl::GetFlag(FLAGS_launch_unix_ns) <= 0) {
      std::cerr << "--restart_probe needs --launch_unix_ns (the launcher's `date +%s%N`)\n";
      return kExitUsage;
    }
    return RunRestartProbe(s, config, main_unix_ns, *early);
  }

  const int rank = absl::GetFlag(FLAGS_rank);
  const std::string prefix = absl::StrCat("EPF_RESULT rank=", rank, " group=", absl::GetFlag(FLAGS_group),
                                          " mode=", mode, " tokens=", s.tokens, " hidden=", s.hidden, " topk=", s.topk,
                                          " experts=", s.experts, " fp8=", s.fp8 ? 1 : 0);
  auto fail = [&](const std::string& what, const absl::Status& status) {
    std::cout << prefix
              << " ok=0 error=" << Quote(absl::Status(status.code(), what + ": " + std::string(status.message())))
              << std::endl;
    return kExitMismatch;
  };
  auto connected =
      client::Client::Connect(absl::GetFlag(FLAGS_socket), {.client_name = absl::StrCat("epfabric_worker-", rank)});
  if (!connected.ok()) return fail("Connect", connected.status());
  client::AttachOptions attach_options;
  // With CUDA devices visible, this rank's device is chosen before Attach: cuda regions are mapped for the
  // accessing device (host-backend groups ignore it). Without a device (or driver) nothing CUDA is called again.
  if (const int device = ChooseDevice(rank); device >= 0) {
    if (cudaSetDevice(device) != cudaSuccess) {
      return fail("cudaSetDevice", absl::InvalidArgumentError(absl::StrCat("device ", device)));
    }
    attach_options.accessing_device = device;
  }
  auto lease = (*connected)->Attach(absl::GetFlag(FLAGS_group), rank, absl::GetFlag(FLAGS_token), attach_options);
  // A rank whose previous holder was killed a moment ago: the daemon ends that lease when it sees the connection
  // close; retry "already attached" for a few seconds.
  for (int tries = 0; tries < 100 && absl::IsFailedPrecondition(lease.status()); ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    lease = (*connected)->Attach(absl::GetFlag(FLAGS_group), rank, absl::GetFlag(FLAGS_token), attach_options);
  }
  if (!lease.ok()) return fail("Attach", lease.status());
  if ((*lease)->group().low_latency() != s.low_latency) {
    return fail("Attach", absl::InvalidArgumentError("--mode is not the group's mode"));
  }
  auto buffer = Buffer::Create(lease->get(), config);
  if (!buffer.ok()) return fail("Buffer::Create", buffer.status());
  Memory mem((*buffer)->backend() == v1::BACKEND_CUDA);
  Checks checks(rank);

  if (absl::GetFlag(FLAGS_reset_first)) {
    if (absl::Status reset = (*buffer)->Reset(); !reset.ok()) return fail("Reset", reset);
  }
  int refused = 0, cases = 0;
  if (absl::GetFlag(FLAGS_bad_input)) {
    if (absl::Status ran = RunBadInput(**buffer, mem, s, checks, &refused, &cases); !ran.ok()) {
      return fail("bad input", ran);
    }
  }

  std::vector<double> dispatch_ms, combine_ms;
  uint64_t bytes = 0;
  auto run_rounds = [&](int rounds) -> absl::Status {
    // Every round runs even after a mismatch, so that the peers are not left waiting.
    for (int round = 0; round < rounds; ++round) {
      RoundStats stats;
      absl::Status ran = s.low_latency ? RunLowLatencyRound(**buffer, mem, s, round, checks, &stats)
                                       : RunNormalRound(**buffer, mem, s, round, checks, &stats);
      if (!ran.ok()) return ran;
      dispatch_ms.push_back(stats.dispatch_ms);
      combine_ms.push_back(stats.combine_ms);
      bytes = stats.bytes;
    }
    return absl::OkStatus();
  };

  int timeouts = 0;
  const int repeats = absl::GetFlag(FLAGS_repeats);
  if (absl::GetFlag(FLAGS_until_timeout)) {
    // Rounds until a peer stops answering (the test kills one), then recovery.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(absl::GetFlag(FLAGS_max_seconds));
    absl::Status ran;
    for (int round = 0; ran.ok() && checks.failures() == 0; ++round) {
      if (std::chrono::steady_clock::now() > deadline) {
        return fail("until_timeout", absl::DeadlineExceededError("no call timed out within --max_seconds"));
      }
      RoundStats stats;
      ran = s.low_latency ? RunLowLatencyRound(**buffer, mem, s, 1000 + round, checks, &stats)
                          : RunNormalRound(**buffer, mem, s, 1000 + round, checks, &stats);
      if (round == 0) std::cout << "EPF_EVENT rank=" << rank << " running" << std::endl;
    }
    if (checks.failures() > 0) return fail("before the timeout", absl::DataLossError("mismatches"));
    if (!absl::IsDeadlineExceeded(ran)) return fail("expected DeadlineExceeded", ran);
    ++timeouts;
    std::cout << "EPF_EVENT rank=" << rank << " timeout status=" << Quote(ran) << std::endl;
    const std::string dir = absl::GetFlag(FLAGS_recover_dir);
    if (dir.empty()) {
      std::cout << prefix << " ok=1 timeouts=1 recovered=0" << std::endl;
      return 0;
    }
    Touch(absl::StrCat(dir, "/timedout.", rank));
    if (!WaitForFile(dir + "/reset", absl::Seconds(60))) {
      return fail("recovery", absl::DeadlineExceededError("no " + dir + "/reset"));
    }
    if (absl::Status reset = (*buffer)->Reset(); !reset.ok()) return fail("Reset", reset);
    Touch(absl::StrCat(dir, "/reset.", rank));
    if (!WaitForFile(dir + "/go", absl::Seconds(60))) {
      return fail("recovery", absl::DeadlineExceededError("no " + dir + "/go"));
    }
  }
  if (!absl::GetFlag(FLAGS_until_timeout) && !absl::GetFlag(FLAGS_recover_dir).empty()) {
    // A rank that rejoins: say it is ready, start with the others.
    const std::string dir = absl::GetFlag(FLAGS_recover_dir);
    Touch(absl::StrCat(dir, "/ready.", rank));
    if (!WaitForFile(dir + "/go", absl::Seconds(60))) {
      return fail("rejoin", absl::DeadlineExceededError("no " + dir + "/go"));
    }
  }
  if (absl::Status ran = run_rounds(repeats); !ran.ok()) return fail("round", ran);
  if (checks.failures() > 0) {
    std::cout << prefix << " ok=0 mismatches=" << checks.failures() << " error=\"outputs differ (see stderr)\""
              << std::endl;
    return kExitMismatch;
  }
  std::cout << prefix
            << absl::StrFormat(
                   " ok=1 rounds=%d dispatch_ms=%.3f combine_ms=%.3f bytes=%d max_rel_err=%.3g "
                   "max_rel_err_vs_bf16=%.3g bad_input_refused=%d/%d timeouts=%d backend=%s "
                   "restart_to_first_dispatch_ms=%.2f",
                   static_cast<int>(dispatch_ms.size()), Median(dispatch_ms), Median(combine_ms), bytes,
                   checks.max_rel_err(), checks.max_rel_err_vs_bf16, refused, cases, timeouts,
                   (*buffer)->backend() == v1::BACKEND_CUDA ? "cuda" : "host", g_restart_to_first_dispatch_ms)
            << std::endl;
  return 0;
}

}  // namespace
}  // namespace epfabric::worker

int main(int argc, char** argv) {
  // First thing: --restart_probe reports this as main_ms (exec, dynamic loading, static initialisers).
  const int64_t main_unix_ns = absl::ToUnixNanos(absl::Now());
  absl::ParseCommandLine(argc, argv);
  std::optional<epfabric::worker::EarlyCudaContext> early;
  if (absl::GetFlag(FLAGS_restart_probe)) early.emplace(absl::GetFlag(FLAGS_rank));
  return epfabric::worker::Main(main_unix_ns, early ? &*early : nullptr);
}
