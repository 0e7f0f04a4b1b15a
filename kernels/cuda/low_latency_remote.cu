// Low latency across hosts, device-issued (epfabric/kernels/low_latency_remote.h): after a step of the dispatch or
// combine kernel has staged what goes to the ranks on other hosts, this kernel puts exactly those ranges into their
// inboxes, in the relay's order (client/internode_low_latency_relay.cc): data first, then the signal that publishes
// it, on one ring per destination. One warp per destination; lane 0 issues (the ring keeps a warp's commands in
// program order), the other lanes help find the rows to send. What is put comes from this rank's outbox for the
// destination (compact) and lands in this rank's slots of the destination's inbox.
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

constexpr int kIssueWarpsPerBlock = 8;

// Lane 0's sends to one destination: a range of this rank's outbox for `dst` (compact slots, `outbox`) to the same
// slots of dst's inbox (the full layout, this rank's slots `own`). Offsets are the RDMA region's.
struct Sender {
  const RemoteIssueKernelParams& p;
  transport_device::Ring ring;
  int dst;
  uint64_t outbox;  // this call's half of the outbox for dst
  uint64_t inbox;   // this call's half of dst's inbox
  bool ok;

  __device__ void put(size_t outbox_offset, size_t inbox_offset, size_t bytes) {
    if (!ok || bytes == 0) return;
    ok = transport_device::issue(ring, transport::Opcode::kPut, dst, inbox + inbox_offset, outbox + outbox_offset,
                                 bytes, p.g.timeout_ns, p.g.status, p.g.rank);
  }
};

// What a dispatch's send phase staged for `dst` (`staged`: this call's half of its outbox, device memory): the
// messages of this rank's tokens, the entries of each routing list, then the count signals (nonzero once staged: the
// call's tag and count + 1, LowLatencyCountSignal).
__device__ void send_dispatch(Sender& out, const uint8_t* staged) {
  const GroupView& g = out.p.g;
  const LowLatencyLayout& l = g.layout;
  const LowLatencySlots &o = l.outbox, &own = g.own;
  const int M = l.max_tokens_per_rank, L = l.num_local_experts;
  const int64_t* counts = reinterpret_cast<const int64_t*>(staged + o.count);
  out.put(o.msgs, own.msgs, static_cast<size_t>(out.p.num_tokens) * l.dispatch_msg_bytes);
  for (int local = 0; local < L; ++local) {
    const uint64_t value = static_cast<uint64_t>(ptx::ld_cg_global(counts + local));
    const int64_t count = value == 0 ? 0 : static_cast<int64_t>(value & 0xffffffffu) - 1;
    if (count <= 0 || count > M) continue;  // the kernel's own count: 0 .. M
    out.put(o.table + local * o.table_stride, own.table + local * own.table_stride,
            static_cast<size_t>(count) * sizeof(int32_t));
  }
  for (int local = 0; local < L; ++local) {
    if (ptx::ld_cg_global(counts + local) == 0) continue;
    out.put(o.count + local * o.count_stride, own.count + local * own.count_stride, sizeof(int64_t));
  }
}

__device__ void send_weights(Sender& out, const uint8_t* staged) {
  const LowLatencySlots &o = out.p.g.layout.outbox, &own = out.p.g.own;
  out.put(o.weights, own.weights, static_cast<size_t>(out.p.num_tokens) * kLowLatencyMaxTopk * sizeof(float));
  if (ptx::ld_volatile_global(reinterpret_cast<const int32_t*>(staged + o.weights_flag)) != 0) {
    out.put(o.weights_flag, own.weights_flag, sizeof(int32_t));
  }
}

// The partial-sum rows of dst's tokens that this rank holds experts of (the dispatch's token map lists them), then
// the combine flag. The whole warp scans the map, 32 tokens at a time; lane 0 sends in token order.
__device__ void send_rows(Sender& out, const uint8_t* staged, int lane) {
  const GroupView& g = out.p.g;
  const LowLatencyLayout& l = g.layout;
  const LowLatencySlots &o = l.outbox, &own = g.own;
  const int M = l.max_tokens_per_rank;
  const size_t row_bytes = static_cast<size_t>(l.hidden) * 2;
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
        out.put(o.recv + row * o.recv_stride, own.recv + row * own.recv_stride, row_bytes);
      }
    }
  }
  if (lane == 0 && ptx::ld_volatile_global(reinterpret_cast<const int32_t*>(staged + o.combine_flag)) != 0) {
    out.put(o.combine_flag, own.combine_flag, sizeof(int32_t));
  }
}

__global__ void __launch_bounds__(kIssueWarpsPerBlock * 32)
    remote_issue_kernel(const __grid_constant__ RemoteIssueKernelParams p) {
  const GroupView& g = p.g;
  const int lane = threadIdx.x % 32, dst = blockIdx.x * kIssueWarpsPerBlock + threadIdx.x / 32;
  if (p.step == kStepQuiet) {
    // Every ring this rank issues on, in parallel: a failed ring ends its wait (the host reads why from the ring).
    if (blockIdx.x == 0 && threadIdx.x < p.num_rings) {
      transport_device::quiet(ring_of(p.rings[threadIdx.x]), g.timeout_ns, g.status, g.rank);
    }
    return;
  }
  if (dst >= g.num_ranks || !is_remote(g, dst)) return;
  if (g.rank_mask != nullptr && ptx::ld_volatile_global(g.rank_mask + dst) != 0) return;  // masked: nothing to send
  const LowLatencyLayout& l = g.layout;
  const uint64_t outbox_half = 2 * l.half_bytes + (2 * static_cast<uint64_t>(dst) + g.half) * l.outbox_half_bytes;
  Sender out{
      p,   ring_of(p.rings[dst % p.num_rings]), dst, p.rdma_offset + outbox_half, p.rdma_offset + g.half * l.half_bytes,
      true};
  const uint8_t* staged = region<true>(g, dst) + g.half * l.outbox_half_bytes;  // the same half of the outbox, mapped
  if (p.step == kStepCombineRows) {
    send_rows(out, staged, lane);
  } else if (lane == 0) {
    if (p.step == kStepDispatch) send_dispatch(out, staged);
    if (p.step == kStepCombineWeights) send_weights(out, staged);
  }
}

}  // namespace

cudaError_t LaunchRemoteIssue(const RemoteIssueKernelParams& params, cudaStream_t stream) {
  const int blocks =
      params.step == kStepQuiet ? 1 : (params.g.num_ranks + kIssueWarpsPerBlock - 1) / kIssueWarpsPerBlock;
  return launch_kernel(remote_issue_kernel, params, LaunchShape{.blocks = blocks, .threads = kIssueWarpsPerBlock * 32},
                       stream);
}

cudaError_t PreloadRemoteIssue() { return preload_kernel(remote_issue_kernel); }

}  // namespace epfabric::kernels::low_latency
