// Internode normal mode in worst-case mode (num_worst_tokens; internode_layout.h): the RDMA stage's steps as kernels,
// so that nothing waits on the host and a call can be captured into a CUDA graph. The data steps (plan, gather,
// scatter) have host twins in host_backend/host_internode.cc with the same loops; the transport steps (issue, wait)
// are the host path's puts and waits (client/internode_path.cc) done by one block on the device.
#include <cuda_runtime.h>

#include "api/internode_launch.h"
#include "bounded_wait.cuh"
#include "transport.cuh"

namespace epfabric::kernels::internode {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kPlanThreads = 512;
constexpr uint64_t kWord = sizeof(uint64_t);

__device__ __forceinline__ int clamp_rows(int64_t n, int max_rows) {
  return n < 0 ? 0 : (n > max_rows ? max_rows : static_cast<int>(n));
}

// One block per host: a block-wide running count over the tokens, 512 at a time (ballot within a warp, then the
// warps' totals in shared memory), so that rows keep token order.
__global__ void __launch_bounds__(kPlanThreads) plan_kernel(const __grid_constant__ InternodePlanParams p) {
  __shared__ int warp_counts[kPlanThreads / 32];
  const int host = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int R = p.num_hosts * p.ranks_per_host;
  int32_t* tokens = p.send_plan + p.num_hosts + static_cast<size_t>(host) * p.max_rows;
  int base = 0;
  for (int first = 0; first < p.num_tokens; first += kPlanThreads) {
    const int t = first + static_cast<int>(threadIdx.x);
    bool goes = false;
    if (t < p.num_tokens) {
      goes = p.num_hosts == 1;
      for (int l = 0; l < p.ranks_per_host && !goes; ++l) {
        goes = p.is_token_in_rank[static_cast<size_t>(t) * R + host * p.ranks_per_host + l];
      }
    }
    const uint32_t ballot = __ballot_sync(0xffffffffu, goes);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < kPlanThreads / 32; ++w) {
      before += w < warp ? warp_counts[w] : 0;
      total += warp_counts[w];
    }
    const int row = base + before + __popc(ballot & ((1u << lane) - 1u));
    if (t < p.num_tokens) {
      p.send_slot[static_cast<size_t>(t) * p.num_hosts + host] = goes ? row : -1;
      if (goes) tokens[row] = t;
    }
    base += total;
    __syncthreads();  // warp_counts is rewritten by the next round
  }
  if (threadIdx.x == 0) p.send_plan[host] = base;
}

// The rows of host h this gateway forwards: the own plan's count for the own host, the count word a peer put for
// another (peer data: checked; after a recorded failure it may never have come, so 0).
__device__ int gathered_rows(const InternodeGatherParams& p, int host) {
  if (host == p.self_host) return clamp_rows(p.send_counts[host], p.max_rows);
  if (status_failed(p.status)) return 0;
  const int peer = host * p.ranks_per_host + (p.rank % p.ranks_per_host);
  const int64_t n =
      ptx::ld_acquire_sys_global(reinterpret_cast<const int64_t*>(p.region + p.layout.dispatch_count) + host);
  if (!check_peer_value(p.status, PeerDataField::kInternodeRowCount, p.rank, peer, host, n, 0, p.max_rows)) return 0;
  if (p.expected_counts != nullptr && n != p.expected_counts[host]) {
    record_bad_peer_data(p.status, PeerDataField::kInternodeCachedRowCount, p.rank, peer, host, n,
                         p.expected_counts[host], p.expected_counts[host]);
    return 0;
  }
  return static_cast<int>(n);
}

