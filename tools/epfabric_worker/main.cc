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
//
// The pieces: worker.h (scenario, inputs, helpers), memory.h, checks.h, normal_round.cc, low_latency_round.cc,
// bad_input.cc, restart_probe.{h,cc}; this file parses the flags and runs the process.
#include <cuda_runtime_api.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "checks.h"
#include "elastic.h"
#include "graphs.h"
#include "memory.h"
#include "restart_probe.h"
#include "worker.h"

ABSL_FLAG(std::string, socket, "", "Unix socket of this rank's daemon (its --client_socket).");
ABSL_FLAG(std::string, group, "", "Group name.");
ABSL_FLAG(int, rank, -1, "Group rank to attach as.");
ABSL_FLAG(std::string, token, "", "The group's token.");
ABSL_FLAG(std::string, mode, "normal",
          "normal or low_latency (must be the group's mode), or both: a low-latency group that serves normal mode too "
          "(num_normal_bytes); each round is a normal round, then a low-latency round, on two Buffers of one lease.");
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
          "Run rounds until a call fails because a peer died: DeadlineExceeded (a timeout) or Unavailable (the peer "
          "published as lost; low latency: a round that masked it); then recover with --recover_dir.");
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
ABSL_FLAG(bool, flip_masked_output, false,
          "Tests of the checks: as --flip_one_output, in the rounds that ran with a rank masked only (--shrink).");
ABSL_FLAG(bool, region_bytes, false, "Print RequiredRegionBytes for the scenario and --ranks, then exit.");
ABSL_FLAG(int, ranks, 4, "--region_bytes: number of same-host ranks.");
ABSL_FLAG(int, hosts, 1,
          "--region_bytes: hosts of the group (--ranks per host); with more than one (or --force_internode) prints "
          "`NVL_BYTES RDMA_BYTES` (RequiredGroupBytes).");
ABSL_FLAG(bool, cached, false, "Normal mode: after each dispatch, a cached dispatch with its handle, checked alike.");
ABSL_FLAG(int, worst_tokens, 0,
          "Normal mode: dispatch with num_worst_tokens = N (outputs of N rows, the received ones first, padding "
          "after them; across hosts the RDMA stage then waits on the device, not the host).");
ABSL_FLAG(bool, force_internode, false,
          "Normal mode: BufferConfig.force_internode (a one-host group through the "
          "internode path; it must give the intranode path's bits).");
ABSL_FLAG(bool, packed_scales, false,
          "Normal mode with --fp8: x_scales as packed UE8M0 int32 [tokens, hidden / 512] (powers of two).");
ABSL_FLAG(bool, hooks, false, "Low latency: odd rounds run through the receive hooks (return_recv_hook).");
ABSL_FLAG(bool, relay, false,
          "Low latency across hosts: BufferConfig.low_latency_relay (the host backend relays between steps, as cuda "
          "does).");
ABSL_FLAG(std::string, low_latency_issue, "auto",
          "Low latency across hosts on cuda: BufferConfig.low_latency_issue (device, relay or auto).");
ABSL_FLAG(bool, graph, false,
          "cuda: each round's dispatch and combine replay CUDA graphs captured at the first round (needs "
          "--fixed_tokens; low latency without --hooks; normal mode with --worst_tokens, without --cached; no "
          "--mode=both).");
ABSL_FLAG(int64_t, launch_unix_ns, 0,
          "When the launcher started this process (CLOCK_REALTIME ns, e.g. `date +%s%N`). Checked modes report "
          "restart_to_first_dispatch_ms from it to the first completed dispatch, which there also includes making "
          "every rank's inputs and the host reference; --restart_probe measures the restart path alone.");
ABSL_FLAG(int, device, -1, "CUDA device when devices are visible; -1: rank modulo the visible devices.");
ABSL_FLAG(bool, shrink, false,
          "Low latency: BufferConfig.enable_shrink. A round that runs with ranks masked (lost, or silent past the "
          "timeout) is checked against the reference without them instead of failing; the round reports them.");
