#include "epfabric/kernels/transport/issuer.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"

namespace epfabric::kernels::transport {
namespace {

template <typename T>
T LoadAcquire(const T& word) {
  return std::atomic_ref<T>(const_cast<T&>(word)).load(std::memory_order_acquire);
}

const char* OpcodeName(uint64_t opcode) {
  switch (static_cast<Opcode>(opcode)) {
    case Opcode::kPut:
      return "put";
    case Opcode::kSignalAdd:
      return "signal_add";
    default:
      return "command";
  }
}

// Spins briefly, then yields, then sleeps: a quiet that waits for a remote host must not burn a core.
class Backoff {
 public:
  void Pause() {
    ++rounds_;
    if (rounds_ < 64) return;
    if (rounds_ < 256) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(rounds_ < 4096 ? 20 : 200));
  }

 private:
  uint32_t rounds_ = 0;
};

}  // namespace

std::string DescribeRingError(int channel, const RingControl& control) {
  const auto code = static_cast<RingErrorCode>(LoadAcquire(control.error_code));
  const int rank = control.error_rank;
  const uint64_t index = control.error_index;
  const uint64_t value = control.error_value;
  const std::string where = absl::StrCat("transport ring ", channel, ": command ", index);
  switch (code) {
    case RingErrorCode::kOk:
      return absl::StrCat("transport ring ", channel, ": no error");
    case RingErrorCode::kBadOpcode:
      return absl::StrCat(where, ": opcode ", value, " is not put (1) or signal_add (2)");
    case RingErrorCode::kBadRank:
      return absl::StrCat(where, ": destination rank ", value, " is not a rank of the group");
    case RingErrorCode::kSourceOutOfRange:
      return absl::StrCat(where, " (put to rank ", rank, "): source range ends at ", value,
                          ", outside this rank's RDMA region");
    case RingErrorCode::kDestOutOfRange:
      return absl::StrCat(where, " (to rank ", rank, "): destination range ends at ", value, ", outside rank ", rank,
                          "'s RDMA region");
    case RingErrorCode::kBadSize:
      return absl::StrCat(where, " (put to rank ", rank, "): size 0");
    case RingErrorCode::kMisaligned:
      return absl::StrCat(where, " (signal_add to rank ", rank, "): offset ", value, " is not 8-byte aligned");
    case RingErrorCode::kBadStamp:
      return absl::StrCat(where, ": slot stamp ", value, " is not the expected one (the ring was overwritten)");
    case RingErrorCode::kPeerLost:
      return absl::StrCat(where, " (to rank ", rank, "): rank ", rank, " is unreachable (its daemon or host is lost)");
    case RingErrorCode::kWireError:
      return absl::StrCat(where, " (to rank ", rank, "): the wire failed (see the daemon's log)");
    case RingErrorCode::kLeaseEnded:
      return absl::StrCat("transport ring ", channel, ": the lease ended; the ring is being cleaned");
  }
  return absl::StrCat(where, ": error code ", static_cast<int>(code), " (", OpcodeName(value), ")");
}

absl::Status RingErrorStatus(int channel, const RingControl& control) {
  const auto code = static_cast<RingErrorCode>(LoadAcquire(control.error_code));
  switch (code) {
    case RingErrorCode::kOk:
      return absl::OkStatus();
    case RingErrorCode::kPeerLost:
    case RingErrorCode::kWireError:
      return absl::UnavailableError(DescribeRingError(channel, control));
    case RingErrorCode::kLeaseEnded:
      return absl::AbortedError(DescribeRingError(channel, control));
    case RingErrorCode::kBadStamp:
      return absl::DataLossError(DescribeRingError(channel, control));
    default:
      return absl::InvalidArgumentError(DescribeRingError(channel, control));
  }
}

absl::StatusOr<RingIssuer> RingIssuer::Create(void* ring, int channel, uint32_t slots) {
  if (ring == nullptr) return absl::InvalidArgumentError("transport ring: null");
  if (!ValidRingSlots(slots)) {
    return absl::InvalidArgumentError(absl::StrCat("transport ring: ", slots, " slots (a power of two in [",
                                                   kMinRingSlots, ", ", kMaxRingSlots, "])"));
  }
  auto* control = static_cast<RingControl*>(ring);
  if (LoadAcquire(control->magic) != kRingMagic) {
    return absl::FailedPreconditionError(
        absl::StrCat("transport ring ", channel, ": not initialised by the daemon (magic ", control->magic, ")"));
  }
  auto* commands = reinterpret_cast<Command*>(static_cast<char*>(ring) + sizeof(RingControl));
  return RingIssuer(control, commands, channel, slots);
}

