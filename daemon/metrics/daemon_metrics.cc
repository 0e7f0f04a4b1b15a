#include "metrics/daemon_metrics.h"

#include <google/protobuf/descriptor.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "epfabric/v1/common.pb.h"
#include "epfabric/v1/peer.pb.h"
#include "metrics/datapath_metrics.h"

namespace epfabric::daemon::metrics {
namespace {

constexpr char kAttachMethod[] = "/epfabric.v1.Control/Attach";

// "MEMBER_STATE_UP" -> "up" (the enum's prefix is `prefix`).
std::string EnumLabel(const std::string& name, const std::string& prefix) {
  std::string label = name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
  std::transform(label.begin(), label.end(), label.begin(), [](unsigned char c) { return std::tolower(c); });
  return label;
}

std::string CodeLabel(int code) {
  return code >= 0 && code <= 16 ? absl::StatusCodeToString(static_cast<absl::StatusCode>(code)) : "UNKNOWN";
}

// (service, method) of a gRPC path, or ("unknown", "unknown") when no service linked into this binary defines it.
std::pair<std::string, std::string> ServiceAndMethod(const std::string& full_method) {
  std::vector<std::string> parts = absl::StrSplit(full_method, '/');
  if (parts.size() == 3 && parts[0].empty()) {
    if (parts[1] == "grpc.reflection.v1alpha.ServerReflection" || parts[1] == "grpc.reflection.v1.ServerReflection") {
      if (parts[2] == "ServerReflectionInfo") return {parts[1], parts[2]};
    }
    const google::protobuf::ServiceDescriptor* service =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(parts[1]);
    if (service != nullptr && service->FindMethodByName(parts[2]) != nullptr) return {parts[1], parts[2]};
  }
  return {"unknown", "unknown"};
}

// Times one call from its creation to the status it sends (or its end without one: CANCELLED).
class RpcInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcInterceptor(DaemonMetrics* metrics, const std::string* listener, std::string method)
      : metrics_(metrics), listener_(listener), method_(std::move(method)), start_(absl::Now()) {}
  ~RpcInterceptor() override {
    if (!recorded_)
      metrics_->RecordRpc(*listener_, method_, static_cast<int>(grpc::StatusCode::CANCELLED), absl::Now() - start_);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS) &&
        !recorded_) {
      recorded_ = true;
      metrics_->RecordRpc(*listener_, method_, static_cast<int>(methods->GetSendStatus().error_code()),
                          absl::Now() - start_);
    }
    methods->Proceed();
  }

 private:
  DaemonMetrics* const metrics_;
  const std::string* const listener_;
  const std::string method_;
  const absl::Time start_;
  bool recorded_ = false;
};

class RpcInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  RpcInterceptorFactory(DaemonMetrics* metrics, std::string listener)
      : metrics_(metrics), listener_(std::move(listener)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    return new RpcInterceptor(metrics_, &listener_, info->method() != nullptr ? info->method() : "");
  }

 private:
  DaemonMetrics* const metrics_;
  const std::string listener_;
};

}  // namespace

