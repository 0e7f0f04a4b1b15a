// The group's generation as a Buffer sees it (docs/data-layout.md, "Generations"): taken from every rank's lease
// serial at the first call after the Buffer was made or reset, checked before every call, and what a call does when
// a rank's client left or changed since (fail naming it, or mask it in low latency with enable_shrink); and the
// collective Rejoin that takes a new generation with a replacement client at a call boundary (docs/elastic.md).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "buffer/buffer_state.h"
#include "epfabric/client/client.h"
#include "epfabric/common/status_macros.h"

namespace epfabric::client {

namespace {

// The generation of a group whose ranks have these lease serials (all nonzero): a digest every rank computes alike.
uint64_t GenerationOf(const std::vector<uint64_t>& serials) {
  uint64_t digest = 0x6a09e667f3bcc908ull;
  for (uint64_t serial : serials) {
    digest = (digest ^ serial) * 0x100000001b3ull;
    digest ^= digest >> 29;
  }
  return digest;
}

std::vector<uint64_t> ReadSerials(const uint64_t* words, int num_ranks) {
  std::vector<uint64_t> serials(num_ranks);
  for (int r = 0; r < num_ranks; ++r) serials[r] = __atomic_load_n(words + r, __ATOMIC_ACQUIRE);
  return serials;
}

}  // namespace

absl::Status Buffer::State::TakeGeneration() {
  call_index = 0;
  serials.clear();
  generation = 0;
  const uint64_t* words = lease->lease_serials();
  if (words == nullptr) {  // no counters page: calls are tagged with generation 0
    generation_pending = false;
    return absl::OkStatus();
  }
  const int world = lease->world_size();
  const absl::Time deadline = absl::Now() + config.timeout;
  for (;;) {
    std::vector<uint64_t> now = ReadSerials(words, world);
    std::vector<int> missing;
    for (int r = 0; r < world; ++r) {
      if (now[r] == 0) missing.push_back(r);
    }
    if (missing.empty()) {
      serials = std::move(now);
      generation = GenerationOf(serials);
      generation_pending = false;
      return absl::OkStatus();
    }
    if (absl::Now() > deadline) {
      return absl::UnavailableError(absl::StrFormat(
          "group '%s': rank(s) %s have no client attached after %s; a low-latency Buffer is made by every rank of the "
          "group together (each rank's client must attach first)",
          lease->group_name(), absl::StrJoin(missing, ", "), absl::FormatDuration(config.timeout)));
    }
    absl::SleepFor(absl::Microseconds(200));
  }
}

absl::Status Buffer::State::CheckGeneration(bool may_mask, cudaStream_t stream) {
  if (generation_pending) EPF_RETURN_IF_ERROR(TakeGeneration());
  if (const uint64_t* words = lease->lease_serials(); words != nullptr && !serials.empty()) {
    // A rank whose client left or changed since this Buffer was made is not part of its generation: its signals
    // never carry this generation's tags, and it must not read this generation's.
    const std::vector<uint64_t> now = ReadSerials(words, static_cast<int>(serials.size()));
    for (int r = 0; r < static_cast<int>(serials.size()); ++r) {
      if (now[r] == serials[r] || r == lease->rank()) continue;
      if (!may_mask) {
        return absl::UnavailableError(
            now[r] == 0 ? absl::StrFormat("group '%s': rank %d is lost (its client's lease ended since this Buffer "
                                          "was made); make a new Buffer (or Reset) on every rank once it is back "
                                          "(low latency: or make the Buffer with enable_shrink to go on without it)",
                                          lease->group_name(), r)
                        : absl::StrFormat("group '%s' rank %d has a new client since this Buffer was made; make a new "
                                          "Buffer (or Reset) on every rank of the group to serve with it",
                                          lease->group_name(), r));
      }
      EPF_RETURN_IF_ERROR(MaskRank(r, stream));
    }
  }
  return absl::OkStatus();
}

absl::Status Buffer::State::UsableForNormal() {
  EPF_RETURN_IF_ERROR(CheckGeneration(/*may_mask=*/false, nullptr));
  return Usable();
}

absl::Status Buffer::State::UsableForLowLatency(cudaStream_t stream) {
  int32_t* mask = path->LowLatencyRankMask();
  EPF_RETURN_IF_ERROR(CheckGeneration(config.enable_shrink && mask != nullptr, stream));
  absl::Status usable = Usable();
  if (usable.ok() || lease->group_state() != v1::GROUP_STATE_DEGRADED || !config.enable_shrink) return usable;
  const std::vector<int> lost = lease->lost_ranks();
  if (lost.empty() || mask == nullptr || std::find(lost.begin(), lost.end(), rank) != lost.end()) return usable;
  for (int r : lost) {
    if (r < 0 || r >= num_ranks) return usable;
    EPF_RETURN_IF_ERROR(MaskRank(r, stream));
  }
  return absl::OkStatus();
}

absl::Status Buffer::State::ExplainFirstCall(absl::Status status) const {
  // The first dispatch and its combine of a generation: a peer that does not answer may be serving the previous one.
  if (!absl::IsDeadlineExceeded(status) || call_index > 2 || serials.empty()) return status;
  return absl::Status(
      status.code(),
      absl::StrCat(status.message(),
                   "; this was among the first calls since this Buffer was made or reset: a peer whose Buffer was made "
                   "before this rank's client attached (this client replaced one that left) does not serve it until "
                   "every rank of the group makes a new Buffer or calls Reset"));
}

absl::Status Buffer::State::NameGoneRanks(absl::Status status) const {
  const uint64_t* words = lease->lease_serials();
  // Only a wait that ended on a peer leaving says nothing of why; a lost rank's own error already names it.
  if (!absl::IsUnavailable(status) || !absl::StrContains(status.message(), "left the call") || words == nullptr ||
      serials.empty()) {
    return status;
  }
  const std::vector<uint64_t> now = ReadSerials(words, static_cast<int>(serials.size()));
  std::string gone;
  for (int r = 0; r < static_cast<int>(serials.size()); ++r) {
    if (now[r] == serials[r] || r == lease->rank()) continue;
    absl::StrAppend(&gone, "; rank ", r,
                    now[r] == 0 ? " is lost (its client's lease ended since this Buffer was made)"
                                : " has a new client since this Buffer was made");
  }
  if (gone.empty()) return status;
  return absl::Status(status.code(), absl::StrCat(status.message(), gone));
}

absl::Status Buffer::State::MaskRank(int r, cudaStream_t stream) { return SetRankMask(r, /*masked=*/true, stream); }

absl::Status Buffer::State::SetRankMask(int r, bool masked, cudaStream_t stream) {
  int32_t* mask = path->LowLatencyRankMask();
  if (path->backend() == Backend::kCuda) {
    // Any nonzero word masks; stream order keeps it behind the calls already queued.
    const cudaError_t error = cudaMemsetAsync(mask + r, masked ? 1 : 0, sizeof(int32_t), stream);
    if (error != cudaSuccess) {
      return absl::InternalError(
          absl::StrCat(masked ? "masking" : "unmasking", " rank ", r, ": ", cudaGetErrorString(error)));
    }
  } else {
    // The calls run on this thread; the atomic store only keeps the kernels' concurrent acquire loads well defined.
    __atomic_store_n(mask + r, masked ? 1 : 0, __ATOMIC_RELEASE);
  }
  return absl::OkStatus();
}

// ---- elastic EP: rejoin at a call boundary ----

std::vector<int> Buffer::RanksWaitingToRejoin() const {
  const State& s = *state_;
  std::vector<int> waiting;
  const uint64_t* words = s.lease->lease_serials();
  if (!s.config.low_latency || words == nullptr || s.serials.empty()) return waiting;
  const std::vector<uint64_t> now = ReadSerials(words, static_cast<int>(s.serials.size()));
  for (int r = 0; r < static_cast<int>(now.size()); ++r) {
    if (now[r] != 0 && now[r] != s.serials[r]) waiting.push_back(r);
  }
  return waiting;
}

absl::Status Buffer::Rejoin(cudaStream_t stream) {
  State& s = *state_;
  if (!s.config.low_latency) {
    return absl::FailedPreconditionError(
        "Rejoin needs a low-latency Buffer; in normal mode every rank calls Reset (no call of the group in flight)");
  }
  EPF_RETURN_IF_ERROR(s.RequireMode(/*low_latency=*/true, "Rejoin"));
  if (s.cursor.Peek() != 0) {
    // Every rank's next call must use the half a fresh Buffer's first call uses (0): a survivor whose next call
    // reused the half of its previous one could overwrite what a slower peer is still reading there.
    return absl::FailedPreconditionError(
        "Rejoin: an odd number of low-latency calls since this Buffer was made or reset (between a dispatch and its "
        "combine); every rank rejoins between a combine and the next dispatch");
  }
  const uint64_t* words = s.lease->lease_serials();
  if (words == nullptr) return absl::OkStatus();  // no counters page: no generations to change
  if (!s.generation_pending) {
    const std::vector<uint64_t> now = ReadSerials(words, static_cast<int>(s.serials.size()));
    if (now == s.serials) return absl::OkStatus();  // nobody waiting: the generation and the masks stay
  }
  // A Buffer that made no call yet joins peers that are serving: it must not write into their regions before each
  // of them finished its last call of the previous generation (that call cleans the half this rank writes first).
  const bool joins_running_peers = s.generation_pending;
  EPF_RETURN_IF_ERROR(s.TakeGeneration());  // every rank has a client now (waits for it): the new generation
  if (int32_t* mask = s.path->LowLatencyRankMask(); mask != nullptr) {
    for (int r = 0; r < s.num_ranks; ++r) EPF_RETURN_IF_ERROR(s.SetRankMask(r, /*masked=*/false, stream));
  }
  if (!joins_running_peers || s.num_ranks == 1) return absl::OkStatus();
  return s.path->AwaitFirstDispatchOfPeers(kernels::LowLatencyCallTag(s.generation, s.call_index), s.cursor.Peek(),
                                           s.config.timeout);
}

absl::StatusOr<std::vector<int32_t>> Buffer::ActiveRanks(cudaStream_t stream) const {
  const State& s = *state_;
  const int32_t* mask = s.config.low_latency ? s.path->LowLatencyRankMask() : nullptr;
  if (mask == nullptr) return absl::FailedPreconditionError("ActiveRanks needs a low-latency Buffer");
  std::vector<int32_t> active(s.num_ranks, 0);
  if (s.path->backend() == Backend::kCuda) {
    cudaError_t error =
        cudaMemcpyAsync(active.data(), mask, sizeof(int32_t) * s.num_ranks, cudaMemcpyDeviceToHost, stream);
    if (error == cudaSuccess) error = cudaStreamSynchronize(stream);
    if (error != cudaSuccess) return absl::InternalError(absl::StrCat("ActiveRanks: ", cudaGetErrorString(error)));
  } else {
    for (int r = 0; r < s.num_ranks; ++r) active[r] = __atomic_load_n(mask + r, __ATOMIC_ACQUIRE);
  }
  for (int32_t& a : active) a = a == 0 ? 1 : 0;
  return active;
}

}  // namespace epfabric::client
