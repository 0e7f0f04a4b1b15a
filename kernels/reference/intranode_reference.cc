#include "epfabric/kernels/reference/intranode_reference.h"

#include <cstring>

namespace epfabric::kernels::reference {

uint16_t FloatToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float Bf16ToFloat(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

int ChannelTokenBegin(int num_tokens, int num_channels, int channel) {
  return static_cast<int>(static_cast<int64_t>(num_tokens) * channel / num_channels);
}

Layout ComputeLayout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks) {
  Layout l;
  const int num_rdma_ranks = (num_ranks + 7) / 8;
  l.num_tokens_per_rank.assign(num_ranks, 0);
  l.num_tokens_per_rdma_rank.assign(num_rdma_ranks, 0);
  l.num_tokens_per_expert.assign(num_experts, 0);
  l.is_token_in_rank.assign(static_cast<size_t>(num_tokens) * num_ranks, 0);
  const int experts_per_rank = num_experts / num_ranks;
  for (int t = 0; t < num_tokens; ++t) {
    std::vector<bool> in_rank(num_ranks, false);
    for (int k = 0; k < num_topk; ++k) {
      const int64_t e = topk_idx[static_cast<size_t>(t) * num_topk + k];
      if (e < -1 || e >= num_experts) {
        ++l.num_invalid_topk;
        continue;
      }
      if (e < 0) continue;
      ++l.num_tokens_per_expert[e];
      in_rank[e / experts_per_rank] = true;
    }
    std::vector<bool> in_rdma(num_rdma_ranks, false);
    for (int r = 0; r < num_ranks; ++r) {
      if (!in_rank[r]) continue;
      l.is_token_in_rank[static_cast<size_t>(t) * num_ranks + r] = 1;
      ++l.num_tokens_per_rank[r];
      in_rdma[r / 8] = true;
    }
    for (int rr = 0; rr < num_rdma_ranks; ++rr) l.num_tokens_per_rdma_rank[rr] += in_rdma[rr] ? 1 : 0;
  }
  return l;
}

std::vector<RankOutput> Dispatch(const std::vector<RankInput>& inputs, const DispatchConfig& c) {
  const int R = c.num_ranks;
  const int experts_per_rank = c.num_experts / R;
  std::vector<RankOutput> out(R);
  // Layout and, per source, the slot of each token among the tokens it sends to each destination.
  for (int s = 0; s < R; ++s) {
    const RankInput& in = inputs[s];
    out[s].layout = ComputeLayout(in.topk_idx.data(), in.num_tokens, in.routing_topk, c.num_experts, R);
    out[s].send_slot.assign(static_cast<size_t>(in.num_tokens) * R, -1);
    out[s].recv_channel_prefix.assign(static_cast<size_t>(R) * c.num_channels, 0);
    std::vector<int> next(R, 0);
    for (int t = 0; t < in.num_tokens; ++t) {
      for (int d = 0; d < R; ++d) {
        if (out[s].layout.is_token_in_rank[static_cast<size_t>(t) * R + d]) {
          out[s].send_slot[static_cast<size_t>(t) * R + d] = next[d]++;
        }
      }
    }
  }
  // Notify: rank prefix matrix (inclusive over sources) and receive counts.
  std::vector<int32_t> rank_prefix(static_cast<size_t>(R) * R, 0);
  for (int s = 0; s < R; ++s) {
    for (int d = 0; d < R; ++d) {
      rank_prefix[s * R + d] = (s > 0 ? rank_prefix[(s - 1) * R + d] : 0) + out[s].layout.num_tokens_per_rank[d];
    }
  }
  for (int d = 0; d < R; ++d) {
    RankOutput& o = out[d];
    o.rank_prefix_matrix = rank_prefix;
    o.num_recv_tokens = rank_prefix[(R - 1) * R + d];
    o.num_recv_tokens_per_expert.assign(experts_per_rank, 0);
    for (int s = 0; s < R; ++s) {
      for (int e = 0; e < experts_per_rank; ++e) {
        o.num_recv_tokens_per_expert[e] += out[s].layout.num_tokens_per_expert[d * experts_per_rank + e];
      }
    }
    for (int32_t& n : o.num_recv_tokens_per_expert) {
      n = (n + c.expert_alignment - 1) / c.expert_alignment * c.expert_alignment;
    }
    const size_t n = o.num_recv_tokens;
    o.recv_x.assign(n * c.row_bytes, 0);
    o.recv_x_scales.assign(n * c.num_scales, 0.0f);
    o.recv_topk_idx.assign(n * c.num_topk, 0);
    o.recv_topk_weights.assign(c.has_weights ? n * c.num_topk : 0, 0.0f);
    o.recv_src_idx.assign(n, 0);
    o.recv_src_rank.assign(n, 0);
  }
  // Dispatch: received order is by source rank, then source token index.
  for (int d = 0; d < R; ++d) {
    RankOutput& o = out[d];
    size_t row = 0;
    for (int s = 0; s < R; ++s) {
      const RankInput& in = inputs[s];
      for (int channel = 0; channel < c.num_channels; ++channel) {
        // First slot of the channel = tokens of earlier channels sent to d.
        const int begin_token = ChannelTokenBegin(in.num_tokens, c.num_channels, channel);
        int first_slot = 0;
        for (int t = 0; t < begin_token; ++t)
          first_slot += out[s].layout.is_token_in_rank[static_cast<size_t>(t) * R + d];
        o.recv_channel_prefix[s * c.num_channels + channel] = first_slot;
      }
      for (int t = 0; t < in.num_tokens; ++t) {
        if (!out[s].layout.is_token_in_rank[static_cast<size_t>(t) * R + d]) continue;
        std::memcpy(o.recv_x.data() + row * c.row_bytes, in.x.data() + static_cast<size_t>(t) * c.row_bytes,
                    c.row_bytes);
        for (int i = 0; i < c.num_scales; ++i) {
          o.recv_x_scales[row * c.num_scales + i] = in.x_scales[static_cast<size_t>(t) * c.num_scales + i];
        }
        for (int k = 0; k < c.num_topk; ++k) {
          const int64_t e = in.topk_idx[static_cast<size_t>(t) * c.num_topk + k];
          const bool here =
              e >= static_cast<int64_t>(d) * experts_per_rank && e < static_cast<int64_t>(d + 1) * experts_per_rank;
          o.recv_topk_idx[row * c.num_topk + k] = here ? e - static_cast<int64_t>(d) * experts_per_rank : -1;
          if (c.has_weights) {
            o.recv_topk_weights[row * c.num_topk + k] =
                here ? in.topk_weights[static_cast<size_t>(t) * c.num_topk + k] : 0.0f;
          }
        }
        o.recv_src_idx[row] = t;
        o.recv_src_rank[row] = s;
        ++row;
      }
    }
  }
  return out;
}

std::vector<CombineOutput> Combine(const std::vector<RankOutput>& dispatched, const std::vector<CombineInput>& inputs,
                                   int hidden, int num_topk) {
  const int R = static_cast<int>(dispatched.size());
  std::vector<CombineOutput> out(R);
  for (int s = 0; s < R; ++s) {
    const RankOutput& src = dispatched[s];
    const int num_tokens = static_cast<int>(src.send_slot.size() / R);
    CombineOutput& o = out[s];
    o.combined_x.assign(static_cast<size_t>(num_tokens) * hidden, 0);
    o.combined_x_float.assign(static_cast<size_t>(num_tokens) * hidden, 0.0f);
    o.combined_topk_weights.assign(static_cast<size_t>(num_tokens) * num_topk, 0.0f);
    const bool has_weights = num_topk > 0;
    for (int t = 0; t < num_tokens; ++t) {
      std::vector<float> acc(hidden, 0.0f);
      std::vector<float> w(num_topk, 0.0f);
      for (int d = 0; d < R; ++d) {
        const int slot = src.send_slot[static_cast<size_t>(t) * R + d];
        if (slot < 0) continue;
        const size_t row = (s > 0 ? dispatched[d].rank_prefix_matrix[(s - 1) * R + d] : 0) + slot;
        const uint16_t* x = inputs[d].x.data() + row * hidden;
        for (int i = 0; i < hidden; ++i) acc[i] += Bf16ToFloat(x[i]);
        if (has_weights) {
          for (int k = 0; k < num_topk; ++k) w[k] += inputs[d].topk_weights[row * num_topk + k];
        }
      }
      const CombineInput& own = inputs[s];
      for (int i = 0; i < hidden; ++i) {
        float v = acc[i];
        if (!own.bias_0.empty()) v += Bf16ToFloat(own.bias_0[static_cast<size_t>(t) * hidden + i]);
        if (!own.bias_1.empty()) v += Bf16ToFloat(own.bias_1[static_cast<size_t>(t) * hidden + i]);
        o.combined_x_float[static_cast<size_t>(t) * hidden + i] = v;
        o.combined_x[static_cast<size_t>(t) * hidden + i] = FloatToBf16(v);
      }
      for (int k = 0; k < num_topk; ++k) o.combined_topk_weights[static_cast<size_t>(t) * num_topk + k] = w[k];
    }
  }
  return out;
}

}  // namespace epfabric::kernels::reference
