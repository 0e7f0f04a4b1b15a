// The internode normal mode's two data steps on the CPU (internode.h): the same loops as kernels/cuda/internode.cu,
// in the same order, so both backends give the same bits.
#include <algorithm>
#include <cstring>
#include <vector>

#include "epfabric/common/status_macros.h"
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

}  // namespace epfabric::kernels::host_backend
