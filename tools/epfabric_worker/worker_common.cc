// epfabric_worker: the inputs every rank generates alike, timing, failure injection and small helpers.
#include <cuda_runtime_api.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "worker.h"

namespace epfabric::worker {
namespace {

// Milliseconds from --launch_unix_ns to the end of this process' first completed dispatch; -1 until then (or
// without the flag). Restarting a serving process and being back at its first dispatch is what the daemon saves.
double g_restart_to_first_dispatch_ms = -1;

}  // namespace

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

double RestartToFirstDispatchMs() { return g_restart_to_first_dispatch_ms; }

void NoteDispatchCompleted() {
  const int64_t launched = absl::GetFlag(FLAGS_launch_unix_ns);
  if (launched <= 0 || g_restart_to_first_dispatch_ms >= 0) return;
  const int64_t now = absl::ToUnixNanos(absl::Now());
  g_restart_to_first_dispatch_ms = static_cast<double>(now - launched) / 1e6;
}

namespace {
int64_t g_last_call_started_unix_ns = 0;
int64_t g_mask_seen_unix_ns = 0;
}  // namespace

void NoteCallStarted() { g_last_call_started_unix_ns = absl::GetCurrentTimeNanos(); }
int64_t LastCallStartedUnixNs() { return g_last_call_started_unix_ns; }
void NoteMaskSeen() {
  if (g_mask_seen_unix_ns == 0) g_mask_seen_unix_ns = absl::GetCurrentTimeNanos();
}
int64_t MaskSeenUnixNs() { return g_mask_seen_unix_ns; }

double MsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

void MaybeDieDuringThisDispatch() {
  static int calls = 0;
  if (++calls != absl::GetFlag(FLAGS_sigkill_in_dispatch)) return;
  std::cout << "EPF_EVENT rank=" << absl::GetFlag(FLAGS_rank) << " dying in dispatch " << calls << std::endl;
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::microseconds(absl::GetFlag(FLAGS_sigkill_delay_us)));
    // When it dies, for the tests that measure how long the survivors take to notice (stdout is not flushed by a
    // SIGKILL: written before it).
    std::cout << "EPF_EVENT rank=" << absl::GetFlag(FLAGS_rank) << " sigkill unix_ns=" << absl::GetCurrentTimeNanos()
              << std::endl;
    raise(SIGKILL);
  }).detach();
}

std::string Quote(const absl::Status& status) {
  return absl::StrCat("\"", absl::StrReplaceAll(status.ToString(), {{"\"", "'"}, {"\n", " "}}), "\"");
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int ChooseDevice(int rank) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count <= 0) {
    (void)cudaGetLastError();
    return -1;
  }
  const int device = absl::GetFlag(FLAGS_device);
  return device >= 0 ? device : rank % count;
}

}  // namespace epfabric::worker
