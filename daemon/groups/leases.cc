#include "groups/leases.h"

#include <algorithm>
#include <memory>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "epfabric/common/status_macros.h"
#include "groups/group_checks.h"
#include "logging.h"

namespace epfabric::daemon::groups {
namespace {

absl::Status NotLive(const std::string& lease_id) {
  return absl::NotFoundError(absl::StrCat("lease_id: '", lease_id, "' is not a live lease"));
}

}  // namespace

Leases::Lease* Leases::FindLiveLocked(const std::string& lease_id) {
  auto it = leases_.find(lease_id);
  return it != leases_.end() && !it->second.ending ? &it->second : nullptr;
}

const Leases::Lease* Leases::FindLiveLocked(const std::string& lease_id) const {
  auto it = leases_.find(lease_id);
  return it != leases_.end() && !it->second.ending ? &it->second : nullptr;
}

bool Leases::EndingLocked(const std::string& group, int rank) const {
  return std::any_of(leases_.begin(), leases_.end(), [&](const auto& entry) {
    const Lease& lease = entry.second;
    return lease.ending && lease.info.group() == group && (rank < 0 || lease.info.rank() == rank);
  });
}

absl::StatusOr<v1::AttachResponse> Leases::Attach(const v1::AttachRequest& request, const ClientIdentity& client) {
  absl::StatusOr<v1::AttachResponse> response = StartLease(request, client);
  const absl::Time give_up = absl::Now() + limits_.degraded_attach_wait;
  while (absl::IsUnavailable(response.status()) && local_->State(request.group()) == v1::GROUP_STATE_DEGRADED &&
         absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(20));
    response = StartLease(request, client);
  }
  if (response.ok() && observer_) observer_(request.group(), request.rank(), /*attached=*/true);
  return response;
}

absl::StatusOr<v1::AttachResponse> Leases::StartLease(const v1::AttachRequest& request, const ClientIdentity& client) {
  if (request.group().empty()) return absl::InvalidArgumentError("group: empty");
  if (request.token().empty()) return absl::InvalidArgumentError("token: empty");
  if (request.client_name().size() > 128) return absl::InvalidArgumentError("client_name: longer than 128 bytes");
  absl::Duration ttl = request.lease_ttl_ms() == 0 ? limits_.default_ttl : absl::Milliseconds(request.lease_ttl_ms());
  ttl = std::clamp(ttl, limits_.min_ttl, limits_.max_ttl);
  const v1::Membership view = membership_->View();

  absl::MutexLock lock(&mutex_);
  // The rank's previous lease is still being cleaned: its regions are not zero yet.
  while (EndingLocked(request.group(), request.rank())) ended_.Wait(&mutex_);
  EPF_ASSIGN_OR_RETURN(v1::AttachResponse response, local_->DescribeForAttach(request, view));
  for (const auto& [id, lease] : leases_) {
    if (lease.info.group() == request.group() && lease.info.rank() == request.rank()) {
      return absl::FailedPreconditionError(absl::StrCat("group '", request.group(), "' rank ", request.rank(),
                                                        " is already attached (pid ", lease.info.pid(), ")"));
    }
  }
  Lease lease;
  lease.ttl = ttl;
  lease.expires = absl::Now() + ttl;
  lease.info.set_lease_id(RandomHex128());
  lease.info.set_group(request.group());
  lease.info.set_rank(request.rank());
  lease.info.set_client_name(request.client_name());
  lease.info.set_pid(client.pid);
  lease.info.set_uid(client.uid);
  lease.info.set_attached_unix(absl::ToUnixSeconds(absl::Now()));
  lease.info.set_expires_unix_ms(absl::ToUnixMillis(lease.expires));
  response.set_lease_id(lease.info.lease_id());
  response.set_lease_ttl_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(ttl)));
  Logger("groups")->info("lease {} on group '{}' rank {} for '{}' (pid {}, uid {})", lease.info.lease_id(),
                         request.group(), request.rank(), request.client_name(), client.pid, client.uid);
  leases_[lease.info.lease_id()] = std::move(lease);
  return response;
}

