// The Lease's methods: keep-alive, Detach, health and the mapped regions (client.h).
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "epfabric/client/client.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/kernels/datapath_stats.h"
#include "epfabric/proto/grpc_status.h"
#include "lease_state.h"

namespace epfabric::client {

using memory::MappedRegion;

namespace internal {

std::chrono::system_clock::time_point DeadlineIn(absl::Duration timeout) {
  return absl::ToChronoTime(absl::Now() + timeout);
}

absl::Status Annotate(const absl::Status& status, const std::string& what) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(what, ": ", status.message()));
}

}  // namespace internal

using internal::Annotate;
using internal::DeadlineIn;

bool Lease::State::SideChannelClosed() const {
  pollfd entry{.fd = side_channel.get(), .events = POLLIN | POLLRDHUP, .revents = 0};
  if (poll(&entry, 1, 0) <= 0) return false;
  if ((entry.revents & (POLLHUP | POLLRDHUP | POLLERR)) != 0) return true;
  char byte;
  return recv(side_channel.get(), &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

void Lease::State::KeepAliveLoop() {
  const absl::Duration period = std::max(ttl / 3, absl::Milliseconds(20));
  absl::MutexLock lock(&mutex);
  while (!mutex.AwaitWithTimeout(absl::Condition(&stopping), period)) {
    mutex.Unlock();
    grpc::ClientContext context;
    context.set_deadline(DeadlineIn(std::min(timeout, period)));
    v1::KeepAliveRequest request;
    request.set_lease_id(attach.lease_id());
    v1::KeepAliveResponse response;
    const grpc::Status status = stub->KeepAlive(&context, request, &response);
    const bool closed = SideChannelClosed();
    mutex.Lock();
    if (status.ok()) {
      group_state = response.group_state();
      epoch = response.epoch();
      lost_ranks.assign(response.lost_ranks().begin(), response.lost_ranks().end());
      unreachable = absl::OkStatus();
    } else if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
      ended = absl::FailedPreconditionError(
          absl::StrCat("lease ", attach.lease_id(), " on group '", attach.group().name(), "' rank ", attach.rank(),
                       " has ended (expired or released by the daemon): ", status.error_message()));
    } else {
      unreachable = absl::UnavailableError(absl::StrCat("KeepAlive to ", socket_path, ": ", status.error_message()));
    }
    if (closed && ended.ok()) {
      ended = absl::FailedPreconditionError(
          absl::StrCat("the daemon at ", socket_path, " closed the lease's side channel (it stopped or restarted)"));
    }
    if (!ended.ok()) return;  // nothing left to keep alive
  }
}

Lease::Lease(std::unique_ptr<State> state) : state_(std::move(state)) {}

Lease::~Lease() { (void)Detach(); }

absl::Status Lease::Detach() {
  State& s = *state_;
  std::vector<MappedRegion> unmapping;
  {
    absl::MutexLock lock(&s.mutex);
    if (s.detached) return absl::OkStatus();
    s.detached = true;
    s.stopping = true;
    for (std::optional<MappedRegion>& region : s.nvl) {
      if (region.has_value()) unmapping.push_back(std::move(*region));
    }
    s.nvl.clear();
    if (s.rdma.has_value()) unmapping.push_back(std::move(*s.rdma));
    s.rdma.reset();
    if (s.commands.has_value()) unmapping.push_back(std::move(*s.commands));
    s.commands.reset();
    if (s.stats.has_value()) unmapping.push_back(std::move(*s.stats));
    s.stats.reset();
  }
  if (s.keep_alive.joinable()) s.keep_alive.join();
  // Unmapped before the daemon zeroes the memory for the next client: nothing here can touch it afterwards.
  absl::Status first;
  for (MappedRegion& region : unmapping) first.Update(region.Unmap());
  grpc::ClientContext context;
  context.set_deadline(DeadlineIn(s.timeout));
  v1::DetachRequest request;
  request.set_lease_id(s.attach.lease_id());
  v1::DetachResponse response;
  const grpc::Status status = s.stub->Detach(&context, request, &response);
  if (!status.ok() && status.error_code() != grpc::StatusCode::NOT_FOUND) {
    first.Update(Annotate(FromGrpcStatus(status), absl::StrCat("Detach on ", s.socket_path)));
  }
  // Closing the side channel would end the lease too; after Detach it only says goodbye.
  s.side_channel.reset();
  return first;
}

absl::Status Lease::Healthy() const {
  // Through state_-> (not a local reference) so that the thread-safety analysis sees the lock that guards the fields.
  absl::MutexLock lock(&state_->mutex);
  const std::string& group = state_->attach.group().name();
  if (state_->detached) {
    return absl::FailedPreconditionError(absl::StrCat("lease ", state_->attach.lease_id(), " was detached"));
  }
  EPF_RETURN_IF_ERROR(state_->ended);
  if (state_->group_state == v1::GROUP_STATE_DEGRADED) {
    return absl::UnavailableError(absl::StrCat("group '", group, "' is DEGRADED (epoch ", state_->epoch,
                                               "): a member is down or restarted; delete and re-create the group"));
  }
  if (state_->group_state != v1::GROUP_STATE_READY) {
    return absl::UnavailableError(absl::StrCat("group '", group, "' is ", v1::GroupState_Name(state_->group_state)));
  }
  return state_->unreachable;
}

const std::string& Lease::lease_id() const { return state_->attach.lease_id(); }
const std::string& Lease::group_name() const { return state_->attach.group().name(); }
const v1::GroupInfo& Lease::group() const { return state_->attach.group(); }
int Lease::rank() const { return state_->attach.rank(); }
int Lease::world_size() const { return state_->attach.world_size(); }
const std::vector<int>& Lease::nvl_ranks() const { return state_->nvl_ranks; }
v1::Backend Lease::backend() const { return state_->attach.backend(); }
v1::Transport Lease::transport() const { return state_->attach.transport(); }
uint64_t Lease::attach_epoch() const { return state_->attach.epoch(); }
absl::Duration Lease::lease_ttl() const { return state_->ttl; }

v1::GroupState Lease::group_state() const {
  absl::MutexLock lock(&state_->mutex);
  return state_->group_state;
}

std::vector<int> Lease::lost_ranks() const {
  absl::MutexLock lock(&state_->mutex);
  return state_->lost_ranks;
}

uint64_t Lease::epoch() const {
  absl::MutexLock lock(&state_->mutex);
  return state_->epoch;
}

void* Lease::region(int group_rank) const {
  absl::MutexLock lock(&state_->mutex);
  if (group_rank < 0 || group_rank >= static_cast<int>(state_->nvl.size()) || !state_->nvl[group_rank].has_value())
    return nullptr;
  return state_->nvl[group_rank]->data();
}

uint64_t Lease::region_bytes(int group_rank) const {
  absl::MutexLock lock(&state_->mutex);
  if (group_rank < 0 || group_rank >= static_cast<int>(state_->nvl.size()) || !state_->nvl[group_rank].has_value())
    return 0;
  return state_->nvl[group_rank]->size();
}

const v1::RegionDescriptor* Lease::region_descriptor(int group_rank) const {
  absl::MutexLock lock(&state_->mutex);
  if (group_rank < 0 || group_rank >= static_cast<int>(state_->nvl.size()) || !state_->nvl[group_rank].has_value())
    return nullptr;
  return &state_->nvl_descriptors[group_rank];
}

void* Lease::rdma_region() const {
  absl::MutexLock lock(&state_->mutex);
  return state_->rdma.has_value() ? state_->rdma->data() : nullptr;
}

void* Lease::commands_region() const {
  absl::MutexLock lock(&state_->mutex);
  return state_->commands.has_value() ? state_->commands->data() : nullptr;
}

void* Lease::commands_region_device() const {
  absl::MutexLock lock(&state_->mutex);
  return state_->commands.has_value() ? state_->commands->device_data() : nullptr;
}

kernels::DataPathStats* Lease::datapath_stats() const {
  absl::MutexLock lock(&state_->mutex);
  if (!state_->stats.has_value() || state_->stats->size() < sizeof(kernels::DataPathStats)) return nullptr;
  return static_cast<kernels::DataPathStats*>(state_->stats->data());
}

void* Lease::datapath_stats_device() const {
  absl::MutexLock lock(&state_->mutex);
  return state_->stats.has_value() ? state_->stats->device_data() : nullptr;
}

const uint64_t* Lease::lost_ranks_words(bool device, bool same_host_order) const {
  absl::MutexLock lock(&state_->mutex);
  if (!state_->stats.has_value() || state_->stats->size() < kernels::kDataPathStatsBytes) return nullptr;
  const auto* page = static_cast<const char*>(device ? state_->stats->device_data() : state_->stats->data());
  if (page == nullptr) return nullptr;
  return reinterpret_cast<const uint64_t*>(
      page + (same_host_order ? kernels::kLostLocalRanksOffset : kernels::kLostRanksOffset));
}

const uint64_t* Lease::lease_serials() const {
  absl::MutexLock lock(&state_->mutex);
  if (!state_->stats.has_value() || state_->stats->size() < kernels::kDataPathStatsBytes) return nullptr;
  const auto* page = static_cast<const char*>(state_->stats->data());
  return page == nullptr ? nullptr : reinterpret_cast<const uint64_t*>(page + kernels::kLeaseSerialsOffset);
}

uint64_t Lease::commands_region_bytes() const {
  absl::MutexLock lock(&state_->mutex);
  return state_->commands.has_value() ? state_->commands->size() : 0;
}

uint64_t Lease::rdma_region_bytes() const {
  absl::MutexLock lock(&state_->mutex);
  return state_->rdma.has_value() ? state_->rdma->size() : 0;
}

}  // namespace epfabric::client