// blockIdx.y = source host; warps stride over the host's max_rows places (rows, then padding).
__global__ void __launch_bounds__(kThreads) gather_kernel(const __grid_constant__ InternodeGatherParams p) {
  const int host = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const InternodeRdmaLayout& l = p.layout;
  const int n = gathered_rows(p, host);
  if (blockIdx.x == 0 && threadIdx.x == 0) p.recv_counts[host] = n;
  const uint8_t* x_src = p.region + l.recv_x + static_cast<size_t>(host) * l.x_slab_bytes;
  const uint32_t* scales_src =
      reinterpret_cast<const uint32_t*>(p.region + l.recv_scales + static_cast<size_t>(host) * l.scales_slab_bytes);
  const int64_t* idx_src =
      reinterpret_cast<const int64_t*>(p.region + l.recv_topk_idx + static_cast<size_t>(host) * l.topk_idx_slab_bytes);
  const float* w_src = reinterpret_cast<const float*>(p.region + l.recv_topk_weights +
                                                      static_cast<size_t>(host) * l.topk_weights_slab_bytes);
  for (int i = blockIdx.x * kWarps + warp; i < p.max_rows; i += gridDim.x * kWarps) {
    const bool row = i < n;
    const size_t out = static_cast<size_t>(host) * p.max_rows + i;
    int4* x_dst = reinterpret_cast<int4*>(static_cast<uint8_t*>(p.x) + out * p.row_bytes);
    const int4* x_row = reinterpret_cast<const int4*>(x_src + static_cast<size_t>(i) * p.row_bytes);
    for (int v = lane; v < p.row_bytes / 16; v += 32) x_dst[v] = row ? x_row[v] : make_int4(0, 0, 0, 0);
    for (int s = lane; s < p.num_scales; s += 32) {
      p.x_scales[out * p.num_scales + s] = row ? scales_src[static_cast<size_t>(i) * p.num_scales + s] : 0u;
    }
    for (int k = lane; k < p.num_topk; k += 32) {
      p.topk_idx[out * p.num_topk + k] = row ? idx_src[static_cast<size_t>(i) * p.num_topk + k] : -1;
      if (p.topk_weights != nullptr) {
        p.topk_weights[out * p.num_topk + k] = row ? w_src[static_cast<size_t>(i) * p.num_topk + k] : 0.0f;
      }
    }
  }
}

// blockIdx.y = source host; warps stride over its rows.
__global__ void __launch_bounds__(kThreads) scatter_kernel(const __grid_constant__ InternodeScatterParams p) {
  const int host = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const InternodeRdmaLayout& l = p.layout;
  const int n = clamp_rows(p.recv_counts[host], p.max_rows);
  const bool own = host == p.self_host;
  const size_t row_bytes = static_cast<size_t>(p.hidden) * 2;
  uint8_t* x_dst = p.region + (own ? l.combine_recv_x : l.combine_send_x) + host * l.combine_x_slab_bytes;
  float* w_dst = reinterpret_cast<float*>(p.region + (own ? l.combine_recv_weights : l.combine_send_weights) +
                                          host * l.combine_weights_slab_bytes);
  for (int i = blockIdx.x * kWarps + warp; i < n; i += gridDim.x * kWarps) {
    const size_t in = static_cast<size_t>(host) * p.max_rows + i;
    const int4* src = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(p.x) + in * row_bytes);
    int4* dst = reinterpret_cast<int4*>(x_dst + i * row_bytes);
    for (size_t v = lane; v < row_bytes / 16; v += 32) dst[v] = src[v];
    for (int k = lane; k < p.num_topk; k += 32) {
      w_dst[static_cast<size_t>(i) * p.num_topk + k] = p.topk_weights[in * p.num_topk + k];
    }
  }
}

__device__ __forceinline__ transport::RingControl* control_of(const InternodeRing& r) {
  return static_cast<transport::RingControl*>(r.control);
}

// Lane 0 of a warp: one host's commands of a step, on one ring, in order (a signal after the data it publishes).
struct HostSender {
  const InternodeIssueParams& p;
  transport_device::Ring ring;
  int peer;
  bool ok = true;

