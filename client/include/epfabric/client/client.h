// The control side of an epfabric client (a serving process): connect to the daemon of this process' GPU over its
// Unix socket, take the lease of one group rank, and map the communication regions of every same-host rank of the
// group into this process. The data path (dispatch/combine kernels) is layered on top of a Lease: it only needs
// the mapped pointers, the sizes, the ranks and Healthy(). See docs/client.md.
//
//   auto client = epfabric::client::Client::Connect("/run/epfabric/gpu3.sock");
//   auto lease = (*client)->Attach("tenant-a", /*rank=*/3, token);
//   void* mine = (*lease)->region(3);           // this rank's NVL region
//   void* peer = (*lease)->region(2);           // a same-host peer's NVL region, mapped here
//   if (absl::Status ok = (*lease)->Healthy(); !ok.ok()) ...   // fail fast when the group is degraded
//   (*lease)->Detach();                         // or let the destructor do it
//
// Threads: a Lease runs one background thread (KeepAlive at a third of the lease TTL). Client and Lease are safe to
// use from several threads; a Lease may outlive its Client.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "epfabric/v1/common.pb.h"
#include "epfabric/v1/control.pb.h"
#include "epfabric/v1/ops.pb.h"

namespace epfabric::kernels {
struct DataPathStats;  // epfabric/kernels/datapath_stats.h
}

namespace epfabric::client {

struct ConnectOptions {
  // Deadline of each control call (connect, Attach, KeepAlive, Detach, each side-channel exchange).
  absl::Duration timeout = absl::Seconds(5);
  // A label the daemon shows in ListClients (the serving process' name); at most 128 bytes.
  std::string client_name;
  // Where this process finds the daemons' fd sockets when it sees the shared socket directory under another path
  // than the daemons do (a container mounting the hostPath elsewhere): <fd_socket_directory>/<file name>. Empty:
  // the daemons' own paths (RegionDescriptor.fd_socket). This daemon's own fd socket is always found next to the
  // socket given to Connect.
  std::string fd_socket_directory;
};

struct AttachOptions {
  // Requested lease TTL; zero: the daemon's default. The daemon clamps it to its limits.
  absl::Duration lease_ttl = absl::ZeroDuration();
  // Cuda regions: the CUDA device (ordinal in this process) whose kernels access the regions; -1: the current one.
  int accessing_device = -1;
  // Send KeepAlive on a background thread at a third of the TTL. Off only to let a lease expire on purpose.
  bool keep_alive = true;
};

// One group rank held by this process. Regions stay mapped until Detach (or destruction).
class Lease {
 public:
  ~Lease();  // Detaches (errors are dropped; call Detach() to see them).
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;

  // Unmaps every region, ends the lease on the daemon (which zeroes this rank's regions for the next client) and
  // closes the side-channel connection. Idempotent: later calls return OK. A lease that had already ended (expired,
  // group deleted) is not an error; Unavailable when the daemon cannot be reached (this side is detached anyway,
  // and a live daemon ends the lease when the side channel closes).
  absl::Status Detach();

  // OK while the lease is held and the group is READY. Unavailable when the group is DEGRADED (a member is down or
  // restarted; operations should fail fast), not READY, or the daemon stopped answering; FailedPrecondition when
  // the lease ended (detached, expired, or the daemon forgot it). Refreshed by every KeepAlive.
  absl::Status Healthy() const;

  // Facts from Attach.
  const std::string& lease_id() const;
  const std::string& group_name() const;
  const v1::GroupInfo& group() const;
  int rank() const;
  int world_size() const;
  // Group ranks on this host (reachable through NVLink/peer access), this rank included, ascending.
  const std::vector<int>& nvl_ranks() const;
  v1::Backend backend() const;
  // The wire of the daemon's transport (groups with an RDMA region), TRANSPORT_UNSPECIFIED otherwise.
  v1::Transport transport() const;
  // Fabric epoch at attach time.
  uint64_t attach_epoch() const;
  absl::Duration lease_ttl() const;
  // The last group state and epoch the daemon reported (Attach, then every KeepAlive).
  v1::GroupState group_state() const;
  // While the group is DEGRADED: the group ranks whose member is down or restarted (from the last keep-alive).
  std::vector<int> lost_ranks() const;
  uint64_t epoch() const;

