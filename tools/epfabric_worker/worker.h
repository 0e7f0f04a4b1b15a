// epfabric_worker's pieces (tools/epfabric_worker/main.cc has the whole story): the scenario, the inputs every rank
// generates alike, the rounds of each mode and the helpers they share.
#pragma once

#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "epfabric/client/buffer.h"
#include "epfabric/client/client.h"
#include "epfabric/kernels/reference/fp8.h"
#include "epfabric/kernels/reference/internode_reference.h"
#include "epfabric/kernels/reference/intranode_reference.h"
#include "epfabric/kernels/reference/low_latency_reference.h"

// Flags defined in main.cc that the other pieces read.
ABSL_DECLARE_FLAG(std::string, socket);
ABSL_DECLARE_FLAG(std::string, group);
ABSL_DECLARE_FLAG(int, rank);
ABSL_DECLARE_FLAG(std::string, token);
ABSL_DECLARE_FLAG(int, sigkill_in_dispatch);
ABSL_DECLARE_FLAG(int, sigkill_delay_us);
ABSL_DECLARE_FLAG(int64_t, launch_unix_ns);
ABSL_DECLARE_FLAG(int, device);

namespace epfabric::worker {

namespace ref = ::epfabric::kernels::reference;
namespace host = ::epfabric::kernels::host;
using client::Buffer;
using client::BufferConfig;
using client::Tensor;
using client::TensorView;
using kernels::DType;

class Memory;
class Checks;

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
  int hosts = 1;                 // hosts the group spans (from the lease): >1 checks against the internode reference
  bool force_internode = false;  // BufferConfig.force_internode (one host through the internode path)
  bool packed_scales = false;    // normal fp8: x_scales as DeepEP's packed UE8M0 int32 (hidden % 512 == 0)
  bool hooks = false;            // low latency: odd rounds through DeepEP's receive hooks
  bool cached = false;           // normal mode: also a cached dispatch with the round's handle, checked the same
  int worst_tokens = 0;          // normal mode: DispatchArgs.num_worst_tokens (outputs of that many rows, padding)
  bool shrink = false;  // low latency: BufferConfig.enable_shrink; rounds with masked ranks are checked, not failed
  bool flip_masked_output = false;  // tests of the checks: as flip_one_output, in rounds with a rank masked only
};

inline float ExpertScale(int64_t expert) { return 1.0f + static_cast<float>(expert % 8) * 0.125f; }

// ---- inputs, identical on every rank ----

std::mt19937_64 RoundRng(const Scenario& s, int round);
int TokensOf(std::mt19937_64& rng, const Scenario& s, int rank);
std::vector<int64_t> RandomTopk(std::mt19937_64& rng, const Scenario& s, int rank, int num_tokens);
uint16_t RandomBf16(std::mt19937_64& rng, float range);

struct RoundStats {
  double dispatch_ms = 0, combine_ms = 0;
  uint64_t bytes = 0;   // payload this rank sent: dispatched rows + combined rows
  int tokens = 0;       // tokens this rank dispatched
  int remote_rows = 0;  // groups across hosts: rows this rank sent to other hosts (one per token and remote host)
  // Low latency with --shrink: the ranks masked at the end of the round (its outputs were checked without them), and
  // when the round's first call that returned with a rank masked returned (Unix ns; 0: none).
  std::vector<int> masked;
  int64_t first_masked_ok_unix_ns = 0;
};

// Milliseconds from --launch_unix_ns to the end of this process' first completed dispatch; -1 until then (or
// without the flag). Restarting a serving process and being back at its first dispatch is what the daemon saves.
double RestartToFirstDispatchMs();
void NoteDispatchCompleted();

double MsSince(std::chrono::steady_clock::time_point start);

// When the last data-path call (layout + dispatch, combine) started, in Unix ns; printed with a failed call, so
// that a test can tell how long the call waited on a lost rank from how long this process was busy before it.
void NoteCallStarted();
int64_t LastCallStartedUnixNs();
// When a low-latency call returned with a rank masked, in Unix ns (0: none yet). The round still runs its combine
// afterwards (the other survivors wait for it), which is this process' work, not a wait on the lost rank.
void NoteMaskSeen();
int64_t MaskSeenUnixNs();

// --sigkill_in_dispatch: dies like a crash (no clean-up) while the N-th dispatch call is running.
void MaybeDieDuringThisDispatch();

std::string Quote(const absl::Status& status);
double Median(std::vector<double> v);

// This rank's CUDA device: --device, else the rank modulo the visible devices; -1 when none is visible (no GPU or no
// driver: then nothing CUDA is called again). The checked modes and the probe choose it the same way.
int ChooseDevice(int rank);

// One checked round of the group's mode (normal_round.cc, low_latency_round.cc). Returns the first failing call's
// status (then the round stops: the peers see the same failure or time out), OK otherwise; mismatches go to
// `checks`.
// `graphs` (--graph): the calls replay CUDA graphs captured at the first round (graphs.h).
class NormalGraphs;
class LowLatencyGraphs;
absl::Status RunNormalRound(Buffer& buffer, Memory& mem, const Scenario& s, int round, Checks& checks,
                            RoundStats* stats, NormalGraphs* graphs = nullptr);
absl::Status RunLowLatencyRound(Buffer& buffer, Memory& mem, const Scenario& s, int round, Checks& checks,
                                RoundStats* stats, LowLatencyGraphs* graphs = nullptr);

// --bad_input (bad_input.cc): every call must be refused with InvalidArgument, before anything runs.
absl::Status RunBadInput(Buffer& buffer, Memory& mem, const Scenario& s, Checks& checks, int* refused, int* cases);

}  // namespace epfabric::worker