namespace {

// PERMISSION_DENIED unless `caller` is the process that holds `info` (or an unchecked in-process call).
absl::Status CheckHolder(const v1::ClientInfo& info, const std::optional<ClientIdentity>& caller, const char* what) {
  if (!caller.has_value()) return absl::OkStatus();
  if (caller->pid == info.pid() && caller->uid == info.uid()) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(what, ": lease ", info.lease_id(), " is held by pid ", info.pid(),
                                                  " uid ", info.uid(), "; the caller is pid ", caller->pid, " uid ",
                                                  caller->uid));
}

}  // namespace

absl::Status Leases::Detach(const v1::DetachRequest& request, std::optional<ClientIdentity> caller) {
  {
    absl::MutexLock lock(&mutex_);
    Lease* lease = FindLiveLocked(request.lease_id());
    if (lease == nullptr) return NotLive(request.lease_id());
    EPF_RETURN_IF_ERROR(CheckHolder(lease->info, caller, "Detach"));
  }
  return EndLease(request.lease_id(), "detached");
}

absl::Status Leases::EndLease(const std::string& lease_id, const std::string& reason) {
  std::string group;
  int rank = -1;
  {
    absl::MutexLock lock(&mutex_);
    Lease* lease = FindLiveLocked(lease_id);
    if (lease == nullptr) return NotLive(lease_id);
    lease->ending = true;
    group = lease->info.group();
    rank = lease->info.rank();
  }
  // The other members stop waiting for this rank now; the zeroing follows on the cleaner thread.
  if (observer_) observer_(group, rank, /*attached=*/false);
  FinishEndingLater(lease_id, group, rank, reason);
  return absl::OkStatus();
}

Leases::~Leases() {
  std::thread cleaner;
  {
    absl::MutexLock lock(&cleaner_mutex_);
    cleaner_stopping_ = true;
    cleaner = std::move(cleaner_);
  }
  if (cleaner.joinable()) cleaner.join();
}

void Leases::FinishEndingLater(std::string lease_id, std::string group, int rank, std::string why) {
  absl::MutexLock lock(&cleaner_mutex_);
  cleaner_queue_.push_back({std::move(lease_id), std::move(group), rank, std::move(why)});
  if (!cleaner_.joinable() && !cleaner_stopping_) cleaner_ = std::thread([this] { CleanerLoop(); });
}

