// The fd side channel: a Unix stream socket next to the client socket ("<client_socket>.fds", same mode) where
// clients fetch the file descriptors of POSIX_FD and host (POSIX_SHM) regions (gRPC cannot carry descriptors) and where
// a client's connection holds its lease, so that the lease ends when the client's process exits or is killed, whatever
// the backend. Protocol: proto/epfabric/v1/fdchannel.proto, framed by epfabric/common/fd_passing.h; docs/client.md.
//
// Threads: one poller (accepts, watches every idle connection, closes idle ones) and a fixed pool of kWorkers that
// serve one request each time a whole request has arrived. Connections cost no thread while they wait (an attached
// client holds its lease on one for as long as it lives). A worker never waits for a client: a request that has only
// partly arrived stays with the poller (which looks again every kPartialRecheck and closes the connection when the
// rest has not come within kMessageTimeout), and an answer the client does not take within kAnswerTimeout closes the
// connection. So a stalled connection costs a worker microseconds, and readable connections are served first come,
// first served whatever their uid. When every slot is taken, a new connection closes the oldest one that holds no
// lease and is not being served (a client binds its lease right after connecting; a tenant can choose its uids in
// a container, so the per-uid cap alone is no fairness).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <deque>
#include <list>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "epfabric/common/fd_passing.h"
#include "epfabric/v1/fdchannel.pb.h"
#include "groups/group_manager.h"
#include "services/connection_limits.h"

namespace epfabric::daemon {

// The path of the fd side channel of a daemon whose client socket is `client_socket`.
std::string FdSocketPath(const std::string& client_socket);

class FdChannel {
 public:
  // Limits: a request is a few hundred bytes; the connection count bounds threads and descriptors.
  static constexpr size_t kMaxRequestBytes = 4096;
  static constexpr size_t kMaxConnections = 512;
  // One uid cannot take every connection (nor every thread: one serves each connection).
  static constexpr size_t kMaxConnectionsPerUid = 64;
  // A connection that holds no lease and sends nothing for this long is closed.
  static constexpr absl::Duration kIdleTimeout = absl::Seconds(60);
  // Workers serving requests; requests are short (a map lookup and a sendmsg).
  static constexpr int kWorkers = 4;
  // A message that started arriving must be complete within this; the connection is closed otherwise.
  static constexpr absl::Duration kMessageTimeout = absl::Seconds(2);
  // How often the poller looks again at a connection whose request has partly arrived.
  static constexpr absl::Duration kPartialRecheck = absl::Milliseconds(10);
  // An answer must leave within this (a client reads each answer before its next request, so its socket always
  // has room); the connection is closed otherwise.
  static constexpr absl::Duration kAnswerTimeout = absl::Milliseconds(100);

  explicit FdChannel(groups::GroupManager* groups) : groups_(groups) {}
  ~FdChannel();
  FdChannel(const FdChannel&) = delete;
  FdChannel& operator=(const FdChannel&) = delete;

  // Binds `path` (which must be free) with permission bits `mode` and starts serving.
  absl::Status Start(const std::string& path, uint32_t mode);
  // Stops accepting, closes every connection and removes the socket file. Leases held by connections are NOT
  // ended: the daemon is going away with its memory. Idempotent.
  void Stop();

  // What one request gets: the response and, for a POSIX_FD or POSIX_SHM region, the descriptor to attach to it.
  struct Answer {
    v1::FdResponse response;
    common::UniqueFd fd;
  };
  // Decides one request from a connection of process `peer` that holds lease `*held_lease` (empty: none); binds
  // the lease to the connection (updating `*held_lease`) when the request presents one that checks out.
  Answer Handle(const v1::FdRequest& request, const common::PeerCredentials& peer, std::string* held_lease);
  // A connection that held `lease_id` closed: the lease ends (unless the daemon is stopping).
  void OnConnectionClosed(const std::string& lease_id, const common::PeerCredentials& peer);

  // metrics (daemon/metrics): connections closed at accept by the limits, and requests answered with an error.
  uint64_t ConnectionsRefused() const { return connections_refused_.load(std::memory_order_relaxed); }
  uint64_t RequestsRefused() const { return requests_refused_.load(std::memory_order_relaxed); }

 private:
  struct Connection {
    common::UniqueFd fd;
    common::PeerCredentials peer;
    std::string held_lease;    // touched only by the worker serving the connection (one at a time)
    absl::Time last_activity;  // guarded by mutex_
    bool busy = false;         // queued or being served; guarded by mutex_
    bool finished = false;     // closed by its worker; reaped by the poller; guarded by mutex_
    // When its current request started to arrive (InfinitePast: none is partly here); guarded by mutex_.
    absl::Time partial_since = absl::InfinitePast();
  };
  // What a worker found on a readable connection.
  enum class Served { kAnswered, kPartial, kNothing, kClose };

  // The poller: accepts, hands readable connections to the workers, closes idle ones, reaps finished ones.
  void PollLoop();
  void Accept();
  void WorkerLoop();
  // Serves one request of `connection` if all of it has arrived.
  Served ServeOne(Connection* connection);
  // When every slot is taken: closes the oldest connection that holds no lease and is not being served.
  void EvictOldestIdleLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Wakes the poller (a connection came back from a worker, or the channel stops).
  void Wake();
  bool stopping() const;
  bool HasWorkOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  groups::GroupManager* const groups_;
  std::string path_;
  common::UniqueFd listen_fd_;
  common::UniqueFd wake_fd_;  // eventfd
  std::thread poll_thread_;
  std::vector<std::thread> workers_;

  ConnectionLimits limits_{kMaxConnections, kMaxConnectionsPerUid};
  DescriptorReserve reserve_;
  RateLimitedWarning refusal_warning_;
  std::atomic<uint64_t> connections_refused_{0};  // metrics hook
  std::atomic<uint64_t> requests_refused_{0};     // metrics hook

  mutable absl::Mutex mutex_;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::list<std::unique_ptr<Connection>> connections_ ABSL_GUARDED_BY(mutex_);
  std::deque<Connection*> ready_ ABSL_GUARDED_BY(mutex_);  // readable connections waiting for a worker
  // Leases held by a live connection (a lease is held by at most one).
  std::set<std::string> held_leases_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace epfabric::daemon
