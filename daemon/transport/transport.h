// The daemon's transport: one wire (socket or verbs), the proxy threads, and per group a GroupTransport that owns the
// member's command rings and the group's link. docs/internode.md has the model; groups/local_groups.cc drives it
// (Open at Prepare, Connect at Commit, Stop/Reset around the zeroing at lease end, destruction at release).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "epfabric/v1/peer.pb.h"
#include "memory/region.h"
#include "transport/command_ring.h"
#include "transport/proxy.h"
#include "transport/socket_wire.h"
#include "transport/wire.h"

namespace epfabric::daemon::transport {

struct TransportOptions {
  // TRANSPORT_UNSPECIFIED ("auto"): verbs when a device with an active port exists and can register this daemon's
  // memory, else the socket wire.
  v1::Transport kind = v1::TRANSPORT_SOCKET;
  // The daemon's GPU (cuda backend; -1 on the host backend): what the verbs wire must be able to register.
  int device = -1;
  SocketWireOptions socket;
  ProxyOptions proxy;
  // Labels the command regions' memfds (like the host backend's regions).
  std::string name_prefix = "epf";
};

// One group's transport on this member.
class GroupTransport final : public CompletionSink {
 public:
  ~GroupTransport() override;  // stops proxying, fails what is in flight, closes the connections
  GroupTransport(const GroupTransport&) = delete;
  GroupTransport& operator=(const GroupTransport&) = delete;

  // Phase 2 of CreateGroup: every member's endpoint, by group rank. Starts proxying this member's rings. Commands
  // are checked against the other members' claimed region sizes (each member checks what lands in its own region
  // against its allocation) and against this member's own allocation: INVALID_ARGUMENT when the endpoint for this
  // member's rank claims another size.
  absl::Status Connect(const std::vector<v1::TransportEndpoint>& members);

  // Lease end, around the zeroing of the rank's regions (the command region included): Stop ends the rings (their
  // issuers see kLeaseEnded) and waits, bounded, for what is in flight; Reset starts fresh rings in a new command
  // region, so that the old holder's mapping of the old one reaches no ring of the next holder (when the new
  // region cannot be allocated, the zeroed old one serves again, with a warning).
  void Stop(absl::Duration timeout);
  void Reset() ABSL_LOCKS_EXCLUDED(commands_mutex_);

  // The command region (kind COMMANDS) of the current lease generation, handed to the rank's lease holder.
  std::shared_ptr<memory::Region> commands() const ABSL_LOCKS_EXCLUDED(commands_mutex_) {
    absl::MutexLock lock(&commands_mutex_);
    return commands_;
  }
  std::vector<RingCounters> counters() const;

  void Complete(uint64_t cookie, absl::Status status) override;

 private:
  friend class Transport;
  GroupTransport(Proxy* proxy, std::shared_ptr<memory::Region> commands, int channels, uint32_t slots);

  Proxy* const proxy_;
  memory::RegionAllocator* allocator_ = nullptr;  // of command regions (Reset)
  memory::RegionSpec command_spec_;
  uint32_t slots_ = 0;
  mutable absl::Mutex commands_mutex_;
  std::shared_ptr<memory::Region> commands_ ABSL_GUARDED_BY(commands_mutex_);
  std::vector<std::unique_ptr<CommandRing>> rings_;
  std::unique_ptr<GroupLink> link_;  // after rings_: destroyed first, while the rings still take completions
  CommandBounds bounds_;
  uint64_t local_region_bytes_ = 0;  // this member's RDMA region, as allocated
  bool proxied_ = false;
};

struct GroupTransportSpec {
  std::string group;
  int self_rank = -1;
  int world = 0;
  int channels = 0;
  uint32_t slots = 0;
  std::string data_key;  // the group's data key (security::DataKey of its token; the token stays with the coordinator)
  memory::Region* rdma = nullptr;
};

class Transport {
 public:
  static absl::StatusOr<std::unique_ptr<Transport>> Start(const TransportOptions& options);

  v1::Transport kind() const { return wire_->kind(); }
  // For MemberInfo: the socket wire's data listener ("" for verbs).
  std::string data_address() const;
  std::string Describe() const { return wire_->Describe(); }
  // The socket wire's data-listener counters (zeros on another wire).
  SocketWireCounters socket_counters() const { return socket_ != nullptr ? socket_->counters() : SocketWireCounters{}; }

  // Phase 1 of CreateGroup: the command region and the rings, the wire's registration; fills `local`.
  absl::StatusOr<std::unique_ptr<GroupTransport>> OpenGroup(const GroupTransportSpec& spec,
                                                            v1::TransportEndpoint* local);

 private:
  std::unique_ptr<Wire> wire_;
  SocketWire* socket_ = nullptr;  // wire_ when it is the socket wire
  std::unique_ptr<Proxy> proxy_;
  std::unique_ptr<memory::RegionAllocator> command_allocator_;
};

}  // namespace epfabric::daemon::transport