void Leases::CleanerLoop() {
  while (true) {
    PendingEnding next;
    {
      absl::MutexLock lock(&cleaner_mutex_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(cleaner_mutex_) {
        return cleaner_stopping_ || !cleaner_queue_.empty();
      };
      cleaner_mutex_.Await(absl::Condition(&ready));
      // Drains the queue before stopping: an ending lease must not stay `ending` (Attach and ReleaseGroup wait).
      if (cleaner_queue_.empty()) return;
      next = std::move(cleaner_queue_.front());
      cleaner_queue_.pop_front();
    }
    ZeroAndRemove(next.lease_id, next.group, next.rank, next.why);
  }
}

void Leases::ExpireLeases(absl::Time now) {
  struct Expired {
    std::string id, group;
    int rank;
  };
  std::vector<Expired> expired;
  {
    absl::MutexLock lock(&mutex_);
    for (auto& [id, lease] : leases_) {
      if (lease.ending || lease.expires >= now) continue;
      lease.ending = true;
      expired.push_back({id, lease.info.group(), lease.info.rank()});
    }
  }
  for (const Expired& e : expired) FinishEnding(e.id, e.group, e.rank, "expired");
}

void Leases::FinishEnding(const std::string& lease_id, const std::string& group, int rank, const std::string& why) {
  // First, so that the survivors' waits end while this rank's regions are still being zeroed.
  if (observer_) observer_(group, rank, /*attached=*/false);
  ZeroAndRemove(lease_id, group, rank, why);
}

void Leases::ZeroAndRemove(const std::string& lease_id, const std::string& group, int rank, const std::string& why) {
  {
    // A whole region is zeroed (cudaMemsetAsync + synchronise, or a memset of shared memory): no lock is held. The
    // references are dropped before the lease goes, so that ReleaseGroup (which waits for it) frees the memory.
    // The command rings stop first (their issuers see the lease end; what is in flight finishes, bounded), so that
    // nothing writes the regions while they are zeroed; then they start afresh on zeroed memory.
    local_->StopTransport(group);
    const std::vector<std::shared_ptr<memory::Region>> regions = local_->Regions(group);
    for (const std::shared_ptr<memory::Region>& region : regions) {
      if (absl::Status zeroed = region->Zero(0, region->descriptor().size_bytes()); !zeroed.ok()) {
        Logger("groups")->error("cleaning group '{}' after lease {}: {}", group, lease_id, zeroed.ToString());
      }
    }
    local_->ResetTransport(group);
  }
  absl::MutexLock lock(&mutex_);
  auto it = leases_.find(lease_id);
  if (it != leases_.end()) {
    Logger("groups")->info("lease {} on group '{}' rank {} ended ({})", lease_id, group, rank, why);
    leases_.erase(it);
  }
  ended_.SignalAll();
}

absl::StatusOr<v1::ClientInfo> Leases::LeaseInfo(const std::string& lease_id) const {
  absl::MutexLock lock(&mutex_);
  const Lease* lease = FindLiveLocked(lease_id);
  if (lease == nullptr) return NotLive(lease_id);
  return lease->info;
}

absl::StatusOr<v1::KeepAliveResponse> Leases::KeepAlive(const v1::KeepAliveRequest& request,
                                                        std::optional<ClientIdentity> caller) {
  const v1::Membership view = membership_->View();  // before our lock: membership's lock is not nested in it
  const uint64_t epoch = view.epoch();
  absl::MutexLock lock(&mutex_);
  Lease* lease = FindLiveLocked(request.lease_id());
  if (lease == nullptr) return NotLive(request.lease_id());
  EPF_RETURN_IF_ERROR(CheckHolder(lease->info, caller, "KeepAlive"));
  lease->expires = absl::Now() + lease->ttl;
  lease->info.set_expires_unix_ms(absl::ToUnixMillis(lease->expires));
  v1::KeepAliveResponse response;
  response.set_lease_ttl_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(lease->ttl)));
  response.set_group_state(local_->State(lease->info.group()));
  for (int rank : local_->LostRanks(lease->info.group(), view)) response.add_lost_ranks(rank);
  response.set_epoch(epoch);
  return response;
}

std::vector<v1::ClientInfo> Leases::Clients() const {
  std::vector<v1::ClientInfo> clients;
  absl::MutexLock lock(&mutex_);
  for (const auto& [id, lease] : leases_) {
    if (!lease.ending) clients.push_back(lease.info);
  }
  return clients;
}

std::map<std::string, std::vector<int>> Leases::AttachedRanks() const {
  std::map<std::string, std::vector<int>> attached;
  absl::MutexLock lock(&mutex_);
  for (const auto& [id, lease] : leases_) {
    if (!lease.ending) attached[lease.info.group()].push_back(lease.info.rank());
  }
  return attached;
}

std::optional<LocalGroup> Leases::ReleaseGroup(const std::string& name) {
  absl::MutexLock lock(&mutex_);
  while (EndingLocked(name, -1)) ended_.Wait(&mutex_);
  std::erase_if(leases_, [&name](const auto& entry) { return entry.second.info.group() == name; });
  return local_->Remove(name);
}

}  // namespace epfabric::daemon::groups
