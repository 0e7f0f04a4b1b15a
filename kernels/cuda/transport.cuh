// Device-side transport issuer: the protocol of epfabric/kernels/transport/ring.h from device code. Commands go into a
// ring in host memory (the daemon's command region, registered with CUDA in the client), read by the daemon's proxy.
// Any thread may issue; a warp that issues many commands should let one lane issue them (the slot reservation is an
// compare-and-swap in device memory, one counter per ring, because atomics to host memory are not atomic across PCIe
// on x86).
#pragma once

#include <cstdint>

#include "bounded_wait.cuh"
#include "epfabric/kernels/device/ptx.cuh"
#include "epfabric/kernels/status_word.h"
#include "epfabric/kernels/transport/ring.h"

namespace epfabric::kernels::transport_device {

using transport::Command;
using transport::Opcode;
using transport::RingControl;

struct Ring {
  RingControl* control;      // device pointer of the mapped ring (host memory)
  Command* slots;            // control + 1
  unsigned long long* next;  // device memory: the next index to reserve on this ring
  uint32_t slot_count;
  int channel;
};

__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* ptr) {
  return static_cast<uint64_t>(ptx::ld_acquire_sys_global(reinterpret_cast<const int64_t*>(ptr)));
}

__device__ __forceinline__ bool ring_failed(const Ring& ring) {
  return ptx::ld_acquire_sys_global(&ring.control->error_code) != 0;
}

// Issues one command. Returns false when the ring failed (the daemon recorded an error: the host reads it from the
// ring) or a free slot did not appear within `timeout_ns` (recorded in `status`).
__device__ __forceinline__ bool issue(const Ring& ring, Opcode opcode, int dst_rank, uint64_t dst_offset,
                                      uint64_t src_offset, uint64_t arg, uint64_t timeout_ns, KernelStatus* status,
                                      int self_rank) {
  if (ring_failed(ring)) return false;
  // The next index is reserved (compare-and-swap) only once its slot is free, so a wait that times out reserves
  // nothing: an index taken first and then abandoned would leave a slot nobody writes, and the daemon's proxy (which
  // takes the slots in order) would stop there until the lease ends, even after the ring drained again.
  uint64_t index = 0;
  bool reserved = false;
  const bool ended = bounded_wait(
      [&] {
        if (ring_failed(ring)) return true;
        index = *reinterpret_cast<volatile unsigned long long*>(ring.next);
        if (index - ld_acquire_sys_u64(&ring.control->consumed) >= ring.slot_count) return false;  // full
        reserved = atomicCAS(ring.next, index, index + 1) == index;  // else another issuer took it: again
        return reserved;
      },
      timeout_ns, status, WaitSite::kTransportRingSpace, self_rank, dst_rank, ring.channel);
  if (!ended || !reserved || ring_failed(ring)) return false;
  Command* slot = ring.slots + (index & (ring.slot_count - 1));
  // The fields first, then the stamp: the fence orders them for the daemon's CPU reads across PCIe.
  slot->opcode = static_cast<uint8_t>(opcode);
  slot->reserved = 0;
  slot->dst_rank = static_cast<uint16_t>(dst_rank);
  slot->dst_offset = dst_offset;
  slot->src_offset = src_offset;
  slot->arg = arg;
  __threadfence_system();
  ptx::st_release_sys_global(reinterpret_cast<int32_t*>(&slot->stamp), static_cast<int32_t>(index + 1));
  return true;
}

// Waits until every command reserved on the ring so far is complete at its destination.
__device__ __forceinline__ bool quiet(const Ring& ring, uint64_t timeout_ns, KernelStatus* status, int self_rank) {
  const uint64_t target = *reinterpret_cast<volatile unsigned long long*>(ring.next);
  const bool done = bounded_wait(
      [&] { return ld_acquire_sys_u64(&ring.control->completed) >= target || ring_failed(ring); }, timeout_ns, status,
      WaitSite::kTransportQuiet, self_rank, ptx::ld_acquire_sys_global(&ring.control->waiting_rank), ring.channel);
  return done && !ring_failed(ring);
}

}  // namespace epfabric::kernels::transport_device
