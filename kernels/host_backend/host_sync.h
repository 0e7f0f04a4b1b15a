// Private helpers of the host backend: atomics on signals that live in shared memory regions, and the bounded wait.
//
// Signals are plain int32/int64 words inside a region that several processes have mapped (at different addresses).
// They are accessed only through std::atomic_ref, which on this platform is lock-free and address-free for 4- and
// 8-byte aligned words (static_asserts below), so it is valid across processes. Data (rows, counts tables) is
// written with plain stores / memcpy and published by a release store or release read-modify-write of a signal; the
// reader's acquire load of that signal makes the data visible (the same release/acquire pairs as the GPU kernels'
// st.release.sys / ld.acquire.sys).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "absl/status/status.h"
#include "epfabric/kernels/common.h"
#include "epfabric/kernels/status_word.h"

namespace epfabric::kernels::host_backend::internal {

static_assert(std::atomic_ref<int32_t>::is_always_lock_free, "region signals need lock-free 4-byte atomics");
static_assert(std::atomic_ref<int64_t>::is_always_lock_free, "region signals need lock-free 8-byte atomics");

template <typename T>
inline T LoadAcquire(const T* word) {
  return std::atomic_ref<T>(*const_cast<T*>(word)).load(std::memory_order_acquire);
}
// Peer data that is published by an earlier acquire (a barrier) but may still be written by a misbehaving peer: read
// once, atomically, into a local copy that is then checked and used.
template <typename T>
inline T LoadRelaxed(const T* word) {
  return std::atomic_ref<T>(*const_cast<T*>(word)).load(std::memory_order_relaxed);
}
template <typename T>
inline void StoreRelease(T* word, T value) {
  std::atomic_ref<T>(*word).store(value, std::memory_order_release);
}
template <typename T>
inline void StoreRelaxed(T* word, T value) {
  std::atomic_ref<T>(*word).store(value, std::memory_order_relaxed);
}
template <typename T>
inline T FetchAddRelease(T* word, T value) {
  return std::atomic_ref<T>(*word).fetch_add(value, std::memory_order_acq_rel);
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// The first failure of a call — a wait that timed out (who was waited for) or a bad value read from peer-writable
// memory (who wrote it, which field, the value and its valid range). Turned into the same absl::Status as the GPU's
// status word (KernelStatusToStatus), and copied into the caller's status word (if any) when that word is still clear.
class FailureRecord {
 public:
  bool failed() const { return record_.code != kKernelStatusOk; }
  void Record(WaitSite site, int waiting_rank, int peer_rank, int channel) {
    if (failed()) return;  // keep the root cause, not its consequences
    record_.code = kKernelStatusTimeout;
    record_.site = static_cast<int32_t>(site);
    record_.waiting_rank = waiting_rank;
    record_.peer_rank = peer_rank;
    record_.channel = channel;
  }
  // A wait on `peer_rank` that ended because the daemon published that rank as lost (kKernelStatusPeerLost).
  void RecordPeerLost(WaitSite site, int waiting_rank, int peer_rank, int channel) {
    if (failed()) return;
    Record(site, waiting_rank, peer_rank, channel);
    record_.code = kKernelStatusPeerLost;
  }
  // A wait on `peer_rank` that ended because that rank left the call (kKernelStatusPeerLeftCall).
  void RecordPeerLeftCall(WaitSite site, int waiting_rank, int peer_rank, int channel) {
    if (failed()) return;
    Record(site, waiting_rank, peer_rank, channel);
    record_.code = kKernelStatusPeerLeftCall;
  }
  // A wait's outcome as the call records it: a timeout or a lost peer (see WaitForPeer).
  void RecordWait(bool lost, WaitSite site, int waiting_rank, int peer_rank, int channel) {
    if (lost) {
      RecordPeerLost(site, waiting_rank, peer_rank, channel);
    } else {
      Record(site, waiting_rank, peer_rank, channel);
    }
  }
  void RecordBadPeerData(PeerDataField field, int reading_rank, int peer_rank, int index, int64_t value,
                         int64_t min_value, int64_t max_value) {
    if (failed()) return;
    record_ = BadPeerDataRecord(field, reading_rank, peer_rank, index, value, min_value, max_value);
  }
  // Any other record (kKernelStatusRecvCapacity) found by the caller.
  void Adopt(const KernelStatus& record) {
    if (!failed()) record_ = record;
  }
  // Checks `min_value <= value <= max_value` for a value read from `peer_rank`'s writes; records it when outside.
  bool CheckPeerValue(PeerDataField field, int reading_rank, int peer_rank, int index, int64_t value, int64_t min_value,
                      int64_t max_value) {
    if (value >= min_value && value <= max_value) return true;
    RecordBadPeerData(field, reading_rank, peer_rank, index, value, min_value, max_value);
    return false;
  }
  // Copies the record into `status_word` if it holds no earlier failure, and returns the status of this call.
  absl::Status Finish(KernelStatus* status_word) const {
    if (!failed()) return absl::OkStatus();
    if (status_word != nullptr) {
      int32_t expected = kKernelStatusOk;
      // Claim the word as the GPU kernels do (compare-and-swap on code), then fill in the fields.
      if (std::atomic_ref<int32_t>(status_word->code)
              .compare_exchange_strong(expected, record_.code, std::memory_order_acq_rel)) {
        status_word->site = record_.site;
        status_word->waiting_rank = record_.waiting_rank;
        status_word->peer_rank = record_.peer_rank;
        status_word->channel = record_.channel;
        status_word->value = record_.value;
        status_word->min_value = record_.min_value;
        status_word->max_value = record_.max_value;
      }
    }
    return KernelStatusToStatus(record_);
  }

 private:
  KernelStatus record_{};
};

// True when the daemon published group rank `rank` as lost (status_word.h, kMaxLostRanks); `lost_ranks` may be null.
inline bool RankLost(const uint64_t* lost_ranks, int rank) {
  if (lost_ranks == nullptr || rank < 0 || rank >= kMaxLostRanks) return false;
  return ((LoadAcquire(lost_ranks + rank / 64) >> (rank % 64)) & 1u) != 0;
}

// The lost-ranks words to poll for a wait on `peer` (null: none), unless `ignore` has its bit (see
// IntranodeGroup::lost_ignore).
inline const uint64_t* LossWords(const uint64_t* lost_ranks, const uint64_t* ignore, int peer) {
  if (lost_ranks == nullptr || peer < 0 || peer >= kMaxLostRanks) return nullptr;
  return ((ignore[peer / 64] >> (peer % 64)) & 1u) != 0 ? nullptr : lost_ranks;
}

// Spins until `ready()` is true or `timeout_ns` passed. Backoff: a short pause loop (a peer on another core usually
// answers within microseconds), then yields (ranks may outnumber cores: CI has 2), then sleeps of up to 50 us so
// that a long wait does not burn a core. Returns false on timeout (ready() was false at the last check), or as soon
// as `give_up()` is true (checked with the timer).
template <typename Ready, typename GiveUp>
bool BoundedWait(Ready&& ready, uint64_t timeout_ns, GiveUp&& give_up) {
  for (int i = 0; i < 128; ++i) {
    if (ready()) return true;
    CpuRelax();
  }
  const auto start = std::chrono::steady_clock::now();
  const auto timeout = std::chrono::nanoseconds(timeout_ns);
  for (uint32_t iter = 0;; ++iter) {
    if (ready()) return true;
    if (give_up() || std::chrono::steady_clock::now() - start > timeout) return ready();
    if (iter < 256) {
      std::this_thread::yield();
    } else {
      const auto waited = std::chrono::steady_clock::now() - start;
      std::this_thread::sleep_for(std::clamp(waited / 20,
                                             std::chrono::steady_clock::duration(std::chrono::microseconds(1)),
                                             std::chrono::steady_clock::duration(std::chrono::milliseconds(1))));
    }
  }
}

template <typename Ready>
bool BoundedWait(Ready&& ready, uint64_t timeout_ns) {
  return BoundedWait(ready, timeout_ns, [] { return false; });
}

// BoundedWait on a signal of group rank `peer`, ending early when the daemon publishes that rank as lost. Returns
// true when ready; otherwise `*lost` says why it ended (lost, or timed out).
template <typename Ready>
bool WaitForPeer(Ready&& ready, uint64_t timeout_ns, const uint64_t* lost_ranks, int peer, bool* lost) {
  *lost = false;
  return BoundedWait(ready, timeout_ns, [&] { return *lost = RankLost(lost_ranks, peer); });
}

}  // namespace epfabric::kernels::host_backend::internal
