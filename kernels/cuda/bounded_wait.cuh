// Bounded spin-waits. Every wait on a peer's signal goes through these: on expiry the first timing-out thread
// records who it waited for in the KernelStatus (see common.h) and the caller returns, so the kernel ends and the
// host reports an error. Never `trap`: that would destroy the CUDA context of a client that did nothing wrong.
#pragma once

#include <climits>
#include <cstdint>

#include "epfabric/kernels/device/ptx.cuh"
#include "epfabric/kernels/status_word.h"

namespace epfabric::kernels {

// Records why a wait on `peer_rank` ended (`code`: kKernelStatusTimeout, kKernelStatusPeerLost,
// kKernelStatusPeerLeftCall) unless an earlier failure was recorded.
__device__ __forceinline__ void record_wait_end(KernelStatus* status, int32_t code, WaitSite site, int waiting_rank,
                                                int peer_rank, int channel) {
  if (status == nullptr) return;
  if (atomicCAS(&status->code, kKernelStatusOk, code) == kKernelStatusOk) {
    status->site = static_cast<int32_t>(site);
    status->waiting_rank = waiting_rank;
    status->peer_rank = peer_rank;
    status->channel = channel;
    __threadfence_system();
  }
}

__device__ __forceinline__ void record_timeout(KernelStatus* status, WaitSite site, int waiting_rank, int peer_rank,
                                               int channel) {
  record_wait_end(status, kKernelStatusTimeout, site, waiting_rank, peer_rank, channel);
}

// Records a value read from peer-writable memory that lies outside [min_value, max_value] (kKernelStatusBadPeerData)
// unless an earlier failure was recorded. The caller then treats the item as empty: a bad value is never used as a
// size, index or offset, and the kernel never traps.
__device__ __forceinline__ void record_bad_peer_data(KernelStatus* status, PeerDataField field, int reading_rank,
                                                     int peer_rank, int index, int64_t value, int64_t min_value,
                                                     int64_t max_value) {
  if (status == nullptr) return;
  if (atomicCAS(&status->code, kKernelStatusOk, kKernelStatusBadPeerData) == kKernelStatusOk) {
    auto saturate = [](int64_t v) {
      return static_cast<int32_t>(v < INT32_MIN ? INT32_MIN : (v > INT32_MAX ? INT32_MAX : v));
    };
    status->site = static_cast<int32_t>(field);
    status->waiting_rank = reading_rank;
    status->peer_rank = peer_rank;
    status->channel = index;
    status->value = saturate(value);
    status->min_value = saturate(min_value);
    status->max_value = saturate(max_value);
    __threadfence_system();
  }
}

// Records that this rank receives `num_recv` rows with room for `capacity` (kKernelStatusRecvCapacity: worst-case mode
// with too small a num_worst_tokens) unless an earlier failure was recorded.
__device__ __forceinline__ void record_recv_capacity(KernelStatus* status, CapacitySite site, int rank, int num_recv,
                                                     int capacity) {
  if (status == nullptr) return;
  if (atomicCAS(&status->code, kKernelStatusOk, kKernelStatusRecvCapacity) == kKernelStatusOk) {
    status->site = static_cast<int32_t>(site);
    status->waiting_rank = rank;
    status->peer_rank = -1;
    status->channel = -1;
    status->value = num_recv;
    status->min_value = 0;
    status->max_value = capacity;
    __threadfence_system();
  }
}

// True when `min_value <= value <= max_value`; otherwise records the value (record_bad_peer_data) and returns false.
__device__ __forceinline__ bool check_peer_value(KernelStatus* status, PeerDataField field, int reading_rank,
                                                 int peer_rank, int index, int64_t value, int64_t min_value,
                                                 int64_t max_value) {
  if (value >= min_value && value <= max_value) return true;
  record_bad_peer_data(status, field, reading_rank, peer_rank, index, value, min_value, max_value);
  return false;
}

// True when the daemon published group rank `rank` as lost (status_word.h, kMaxLostRanks). `lost_ranks` may be null
// (nothing published, e.g. kernels run by tests without a daemon) and points to mapped host memory: read it only on
// the slow path of a wait. An acquire: what landed here before the daemon published the loss (the rank's last puts,
// which complete before its lease ends) is visible to the reads that follow.
__device__ __forceinline__ bool peer_lost(const uint64_t* lost_ranks, int rank) {
  if (lost_ranks == nullptr || rank < 0 || rank >= kMaxLostRanks) return false;
  const uint64_t word =
      static_cast<uint64_t>(ptx::ld_acquire_sys_global(reinterpret_cast<const int64_t*>(lost_ranks + rank / 64)));
  return ((word >> (rank % 64)) & 1u) != 0;
}

// The lost-ranks words to poll for a wait on `peer` (null: none): a kernel view's `lost_ranks` unless the view ignores
// that rank's bit (`lost_ignore`: lost before the Buffer was made, until its bit clears).
template <typename View>
__device__ __forceinline__ const uint64_t* loss_words(const View& g, int peer) {
  if (g.lost_ranks == nullptr || peer < 0 || peer >= kMaxLostRanks) return nullptr;
  return ((g.lost_ignore[peer / 64] >> (peer % 64)) & 1u) != 0 ? nullptr : g.lost_ranks;
}

// Records that a wait on `peer_rank` ended because that rank is lost, unless an earlier failure was recorded.
__device__ __forceinline__ void record_peer_lost(KernelStatus* status, WaitSite site, int waiting_rank, int peer_rank,
                                                 int channel) {
  record_wait_end(status, kKernelStatusPeerLost, site, waiting_rank, peer_rank, channel);
}

// True when some thread (of any block of this launch, or of an earlier launch that was not cleared) already
// recorded a failure: waits elsewhere can give up early instead of each running into its own timeout.
__device__ __forceinline__ bool status_failed(const KernelStatus* status) {
  return status != nullptr && ptx::ld_volatile_global(&status->code) != kKernelStatusOk;
}

// Spins until `pred()` is true. Returns false (after recording the timeout) if `timeout_ns` passes first, or if
// another thread already recorded a failure. The timer is %globaltimer, checked every 256 polls to keep the
// polling loop tight. With `lost_ranks`, the same slow path also returns false once `peer_rank` is published as
// lost, recording it (kKernelStatusPeerLost) when `record_loss`; low latency passes false and masks the rank instead.
template <typename Pred>
__device__ __forceinline__ bool bounded_wait(Pred pred, uint64_t timeout_ns, KernelStatus* status, WaitSite site,
                                             int waiting_rank, int peer_rank, int channel,
                                             const uint64_t* lost_ranks = nullptr, bool record_loss = true) {
  if (pred()) return true;
  const uint64_t start = ptx::global_timer_ns();
  for (uint32_t iter = 1;; ++iter) {
    if (pred()) return true;
    if ((iter & 255u) == 0) {
      if (status_failed(status)) return false;
      if (peer_lost(lost_ranks, peer_rank)) {
        // A rank that ends its lease right after its last data landed is published as lost after that landing: data
        // that arrived between the poll above and this read is there, and the rank was not silent (seen across
        // hosts, where a rank's last puts land moments before it exits).
        if (pred()) return true;
        if (record_loss) record_peer_lost(status, site, waiting_rank, peer_rank, channel);
        return false;
      }
      if (ptx::global_timer_ns() - start > timeout_ns) {
        record_timeout(status, site, waiting_rank, peer_rank, channel);
        return false;
      }
    }
  }
}

}  // namespace epfabric::kernels
