// Low latency across hosts, device-issued (epfabric/kernels/low_latency_remote.h): after a step of the dispatch or
// combine kernel has staged what goes to the ranks on other hosts, this kernel puts exactly those ranges into their
// inboxes, in the relay's order (client/internode_low_latency_relay.cc): data first, then the signal that publishes
// it, on one ring per destination. One warp per destination; lane 0 issues (the ring keeps a warp's commands in
// program order), the other lanes help find the rows to send.
#include "api/launch.h"
#include "launch.cuh"
#include "low_latency_common.cuh"
#include "transport.cuh"

namespace epfabric::kernels::low_latency {
namespace {

constexpr int kStepQuiet = 0, kStepDispatch = 1, kStepCombineWeights = 2, kStepCombineRows = 3;

__device__ __forceinline__ transport_device::Ring ring_of(const RemoteRing& r) {
  auto* control = static_cast<transport::RingControl*>(r.control);
  return transport_device::Ring{control, reinterpret_cast<transport::Command*>(control + 1), r.next, r.slots,
                                r.channel};
}

// Lane 0's sends to one destination. Offsets are inside a rank's low-latency part (a half's base included): the
// source is the same offset of this rank's staging copy for `dst`, the destination that of dst's inbox.
struct Sender {
  const RemoteIssueKernelParams& p;
  transport_device::Ring ring;
  int dst;
  uint64_t staging;  // the staging copy's offset in this rank's RDMA region
  bool ok;

