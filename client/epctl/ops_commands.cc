// epctl's read-only verbs over groups, leases and counters: groups, leases, stats.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <map>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "epctl/commands.h"
#include "epfabric/v1/control.grpc.pb.h"
#include "epfabric/v1/ops.grpc.pb.h"

namespace epfabric::epctl {
namespace {

std::string ShortEnum(const std::string& name) { return name.substr(name.rfind('_') + 1); }

std::string UtcTime(int64_t unix_seconds) {
  const std::time_t t = unix_seconds;
  std::tm tm{};
  gmtime_r(&t, &tm);
  return absl::StrFormat("%04d-%02d-%02dT%02d:%02d:%02dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour,
                         tm.tm_min, tm.tm_sec);
}

std::string Labels(const v1::MetricSample& sample) {
  std::vector<std::pair<std::string, std::string>> labels(sample.labels().begin(), sample.labels().end());
  std::sort(labels.begin(), labels.end());
  std::vector<std::string> parts;
  for (const auto& [name, value] : labels) parts.push_back(absl::StrCat(name, "=", value));
  return absl::StrJoin(parts, " ");
}

}  // namespace

std::string FormatGroups(const v1::ListGroupsResponse& response) {
  std::string s = absl::StrFormat("%-24s %-9s %-12s %12s %12s %-4s %s\n", "group", "state", "ranks", "nvl_bytes",
                                  "rdma_bytes", "ll", "attached");
  for (const v1::GroupInfo& g : response.groups()) {
    absl::StrAppend(
        &s,
        absl::StrFormat("%-24s %-9s %-12s %12d %12d %-4s [%s]\n", g.name(), ShortEnum(v1::GroupState_Name(g.state())),
                        absl::StrCat("[", absl::StrJoin(g.ranks(), ","), "]"), g.num_nvl_bytes(), g.num_rdma_bytes(),
                        g.low_latency() ? (g.num_normal_bytes() > 0 ? "both" : "yes") : "no",
                        absl::StrJoin(g.attached_ranks(), ",")));
  }
  if (response.groups().empty()) s += "(no groups)\n";
  return s;
}

std::string FormatLeases(const v1::ListClientsResponse& response, int64_t now_unix) {
  std::string s = absl::StrFormat("%-7s %-8s %-24s %-5s %-30s %-10s %s\n", "uid", "pid", "group", "rank", "since",
                                  "expires", "client");
  for (const v1::ClientInfo& c : response.clients()) {
    const int64_t expires_in_ms = c.expires_unix_ms() - now_unix * 1000;
    absl::StrAppend(&s, absl::StrFormat("%-7d %-8d %-24s %-5d %-30s %-10s %s\n", c.uid(), c.pid(), c.group(), c.rank(),
                                        absl::StrCat(UtcTime(c.attached_unix()), " (",
                                                     std::max<int64_t>(0, now_unix - c.attached_unix()), " s ago)"),
                                        absl::StrCat("in ", std::max<int64_t>(0, expires_in_ms / 1000), " s"),
                                        c.client_name().empty() ? "-" : c.client_name()));
  }
  if (response.clients().empty()) s += "(no leases)\n";
  return s;
}

// Expert load as a small table: per group, the tokens this rank's experts received, max/mean over them, and the
// busiest experts when the daemon exports per-expert series (--metrics_expert_series).
std::string FormatExpertLoad(const v1::Stats& stats) {
  struct Load {
    double received = 0, imbalance = 0;
    std::vector<std::pair<double, std::string>> experts;  // (tokens, expert)
  };
  std::map<std::string, Load> loads;
  for (const v1::MetricSample& sample : stats.samples()) {
    auto group = sample.labels().find("group");
    if (group == sample.labels().end()) continue;
    if (sample.name() == "epfabric_expert_tokens_received_rank_total") loads[group->second].received = sample.value();
    if (sample.name() == "epfabric_expert_load_imbalance") loads[group->second].imbalance = sample.value();
    if (sample.name() == "epfabric_expert_tokens_received_total") {
      auto expert = sample.labels().find("expert");
      if (expert != sample.labels().end()) loads[group->second].experts.emplace_back(sample.value(), expert->second);
    }
  }
  if (loads.empty()) return "";
  std::string s = absl::StrFormat("expert load (this rank)\n  %-24s %14s %10s  %s\n", "group", "tokens", "max/mean",
                                  "busiest experts (tokens)");
  for (auto& [group, load] : loads) {
    std::sort(load.experts.rbegin(), load.experts.rend());
    std::vector<std::string> top;
    for (size_t i = 0; i < load.experts.size() && i < 3; ++i) {
      top.push_back(absl::StrFormat("%s (%.0f)", load.experts[i].second, load.experts[i].first));
    }
    absl::StrAppendFormat(&s, "  %-24s %14.0f %10.2f  %s\n", group, load.received, load.imbalance,
                          top.empty() ? "-" : absl::StrJoin(top, ", "));
  }
  return s;
}

std::string FormatStats(const v1::Stats& stats) {
  std::string s = absl::StrCat("uptime ", stats.uptime_seconds(), " s\n");
  // Histograms as count and mean: the buckets are for Prometheus.
  std::vector<std::pair<std::string, std::string>> rows;
  std::map<std::string, double> sums;
  for (const v1::MetricSample& sample : stats.samples()) {
    if (sample.type() == "histogram" && sample.name().size() > 4 &&
        sample.name().compare(sample.name().size() - 4, 4, "_sum") == 0) {
      sums[absl::StrCat(sample.name().substr(0, sample.name().size() - 4), "|", Labels(sample))] = sample.value();
    }
  }
  for (const v1::MetricSample& sample : stats.samples()) {
    const std::string& name = sample.name();
    if (sample.type() == "histogram") {
      if (name.size() < 6 || name.compare(name.size() - 6, 6, "_count") != 0) continue;
      const std::string base = name.substr(0, name.size() - 6);
      const double sum = sums[absl::StrCat(base, "|", Labels(sample))];
      rows.emplace_back(absl::StrCat(base, " ", Labels(sample)),
                        absl::StrFormat("count %.0f  mean %.3f ms", sample.value(),
                                        sample.value() > 0 ? 1000 * sum / sample.value() : 0.0));
      continue;
    }
    rows.emplace_back(absl::StrCat(name, " ", Labels(sample)), absl::StrFormat("%.17g", sample.value()));
  }
  size_t width = 0;
  for (const auto& row : rows) width = std::max(width, row.first.size());
  for (const auto& [key, value] : rows)
    absl::StrAppend(&s, "  ", key, std::string(width - key.size() + 2, ' '), value, "\n");
  absl::StrAppend(&s, FormatExpertLoad(stats));
  return s;
}

int RunGroups(const GlobalOptions& options, const std::shared_ptr<grpc::Channel>& channel, std::ostream& out,
              std::ostream& err) {
  if (!options.address.empty()) {
    err << ControlOnlyOnSocket("groups") << "\n";
    return 2;
  }
  auto stub = v1::Control::NewStub(channel);
  grpc::ClientContext context;
  SetDeadline(context, options);
  v1::ListGroupsResponse response;
  const grpc::Status status = stub->ListGroups(&context, v1::ListGroupsRequest(), &response);
  if (!status.ok()) {
    err << RpcError("ListGroups", options, status) << "\n";
    return 1;
  }
  out << (options.json ? ToJson(response) : FormatGroups(response));
  return 0;
}

int RunLeases(const GlobalOptions& options, const std::shared_ptr<grpc::Channel>& channel, std::ostream& out,
              std::ostream& err) {
  auto stub = v1::Ops::NewStub(channel);
  grpc::ClientContext context;
  SetDeadline(context, options);
  v1::ListClientsResponse response;
  const grpc::Status status = stub->ListClients(&context, v1::ListClientsRequest(), &response);
  if (!status.ok()) {
    err << RpcError("ListClients", options, status) << "\n";
    return 1;
  }
  out << (options.json ? ToJson(response, OmittedFor("leases")) : FormatLeases(response, std::time(nullptr)));
  return 0;
}

int RunStats(const GlobalOptions& options, const std::shared_ptr<grpc::Channel>& channel, std::ostream& out,
             std::ostream& err) {
  if (options.watch && options.interval_ms <= 0) {
    err << "epctl: --interval_ms: " << options.interval_ms << " is not positive\n";
    return 2;
  }
  auto stub = v1::Ops::NewStub(channel);
  v1::GetStatsRequest request;
  request.set_group(options.group);
  for (int round = 0;; ++round) {
    grpc::ClientContext context;
    SetDeadline(context, options);
    v1::Stats stats;
    const grpc::Status status = stub->GetStats(&context, request, &stats);
    if (!status.ok()) {
      err << RpcError("GetStats", options, status) << "\n";
      return 1;
    }
    if (options.json) {
      out << ToJson(stats);
    } else {
      if (options.watch) out << "--- " << UtcTime(std::time(nullptr)) << "\n";
      out << FormatStats(stats);
    }
    out.flush();
    if (!options.watch || (options.count > 0 && round + 1 >= options.count)) return 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(options.interval_ms));
  }
}

}  // namespace epfabric::epctl