ABSL_FLAG(std::string, elastic_dir, "",
          "Low latency with --shrink: elastic EP through files in DIR (tools/epfabric_worker/elastic.h): rounds until "
          "DIR/rejoin_at, Buffer::Rejoin there, then --repeats rounds at full strength.");
ABSL_FLAG(bool, replacement, false, "--elastic_dir: this process replaces a rank's client that left.");
ABSL_FLAG(int, round_pause_ms, 0, "--elastic_dir: pause between rounds (a serving engine's work between steps).");
ABSL_FLAG(bool, restart_probe, false,
          "Measure only what a restarted serving process pays before its first dispatch (needs --launch_unix_ns): "
          "connect, attach (maps every same-host region), Buffer::Create, one layout + dispatch of this rank's own "
          "cheaply made inputs, completion; then one unchecked combine. Prints `EPF_RESTART ...` and exits 0.");

namespace epfabric::worker {
namespace {

bool WaitForFile(const std::string& path, absl::Duration timeout) {
  const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoMilliseconds(timeout);
  while (!std::filesystem::exists(path)) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

void Touch(const std::string& path) { std::ofstream(path).put('\n'); }

int Main(int64_t main_unix_ns, EarlyCudaContext* early) {
  Scenario s;
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode != "normal" && mode != "low_latency" && mode != "both") {
    std::cerr << "--mode must be normal, low_latency or both\n";
    return kExitUsage;
  }
  const bool both = mode == "both";
  if (both && (absl::GetFlag(FLAGS_until_timeout) || absl::GetFlag(FLAGS_bad_input) ||
               absl::GetFlag(FLAGS_restart_probe) || absl::GetFlag(FLAGS_region_bytes))) {
    std::cerr << "--mode=both runs rounds only (no --until_timeout, --bad_input, --restart_probe, --region_bytes)\n";
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
  s.flip_masked_output = absl::GetFlag(FLAGS_flip_masked_output);
  if (s.routing != "random" && s.routing != "silent" && s.routing != "nowhere" && s.routing != "one_expert") {
    std::cerr << "unknown --routing=" << s.routing << "\n";
    return kExitUsage;
  }
  if (s.tokens < 1 || s.hidden < 1 || s.topk < 1 || s.experts < 1 || (s.fp8 && s.hidden % 128 != 0)) {
    std::cerr << "--tokens, --hidden, --topk and --experts must be positive (--fp8: hidden a multiple of 128)\n";
    return kExitUsage;
  }
  s.force_internode = absl::GetFlag(FLAGS_force_internode);
  s.cached = absl::GetFlag(FLAGS_cached);
  s.worst_tokens = absl::GetFlag(FLAGS_worst_tokens);
  s.hooks = absl::GetFlag(FLAGS_hooks);
  s.packed_scales = absl::GetFlag(FLAGS_packed_scales);
  if (s.packed_scales && (!s.fp8 || s.hidden % 512 != 0)) {
    std::cerr << "--packed_scales needs --fp8 and a hidden size that is a multiple of 512\n";
    return kExitUsage;
  }
  const std::string issue = absl::GetFlag(FLAGS_low_latency_issue);
  if (issue != "auto" && issue != "device" && issue != "relay") {
    std::cerr << "unknown --low_latency_issue=" << issue << "\n";
    return kExitUsage;
  }
  const bool graph = absl::GetFlag(FLAGS_graph);
  if (graph && (!s.fixed_tokens || (s.low_latency ? s.hooks : s.worst_tokens == 0 || s.cached))) {
    std::cerr << "--graph needs --fixed_tokens, and low latency without --hooks or normal mode with --worst_tokens "
                 "and without --cached\n";
    return kExitUsage;
  }
  if (s.worst_tokens < 0 || (s.worst_tokens > 0 && s.low_latency)) {
    std::cerr << "--worst_tokens needs normal mode and a count >= 0\n";
    return kExitUsage;
  }
  s.shrink = absl::GetFlag(FLAGS_shrink);
  const std::string elastic_dir = absl::GetFlag(FLAGS_elastic_dir);
  if ((s.shrink && !s.low_latency) || (!elastic_dir.empty() && (!s.shrink || graph || s.hooks))) {
    std::cerr << "--shrink needs --mode=low_latency; --elastic_dir needs --shrink (no --graph, no --hooks)\n";
    return kExitUsage;
  }
  BufferConfig config{.max_tokens_per_rank = s.tokens,
                      .hidden = s.hidden,
                      .max_topk = s.topk,
                      .num_experts = s.experts,
                      .num_sms = s.num_sms,
                      .low_latency = s.low_latency,
                      .timeout = absl::Milliseconds(absl::GetFlag(FLAGS_timeout_ms)),
                      .enable_shrink = s.shrink,
                      .force_internode = s.force_internode,
                      .low_latency_relay = absl::GetFlag(FLAGS_relay)};
  config.low_latency_issue = issue == "device"  ? BufferConfig::LowLatencyIssue::kDevice
                             : issue == "relay" ? BufferConfig::LowLatencyIssue::kRelay
                                                : BufferConfig::LowLatencyIssue::kAuto;
  if (absl::GetFlag(FLAGS_region_bytes) && (absl::GetFlag(FLAGS_hosts) > 1 || s.force_internode)) {
    auto bytes = client::RequiredGroupBytes(config, absl::GetFlag(FLAGS_hosts), absl::GetFlag(FLAGS_ranks));
    if (!bytes.ok()) {
      std::cerr << "RequiredGroupBytes: " << bytes.status() << "\n";
      return kExitUsage;
    }
    std::cout << bytes->nvl << " " << bytes->rdma << "\n";
    return 0;
  }
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
  for (int tries = 0; tries < 333 && absl::IsFailedPrecondition(lease.status()); ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    lease = (*connected)->Attach(absl::GetFlag(FLAGS_group), rank, absl::GetFlag(FLAGS_token), attach_options);
  }
  if (!lease.ok()) return fail("Attach", lease.status());
  if ((*lease)->group().low_latency() != (s.low_latency || both)) {
    return fail("Attach", absl::InvalidArgumentError("--mode is not the group's mode"));
  }
  s.hosts = (*lease)->world_size() / static_cast<int>((*lease)->nvl_ranks().size());
  // --graph: outputs from an arena (their captured addresses stay valid), calls replayed from graphs.
  std::shared_ptr<client::Allocator> arena;
  std::unique_ptr<LowLatencyGraphs> graphs;
  std::unique_ptr<NormalGraphs> normal_graphs;
  if (graph) {
    arena = std::make_shared<ArenaAllocator>(size_t{1} << 30);
    if (s.low_latency) {
      graphs = std::make_unique<LowLatencyGraphs>();
    } else {
      normal_graphs = std::make_unique<NormalGraphs>();
    }
  }
  auto buffer = Buffer::Create(lease->get(), config, arena);
  if (!buffer.ok()) return fail("Buffer::Create", buffer.status());
  // --mode=both: the same lease's low-latency Buffer, in the other part of the regions.
  Scenario ll_scenario = s;
  ll_scenario.low_latency = true;
  std::unique_ptr<Buffer> ll_buffer;
  if (both) {
    BufferConfig ll_config = config;
    ll_config.low_latency = true;
    auto created = Buffer::Create(lease->get(), ll_config);
    if (!created.ok()) return fail("Buffer::Create (low latency)", created.status());
    ll_buffer = std::move(*created);
  }
  Memory mem((*buffer)->backend() == client::Backend::kCuda);
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
  int round_tokens = 0, remote_rows = 0;
  auto run_rounds = [&](int rounds) -> absl::Status {
    // Every round runs even after a mismatch, so that the peers are not left waiting.
    for (int round = 0; round < rounds; ++round) {
      RoundStats stats;
      absl::Status ran = s.low_latency ? RunLowLatencyRound(**buffer, mem, s, round, checks, &stats, graphs.get())
                                       : RunNormalRound(**buffer, mem, s, round, checks, &stats, normal_graphs.get());
      if (!ran.ok()) return ran;
      if (round == 0) std::cout << "EPF_EVENT rank=" << rank << " running" << std::endl;
      if (both) {
        RoundStats ll_stats;
        if (absl::Status ll = RunLowLatencyRound(*ll_buffer, mem, ll_scenario, round, checks, &ll_stats); !ll.ok()) {
          return ll;
        }
      }
      dispatch_ms.push_back(stats.dispatch_ms);
      combine_ms.push_back(stats.combine_ms);
      bytes = stats.bytes;
      round_tokens += stats.tokens;
      remote_rows += stats.remote_rows;
    }
    return absl::OkStatus();
  };

  int timeouts = 0;
  const int repeats = absl::GetFlag(FLAGS_repeats);
  if (!elastic_dir.empty()) {
    ElasticOutcome outcome;
    const ElasticOptions options{.dir = elastic_dir,
                                 .replacement = absl::GetFlag(FLAGS_replacement),
                                 .rounds_after = repeats,
                                 .round_pause_ms = absl::GetFlag(FLAGS_round_pause_ms),
                                 .max_time = absl::Seconds(absl::GetFlag(FLAGS_max_seconds))};
    if (absl::Status ran = RunElastic(**buffer, mem, s, options, checks, &outcome); !ran.ok()) {
      return fail("elastic", ran);
    }
    if (checks.failures() > 0) {
      std::cout << prefix << " ok=0 mismatches=" << checks.failures() << " error=\"outputs differ (see stderr)\""
                << std::endl;
      return kExitMismatch;
    }
    std::cout << prefix
              << absl::StrFormat(
                     " ok=1 rounds=%d masked_rounds=%d full_rounds_after=%d rejoin_round=%d "
                     "rejoin_ms=%.3f first_masked_ok_unix_ns=%d restart_to_first_dispatch_ms=%.2f",
                     outcome.rounds, outcome.masked_rounds, outcome.full_rounds_after, outcome.rejoin_round,
                     outcome.rejoin_ms, outcome.first_masked_ok_unix_ns, RestartToFirstDispatchMs())
              << std::endl;
    return 0;
  }
  if (absl::GetFlag(FLAGS_until_timeout)) {
    // Rounds until a peer stops answering (the test kills one), then recovery.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(absl::GetFlag(FLAGS_max_seconds));
    absl::Status ran;
    for (int round = 0; ran.ok() && checks.failures() == 0; ++round) {
      if (std::chrono::steady_clock::now() > deadline) {
        return fail("until_timeout", absl::DeadlineExceededError("no call timed out within --max_seconds"));
      }
      RoundStats stats;
      ran = s.low_latency ? RunLowLatencyRound(**buffer, mem, s, 1000 + round, checks, &stats, graphs.get())
                          : RunNormalRound(**buffer, mem, s, 1000 + round, checks, &stats, normal_graphs.get());
      if (round == 0) std::cout << "EPF_EVENT rank=" << rank << " running" << std::endl;
    }
    if (checks.failures() > 0) return fail("before the timeout", absl::DataLossError("mismatches"));
    if (!absl::IsDeadlineExceeded(ran) && !absl::IsUnavailable(ran)) {
      return fail("expected DeadlineExceeded or Unavailable", ran);
    }
    ++timeouts;
    std::cout << "EPF_EVENT rank=" << rank << " timeout unix_ns=" << absl::GetCurrentTimeNanos()
              << " call_unix_ns=" << LastCallStartedUnixNs() << " mask_seen_unix_ns=" << MaskSeenUnixNs()
              << " status=" << Quote(ran) << std::endl;
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
                   "restart_to_first_dispatch_ms=%.2f tokens_total=%d remote_rows_total=%d",
                   static_cast<int>(dispatch_ms.size()), Median(dispatch_ms), Median(combine_ms), bytes,
                   checks.max_rel_err(), checks.max_rel_err_vs_bf16, refused, cases, timeouts,
                   (*buffer)->backend() == client::Backend::kCuda ? "cuda" : "host", RestartToFirstDispatchMs(),
                   round_tokens, remote_rows)
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
