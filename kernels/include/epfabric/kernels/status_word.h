// The status word that every bounded wait in a kernel reports into, and the other constants host and device code
// share. Device-safe: no absl, no std library beyond fixed-width integers, so that .cu files can include it.
#pragma once

#include <cstdint>

namespace epfabric::kernels {

// Default bound for every spin-wait in a kernel. A wait that runs longer records who it waited for in the
// KernelStatus and makes the kernel exit; the host turns that into absl::DeadlineExceededError.
inline constexpr uint64_t kDefaultWaitTimeoutNs = 5ull * 1000 * 1000 * 1000;

// The maximum number of same-host peers a kernel addresses through NVLink (DGX/HGX boxes have 8 GPUs).
inline constexpr int kMaxNvlPeers = 8;

// Kernel timelines for benchmarks (optional `profile_ns` of IntranodeGroup and LowLatencyContext): device memory of
// uint64 [blocks][kProfileSlotsPerBlock], %globaltimer nanoseconds. Per block: slot 0 = entry, slot 1 = end of the
// block's start-up (intranode: after the barrier and the slot scan; low latency: end of the send phase of the
// block's last warp, written by each warp that sends, so it is the latest), slot 2 + w = when warp w finished.
// Production leaves it null (the kernels then skip every mark).
inline constexpr int kProfileSlotsPerBlock = 34;

// Where a bounded wait timed out. Values are stable: they appear in logs and error messages.
enum class WaitSite : int32_t {
  kNone = 0,
  kBarrier = 1,            // cross-rank barrier signal
  kNotifyCounts = 2,       // notify: per-rank/per-expert counts from a peer
  kDispatchFifoSpace = 3,  // dispatch sender: room in the peer's FIFO (head not advanced)
  kDispatchFifoData = 4,   // dispatch receiver: data in the FIFO (tail not advanced)
  kCombineFifoSpace = 5,
  kCombineFifoData = 6,
  kLowLatencyRecvCount = 7,  // low-latency receive: per-expert count flag from a peer
  kLowLatencyCombineFlag = 8,
};

// Written by a kernel when a bounded wait expires. It lives in memory the host can read after the stream is
// synchronised (device memory copied back, or mapped pinned host memory). All fields are written by the first
// thread that times out (it claims `code` with an atomic compare-and-swap); later timeouts leave the record alone
// so that the root cause is reported, not its consequences.
struct KernelStatus {
  int32_t code;          // kKernelStatusOk or kKernelStatusTimeout
  int32_t site;          // WaitSite
  int32_t waiting_rank;  // the rank whose kernel timed out
  int32_t peer_rank;     // the rank it waited for (-1 when not one rank)
  int32_t channel;       // channel / expert / block index, -1 when not meaningful
  int32_t reserved[3];
};
static_assert(sizeof(KernelStatus) == 32);

inline constexpr int32_t kKernelStatusOk = 0;
inline constexpr int32_t kKernelStatusTimeout = 1;

}  // namespace epfabric::kernels
