// A wire moves the transport's validated commands between daemons: the socket wire (TCP frames, the receiving daemon
// writes) and the verbs wire (RDMA WRITE and atomics on RC queue pairs). The proxy (transport/proxy.h) drains the
// command rings, checks every command against the group's regions (transport/command_check.h) and hands only valid
// ones to the group's GroupLink. docs/internode.md describes the model and the ordering rules.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epfabric/v1/peer.pb.h"
#include "memory/region.h"

namespace epfabric::daemon::transport {

// Told when a command handed to a GroupLink is complete: the bytes (or the signal) are in place at the destination
// and the source may be reused. Called exactly once per command, from any thread, never under a lock the wire holds
// while calling into the link. `cookie` is the value given with the command. A non-OK status names the peer.
class CompletionSink {
 public:
  virtual ~CompletionSink() = default;
  virtual void Complete(uint64_t cookie, absl::Status status) = 0;
};

// What a wire needs to know of one group on this member.
struct GroupSetup {
  std::string group;   // name
  int self_rank = -1;  // this daemon's group rank
  int world = 0;       // group size
  int channels = 1;    // transport channels (one ring and one connection / queue pair per peer and channel)
  // HMAC-SHA256 of "epfabric data v1" keyed by the group's token (security::DataKey): the key that data connections
  // of this group prove and are sealed with; members get it instead of the token. Empty on wires that do not need it.
  std::string data_key;
  // This member's RDMA region (host memory or device memory). Owned by the group; outlives the link.
  memory::Region* region = nullptr;
  // Told about every command's completion.
  CompletionSink* sink = nullptr;
};

// One group's connections on a wire. Created by Wire::Open during Prepare; Connect at Commit; destroyed when the
// group is released (after Shutdown, which fails every command still in flight).
class GroupLink {
 public:
  virtual ~GroupLink() = default;
  // Every member's endpoint, indexed by group rank (this member's own included). Connects, or prepares to connect
  // on first use; a peer that cannot be reached makes later commands to it fail, not Connect.
  virtual absl::Status Connect(const std::vector<v1::TransportEndpoint>& members) = 0;
  // Copies [src_offset, src_offset + bytes) of this member's region to dst_rank's region at dst_offset. Commands of
  // one channel to one destination are applied there in the order they were posted. The range checks were done by
  // the caller; a wire checks again only what its own peers send it.
  virtual void Put(int channel, int dst_rank, uint64_t dst_offset, uint64_t src_offset, uint64_t bytes,
                   uint64_t cookie) = 0;
  // Adds `value` to the 8-byte word at dst_offset of dst_rank's region, visible only after every earlier Put of the
  // same channel to dst_rank.
  virtual void SignalAdd(int channel, int dst_rank, uint64_t dst_offset, int64_t value, uint64_t cookie) = 0;
  // Fails every command in flight (kPeerLost / Cancelled) and closes the connections. Idempotent.
  virtual void Shutdown() = 0;
};

class Wire {
 public:
  virtual ~Wire() = default;
  virtual v1::Transport kind() const = 0;
  // Phase 1 of CreateGroup on this member: registers the region, creates what peers need to reach it and fills
  // `local` (transport, region_bytes and the wire's fields).
  virtual absl::StatusOr<std::unique_ptr<GroupLink>> Open(const GroupSetup& setup, v1::TransportEndpoint* local) = 0;
  // For MemberInfo and epctl: the data listener's address (socket), or the device and port (verbs).
  virtual std::string Describe() const = 0;
};

}  // namespace epfabric::daemon::transport