  __device__ void put(size_t offset, size_t bytes) {
    if (!ok || bytes == 0) return;
    ok = transport_device::issue(ring, transport::Opcode::kPut, dst, p.rdma_offset + offset, staging + offset, bytes,
                                 p.g.timeout_ns, p.g.status, p.g.rank);
  }
};

// What a dispatch's send phase staged for `dst`: the messages of this rank's tokens (slot [rank][token]), the
// entries of each routing list, then the counts (nonzero once staged: -1 - count).
__device__ void send_dispatch(Sender& out, const int32_t* staged_signals, size_t base) {
  const GroupView& g = out.p.g;
  const LowLatencyLayout& l = g.layout;
  const int R = g.num_ranks, M = l.max_tokens_per_rank, L = l.num_local_experts, rank = g.rank;
  const int32_t* counts =
      reinterpret_cast<const int32_t*>(reinterpret_cast<const uint8_t*>(staged_signals) + l.dispatch_count_offset);
  out.put(base + l.dispatch_msgs_offset + static_cast<size_t>(rank) * M * l.dispatch_msg_bytes,
          static_cast<size_t>(out.p.num_tokens) * l.dispatch_msg_bytes);
  for (int local = 0; local < L; ++local) {
    const int32_t value = ptx::ld_volatile_global(counts + local * R + rank);
    const int64_t count = value == 0 ? 0 : -1 - static_cast<int64_t>(value);
    if (count <= 0 || count > M) continue;  // the kernel's own count: 0 .. M
    out.put(base + l.dispatch_table_offset + (static_cast<size_t>(local) * R + rank) * M * sizeof(int32_t),
            static_cast<size_t>(count) * sizeof(int32_t));
  }
  for (int local = 0; local < L; ++local) {
    if (ptx::ld_volatile_global(counts + local * R + rank) == 0) continue;
    out.put(base + l.dispatch_count_offset + (static_cast<size_t>(local) * R + rank) * sizeof(int32_t),
            sizeof(int32_t));
  }
}

__device__ void send_weights(Sender& out, const int32_t* staged_signals, size_t base) {
  const LowLatencyLayout& l = out.p.g.layout;
  const int rank = out.p.g.rank;
  const size_t weights_row = kLowLatencyMaxTopk * sizeof(float);
  out.put(base + l.combine_weights_offset + static_cast<size_t>(rank) * l.max_tokens_per_rank * weights_row,
          static_cast<size_t>(out.p.num_tokens) * weights_row);
  const int32_t* flags =
      reinterpret_cast<const int32_t*>(reinterpret_cast<const uint8_t*>(staged_signals) + l.weights_flag_offset);
  if (ptx::ld_volatile_global(flags + rank) != 0) {
    out.put(base + l.weights_flag_offset + static_cast<size_t>(rank) * sizeof(int32_t), sizeof(int32_t));
  }
}

// The partial-sum rows of dst's tokens that this rank holds experts of (the dispatch's token map lists them), then
// the combine flag. The whole warp scans the map, 32 tokens at a time; lane 0 sends in token order.
__device__ void send_rows(Sender& out, const int32_t* staged_signals, size_t base, int lane) {
  const GroupView& g = out.p.g;
  const LowLatencyLayout& l = g.layout;
  const int R = g.num_ranks, M = l.max_tokens_per_rank, H = l.hidden, rank = g.rank;
  const int32_t* map = out.p.token_map + static_cast<size_t>(out.dst) * M * kLowLatencyMaxTopk;
  for (int first = 0; first < M; first += 32) {
    const int t = first + lane;
    bool present = false;
    if (t < M) {
      for (int k = 0; k < kLowLatencyMaxTopk && !present; ++k)
        present = map[static_cast<size_t>(t) * kLowLatencyMaxTopk + k] >= 0;
    }
    uint32_t rows = __ballot_sync(0xffffffffu, present);
    if (lane == 0) {
      for (; rows != 0; rows &= rows - 1) {
        const int row = first + __ffs(rows) - 1;
        out.put(base + l.combine_recv_offset + (static_cast<size_t>(row) * R + rank) * H * 2,
                static_cast<size_t>(H) * 2);
      }
    }
  }
  if (lane == 0) {
    const int32_t* flags =
        reinterpret_cast<const int32_t*>(reinterpret_cast<const uint8_t*>(staged_signals) + l.combine_flag_offset);
    if (ptx::ld_volatile_global(flags + rank) != 0) {
      out.put(base + l.combine_flag_offset + static_cast<size_t>(rank) * sizeof(int32_t), sizeof(int32_t));
    }
  }
}

__global__ void __launch_bounds__(kMaxNvlPeers * 32)
    remote_issue_kernel(const __grid_constant__ RemoteIssueKernelParams p) {
  const GroupView& g = p.g;
  const int lane = threadIdx.x % 32, dst = threadIdx.x / 32;
  if (p.step == kStepQuiet) {
    // Every ring this rank issues on, in parallel: a failed ring ends its wait (the host reads why from the ring).
    if (threadIdx.x < p.num_rings) {
      transport_device::quiet(ring_of(p.rings[threadIdx.x]), g.timeout_ns, g.status, g.rank);
    }
    return;
  }
  if (dst >= g.num_ranks || ((g.remote >> dst) & 1u) == 0) return;
  if (g.rank_mask != nullptr && ptx::ld_volatile_global(g.rank_mask + dst) != 0) return;  // masked: nothing to send
  const size_t base = g.layout.half_bytes * g.half;
  const int32_t* staged_signals = reinterpret_cast<const int32_t*>(half_base(g, dst));  // the staging copy's half
  Sender out{p, ring_of(p.rings[dst % p.num_rings]), dst,
             p.rdma_offset + (1 + static_cast<uint64_t>(dst)) * 2 * g.layout.half_bytes, true};
  if (p.step == kStepCombineRows) {
    send_rows(out, staged_signals, base, lane);
  } else if (lane == 0) {
    if (p.step == kStepDispatch) send_dispatch(out, staged_signals, base);
    if (p.step == kStepCombineWeights) send_weights(out, staged_signals, base);
  }
}

}  // namespace

cudaError_t LaunchRemoteIssue(const RemoteIssueKernelParams& params, cudaStream_t stream) {
  return launch_kernel(remote_issue_kernel, params, LaunchShape{.blocks = 1, .threads = kMaxNvlPeers * 32}, stream);
}

cudaError_t PreloadRemoteIssue() { return preload_kernel(remote_issue_kernel); }

}  // namespace epfabric::kernels::low_latency
