// Bounded spin-waits. Every wait on a peer's signal goes through these: on expiry the first timing-out thread
// records who it waited for in the KernelStatus (see common.h) and the caller returns, so the kernel ends and the
// host reports an error. Never `trap`: that would destroy the CUDA context of a client that did nothing wrong.
#pragma once

#include <cstdint>

#include "epfabric/kernels/device/ptx.cuh"
#include "epfabric/kernels/status_word.h"

namespace epfabric::kernels {

// Records a timeout in `status` unless an earlier one was recorded.
__device__ __forceinline__ void record_timeout(KernelStatus* status, WaitSite site, int waiting_rank, int peer_rank,
                                               int channel) {
  if (status == nullptr) return;
  if (atomicCAS(&status->code, kKernelStatusOk, kKernelStatusTimeout) == kKernelStatusOk) {
    status->site = static_cast<int32_t>(site);
    status->waiting_rank = waiting_rank;
    status->peer_rank = peer_rank;
    status->channel = channel;
    __threadfence_system();
  }
}

// True when some thread (of any block of this launch, or of an earlier launch that was not cleared) already
// recorded a failure: waits elsewhere can give up early instead of each running into its own timeout.
__device__ __forceinline__ bool status_failed(const KernelStatus* status) {
  return status != nullptr && ptx::ld_volatile_global(&status->code) != kKernelStatusOk;
}

// Spins until `pred()` is true. Returns false (after recording the timeout) if `timeout_ns` passes first, or if
// another thread already recorded a failure. The timer is %globaltimer, checked every 256 polls to keep the
// polling loop tight.
template <typename Pred>
__device__ __forceinline__ bool bounded_wait(Pred pred, uint64_t timeout_ns, KernelStatus* status, WaitSite site,
                                             int waiting_rank, int peer_rank, int channel) {
  if (pred()) return true;
  const uint64_t start = ptx::global_timer_ns();
  for (uint32_t iter = 1;; ++iter) {
    if (pred()) return true;
    if ((iter & 255u) == 0) {
      if (status_failed(status)) return false;
      if (ptx::global_timer_ns() - start > timeout_ns) {
        record_timeout(status, site, waiting_rank, peer_rank, channel);
        return false;
      }
    }
  }
}

}  // namespace epfabric::kernels
