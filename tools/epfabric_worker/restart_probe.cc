// epfabric_worker --restart_probe: from launch to this process' first completed dispatch, nothing else in the path.
#include "restart_probe.h"

#include <cuda_runtime_api.h>

#include <chrono>
#include <functional>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "memory.h"

namespace epfabric::worker {
namespace {

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

}  // namespace

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

  Memory mem((*buffer)->backend() == client::Backend::kCuda);
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
                   (*buffer)->backend() == client::Backend::kCuda ? "cuda" : "host", device,
                   s.low_latency ? "low_latency" : "normal", static_cast<int>(inputs->topk_idx.shape[0]), s.hidden,
                   s.topk, s.experts, s.fp8 ? 1 : 0, *received, attach_retries)
            << std::endl;
  return 0;
}

}  // namespace epfabric::worker
