// Lease::State, what a Lease holds: the daemon's stub, the Attach answer, the mapped regions and the keep-alive
// thread. Client::Attach (client.cc) makes it; the Lease's methods (lease.cc) use it.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "epfabric/client/client.h"
#include "epfabric/common/fd_passing.h"
#include "epfabric/v1/control.grpc.pb.h"
#include "memory/region_import.h"

namespace epfabric::client {
namespace internal {

// A gRPC deadline `timeout` from now.
std::chrono::system_clock::time_point DeadlineIn(absl::Duration timeout);
// Prefixes a status' message with what was being done; keeps the code.
absl::Status Annotate(const absl::Status& status, const std::string& what);

}  // namespace internal

struct Lease::State {
  std::shared_ptr<v1::Control::Stub> stub;
  std::string socket_path;
  absl::Duration timeout;
  v1::AttachResponse attach;  // regions cleared once mapped; the facts stay
  std::vector<int> nvl_ranks;
  absl::Duration ttl;

  // The connection to this daemon's fd side channel that holds the lease: it closes when this process dies.
  common::UniqueFd side_channel;

  mutable absl::Mutex mutex;
  std::vector<std::optional<memory::MappedRegion>> nvl ABSL_GUARDED_BY(mutex);  // by group rank
  std::vector<v1::RegionDescriptor> nvl_descriptors ABSL_GUARDED_BY(mutex);
  std::optional<memory::MappedRegion> rdma ABSL_GUARDED_BY(mutex);
  std::optional<memory::MappedRegion> commands ABSL_GUARDED_BY(mutex);  // transport rings (groups with an RDMA region)
  std::optional<memory::MappedRegion> stats ABSL_GUARDED_BY(mutex);     // data-path counters page (datapath_stats.h)
  v1::GroupState group_state ABSL_GUARDED_BY(mutex) = v1::GROUP_STATE_UNSPECIFIED;
  std::vector<int> lost_ranks ABSL_GUARDED_BY(mutex);  // DEGRADED: the group ranks lost
  uint64_t epoch ABSL_GUARDED_BY(mutex) = 0;
  absl::Status ended ABSL_GUARDED_BY(mutex);        // not OK once the lease is known to be gone
  absl::Status unreachable ABSL_GUARDED_BY(mutex);  // the last KeepAlive's transport failure
  bool detached ABSL_GUARDED_BY(mutex) = false;
  bool stopping ABSL_GUARDED_BY(mutex) = false;
  std::thread keep_alive;

  void KeepAliveLoop();
  // Whether the daemon closed the side channel (it stopped, or crashed).
  bool SideChannelClosed() const;
};

}  // namespace epfabric::client
