// Host reference of the internode normal mode (groups of H hosts x L ranks, rank = host * L + local index): what
// every rank receives and what combine returns, built from the intranode reference the way the product composes the
// intranode stage (docs/internode-dispatch.md):
//   - the tokens rank (h', g) sends towards host h (those with an expert on a rank of h; with one host: all of them)
//     form, in token order after those of hosts 0..h'-1, the input of "gateway" rank (h, g), with top-k entries
//     renumbered to host h's experts (-1 for experts elsewhere);
//   - each host runs the intranode reference over its gateways' inputs;
//   - combine: the intranode reference combine within each host (no biases) gives each gateway token's BF16 partial
//     sum; the source sums its tokens' partials over hosts 0..H-1 in float, adds bias_0 and bias_1, rounds to BF16.
//     With one host the intranode combine takes the biases and is the whole combine, as intranode.
#pragma once

#include <vector>

#include "epfabric/kernels/reference/intranode_reference.h"

namespace epfabric::kernels::reference {

struct InternodeDispatched {
  int num_hosts = 1;
  std::vector<RankOutput> outputs;  // per rank: the global layout and what the rank received (host-local experts)
  // Per gateway rank: for each of its gateway tokens, the source host and the token index there.
  std::vector<std::vector<int>> gateway_src_host, gateway_src_token;
  std::vector<RankOutput> inner;  // per rank: the intranode stage's output (its handle fields, for combine)
};

// `config` describes the whole group (num_ranks = H * L, num_experts over all ranks).
InternodeDispatched InternodeDispatch(const std::vector<RankInput>& inputs, const DispatchConfig& config,
                                      int num_hosts);

// inputs[r]: rank r's expert outputs in its received order (and optional weights, biases of its own tokens).
std::vector<CombineOutput> InternodeCombine(const InternodeDispatched& dispatched,
                                            const std::vector<CombineInput>& inputs, int hidden, int num_topk);

}  // namespace epfabric::kernels::reference