  __device__ void command(transport::Opcode opcode, uint64_t dst, uint64_t src, uint64_t arg) {
    if (!ok) return;
    ok = transport_device::issue(ring, opcode, peer, dst, src, arg, p.timeout_ns, p.status, p.rank);
    // A ring the daemon failed (the peer lost, a refused command): recorded, so that the call fails and the next
    // steps send nothing (the host reads the ring's own record for the message).
    if (!ok)
      record_wait_end(p.status, kKernelStatusPeerLost, WaitSite::kTransportRingSpace, p.rank, peer, ring.channel);
  }
  __device__ void put(uint64_t dst, uint64_t src, uint64_t bytes) {
    if (bytes > 0) command(transport::Opcode::kPut, dst, src, bytes);
  }
  __device__ void signal(uint64_t dst) { command(transport::Opcode::kSignalAdd, dst, 0, 1); }
};

__device__ void issue_for_host(const InternodeIssueParams& p, HostSender& out, int host) {
  const InternodeRdmaLayout& l = p.layout;
  const int self = p.self_host;
  const uint64_t n = p.counts == nullptr ? 0 : clamp_rows(p.counts[host], p.max_rows);
  switch (p.step) {
    case InternodeIssueStep::kDispatchRows:
      out.put(l.recv_x + self * l.x_slab_bytes, l.send_x + host * l.x_slab_bytes, n * p.row_bytes);
      out.put(l.recv_scales + self * l.scales_slab_bytes, l.send_scales + host * l.scales_slab_bytes,
              n * p.num_scales * sizeof(float));
      out.put(l.recv_topk_idx + self * l.topk_idx_slab_bytes, l.send_topk_idx + host * l.topk_idx_slab_bytes,
              n * p.num_topk * sizeof(int64_t));
      if (p.has_weights) {
        out.put(l.recv_topk_weights + self * l.topk_weights_slab_bytes,
                l.send_topk_weights + host * l.topk_weights_slab_bytes, n * p.num_topk * sizeof(float));
      }
      out.put(l.dispatch_count + self * kWord, l.send_count + host * kWord, kWord);
      out.signal(l.dispatch_arrived + self * kWord);
      break;
    case InternodeIssueStep::kSlabFree:
      out.signal(l.slab_free + self * kWord);
      break;
    case InternodeIssueStep::kLeave:
      for (const size_t words : {l.dispatch_arrived, l.slab_free, l.combine_arrived, l.combine_free}) {
        out.command(transport::Opcode::kSignalAdd, words + self * kWord, 0, kInternodeLeftCallWord);
      }
      break;
    case InternodeIssueStep::kCombineRows:
      out.put(l.combine_recv_x + self * l.combine_x_slab_bytes, l.combine_send_x + host * l.combine_x_slab_bytes,
              n * p.row_bytes);
      out.put(l.combine_recv_weights + self * l.combine_weights_slab_bytes,
              l.combine_send_weights + host * l.combine_weights_slab_bytes, n * p.num_topk * sizeof(float));
      out.signal(l.combine_arrived + self * kWord);
      break;
  }
}

// One block: warp w serves hosts w, w + kWarps, ... Slots are reserved from a shared-memory copy of each ring's
// `reserved` word, stored back at the end for the host issuers of the same Buffer.
__global__ void __launch_bounds__(kThreads) issue_kernel(const __grid_constant__ InternodeIssueParams p) {
  __shared__ unsigned long long next[kMaxInternodeRings];
  if (threadIdx.x < p.num_rings) {
    next[threadIdx.x] = transport_device::ld_acquire_sys_u64(&control_of(p.rings[threadIdx.x])->reserved);
  }
  __syncthreads();
  // A step after a recorded failure sends nothing (its data may be incomplete) but kLeave, which runs only then.
  const bool send = status_failed(p.status) == (p.step == InternodeIssueStep::kLeave);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int host = warp; host < p.num_hosts && send; host += kWarps) {
    if (host == p.self_host || lane != 0) continue;
    const int c = host % p.num_rings;
    transport::RingControl* control = control_of(p.rings[c]);
    HostSender out{p,
                   transport_device::Ring{control, reinterpret_cast<transport::Command*>(control + 1), &next[c],
                                          p.rings[c].slots, p.rings[c].channel},
                   host * p.ranks_per_host + p.local_rank};
    issue_for_host(p, out, host);
  }
  __syncthreads();
  if (threadIdx.x < p.num_rings) {
    ptx::st_release_sys_global(reinterpret_cast<int64_t*>(&control_of(p.rings[threadIdx.x])->reserved),
                               static_cast<int64_t>(next[threadIdx.x]));
  }
}

