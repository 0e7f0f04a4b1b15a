#include "transport/command_ring.h"

#include <cstring>

namespace epfabric::daemon::transport {
namespace {

using kernels::transport::kRingMagic;
using kernels::transport::RingControl;

constexpr uint64_t kIndexBits = 40;
constexpr uint64_t kIndexMask = (1ull << kIndexBits) - 1;

template <typename T>
void StoreRelease(T& word, T value) {
  std::atomic_ref<T>(word).store(value, std::memory_order_release);
}

RingErrorCode CodeFor(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsCancelled(status) ? RingErrorCode::kPeerLost
                                                                  : RingErrorCode::kWireError;
}

}  // namespace

CommandRing::CommandRing(void* memory, int channel, uint32_t slots)
    : control_(static_cast<RingControl*>(memory)),
      slots_(reinterpret_cast<Command*>(static_cast<char*>(memory) + sizeof(RingControl))),
      channel_(channel),
      slot_count_(slots),
      done_(slots, 0),
      dst_rank_(slots, -1) {}

void CommandRing::Initialize() {
  StoreRelease(control_->slots, slot_count_);
  StoreRelease(control_->waiting_rank, -1);
  StoreRelease(control_->magic, kRingMagic);
}

void CommandRing::Rebind(void* memory) {
  absl::MutexLock lock(&mutex_);
  control_ = static_cast<RingControl*>(memory);
  slots_ = reinterpret_cast<Command*>(static_cast<char*>(memory) + sizeof(RingControl));
}

uint64_t CommandRing::MakeCookie(uint64_t index) const ABSL_NO_THREAD_SAFETY_ANALYSIS {
  return (static_cast<uint64_t>(channel_) << 56) | (static_cast<uint64_t>(generation_ & 0xffff) << kIndexBits) |
         (index & kIndexMask);
}

int CommandRing::Poll(GroupLink* link, const CommandBounds& bounds, int budget) {
  int taken = 0;
  while (taken < budget) {
    uint64_t index = 0;
    bool failed = false;
    uint32_t generation = 0;
    {
      absl::MutexLock lock(&mutex_);
      if (stopped_) return taken;
      index = taken_;
      generation = generation_;
      if (index - completed_ >= slot_count_) return taken;  // as many in flight as the ring has slots
      failed = failed_;
    }
    Command& slot = slots_[index & (slot_count_ - 1)];
    const uint32_t stamp = std::atomic_ref<uint32_t>(slot.stamp).load(std::memory_order_acquire);
    if (stamp != static_cast<uint32_t>(index + 1)) {
      // Not yet published: the slot still holds the previous lap's stamp (0 on the first lap). Anything else means
      // the ring was overwritten; the ring stops here (its issuers see the error, nothing else is affected).
      const uint32_t previous = index < slot_count_ ? 0 : static_cast<uint32_t>(index + 1 - slot_count_);
      if (stamp != previous) {
        absl::MutexLock lock(&mutex_);
        FailLocked(RingErrorCode::kBadStamp, -1, index, stamp);
        stopped_ = true;
      }
      return taken;
    }
    Command command;
    std::memcpy(&command, &slot, sizeof(command));  // one copy: the client may change the slot after this
    const std::optional<CommandFault> fault = failed ? std::nullopt : CheckCommand(command, bounds);
    bool execute = false;
    uint64_t cookie = 0;
    {
      absl::MutexLock lock(&mutex_);
      // The lease ended while the slot was read (Stop, maybe Reset too): the command belongs to the old lease.
      if (stopped_ || generation_ != generation) return taken;
      taken_ = index + 1;
      StoreRelease(control_->consumed, taken_);
      dst_rank_[index & (slot_count_ - 1)] = fault ? -1 : command.dst_rank;
      if (failed_) {
        ++counters_.skipped;
        DoneLocked(index);
      } else if (fault) {
        ++counters_.refused;
        FailLocked(fault->code, fault->rank, index, fault->value);
        DoneLocked(index);
      } else {
        ++counters_.executed;
        execute = true;
        cookie = MakeCookie(index);
        if (completed_ == index) StoreRelease(control_->waiting_rank, static_cast<int32_t>(command.dst_rank));
      }
    }
    ++taken;
    if (!execute) continue;
    // Outside the lock: a wire may complete at once (a local destination, a known-dead peer).
    if (static_cast<Opcode>(command.opcode) == Opcode::kPut) {
      link->Put(channel_, command.dst_rank, command.dst_offset, command.src_offset, command.arg, cookie);
    } else {
      link->SignalAdd(channel_, command.dst_rank, command.dst_offset, static_cast<int64_t>(command.arg), cookie);
    }
  }
  return taken;
}

void CommandRing::Complete(uint64_t cookie, const absl::Status& status) {
  absl::MutexLock lock(&mutex_);
  if (((cookie >> kIndexBits) & 0xffff) != (generation_ & 0xffff)) return;  // from before a reset: ignored
  // The 40-bit index within the window [completed_, taken_).
  const uint64_t index = completed_ + (((cookie & kIndexMask) - completed_) & kIndexMask);
  if (index >= taken_) return;
  if (!status.ok()) {
    ++counters_.failed;
    FailLocked(CodeFor(status), dst_rank_[index & (slot_count_ - 1)], index, 0);
  }
  DoneLocked(index);
}

void CommandRing::FailLocked(RingErrorCode code, int rank, uint64_t index, uint64_t value) {
  if (failed_) return;
  failed_ = true;
  control_->error_rank = rank;
  control_->error_index = index;
  control_->error_value = value;
  StoreRelease(control_->error_code, static_cast<int32_t>(code));
}

void CommandRing::DoneLocked(uint64_t index) {
  done_[index & (slot_count_ - 1)] = 1;
  const uint64_t before = completed_;
  while (completed_ < taken_ && done_[completed_ & (slot_count_ - 1)] != 0) {
    done_[completed_ & (slot_count_ - 1)] = 0;
    ++completed_;
  }
  if (completed_ == before) return;
  StoreRelease(control_->waiting_rank, completed_ < taken_ ? dst_rank_[completed_ & (slot_count_ - 1)] : -1);
  StoreRelease(control_->completed, completed_);
  if (completed_ == taken_) drained_.SignalAll();
}

bool CommandRing::Stop(absl::Duration timeout) {
  absl::MutexLock lock(&mutex_);
  stopped_ = true;
  FailLocked(RingErrorCode::kLeaseEnded, -1, taken_, 0);
  const absl::Time deadline = absl::Now() + timeout;
  while (completed_ < taken_) {
    if (drained_.WaitWithDeadline(&mutex_, deadline)) break;
  }
  return completed_ == taken_;
}

void CommandRing::Reset() {
  {
    absl::MutexLock lock(&mutex_);
    ++generation_;
    taken_ = 0;
    completed_ = 0;
    failed_ = false;
    stopped_ = false;
    std::fill(done_.begin(), done_.end(), 0);
    std::fill(dst_rank_.begin(), dst_rank_.end(), -1);
  }
  Initialize();
}

RingCounters CommandRing::counters() const {
  absl::MutexLock lock(&mutex_);
  return counters_;
}

}  // namespace epfabric::daemon::transport
