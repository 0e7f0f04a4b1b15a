// The daemon's side of one command ring (kernels/transport/ring.h): the proxy thread takes commands off it, checks
// them and hands them to the group's link; the wire reports completions, which advance the ring's `completed` prefix.
// Every counter the issuers read is a copy of state kept here: the ring memory is the client's to scribble on.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "epfabric/kernels/transport/ring.h"
#include "transport/command_check.h"
#include "transport/wire.h"

namespace epfabric::daemon::transport {

// Commands a ring executed, refused or skipped (after its first failure); read by Ops/metrics.
struct RingCounters {
  uint64_t executed = 0;
  uint64_t refused = 0;
  uint64_t failed = 0;   // completed with an error by the wire (peer lost)
  uint64_t skipped = 0;  // consumed after the ring's first failure, not executed
};

class CommandRing {
 public:
  // `memory`: the ring inside the daemon's mapping of the command region (RingBytes(slots) bytes, zeroed). `id` is
  // the ring's index in its group (the channel); cookies carry it.
  CommandRing(void* memory, int channel, uint32_t slots);
  CommandRing(const CommandRing&) = delete;
  CommandRing& operator=(const CommandRing&) = delete;

  // Writes the header an issuer checks (magic, slot count, no waiting rank). After the memory was zeroed.
  void Initialize();
  // Moves the ring to `memory` (zeroed, RingBytes(slots) bytes) for its next generation: a lease's old holder keeps
  // its mapping of the old memory, which nobody polls any more. No Poll may run meanwhile (the proxy removed the
  // ring); completions may (they take the lock). Before Reset.
  void Rebind(void* memory) ABSL_LOCKS_EXCLUDED(mutex_);

  // Proxy thread (one at a time per ring): takes up to `budget` published commands, checks each against `bounds`
  // and posts the valid ones on `link`. Returns how many commands it took.
  int Poll(GroupLink* link, const CommandBounds& bounds, int budget) ABSL_LOCKS_EXCLUDED(mutex_);

  // Wire threads: command `cookie` (from Poll) finished.
  void Complete(uint64_t cookie, const absl::Status& status) ABSL_LOCKS_EXCLUDED(mutex_);

  // Lease end: stop taking commands, record kLeaseEnded, wait (at most `timeout`) for the commands in flight. Returns
  // false when some were still in flight (their completions are then ignored). Then the caller zeroes the memory and
  // calls Reset, which starts a new generation at index 0.
  bool Stop(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mutex_);
  void Reset() ABSL_LOCKS_EXCLUDED(mutex_);

  RingCounters counters() const ABSL_LOCKS_EXCLUDED(mutex_);
  int channel() const { return channel_; }

  // Cookie layout: channel (8 bits) | generation (16 bits) | index (40 bits).
  static int CookieChannel(uint64_t cookie) { return static_cast<int>(cookie >> 56); }
  // The ring generation (lease) a command belongs to: a wire that failed a generation's command fails the rest of it.
  static uint32_t CookieGeneration(uint64_t cookie) { return static_cast<uint32_t>((cookie >> 40) & 0xffff); }

 private:
  uint64_t MakeCookie(uint64_t index) const;
  // Records the ring's first failure in the shared header (later ones are only counted).
  void FailLocked(RingErrorCode code, int rank, uint64_t index, uint64_t value) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Marks `index` done and advances the completed prefix (and the shared copy, and waiting_rank).
  void DoneLocked(uint64_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  // Written only by Rebind (under mutex_, with no Poll running); read by Poll outside the lock for that reason.
  kernels::transport::RingControl* control_;
  kernels::transport::Command* slots_;
  const int channel_;
  const uint32_t slot_count_;

  mutable absl::Mutex mutex_;
  absl::CondVar drained_;
  uint64_t taken_ ABSL_GUARDED_BY(mutex_) = 0;      // commands taken off the ring (consumed)
  uint64_t completed_ ABSL_GUARDED_BY(mutex_) = 0;  // contiguous prefix of finished commands
  uint32_t generation_ ABSL_GUARDED_BY(mutex_) = 0;
  bool failed_ ABSL_GUARDED_BY(mutex_) = false;
  bool stopped_ ABSL_GUARDED_BY(mutex_) = false;
  std::vector<uint8_t> done_ ABSL_GUARDED_BY(mutex_);      // by index % slots, for [completed_, taken_)
  std::vector<int32_t> dst_rank_ ABSL_GUARDED_BY(mutex_);  // destination of each command in flight
  RingCounters counters_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace epfabric::daemon::transport
