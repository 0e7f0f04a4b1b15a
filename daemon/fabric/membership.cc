#include "fabric/membership.h"

#include <algorithm>
#include <optional>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/proto/grpc_status.h"
#include "logging.h"

namespace epfabric::daemon::fabric {
namespace {

constexpr absl::Duration kCoordinatorTick = absl::Milliseconds(50);
constexpr absl::Duration kProbeDeadline = absl::Milliseconds(300);
constexpr absl::Duration kPushDeadline = absl::Milliseconds(500);
constexpr absl::Duration kJoinDeadline = absl::Seconds(1);
constexpr absl::Duration kMinBackoff = absl::Milliseconds(50);
constexpr absl::Duration kMaxBackoff = absl::Seconds(1);

void SetDeadline(grpc::ClientContext& context, absl::Duration timeout) {
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

}  // namespace

Membership::Membership(FabricConfig config, v1::MemberInfo self, PeerLinks* links)
    : config_(std::move(config)), incarnation_(self.incarnation()), links_(links), self_(std::move(self)) {
  view_.set_world_size(config_.world_size);
  for (int r = 0; r < config_.world_size; ++r) {
    v1::MemberInfo* member = view_.add_members();
    member->set_rank(r);
    member->set_state(v1::MEMBER_STATE_MISSING);
  }
  *view_.mutable_members(config_.rank) = self_;
  view_.mutable_members(config_.rank)->set_state(v1::MEMBER_STATE_UP);
  last_beat_.assign(config_.world_size, absl::InfinitePast());
  probing_.assign(config_.world_size, false);
  if (is_coordinator()) {
    view_.set_epoch(1);
    coordinator_reachable_ = true;
  }
}

Membership::~Membership() { Stop(); }

void Membership::RefuseUnverified(const absl::Status& why) {
  absl::MutexLock lock(&mutex_);
  const std::string reason(why.message());
  if (coordinator_unverified_ != reason) {
    Logger("fabric")->error("refusing the answer from {} (not the fabric's coordinator): {}", config_.coordinator,
                            reason);
  }
  coordinator_unverified_ = reason;
}

void Membership::SetPeerAddress(const std::string& address) {
  absl::MutexLock lock(&mutex_);
  self_.set_peer_address(address);
  view_.mutable_members(config_.rank)->set_peer_address(address);
}

v1::MemberInfo Membership::self() const {
  absl::MutexLock lock(&mutex_);
  return self_;
}

void Membership::SetChangeListener(ChangeListener listener) { change_listener_ = std::move(listener); }
void Membership::SetJoinObserver(JoinObserver observer) { join_observer_ = std::move(observer); }
void Membership::SetLocalGroups(LocalGroups groups) { local_groups_ = std::move(groups); }

void Membership::Start() {
  {
    absl::MutexLock lock(&mutex_);
    notify_pending_ = true;
  }
  thread_ = std::thread([this] { Run(); });
}

void Membership::Stop() {
  {
    absl::MutexLock lock(&mutex_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
  absl::MutexLock lock(&mutex_);
  mutex_.Await(absl::Condition(
      +[](int* in_flight) { return *in_flight == 0; }, &probes_in_flight_));
}

absl::Status Membership::CheckFabricId(const std::string& fabric_id) const {
  if (fabric_id == config_.fabric_id) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("fabric id mismatch: this daemon belongs to fabric '",
                                                    config_.fabric_id, "', the caller to '", fabric_id, "'"));
}

std::string Membership::CoordinatorAddress() const {
  if (!is_coordinator()) return config_.coordinator;
  absl::MutexLock lock(&mutex_);
  return self_.peer_address();
}

v1::Membership Membership::View() const {
  absl::MutexLock lock(&mutex_);
  return view_;
}

bool Membership::DegradedLocked() const {
  if (!coordinator_reachable_) return true;
  return std::any_of(view_.members().begin(), view_.members().end(),
                     [](const v1::MemberInfo& m) { return m.state() != v1::MEMBER_STATE_UP; });
}

bool Membership::Degraded() const {
  absl::MutexLock lock(&mutex_);
  return DegradedLocked();
}

std::string Membership::JoinRefusal() const {
  absl::MutexLock lock(&mutex_);
  return join_refusal_;
}

std::string Membership::CoordinatorUnverified() const {
  absl::MutexLock lock(&mutex_);
  return coordinator_unverified_;
}

bool Membership::CoordinatorReachable() const {
  absl::MutexLock lock(&mutex_);
  return coordinator_reachable_;
}

void Membership::ChangedLocked() {
  if (is_coordinator()) {
    view_.set_epoch(view_.epoch() + 1);
    push_pending_ = true;
  }
  notify_pending_ = true;
}

void Membership::Notify() {
  absl::MutexLock serial(&notify_mutex_);
  v1::Membership view;
  bool degraded = false;
  {
    absl::MutexLock lock(&mutex_);
    if (!notify_pending_) return;
    notify_pending_ = false;
    view = view_;
    degraded = DegradedLocked();
  }
  if (change_listener_) change_listener_(view, degraded);
}

void Membership::Run() {
  absl::Duration backoff = kMinBackoff;
  while (true) {
    absl::Duration pause = kCoordinatorTick;
    if (is_coordinator()) {
      RunCoordinatorStep();
    } else {
      RunMemberStep();
      absl::MutexLock lock(&mutex_);
      if (joined_) {
        pause = config_.heartbeat_interval;
        backoff = kMinBackoff;
      } else {
        pause = backoff;
        backoff = std::min(backoff * 2, kMaxBackoff);
      }
    }
    Notify();
    absl::MutexLock lock(&mutex_);
    if (mutex_.AwaitWithTimeout(absl::Condition(&stopping_), pause)) return;
  }
}

// ---- coordinator ----

void Membership::RunCoordinatorStep() {
  const absl::Time now = absl::Now();
  std::vector<std::tuple<int, std::string, uint64_t>> probes;
  std::optional<v1::Membership> push;
  {
    absl::MutexLock lock(&mutex_);
    // Resumed after a stop (SIGSTOP, a frozen container) or a long starvation: every member looks silent for as long
    // as this process did not run, and marking them all DOWN at once would flap every group and every health check.
    // The silence is counted from now on instead; a member that really died is found by the next misses (or at once
    // by the probe of a late one).
    const absl::Duration stalled = now - last_step_ - kCoordinatorTick;
    if (last_step_ != absl::InfinitePast() && stalled > config_.heartbeat_interval) {
      Logger("fabric")->warn(
          "this daemon did not run for {} ms (stopped or starved): the members' silence during that time is not "
          "counted",
          absl::ToInt64Milliseconds(stalled));
      for (int r = 1; r < config_.world_size; ++r) {
        if (last_beat_[r] != absl::InfinitePast()) last_beat_[r] += stalled;
      }
    }
    last_step_ = now;
    for (int r = 1; r < config_.world_size; ++r) {
      v1::MemberInfo* member = view_.mutable_members(r);
      if (member->state() != v1::MEMBER_STATE_UP) continue;
      const absl::Duration silent = now - last_beat_[r];
      if (silent > config_.heartbeat_interval * config_.heartbeat_misses) {
        Logger("fabric")->warn("rank {} missed {} heartbeats ({} ms silent): marking it down", r,
                               config_.heartbeat_misses, absl::ToInt64Milliseconds(silent));
        member->set_state(v1::MEMBER_STATE_DOWN);
        ChangedLocked();
      } else if (silent > config_.heartbeat_interval * 1.5 && !probing_[r]) {
        // Late: a dead process refuses connections at once, so ask instead of waiting out all the misses.
        heartbeats_missed_.fetch_add(1, std::memory_order_relaxed);  // metrics hook
        probing_[r] = true;
        ++probes_in_flight_;
        probes.emplace_back(r, member->peer_address(), member->incarnation());
      }
    }
    if (push_pending_) {
      push_pending_ = false;
      push = view_;
    }
  }
  for (const auto& [rank, address, incarnation] : probes) ProbeAsync(rank, address, incarnation);
  if (push.has_value()) PushMembership(*push);
}

void Membership::ProbeAsync(int rank, const std::string& address, uint64_t incarnation) {
  struct Call {
    grpc::ClientContext context;
    v1::HeartbeatRequest request;
    v1::HeartbeatResponse response;
    std::shared_ptr<v1::Peer::Stub> stub;
  };
  auto* call = new Call();
  call->stub = links_->Stub(address);
  SetDeadline(call->context, kProbeDeadline);
  call->request.set_fabric_id(config_.fabric_id);
  call->request.set_rank(config_.rank);
  call->request.set_incarnation(incarnation_);
  const std::string nonce = links_->ExpectProof(call->context);
  call->stub->async()->Heartbeat(
      &call->context, &call->request, &call->response, [this, call, rank, incarnation, nonce](grpc::Status status) {
        // An answer without the fabric's proof comes from a process that is not a member: the rank's daemon is gone.
        const bool proven =
            !status.ok() ||
            links_->VerifyAnswer(call->context, nonce, "/epfabric.v1.Peer/Heartbeat", call->response).ok();
        absl::MutexLock lock(&mutex_);
        probing_[rank] = false;
        const bool refused = status.error_code() == grpc::StatusCode::UNAVAILABLE;
        const bool replaced = status.ok() && (!proven || call->response.incarnation() != incarnation);
        v1::MemberInfo* member = view_.mutable_members(rank);
        if ((refused || replaced) && member->state() == v1::MEMBER_STATE_UP && member->incarnation() == incarnation) {
          Logger("fabric")->warn("rank {} is late and its peer port {}: marking it down", rank,
                                 refused ? "refuses connections" : "has a new daemon");
          member->set_state(v1::MEMBER_STATE_DOWN);
          ChangedLocked();
        }
        --probes_in_flight_;
        delete call;
      });
}

void Membership::PushMembership(const v1::Membership& view) {
  std::vector<std::string> targets;
  for (const v1::MemberInfo& m : view.members()) {
    if (m.rank() != config_.rank && m.state() == v1::MEMBER_STATE_UP) targets.push_back(m.peer_address());
  }
  if (targets.empty()) return;
  struct Call {
    grpc::ClientContext context;
    v1::PublishMembershipResponse response;
    std::shared_ptr<v1::Peer::Stub> stub;
  };
  v1::PublishMembershipRequest request;
  request.set_fabric_id(config_.fabric_id);
  *request.mutable_membership() = view;
  std::vector<std::unique_ptr<Call>> calls;
  absl::BlockingCounter done(static_cast<int>(targets.size()));
  for (const std::string& address : targets) {
    auto call = std::make_unique<Call>();
    call->stub = links_->Stub(address);
    SetDeadline(call->context, kPushDeadline);
    call->stub->async()->PublishMembership(&call->context, &request, &call->response,
                                           [&done](grpc::Status) { done.DecrementCount(); });
    calls.push_back(std::move(call));
  }
  done.Wait();  // a member that misses a push learns the view from its next heartbeat answer
}

absl::StatusOr<v1::JoinResponse> Membership::HandleJoin(const v1::JoinRequest& request) {
  if (!is_coordinator()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", config_.rank, " is not the coordinator; join rank 0 at ", config_.coordinator));
  }
  EPF_RETURN_IF_ERROR(CheckFabricId(request.fabric_id()));
  if (request.world_size() != config_.world_size) {
    return absl::FailedPreconditionError(absl::StrCat("world size mismatch: the fabric has ", config_.world_size,
                                                      " ranks, the joining daemon expects ", request.world_size()));
  }
  const v1::MemberInfo& member = request.member();
  const int rank = member.rank();
  if (rank <= 0 || rank >= config_.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("member.rank: ", rank, " cannot join (ranks 1..", config_.world_size - 1, " join rank 0)"));
  }
  if (member.peer_address().empty() || member.peer_address().size() > 256 ||
      member.peer_address().find_first_of(" /\\") != std::string::npos) {
    return absl::InvalidArgumentError("member.peer_address: not a host:port");
  }
  // Clients connect to a member's fd side channel at this path: an absolute socket path, nothing else.
  if (!member.fd_socket().empty() && (member.fd_socket()[0] != '/' || member.fd_socket().size() > 107 ||
                                      member.fd_socket().find("/../") != std::string::npos)) {
    return absl::InvalidArgumentError("member.fd_socket: not an absolute Unix socket path of at most 107 bytes");
  }
  if (member.host_id().size() > 256 || member.gpu_uuid().size() > 128 || member.version().size() > 64) {
    return absl::InvalidArgumentError("member: host_id, gpu_uuid or version too long");
  }
  if (member.incarnation() == 0) return absl::InvalidArgumentError("member.incarnation: 0 is not an incarnation");
  if (request.known_epoch() > kMaxEpoch) {
    return absl::InvalidArgumentError(absl::StrCat("known_epoch: ", request.known_epoch(), " is above ", kMaxEpoch));
  }

  std::string holder_address;
  uint64_t holder_incarnation = 0;
  {
    absl::MutexLock lock(&mutex_);
    const v1::MemberInfo& current = view_.members(rank);
    // An incarnation is one daemon process: the same incarnation from another address is not that daemon.
    if (current.state() == v1::MEMBER_STATE_UP && current.incarnation() == member.incarnation() &&
        current.peer_address() != member.peer_address()) {
      return absl::AlreadyExistsError(absl::StrCat("rank ", rank, " incarnation ", member.incarnation(),
                                                   " is already joined from ", current.peer_address(), "; a join from ",
                                                   member.peer_address(), " is refused"));
    }
    if (current.state() == v1::MEMBER_STATE_UP && current.incarnation() != member.incarnation()) {
      holder_address = current.peer_address();
      holder_incarnation = current.incarnation();
    }
  }
  if (holder_incarnation != 0) {
    // Someone holds the rank: refuse unless it no longer answers as itself (a restart faster than detection).
    auto stub = links_->Stub(holder_address);
    grpc::ClientContext context;
    SetDeadline(context, kProbeDeadline);
    v1::HeartbeatRequest probe;
    probe.set_fabric_id(config_.fabric_id);
    probe.set_rank(config_.rank);
    probe.set_incarnation(incarnation_);
    const std::string nonce = links_->ExpectProof(context);
    v1::HeartbeatResponse answer;
    const grpc::Status status = stub->Heartbeat(&context, probe, &answer);
    // Only the holder itself (an answer with the fabric's proof) keeps the rank.
    if (status.ok() && answer.incarnation() == holder_incarnation &&
        links_->VerifyAnswer(context, nonce, "/epfabric.v1.Peer/Heartbeat", answer).ok()) {
      return absl::AlreadyExistsError(absl::StrCat("rank ", rank, " is held by a live daemon at ", holder_address,
                                                   " (incarnation ", holder_incarnation, ")"));
    }
  }

  v1::JoinResponse response;
  {
    absl::MutexLock lock(&mutex_);
    view_.set_epoch(std::max(view_.epoch(), request.known_epoch()));
    v1::MemberInfo* current = view_.mutable_members(rank);
    const bool same = current->state() == v1::MEMBER_STATE_UP && current->incarnation() == member.incarnation() &&
                      current->peer_address() == member.peer_address();
    if (!same) {
      const bool rejoin = current->state() != v1::MEMBER_STATE_MISSING;
      *current = member;
      current->set_state(v1::MEMBER_STATE_UP);
      ChangedLocked();
      Logger("fabric")->info("rank {} {} from {} (incarnation {}); epoch {}", rank, rejoin ? "rejoined" : "joined",
                             member.peer_address(), member.incarnation(), view_.epoch());
    }
    last_beat_[rank] = absl::Now();
    *response.mutable_membership() = view_;
  }
  if (join_observer_) join_observer_(request);
  Notify();
  return response;
}

absl::StatusOr<v1::HeartbeatResponse> Membership::HandleHeartbeat(const v1::HeartbeatRequest& request) {
  EPF_RETURN_IF_ERROR(CheckFabricId(request.fabric_id()));
  v1::HeartbeatResponse response;
  response.set_rank(config_.rank);
  response.set_incarnation(incarnation_);
  absl::MutexLock lock(&mutex_);
  response.set_epoch(view_.epoch());
  if (!is_coordinator() || request.rank() == config_.rank) return response;  // a probe: answer who we are
  if (request.rank() < 0 || request.rank() >= config_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank: ", request.rank(), " is outside the fabric"));
  }
  const v1::MemberInfo& member = view_.members(request.rank());
  if (member.state() != v1::MEMBER_STATE_UP || member.incarnation() != request.incarnation()) {
    return absl::NotFoundError(absl::StrCat("rank ", request.rank(), " incarnation ", request.incarnation(),
                                            " is not a live member; join again"));
  }
  last_beat_[request.rank()] = absl::Now();
  if (request.epoch() < view_.epoch()) *response.mutable_membership() = view_;
  return response;
}

bool Membership::ApplyLocked(const v1::Membership& membership) {
  if (membership.epoch() <= view_.epoch() && coordinator_reachable_) return false;
  if (membership.world_size() != config_.world_size || membership.members_size() != config_.world_size) return false;
  if (membership.epoch() > kMaxEpoch) return false;
  for (int r = 0; r < membership.members_size(); ++r) {
    if (membership.members(r).rank() != r) return false;
  }
  view_ = membership;
  const v1::MemberInfo& me = view_.members(config_.rank);
  if (me.state() != v1::MEMBER_STATE_UP || me.incarnation() != incarnation_) {
    joined_ = false;  // the coordinator no longer counts us in: join again
  }
  notify_pending_ = true;
  return true;
}

absl::Status Membership::HandlePublish(const v1::PublishMembershipRequest& request) {
  EPF_RETURN_IF_ERROR(CheckFabricId(request.fabric_id()));
  if (is_coordinator()) {
    return absl::FailedPreconditionError("rank 0 is the coordinator; it publishes membership, it does not take it");
  }
  {
    absl::MutexLock lock(&mutex_);
    if (request.membership().epoch() > kMaxEpoch) {
      return absl::InvalidArgumentError(
          absl::StrCat("membership.epoch: ", request.membership().epoch(), " is above ", kMaxEpoch));
    }
    if (request.membership().epoch() > view_.epoch()) {
      coordinator_reachable_ = true;
      last_contact_ = absl::Now();
      ApplyLocked(request.membership());
    }
  }
  Notify();
  return absl::OkStatus();
}

// ---- member ----

void Membership::RunMemberStep() {
  bool joined = false;
  uint64_t epoch = 0;
  v1::MemberInfo self;
  // A heartbeat answered late is still an answer: it may take until the coordinator would count as silent. On a
  // starved host (many daemons on few cores) every answer can take longer than one interval, and a deadline of one
  // interval would turn a slow coordinator into a lost one.
  absl::Duration heartbeat_deadline = config_.heartbeat_interval;
  {
    absl::MutexLock lock(&mutex_);
    joined = joined_;
    epoch = view_.epoch();
    self = self_;
    heartbeat_deadline = std::max(heartbeat_deadline,
                                  last_contact_ + config_.heartbeat_interval * config_.heartbeat_misses - absl::Now());
  }
  auto stub = links_->Stub(config_.coordinator);
  grpc::Status status;
  if (!joined) {
    v1::JoinRequest request;
    request.set_fabric_id(config_.fabric_id);
    request.set_world_size(config_.world_size);
    *request.mutable_member() = self;
    request.mutable_member()->set_state(v1::MEMBER_STATE_UP);
    request.set_known_epoch(epoch);
    if (local_groups_) {
      for (v1::GroupRecord& record : local_groups_()) *request.add_groups() = std::move(record);
    }
    grpc::ClientContext context;
    SetDeadline(context, kJoinDeadline);
    const std::string nonce = links_->ExpectProof(context);
    v1::JoinResponse response;
    status = stub->Join(&context, request, &response);
    if (status.ok()) {
      const absl::Status proven = links_->VerifyAnswer(context, nonce, "/epfabric.v1.Peer/Join", response);
      if (!proven.ok()) {
        RefuseUnverified(proven);
        return;
      }
    }
    absl::MutexLock lock(&mutex_);
    if (status.ok()) {
      coordinator_unverified_.clear();
      join_refusal_.clear();
      joined_ = true;
      coordinator_reachable_ = true;
      last_contact_ = absl::Now();
      view_.set_epoch(0);  // take the coordinator's view whatever its epoch
      ApplyLocked(response.membership());
      joined_ = true;
      Logger("fabric")->info("joined the fabric through {}; epoch {}", config_.coordinator, view_.epoch());
      return;
    }
    // An answer other than silence is a refusal: health reports it, and the log says it once per change.
    const bool refused = status.error_code() != grpc::StatusCode::UNAVAILABLE &&
                         status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED;
    const std::string refusal = refused ? FromGrpcStatus(status).ToString() : "";
    static thread_local int failures = 0;
    if ((refused && refusal != join_refusal_) || (!refused && failures++ % 20 == 0)) {
      Logger("fabric")->log(refused ? spdlog::level::err : spdlog::level::info, "join {} failed: {}",
                            config_.coordinator, status.error_message());
    }
    join_refusal_ = refusal;
  } else {
    v1::HeartbeatRequest request;
    request.set_fabric_id(config_.fabric_id);
    request.set_rank(config_.rank);
    request.set_incarnation(incarnation_);
    request.set_epoch(epoch);
    grpc::ClientContext context;
    SetDeadline(context, heartbeat_deadline);
    const std::string nonce = links_->ExpectProof(context);
    v1::HeartbeatResponse response;
    status = stub->Heartbeat(&context, request, &response);
    bool proven = true;
    if (status.ok()) {
      const absl::Status verified = links_->VerifyAnswer(context, nonce, "/epfabric.v1.Peer/Heartbeat", response);
      if (!verified.ok()) {
        RefuseUnverified(verified);
        proven = false;
      }
    }
    absl::MutexLock lock(&mutex_);
    if (status.ok() && proven) {
      coordinator_unverified_.clear();
      if (!coordinator_reachable_) notify_pending_ = true;
      coordinator_reachable_ = true;
      last_contact_ = absl::Now();
      if (response.has_membership()) ApplyLocked(response.membership());
      return;
    }
    if (proven && status.error_code() == grpc::StatusCode::NOT_FOUND) {
      joined_ = false;  // the coordinator restarted or declared us down: join again at once
      return;
    }
    heartbeats_missed_.fetch_add(1, std::memory_order_relaxed);  // metrics hook
  }
  // No answer: after the configured misses, the coordinator counts as down in our view.
  absl::MutexLock lock(&mutex_);
  if (coordinator_reachable_ && absl::Now() - last_contact_ > config_.heartbeat_interval * config_.heartbeat_misses) {
    Logger("fabric")->warn("coordinator {} silent for {} heartbeats: fabric degraded, rejoining", config_.coordinator,
                           config_.heartbeat_misses);
    coordinator_reachable_ = false;
    joined_ = false;
    view_.mutable_members(0)->set_state(v1::MEMBER_STATE_DOWN);
    notify_pending_ = true;
  }
}

}  // namespace epfabric::daemon::fabric