DaemonMetrics::DaemonMetrics(std::function<DaemonSnapshot()> snapshot) : snapshot_(std::move(snapshot)) {
  // Fixed names: a failure here is a programming error that the unit test catches.
  (void)registry_.AddCounter("epfabric_rpcs_total",
                             "gRPC calls served, by listener (client socket or peer port), service, method and status "
                             "code; errors are the calls whose code is not OK",
                             {"listener", "service", "method", "code"}, &rpcs_);
  (void)registry_.AddHistogram("epfabric_attach_duration_seconds",
                               "Time the daemon took to answer Control.Attach, by status code", {"code"},
                               AttachLatencyBuckets(), &attach_seconds_);
  (void)registry_.AddCounter("epfabric_member_down_events_total",
                             "Times this daemon's view saw a rank go from UP to DOWN (missed heartbeats, a dead "
                             "process, or the coordinator going silent)",
                             {"rank"}, &member_down_);
  registry_.AddCollector([this] { return CollectState(); });
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> DaemonMetrics::InterceptorFactory(
    const std::string& listener) {
  return std::make_unique<RpcInterceptorFactory>(this, listener);
}

void DaemonMetrics::RecordRpc(const std::string& listener, const std::string& full_method, int code,
                              absl::Duration elapsed) {
  const auto [service, method] = ServiceAndMethod(full_method);
  rpcs_.Increment({listener, service, method, CodeLabel(code)});
  if (full_method == kAttachMethod) attach_seconds_.Observe({CodeLabel(code)}, absl::ToDoubleSeconds(elapsed));
}

void DaemonMetrics::OnMembership(const v1::Membership& view) {
  std::vector<int> down;
  {
    absl::MutexLock lock(&mutex_);
    last_states_.resize(std::max<size_t>(last_states_.size(), view.members_size()), v1::MEMBER_STATE_UNSPECIFIED);
    for (const v1::MemberInfo& member : view.members()) {
      const int rank = member.rank();
      if (rank < 0 || rank >= static_cast<int>(last_states_.size())) continue;
      if (last_states_[rank] == v1::MEMBER_STATE_UP && member.state() == v1::MEMBER_STATE_DOWN) down.push_back(rank);
      last_states_[rank] = member.state();
    }
  }
  for (int rank : down) member_down_.Increment({absl::StrCat(rank)});
}

std::vector<Family> DaemonMetrics::CollectState() const {
  const DaemonSnapshot s = snapshot_();
  std::vector<Family> out;
  const v1::DaemonInfo& info = s.info;
  out.push_back(FamilyBuilder("epfabric_daemon_info", "This daemon: version, backend, fabric and rank (always 1)")
                    .Add({{"version", info.version()},
                          {"backend", EnumLabel(v1::Backend_Name(info.backend()), "BACKEND_")},
                          {"fabric_id", s.fabric.fabric_id()},
                          {"rank", absl::StrCat(info.rank())},
                          {"world_size", absl::StrCat(info.world_size())}},
                         1)
                    .Build());
  out.push_back(FamilyBuilder("epfabric_daemon_start_time_seconds", "Start time of the daemon, Unix seconds")
                    .Add({}, static_cast<double>(info.start_time_unix()))
                    .Build());

  // Fabric.
  const v1::Membership& membership = s.fabric.membership();
  out.push_back(FamilyBuilder("epfabric_fabric_epoch", "Membership epoch in this daemon's view")
                    .Add({}, static_cast<double>(membership.epoch()))
                    .Build());
  out.push_back(
      FamilyBuilder("epfabric_fabric_degraded", "1 when this daemon cannot reach the coordinator or a member is not UP")
          .Add({}, s.fabric.degraded() ? 1 : 0)
          .Build());
  out.push_back(FamilyBuilder("epfabric_coordinator_reachable", "1 while rank 0 answers this daemon")
                    .Add({}, s.coordinator_reachable ? 1 : 0)
                    .Build());
  std::map<std::string, int> members{{"up", 0}, {"down", 0}, {"missing", 0}};
  for (const v1::MemberInfo& member : membership.members()) {
    ++members[EnumLabel(v1::MemberState_Name(member.state()), "MEMBER_STATE_")];
  }
  FamilyBuilder member_family("epfabric_fabric_members", "Ranks of the fabric by state, in this daemon's view");
  for (const auto& [state, count] : members) member_family.Add({{"state", state}}, count);
  out.push_back(std::move(member_family).Build());
  out.push_back(FamilyBuilder("epfabric_heartbeats_missed_total",
                              "Heartbeats that did not arrive in time: on a member, beats to the coordinator that "
                              "failed; on the coordinator, each time a rank was found silent for 1.5 intervals",
                              MetricType::kCounter)
                    .Add({}, static_cast<double>(s.heartbeats_missed))
                    .Build());

  // Groups, regions and leases.
  std::map<std::string, int> group_states{{"creating", 0}, {"ready", 0}, {"degraded", 0}, {"deleting", 0}};
  FamilyBuilder group_state("epfabric_group_state", "Each group this daemon knows, labelled with its state (1)");
  FamilyBuilder region_bytes("epfabric_region_bytes",
                             "Bytes of region memory this daemon holds for a group, by kind (nvl or rdma)");
  FamilyBuilder attached("epfabric_group_attached_ranks", "Group ranks that hold a client lease (whole group)");
  std::map<std::string, int> leases_by_group;
  for (const v1::GroupInfo& group : s.fabric.groups()) {
    const std::string state = EnumLabel(v1::GroupState_Name(group.state()), "GROUP_STATE_");
    ++group_states[state];
    group_state.Add({{"group", group.name()}, {"state", state}}, 1);
    attached.Add({{"group", group.name()}}, group.attached_ranks_size());
    leases_by_group[group.name()] = 0;
    // The coordinator also lists groups it only registers: count memory only where this daemon is a member.
    if (std::find(group.ranks().begin(), group.ranks().end(), info.rank()) == group.ranks().end()) continue;
    region_bytes.Add({{"group", group.name()}, {"kind", "nvl"}}, static_cast<double>(group.num_nvl_bytes()));
    region_bytes.Add({{"group", group.name()}, {"kind", "rdma"}}, static_cast<double>(group.num_rdma_bytes()));
  }
  FamilyBuilder groups("epfabric_groups", "Groups this daemon knows, by state");
  for (const auto& [state, count] : group_states) groups.Add({{"state", state}}, count);
  out.push_back(std::move(groups).Build());
  out.push_back(std::move(group_state).Build());
  out.push_back(std::move(region_bytes).Build());
  out.push_back(std::move(attached).Build());
  for (const v1::ClientInfo& client : s.clients) ++leases_by_group[client.group()];
  FamilyBuilder leases("epfabric_leases", "Live client leases on this daemon, by group");
  for (const auto& [group, count] : leases_by_group) leases.Add({{"group", group}}, count);
  out.push_back(std::move(leases).Build());

  // fd side channel.
  out.push_back(FamilyBuilder("epfabric_fd_channel_refusals_total",
                              "fd side channel refusals: connections closed at accept (connection limits) and "
                              "requests answered with an error (bad token, lease, group)",
                              MetricType::kCounter)
                    .Add({{"what", "connection"}}, static_cast<double>(s.fd_connections_refused))
                    .Add({{"what", "request"}}, static_cast<double>(s.fd_requests_refused))
                    .Build());

  // Transport (docs/internode.md).
  FamilyBuilder commands("epfabric_transport_commands_total",
                         "Transport commands taken off this daemon's rings, by group and outcome: executed, refused "
                         "(failed the daemon's checks), failed (the wire could not deliver), skipped (after the ring's "
                         "first failure)",
                         MetricType::kCounter);
  for (const DaemonSnapshot::TransportGroup& g : s.transport_groups) {
    commands.Add({{"group", g.group}, {"outcome", "executed"}}, static_cast<double>(g.executed));
    commands.Add({{"group", g.group}, {"outcome", "refused"}}, static_cast<double>(g.refused));
    commands.Add({{"group", g.group}, {"outcome", "failed"}}, static_cast<double>(g.failed));
    commands.Add({{"group", g.group}, {"outcome", "skipped"}}, static_cast<double>(g.skipped));
  }
  out.push_back(std::move(commands).Build());
  out.push_back(FamilyBuilder("epfabric_transport_data_refusals_total",
                              "Socket wire data listener: handshakes refused (unknown group, wrong proof), frames "
                              "refused (failed authentication, outside the region, bad sequence; the connection is "
                              "closed), connections over the limit",
                              MetricType::kCounter)
                    .Add({{"what", "handshake"}}, static_cast<double>(s.data_handshakes_refused))
                    .Add({{"what", "frame"}}, static_cast<double>(s.data_frames_refused))
                    .Add({{"what", "connection"}}, static_cast<double>(s.data_connections_refused))
                    .Build());
  out.push_back(FamilyBuilder("epfabric_transport_frames_applied_total",
                              "Socket wire: frames (puts and signals) this daemon received and applied",
                              MetricType::kCounter)
                    .Add({}, static_cast<double>(s.data_frames_applied))
                    .Build());
  for (Family& family : DataPathFamilies(s.datapath_groups, s.expert_series)) out.push_back(std::move(family));
  return out;
}

std::string DaemonMetrics::Render() const { return Exposition(registry_.Collect()); }

std::string SeriesKey(const Sample& sample) {
  std::string key = sample.name;
  if (sample.labels.empty()) return key;
  key += '{';
  for (size_t i = 0; i < sample.labels.size(); ++i) {
    absl::StrAppend(&key, i ? "," : "", sample.labels[i].first, "=\"", EscapeLabelValue(sample.labels[i].second), "\"");
  }
  return key + "}";
}

v1::Stats DaemonMetrics::Stats(const v1::GetStatsRequest& request, int64_t uptime_seconds) const {
  v1::Stats stats;
  stats.set_uptime_seconds(uptime_seconds);
  for (const Family& family : registry_.Collect()) {
    for (const Sample& sample : family.samples) {
      if (!request.group().empty()) {
        const bool match = std::any_of(sample.labels.begin(), sample.labels.end(), [&](const auto& label) {
          return label.first == "group" && label.second == request.group();
        });
        if (!match) continue;
      }
      v1::MetricSample* out = stats.add_samples();
      out->set_name(sample.name);
      for (const auto& [name, value] : sample.labels) (*out->mutable_labels())[name] = value;
      out->set_value(sample.value);
      out->set_type(MetricTypeName(family.type));
      (*stats.mutable_counters())[SeriesKey(sample)] = sample.value > 0 ? static_cast<uint64_t>(sample.value) : 0;
    }
  }
  return stats;
}

}  // namespace epfabric::daemon::metrics
