#include "metrics/datapath_metrics.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"

namespace epfabric::daemon::metrics {
namespace {

const char* const kOpNames[kernels::kNumDataPathOps] = {"dispatch", "combine", "low_latency_dispatch",
                                                        "low_latency_combine"};

uint64_t LocalExperts(const kernels::DataPathStats& stats) {
  return std::min<uint64_t>(stats.num_local_experts, kernels::kDataPathStatsMaxExperts);
}

// Local expert `e`'s tokens, both modes.
double ExpertTokens(const kernels::DataPathStats& stats, uint64_t e) {
  return static_cast<double>(stats.expert_tokens[e]) + static_cast<double>(stats.ll_expert_tokens[e]);
}

}  // namespace

double LoadImbalance(const kernels::DataPathStats& stats, uint64_t n) {
  n = std::min<uint64_t>(n, kernels::kDataPathStatsMaxExperts);
  if (n == 0) return 0;
  double sum = 0, max = 0;
  for (uint64_t e = 0; e < n; ++e) {
    const double v = ExpertTokens(stats, e);
    sum += v;
    max = std::max(max, v);
  }
  return sum > 0 ? max / (sum / static_cast<double>(n)) : 0;
}

std::vector<Family> DataPathFamilies(const std::vector<groups::GroupDataPathStats>& groups, bool expert_series) {
  FamilyBuilder calls("epfabric_datapath_calls_total",
                      "Data-path calls of this daemon's rank, by group and operation (published by the client)",
                      MetricType::kCounter);
  FamilyBuilder tokens("epfabric_datapath_tokens_total",
                       "Tokens this rank gave to dispatch (sent) and received from normal dispatch (received)",
                       MetricType::kCounter);
  FamilyBuilder bytes("epfabric_datapath_bytes_total",
                      "Bytes of x this rank gave to dispatch (sent) and of recv_x normal dispatch returned (received)",
                      MetricType::kCounter);
  FamilyBuilder failures(
      "epfabric_datapath_failures_total",
      "Data-path calls that failed: timeout (a peer did not answer in time) or error (refused input, "
      "degraded group, ...)",
      MetricType::kCounter);
  FamilyBuilder received("epfabric_expert_tokens_received_rank_total",
                         "Tokens this rank's local experts received (normal: every call; low latency: copied from "
                         "the device every 64 calls)",
                         MetricType::kCounter);
  FamilyBuilder imbalance("epfabric_expert_load_imbalance",
                          "max / mean of the tokens received per local expert of this rank (1 = balanced, 0 = none)");
  FamilyBuilder masked("epfabric_datapath_masked_ranks",
                       "Low latency: ranks this rank's Buffer has masked (by the caller, after a timed-out wait, or a "
                       "lost member), as last published (every 64 dispatches and at Check)");
  FamilyBuilder experts("epfabric_expert_tokens_received_total",
                        "Tokens received per expert (global expert index), with --metrics_expert_series",
                        MetricType::kCounter);
  for (const groups::GroupDataPathStats& g : groups) {
    const kernels::DataPathStats& s = g.stats;
    for (int op = 0; op < kernels::kNumDataPathOps; ++op) {
      calls.Add({{"group", g.group}, {"op", kOpNames[op]}}, static_cast<double>(s.calls[op]));
    }
    tokens.Add({{"group", g.group}, {"direction", "sent"}}, static_cast<double>(s.tokens_sent));
    tokens.Add({{"group", g.group}, {"direction", "received"}}, static_cast<double>(s.tokens_received));
    bytes.Add({{"group", g.group}, {"direction", "sent"}}, static_cast<double>(s.bytes_sent));
    bytes.Add({{"group", g.group}, {"direction", "received"}}, static_cast<double>(s.bytes_received));
    failures.Add({{"group", g.group}, {"kind", "timeout"}}, static_cast<double>(s.timeouts));
    failures.Add({{"group", g.group}, {"kind", "error"}}, static_cast<double>(s.errors));
    int masked_ranks = 0;
    const uint64_t ranks = std::min<uint64_t>(s.num_ranks, kernels::kDataPathStatsMaxRanks);
    for (uint64_t r = 0; r < ranks; ++r) masked_ranks += s.rank_mask[r] != 0;
    masked.Add({{"group", g.group}}, masked_ranks);
    const uint64_t n = LocalExperts(s);
    double total = 0;
    for (uint64_t e = 0; e < n; ++e) total += ExpertTokens(s, e);
    received.Add({{"group", g.group}}, total);
    imbalance.Add({{"group", g.group}}, LoadImbalance(s, n));
    if (!expert_series) continue;
    for (uint64_t e = 0; e < n; ++e) {
      experts.Add({{"group", g.group}, {"expert", absl::StrCat(static_cast<uint64_t>(g.group_rank) * n + e)}},
                  ExpertTokens(s, e));
    }
  }
  std::vector<Family> out;
  out.push_back(std::move(calls).Build());
  out.push_back(std::move(tokens).Build());
  out.push_back(std::move(bytes).Build());
  out.push_back(std::move(failures).Build());
  out.push_back(std::move(masked).Build());
  out.push_back(std::move(received).Build());
  out.push_back(std::move(imbalance).Build());
  if (expert_series) out.push_back(std::move(experts).Build());
  return out;
}

}  // namespace epfabric::daemon::metrics
