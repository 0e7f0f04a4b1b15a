#include "epfabric/kernels/reference/internode_reference.h"

#include <cstring>

namespace epfabric::kernels::reference {

InternodeDispatched InternodeDispatch(const std::vector<RankInput>& inputs, const DispatchConfig& c, int num_hosts) {
  const int R = c.num_ranks, H = num_hosts, L = R / H;
  const int experts_per_host = c.num_experts / H;
  InternodeDispatched out;
  out.num_hosts = H;
  out.outputs.resize(R);
  out.inner.resize(R);
  out.gateway_src_host.resize(R);
  out.gateway_src_token.resize(R);
  std::vector<Layout> layouts(R);
  for (int r = 0; r < R; ++r) {
    layouts[r] =
        ComputeLayout(inputs[r].topk_idx.data(), inputs[r].num_tokens, inputs[r].routing_topk, c.num_experts, R);
  }
  DispatchConfig inner = c;
  inner.num_ranks = L;
  inner.num_experts = experts_per_host;
  for (int h = 0; h < H; ++h) {
    std::vector<RankInput> gateway(L);
    for (int g = 0; g < L; ++g) {
      const int gw = h * L + g;
      RankInput& in = gateway[g];
      in.routing_topk = inputs[gw].routing_topk;
      for (int src_host = 0; src_host < H; ++src_host) {
        const RankInput& src = inputs[src_host * L + g];
        const Layout& layout = layouts[src_host * L + g];
        for (int t = 0; t < src.num_tokens; ++t) {
          bool goes = H == 1;
          for (int l = 0; l < L && !goes; ++l) goes = layout.is_token_in_rank[static_cast<size_t>(t) * R + h * L + l];
          if (!goes) continue;
          ++in.num_tokens;
          out.gateway_src_host[gw].push_back(src_host);
          out.gateway_src_token[gw].push_back(t);
          in.x.insert(in.x.end(), src.x.begin() + static_cast<size_t>(t) * c.row_bytes,
                      src.x.begin() + static_cast<size_t>(t + 1) * c.row_bytes);
          if (c.num_scales > 0) {
            in.x_scales.insert(in.x_scales.end(), src.x_scales.begin() + static_cast<size_t>(t) * c.num_scales,
                               src.x_scales.begin() + static_cast<size_t>(t + 1) * c.num_scales);
          }
          for (int k = 0; k < src.routing_topk; ++k) {
            const int64_t e = src.topk_idx[static_cast<size_t>(t) * src.routing_topk + k];
            const bool here =
                e >= static_cast<int64_t>(h) * experts_per_host && e < static_cast<int64_t>(h + 1) * experts_per_host;
            in.topk_idx.push_back(here ? e - static_cast<int64_t>(h) * experts_per_host : -1);
            if (!src.topk_weights.empty()) {
              in.topk_weights.push_back(src.topk_weights[static_cast<size_t>(t) * src.routing_topk + k]);
            }
          }
        }
      }
    }
    std::vector<RankOutput> host_out = Dispatch(gateway, inner);
    for (int l = 0; l < L; ++l) {
      out.inner[h * L + l] = host_out[l];
      out.outputs[h * L + l] = host_out[l];
      out.outputs[h * L + l].layout = layouts[h * L + l];
    }
  }
  return out;
}

std::vector<CombineOutput> InternodeCombine(const InternodeDispatched& d, const std::vector<CombineInput>& inputs,
                                            int hidden, int num_topk) {
  const int R = static_cast<int>(d.outputs.size()), H = d.num_hosts, L = R / H;
  // The intranode stage of each host: partial sums per gateway token.
  std::vector<CombineOutput> partial(R);
  for (int h = 0; h < H; ++h) {
    std::vector<RankOutput> stage(d.inner.begin() + h * L, d.inner.begin() + (h + 1) * L);
    std::vector<CombineInput> in(inputs.begin() + h * L, inputs.begin() + (h + 1) * L);
    if (H > 1) {
      for (CombineInput& i : in) i.bias_0.clear(), i.bias_1.clear();
    }
    std::vector<CombineOutput> host_out = Combine(stage, in, hidden, num_topk);
    for (int l = 0; l < L; ++l) partial[h * L + l] = std::move(host_out[l]);
  }
  if (H == 1) return partial;
  std::vector<CombineOutput> out(R);
  for (int s = 0; s < R; ++s) {
    const int src_host = s / L, g = s % L;
    const int num_tokens = static_cast<int>(d.outputs[s].layout.is_token_in_rank.size() / R);
    // Row of each of this rank's tokens at each gateway.
    std::vector<int> row(static_cast<size_t>(num_tokens) * H, -1);
    for (int h = 0; h < H; ++h) {
      const int gw = h * L + g;
      for (size_t i = 0; i < d.gateway_src_host[gw].size(); ++i) {
        if (d.gateway_src_host[gw][i] == src_host) row[static_cast<size_t>(d.gateway_src_token[gw][i]) * H + h] = i;
      }
    }
    CombineOutput& o = out[s];
    o.combined_x.assign(static_cast<size_t>(num_tokens) * hidden, 0);
    o.combined_x_float.assign(static_cast<size_t>(num_tokens) * hidden, 0.0f);
    o.combined_topk_weights.assign(static_cast<size_t>(num_tokens) * num_topk, 0.0f);
    const CombineInput& own = inputs[s];
    for (int t = 0; t < num_tokens; ++t) {
      for (int i = 0; i < hidden; ++i) {
        float v = 0.0f;
        for (int h = 0; h < H; ++h) {
          const int r = row[static_cast<size_t>(t) * H + h];
          if (r >= 0) v += Bf16ToFloat(partial[h * L + g].combined_x[static_cast<size_t>(r) * hidden + i]);
        }
        if (!own.bias_0.empty()) v += Bf16ToFloat(own.bias_0[static_cast<size_t>(t) * hidden + i]);
        if (!own.bias_1.empty()) v += Bf16ToFloat(own.bias_1[static_cast<size_t>(t) * hidden + i]);
        o.combined_x_float[static_cast<size_t>(t) * hidden + i] = v;
        o.combined_x[static_cast<size_t>(t) * hidden + i] = FloatToBf16(v);
      }
      for (int k = 0; k < num_topk; ++k) {
        float w = 0.0f;
        for (int h = 0; h < H; ++h) {
          const int r = row[static_cast<size_t>(t) * H + h];
          if (r >= 0) w += partial[h * L + g].combined_topk_weights[static_cast<size_t>(r) * num_topk + k];
        }
        o.combined_topk_weights[static_cast<size_t>(t) * num_topk + k] = w;
      }
    }
  }
  return out;
}

}  // namespace epfabric::kernels::reference
