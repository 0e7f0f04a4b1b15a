// The internode normal mode's data steps on the CPU (internode.h): the same loops as kernels/cuda/internode.cu and
// internode_worst.cu, in the same order, so both backends give the same bits.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "epfabric/common/status_macros.h"
#include "epfabric/kernels/common.h"
#include "epfabric/kernels/host_backend_numeric.h"
#include "epfabric/kernels/internode.h"

namespace epfabric::kernels::host_backend {
namespace {

using internal::AddBf16Row;
using internal::StoreBf16Row;

uint8_t* SlabBase(const InternodePackParams& p, size_t send, size_t recv, size_t slab_bytes, int host) {
  return p.region + (host == p.self_host ? recv : send) + static_cast<size_t>(host) * slab_bytes;
}

}  // namespace

absl::Status InternodePack(const InternodePackParams& p) {
  EPF_RETURN_IF_ERROR(ValidateInternodePack(p));
  const InternodeRdmaLayout& l = p.layout;
  for (int host = 0; host < p.num_hosts; ++host) {
    // The source of the count put to host's gateway.
    std::atomic_ref<int64_t>(reinterpret_cast<int64_t*>(p.region + l.send_count)[host])
        .store(p.send_counts[host], std::memory_order_release);
    uint8_t* x_dst = SlabBase(p, l.send_x, l.recv_x, l.x_slab_bytes, host);
    auto* scales_dst = reinterpret_cast<float*>(SlabBase(p, l.send_scales, l.recv_scales, l.scales_slab_bytes, host));
    auto* idx_dst =
        reinterpret_cast<int64_t*>(SlabBase(p, l.send_topk_idx, l.recv_topk_idx, l.topk_idx_slab_bytes, host));
    auto* w_dst = reinterpret_cast<float*>(
        SlabBase(p, l.send_topk_weights, l.recv_topk_weights, l.topk_weights_slab_bytes, host));
    const int64_t first_expert = static_cast<int64_t>(host) * p.experts_per_host;
    for (int i = 0; i < p.send_counts[host]; ++i) {
      const size_t t = p.send_tokens[static_cast<size_t>(host) * p.max_rows + i];
      std::memcpy(x_dst + static_cast<size_t>(i) * p.row_bytes, static_cast<const uint8_t*>(p.x) + t * p.row_bytes,
                  p.row_bytes);
      if (p.num_scales > 0) {
        std::memcpy(scales_dst + static_cast<size_t>(i) * p.num_scales, p.x_scales + t * p.num_scales,
                    sizeof(float) * p.num_scales);
      }
      for (int k = 0; k < p.num_topk; ++k) {
        const int64_t e = p.topk_idx[t * p.num_topk + k];
        const bool here = e >= first_expert && e < first_expert + p.experts_per_host;
        idx_dst[static_cast<size_t>(i) * p.num_topk + k] = here ? e - first_expert : -1;
        if (p.topk_weights != nullptr)
          w_dst[static_cast<size_t>(i) * p.num_topk + k] = p.topk_weights[t * p.num_topk + k];
      }
    }
  }
  return absl::OkStatus();
}

absl::Status InternodeReduce(const InternodeReduceParams& p) {
  EPF_RETURN_IF_ERROR(ValidateInternodeReduce(p));
  const InternodeRdmaLayout& l = p.layout;
  const auto* bias_0 = static_cast<const uint16_t*>(p.bias_0);
  const auto* bias_1 = static_cast<const uint16_t*>(p.bias_1);
  auto* out = static_cast<uint16_t*>(p.combined_x);
  std::vector<float> acc(p.hidden);
  for (int t = 0; t < p.num_tokens; ++t) {
    const int32_t* slots = p.send_slot + static_cast<size_t>(t) * p.num_hosts;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int host = 0; host < p.num_hosts; ++host) {
      if (slots[host] < 0) continue;
      const auto* row = reinterpret_cast<const uint16_t*>(p.region + l.combine_recv_x +
                                                          static_cast<size_t>(host) * l.combine_x_slab_bytes) +
                        static_cast<size_t>(slots[host]) * p.hidden;
      AddBf16Row(acc.data(), row, p.hidden);
    }
    const size_t base = static_cast<size_t>(t) * p.hidden;
    if (bias_0 != nullptr) AddBf16Row(acc.data(), bias_0 + base, p.hidden);
    if (bias_1 != nullptr) AddBf16Row(acc.data(), bias_1 + base, p.hidden);
    StoreBf16Row(out + base, acc.data(), p.hidden);
    for (int k = 0; k < p.num_topk; ++k) {
      float w = 0.0f;
      for (int host = 0; host < p.num_hosts; ++host) {
        if (slots[host] < 0) continue;
        w += reinterpret_cast<const float*>(
            p.region + l.combine_recv_weights +
            static_cast<size_t>(host) *
                l.combine_weights_slab_bytes)[static_cast<size_t>(slots[host]) * p.num_topk + k];
      }
      p.combined_topk_weights[static_cast<size_t>(t) * p.num_topk + k] = w;
    }
  }
  return absl::OkStatus();
}