  // The NVL region of group rank `group_rank` as mapped in this process (host pointer on the host backend, device
  // pointer usable from the accessing device on cuda); nullptr for a rank on another host, out of range, or after
  // Detach.
  void* region(int group_rank) const;
  uint64_t region_bytes(int group_rank) const;
  // This rank's RDMA region (nullptr / 0 when the group has none).
  void* rdma_region() const;
  uint64_t rdma_region_bytes() const;
  // This rank's transport command rings (groups with an RDMA region; nullptr / 0 otherwise): group().
  // transport_channels() rings of group().ring_slots() slots (epfabric/kernels/transport/ring.h). The host pointer,
  // and on the cuda backend the device pointer that kernels use.
  void* commands_region() const;
  void* commands_region_device() const;
  uint64_t commands_region_bytes() const;
  // This rank's data-path counters page (the daemon's metrics read it; kernels/datapath_stats.h), nullptr when the
  // daemon gave none. The Buffer writes it; the device pointer is the page as CUDA sees it (cuda backend).
  kernels::DataPathStats* datapath_stats() const;
  void* datapath_stats_device() const;
  // The lost-ranks words the daemon publishes in that page (kernels/status_word.h, kMaxLostRanks): the address the
  // host backend reads (`device` false) or the kernels read (`device` true); nullptr when the daemon gave no page.
  // Bit r is group rank r, or with `same_host_order` the r-th of nvl_ranks().
  const uint64_t* lost_ranks_words(bool device, bool same_host_order = false) const;
  // The lease serial of every group rank as the daemon publishes it in that page (kernels::kLeaseSerialsOffset, host
  // address, world_size() words read with acquire loads; 0: that rank has no client); nullptr without a page.
  const uint64_t* lease_serials() const;
  // The descriptor a region was mapped from (nullptr as for region()).
  const v1::RegionDescriptor* region_descriptor(int group_rank) const;

  struct State;

 private:
  friend class Client;
  explicit Lease(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// A connection to one daemon's client socket.
class Client {
 public:
  // Connects to the daemon listening on `socket_path` (its --client_socket). NotFound when there is no socket
  // there; Unavailable when nothing answers within options.timeout.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& socket_path, ConnectOptions options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Takes the lease of (group, rank) on this daemon and maps the NVL region of every same-host rank (and this
  // rank's RDMA region). Errors carry the daemon's status code: PermissionDenied (wrong token), NotFound (no such
  // group here), FailedPrecondition (the rank is already attached, or served by another daemon), Unavailable
  // (group not READY), InvalidArgument; a mapping failure releases the lease before returning.
  absl::StatusOr<std::unique_ptr<Lease>> Attach(const std::string& group, int rank, const std::string& token,
                                                AttachOptions options = {});

  const std::string& socket_path() const;

  // Group management on this daemon's Control service (the daemon coordinates the other members): CreateGroup
  // returns the response (group facts and the token, shown only once); DeleteGroup needs the token. Errors carry the
  // daemon's status code.
  absl::StatusOr<v1::CreateGroupResponse> CreateGroup(const v1::CreateGroupRequest& request);
  absl::Status DeleteGroup(const std::string& group, const std::string& token);
  // The daemon's own facts (fabric rank, world size, backend, device), from Ops.GetTopology: a binding that builds
  // a group over its peers' daemons learns their fabric ranks this way.
  absl::StatusOr<v1::DaemonInfo> GetDaemonInfo();
  // Ops.GetTopology: also the host id, which tells a binding how many hosts a group over some daemons spans.
  absl::StatusOr<v1::Topology> GetTopology();

  struct State;

 private:
  explicit Client(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace epfabric::client