uint64_t RingIssuer::issued() const { return LoadAcquire(control_->reserved); }

absl::Status RingIssuer::Issue(Opcode opcode, int dst_rank, uint64_t dst_offset, uint64_t src_offset, uint64_t arg,
                               absl::Duration timeout) {
  if (absl::Status error = RingErrorStatus(channel_, *control_); !error.ok()) return error;
  if (dst_rank < 0 || dst_rank > 0xffff) {
    return absl::InvalidArgumentError(absl::StrCat("transport: destination rank ", dst_rank));
  }
  // An index is reserved only once its slot is free (the daemon consumed the command one lap earlier), with a
  // compare-and-swap: a timeout then leaves no reserved slot unwritten, so the ring goes on once the daemon drains it
  // (a reserved, never-written slot would stop the daemon there, and every later command with it).
  std::atomic_ref<uint64_t> reserved(control_->reserved);
  uint64_t index = reserved.load(std::memory_order_relaxed);
  const absl::Time deadline = absl::Now() + timeout;
  Backoff backoff;
  while (true) {
    if (index < LoadAcquire(control_->consumed) + slot_count_) {  // free (or a stale index: the swap fails)
      if (reserved.compare_exchange_weak(index, index + 1, std::memory_order_relaxed)) break;
      continue;  // another issuer took it: `index` holds the current value
    }
    if (absl::Status error = RingErrorStatus(channel_, *control_); !error.ok()) return error;
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("transport ring ", channel_, ": no free slot for command ", index,
                                                      " after ", absl::FormatDuration(timeout),
                                                      " (the daemon consumed ", LoadAcquire(control_->consumed),
                                                      "; waiting on rank ", LoadAcquire(control_->waiting_rank), ")"));
    }
    backoff.Pause();
    index = reserved.load(std::memory_order_relaxed);
  }
  Command& slot = slots_[index & (slot_count_ - 1)];
  slot.opcode = static_cast<uint8_t>(opcode);
  slot.reserved = 0;
  slot.dst_rank = static_cast<uint16_t>(dst_rank);
  slot.dst_offset = dst_offset;
  slot.src_offset = src_offset;
  slot.arg = arg;
  std::atomic_ref<uint32_t>(slot.stamp).store(static_cast<uint32_t>(index + 1), std::memory_order_release);
  return absl::OkStatus();
}

absl::Status RingIssuer::Put(int dst_rank, uint64_t dst_offset, uint64_t src_offset, uint64_t bytes,
                             absl::Duration timeout) {
  return Issue(Opcode::kPut, dst_rank, dst_offset, src_offset, bytes, timeout);
}

absl::Status RingIssuer::SignalAdd(int dst_rank, uint64_t dst_offset, int64_t value, absl::Duration timeout) {
  return Issue(Opcode::kSignalAdd, dst_rank, dst_offset, 0, static_cast<uint64_t>(value), timeout);
}

absl::Status RingIssuer::Quiet(absl::Duration timeout) {
  const uint64_t target = LoadAcquire(control_->reserved);
  const absl::Time deadline = absl::Now() + timeout;
  Backoff backoff;
  while (LoadAcquire(control_->completed) < target) {
    if (absl::Status error = RingErrorStatus(channel_, *control_); !error.ok()) return error;
    if (absl::Now() > deadline) {
      const uint64_t completed = LoadAcquire(control_->completed);
      return absl::DeadlineExceededError(absl::StrCat(
          "transport ring ", channel_, ": quiet: ", target - completed, " of ", target, " commands not complete after ",
          absl::FormatDuration(timeout), "; waiting on rank ", LoadAcquire(control_->waiting_rank)));
    }
    backoff.Pause();
  }
  return RingErrorStatus(channel_, *control_);
}

}  // namespace epfabric::kernels::transport