absl::Status InternodePlan(const InternodePlanParams& p) {
  EPF_RETURN_IF_ERROR(ValidateInternodePlan(p));
  const int R = p.num_hosts * p.ranks_per_host;
  for (int host = 0; host < p.num_hosts; ++host) {
    int32_t* tokens = p.send_plan + p.num_hosts + static_cast<size_t>(host) * p.max_rows;
    int rows = 0;
    for (int t = 0; t < p.num_tokens; ++t) {
      bool goes = p.num_hosts == 1;  // with one host every token goes to it
      for (int l = 0; l < p.ranks_per_host && !goes; ++l) {
        goes = p.is_token_in_rank[static_cast<size_t>(t) * R + host * p.ranks_per_host + l];
      }
      p.send_slot[static_cast<size_t>(t) * p.num_hosts + host] = goes ? rows : -1;
      if (goes) tokens[rows++] = t;
    }
    p.send_plan[host] = rows;
  }
  return absl::OkStatus();
}

absl::Status InternodeGather(const InternodeGatherParams& p) {
  EPF_RETURN_IF_ERROR(ValidateInternodeGather(p));
  const InternodeRdmaLayout& l = p.layout;
  const int local = p.rank % p.ranks_per_host;
  // Every count first: a bad one fails the call before anything is copied.
  for (int host = 0; host < p.num_hosts; ++host) {
    int64_t n = p.send_counts[host];
    if (host != p.self_host) {
      n = std::atomic_ref<const int64_t>(reinterpret_cast<const int64_t*>(p.region + l.dispatch_count)[host])
              .load(std::memory_order_acquire);
      const int peer = host * p.ranks_per_host + local;
      if (n < 0 || n > p.max_rows) {
        return KernelStatusToStatus(
            BadPeerDataRecord(PeerDataField::kInternodeRowCount, p.rank, peer, host, n, 0, p.max_rows));
      }
      if (p.expected_counts != nullptr && n != p.expected_counts[host]) {
        return KernelStatusToStatus(BadPeerDataRecord(PeerDataField::kInternodeCachedRowCount, p.rank, peer, host, n,
                                                      p.expected_counts[host], p.expected_counts[host]));
      }
    }
    p.recv_counts[host] = static_cast<int32_t>(std::clamp<int64_t>(n, 0, p.max_rows));
  }
  for (int host = 0; host < p.num_hosts; ++host) {
    const int n = p.recv_counts[host];
    const uint8_t* x_src = p.region + l.recv_x + static_cast<size_t>(host) * l.x_slab_bytes;
    const auto* scales_src =
        reinterpret_cast<const uint32_t*>(p.region + l.recv_scales + static_cast<size_t>(host) * l.scales_slab_bytes);
    const auto* idx_src = reinterpret_cast<const int64_t*>(p.region + l.recv_topk_idx +
                                                           static_cast<size_t>(host) * l.topk_idx_slab_bytes);
    const auto* w_src = reinterpret_cast<const float*>(p.region + l.recv_topk_weights +
                                                       static_cast<size_t>(host) * l.topk_weights_slab_bytes);
    const size_t first = static_cast<size_t>(host) * p.max_rows;
    auto* x = static_cast<uint8_t*>(p.x) + first * p.row_bytes;
    std::memcpy(x, x_src, static_cast<size_t>(n) * p.row_bytes);
    std::memset(x + static_cast<size_t>(n) * p.row_bytes, 0, static_cast<size_t>(p.max_rows - n) * p.row_bytes);
    if (p.num_scales > 0) {
      uint32_t* scales = p.x_scales + first * p.num_scales;
      std::memcpy(scales, scales_src, sizeof(uint32_t) * n * p.num_scales);
      std::fill(scales + static_cast<size_t>(n) * p.num_scales, scales + static_cast<size_t>(p.max_rows) * p.num_scales,
                0u);
    }
    if (p.num_topk > 0) {
      int64_t* idx = p.topk_idx + first * p.num_topk;
      std::memcpy(idx, idx_src, sizeof(int64_t) * n * p.num_topk);
      std::fill(idx + static_cast<size_t>(n) * p.num_topk, idx + static_cast<size_t>(p.max_rows) * p.num_topk, -1);
      if (p.topk_weights != nullptr) {
        float* w = p.topk_weights + first * p.num_topk;
        std::memcpy(w, w_src, sizeof(float) * n * p.num_topk);
        std::fill(w + static_cast<size_t>(n) * p.num_topk, w + static_cast<size_t>(p.max_rows) * p.num_topk, 0.0f);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status InternodeScatter(const InternodeScatterParams& p) {
  EPF_RETURN_IF_ERROR(ValidateInternodeScatter(p));
  const InternodeRdmaLayout& l = p.layout;
  const size_t row_bytes = static_cast<size_t>(p.hidden) * 2;
  for (int host = 0; host < p.num_hosts; ++host) {
    const int n = std::clamp(p.recv_counts[host], 0, p.max_rows);
    const bool own = host == p.self_host;
    const size_t first = static_cast<size_t>(host) * p.max_rows;
    std::memcpy(p.region + (own ? l.combine_recv_x : l.combine_send_x) + host * l.combine_x_slab_bytes,
                static_cast<const uint8_t*>(p.x) + first * row_bytes, n * row_bytes);
    if (p.num_topk > 0) {
      std::memcpy(
          p.region + (own ? l.combine_recv_weights : l.combine_send_weights) + host * l.combine_weights_slab_bytes,
          p.topk_weights + first * p.num_topk, sizeof(float) * n * p.num_topk);
    }
  }
  return absl::OkStatus();
}

}  // namespace epfabric::kernels::host_backend
