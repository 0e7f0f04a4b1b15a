// Issuing transport commands from host code (the host backend, tools, tests): the same protocol as the device-side
// issuer (epfabric/kernels/device/transport.cuh), over one ring of a mapped command region. ring.h has the model.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "epfabric/kernels/transport/ring.h"

namespace epfabric::kernels::transport {

// The message for a ring's recorded failure, e.g. "transport ring 2: command 17 (put to rank 3): destination range
// [4096, 4160) outside rank 3's region".
std::string DescribeRingError(int channel, const RingControl& control);

// The status an issuer reports for the ring's recorded failure: kPeerLost → Unavailable, kLeaseEnded → Aborted,
// a refused command → InvalidArgument, kWireError → Unavailable; OK when none is recorded.
absl::Status RingErrorStatus(int channel, const RingControl& control);

// One ring of a command region, as an issuer sees it. Thread-safe: any number of threads may issue on one ring.
class RingIssuer {
 public:
  // `ring` points at RingControl of ring `channel` inside the mapped command region; `slots` is the group's
  // ring_slots. The daemon must have initialised the ring (magic); FailedPrecondition otherwise.
  static absl::StatusOr<RingIssuer> Create(void* ring, int channel, uint32_t slots);

  // Each call waits (at most `timeout`) for a free slot, then publishes one command. DeadlineExceeded names the
  // rank the daemon is waiting on; a failure the daemon recorded ends the wait at once with RingErrorStatus.
  absl::Status Put(int dst_rank, uint64_t dst_offset, uint64_t src_offset, uint64_t bytes,
                   absl::Duration timeout = absl::Seconds(5));
  absl::Status SignalAdd(int dst_rank, uint64_t dst_offset, int64_t value, absl::Duration timeout = absl::Seconds(5));
  // Waits until every command issued on this ring so far (by any thread) is complete at its destination.
  absl::Status Quiet(absl::Duration timeout = absl::Seconds(5));

  // Commands reserved so far on this ring (the next index).
  uint64_t issued() const;
  int channel() const { return channel_; }
  const RingControl& control() const { return *control_; }

 private:
  RingIssuer(RingControl* control, Command* slots, int channel, uint32_t slot_count)
      : control_(control), slots_(slots), channel_(channel), slot_count_(slot_count) {}
  absl::Status Issue(Opcode opcode, int dst_rank, uint64_t dst_offset, uint64_t src_offset, uint64_t arg,
                     absl::Duration timeout);

  RingControl* control_;
  Command* slots_;
  int channel_;
  uint32_t slot_count_;
};

// Ring `channel` of a command region of `channels` rings of `slots` slots (nullptr when out of range).
inline void* RingAt(void* command_region, int channel, uint32_t slots) {
  return static_cast<char*>(command_region) + static_cast<uint64_t>(channel) * RingBytes(slots);
}

}  // namespace epfabric::kernels::transport