__device__ WaitSite site_of(InternodeWaitWords words) {
  switch (words) {
    case InternodeWaitWords::kDispatchArrived:
      return WaitSite::kInternodeDispatchRows;
    case InternodeWaitWords::kSlabFree:
      return WaitSite::kInternodeSlabFree;
    default:
      return WaitSite::kInternodeCombineRows;
  }
}

// One block, a thread per host: the call counter first (thread 0), then each other host's word, then the quiet.
__global__ void __launch_bounds__(kMaxInternodeHosts) wait_kernel(const __grid_constant__ InternodeWaitParams p) {
  __shared__ uint64_t target;
  const InternodeRdmaLayout& l = p.layout;
  if (threadIdx.x == 0) {
    auto* calls = reinterpret_cast<volatile uint64_t*>(p.region + l.calls) + p.call;
    uint64_t count = *calls;
    if (p.bump) *calls = ++count;
    target = p.words == InternodeWaitWords::kSlabFree ? count - 1 : count;
  }
  __syncthreads();
  const int host = threadIdx.x;
  if (p.words != InternodeWaitWords::kNone && host < p.num_hosts && host != p.self_host) {
    const size_t section = p.words == InternodeWaitWords::kDispatchArrived ? l.dispatch_arrived
                           : p.words == InternodeWaitWords::kSlabFree      ? l.slab_free
                                                                           : l.combine_arrived;
    const uint64_t* word = reinterpret_cast<const uint64_t*>(p.region + section) + host;
    const int peer = host * p.ranks_per_host + p.local_rank;
    const WaitSite site = site_of(p.words);
    const bool arrived = bounded_wait([&] { return transport_device::ld_acquire_sys_u64(word) >= target; },
                                      p.timeout_ns, p.status, site, p.rank, peer, host, loss_words(p, peer));
    // A peer whose call failed marks every word it owes (InternodePath::LeaveCall): the mark reaches any target.
    if (arrived && transport_device::ld_acquire_sys_u64(word) >= kInternodeLeftCallWord) {
      record_wait_end(p.status, kKernelStatusPeerLeftCall, site, p.rank, peer, host);
    }
  }
  __syncthreads();
  if (p.quiet && threadIdx.x < p.num_rings) {
    transport::RingControl* control = control_of(p.rings[threadIdx.x]);
    const uint64_t issued = transport_device::ld_acquire_sys_u64(&control->reserved);
    bounded_wait(
        [&] {
          return transport_device::ld_acquire_sys_u64(&control->completed) >= issued ||
                 ptx::ld_acquire_sys_global(&control->error_code) != 0;
        },
        p.timeout_ns, p.status, WaitSite::kTransportQuiet, p.rank, ptx::ld_acquire_sys_global(&control->waiting_rank),
        p.rings[threadIdx.x].channel);
  }
}

int RowBlocks(int rows) { return std::min(std::max((rows + kWarps - 1) / kWarps, 1), 128); }

}  // namespace

cudaError_t LaunchPlan(const InternodePlanParams& params, cudaStream_t stream) {
  plan_kernel<<<params.num_hosts, kPlanThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t LaunchGather(const InternodeGatherParams& params, cudaStream_t stream) {
  gather_kernel<<<dim3(RowBlocks(params.max_rows), params.num_hosts), kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t LaunchScatter(const InternodeScatterParams& params, cudaStream_t stream) {
  scatter_kernel<<<dim3(RowBlocks(params.max_rows), params.num_hosts), kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t LaunchIssue(const InternodeIssueParams& params, cudaStream_t stream) {
  issue_kernel<<<1, kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t LaunchWait(const InternodeWaitParams& params, cudaStream_t stream) {
  wait_kernel<<<1, kMaxInternodeHosts, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace epfabric::kernels::internode
