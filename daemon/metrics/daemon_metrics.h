// epfabricd's metrics (docs/operations.md, "Metrics reference"):
//   - counted where they happen, without touching the owners' code: gRPC calls by listener, service, method and
//     code (a server interceptor), the Attach latency (the same interceptor), ranks seen going down (the daemon's
//     membership listener);
//   - read at scrape time through the owners' accessors (GroupManager::ListGroups/Clients, Membership::View,
//     FdChannel's refusal counts): members by state, epoch, heartbeats missed, groups and their states, leases,
//     region bytes, fd-channel refusals.
// Nothing here carries a token, a lease id, a pid or a uid: the endpoint may be scraped from the pod network.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/support/server_interceptor.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "epfabric/v1/ops.pb.h"
#include "groups/local_groups.h"
#include "metrics/registry.h"

namespace epfabric::daemon::metrics {

// What one scrape reads from the daemon.
struct DaemonSnapshot {
  v1::DaemonInfo info;
  v1::FabricView fabric;  // membership and the groups this daemon knows (with attached ranks)
  bool coordinator_reachable = true;
  std::vector<v1::ClientInfo> clients;  // live leases
  uint64_t heartbeats_missed = 0;
  uint64_t fd_connections_refused = 0;  // fd side channel: connections closed at accept (limits)
  uint64_t fd_requests_refused = 0;     // fd side channel: requests answered with an error
  // Transport: commands of this daemon's rings by group and outcome (executed, refused, failed, skipped), and what
  // the socket wire's data listener refused or applied.
  struct TransportGroup {
    std::string group;
    uint64_t executed = 0, refused = 0, failed = 0, skipped = 0;
  };
  std::vector<TransportGroup> transport_groups;
  // Data path: each group's counters page as its lease holder wrote it (groups whose page was written).
  std::vector<groups::GroupDataPathStats> datapath_groups;
  bool expert_series = false;  // --metrics_expert_series: one series per expert as well
  uint64_t data_handshakes_refused = 0;
  uint64_t data_frames_refused = 0;
  uint64_t data_connections_refused = 0;
  uint64_t data_frames_applied = 0;
};

// Upper bounds (seconds) of the Attach latency histogram: 100 us to 10 s.
inline const std::vector<double>& AttachLatencyBuckets() {
  static const auto* buckets =
      new std::vector<double>{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 10};
  return *buckets;
}

class DaemonMetrics {
 public:
  explicit DaemonMetrics(std::function<DaemonSnapshot()> snapshot);

  // Counts the calls of one gRPC server; `listener` is "client" (the Unix socket) or "peer" (the TCP port).
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> InterceptorFactory(
      const std::string& listener);
  // The daemon's membership listener calls this with every view: counts ranks that went from UP to DOWN.
  void OnMembership(const v1::Membership& view) ABSL_LOCKS_EXCLUDED(mutex_);

  // A finished call of `full_method` ("/epfabric.v1.Control/Attach"); methods that no service of ours defines are
  // counted as service "unknown", so that callers cannot create series at will.
  void RecordRpc(const std::string& listener, const std::string& full_method, int code, absl::Duration elapsed);

  // The Prometheus text exposition of every family.
  std::string Render() const;
  // The same series for Ops.GetStats, only those labelled group=request.group() when it is set.
  v1::Stats Stats(const v1::GetStatsRequest& request, int64_t uptime_seconds) const;

  const Registry& registry() const { return registry_; }

 private:
  std::vector<Family> CollectState() const;

  std::function<DaemonSnapshot()> snapshot_;
  Registry registry_;
  CounterVec rpcs_;
  HistogramVec attach_seconds_;
  CounterVec member_down_;
  absl::Mutex mutex_;
  std::vector<int> last_states_ ABSL_GUARDED_BY(mutex_);  // v1::MemberState by rank
};

// Prometheus series key of a sample: name{a="x",b="y"} (labels in the sample's order).
std::string SeriesKey(const Sample& sample);

}  // namespace epfabric::daemon::metrics
