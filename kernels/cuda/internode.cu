// The internode normal mode's two data steps on the GPU (internode.h): the source's pack into the RDMA region (and
// each host's count into its send_count word) and its final reduce over the per-host partial rows. Plain copies and
// float sums, warp per row.
#include <cuda_bf16.h>

#include "api/internode_launch.h"

namespace epfabric::kernels::internode {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ uint8_t* SlabBase(const InternodePackParams& p, size_t send, size_t recv, size_t slab_bytes, int host) {
  return p.region + (host == p.self_host ? recv : send) + static_cast<size_t>(host) * slab_bytes;
}

// blockIdx.y = destination host; warps stride over its rows.
__global__ void __launch_bounds__(kThreads) pack_kernel(const __grid_constant__ InternodePackParams p) {
  const int host = blockIdx.y;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int count = p.send_counts[host];
  const InternodeRdmaLayout& l = p.layout;
  // The source of the count put to host's gateway (the host path's and the device issuer's).
  if (blockIdx.x == 0 && threadIdx.x == 0) reinterpret_cast<int64_t*>(p.region + l.send_count)[host] = count;
  uint8_t* x_dst = SlabBase(p, l.send_x, l.recv_x, l.x_slab_bytes, host);
  // Scale words are copied as 4-byte integers: float scales or packed UE8M0 int32 words, bit for bit.
  uint32_t* scales_dst =
      reinterpret_cast<uint32_t*>(SlabBase(p, l.send_scales, l.recv_scales, l.scales_slab_bytes, host));
  const uint32_t* scales_src = reinterpret_cast<const uint32_t*>(p.x_scales);
  int64_t* idx_dst =
      reinterpret_cast<int64_t*>(SlabBase(p, l.send_topk_idx, l.recv_topk_idx, l.topk_idx_slab_bytes, host));
  float* w_dst =
      reinterpret_cast<float*>(SlabBase(p, l.send_topk_weights, l.recv_topk_weights, l.topk_weights_slab_bytes, host));
  const int64_t first_expert = static_cast<int64_t>(host) * p.experts_per_host;
  for (int i = blockIdx.x * kWarps + warp; i < count; i += gridDim.x * kWarps) {
    const int t = p.send_tokens[static_cast<size_t>(host) * p.max_rows + i];
    const int4* src =
        reinterpret_cast<const int4*>(static_cast<const uint8_t*>(p.x) + static_cast<size_t>(t) * p.row_bytes);
    int4* dst = reinterpret_cast<int4*>(x_dst + static_cast<size_t>(i) * p.row_bytes);
    for (int v = lane; v < p.row_bytes / 16; v += 32) dst[v] = src[v];
    for (int s = lane; s < p.num_scales; s += 32) {
      scales_dst[static_cast<size_t>(i) * p.num_scales + s] = scales_src[static_cast<size_t>(t) * p.num_scales + s];
    }
    for (int k = lane; k < p.num_topk; k += 32) {
      const int64_t e = p.topk_idx[static_cast<size_t>(t) * p.num_topk + k];
      const bool here = e >= first_expert && e < first_expert + p.experts_per_host;
      idx_dst[static_cast<size_t>(i) * p.num_topk + k] = here ? e - first_expert : -1;
      if (p.topk_weights != nullptr) {
        w_dst[static_cast<size_t>(i) * p.num_topk + k] = p.topk_weights[static_cast<size_t>(t) * p.num_topk + k];
      }
    }
  }
}

// One block per token (grid-stride): the hosts' partial rows summed in host order, then the biases.
__global__ void __launch_bounds__(kThreads) reduce_kernel(const __grid_constant__ InternodeReduceParams p) {
  const InternodeRdmaLayout& l = p.layout;
  for (int t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    const int32_t* slots = p.send_slot + static_cast<size_t>(t) * p.num_hosts;
    for (int h = threadIdx.x; h < p.hidden; h += blockDim.x) {
      float acc = 0.0f;
      for (int host = 0; host < p.num_hosts; ++host) {
        const int slot = slots[host];
        if (slot < 0) continue;
        const __nv_bfloat16* row = reinterpret_cast<const __nv_bfloat16*>(
            p.region + l.combine_recv_x + static_cast<size_t>(host) * l.combine_x_slab_bytes +
            static_cast<size_t>(slot) * p.hidden * 2);
        acc += __bfloat162float(row[h]);
      }
      if (p.bias_0 != nullptr)
        acc += __bfloat162float(static_cast<const __nv_bfloat16*>(p.bias_0)[static_cast<size_t>(t) * p.hidden + h]);
      if (p.bias_1 != nullptr)
        acc += __bfloat162float(static_cast<const __nv_bfloat16*>(p.bias_1)[static_cast<size_t>(t) * p.hidden + h]);
      static_cast<__nv_bfloat16*>(p.combined_x)[static_cast<size_t>(t) * p.hidden + h] = __float2bfloat16_rn(acc);
    }
    for (int k = threadIdx.x; k < p.num_topk; k += blockDim.x) {
      float acc = 0.0f;
      for (int host = 0; host < p.num_hosts; ++host) {
        const int slot = slots[host];
        if (slot < 0) continue;
        const float* row = reinterpret_cast<const float*>(p.region + l.combine_recv_weights +
                                                          static_cast<size_t>(host) * l.combine_weights_slab_bytes) +
                           static_cast<size_t>(slot) * p.num_topk;
        acc += row[k];
      }
      p.combined_topk_weights[static_cast<size_t>(t) * p.num_topk + k] = acc;
    }
  }
}

}  // namespace

cudaError_t LaunchPack(const InternodePackParams& params, cudaStream_t stream) {
  const int blocks_x = std::min(std::max((params.num_tokens + kWarps - 1) / kWarps, 1), 128);
  pack_kernel<<<dim3(blocks_x, params.num_hosts), kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t LaunchReduce(const InternodeReduceParams& params, cudaStream_t stream) {
  const int blocks = std::min(params.num_tokens, 1024);
  reduce_kernel<<<blocks, kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace epfabric::kernels::internode
