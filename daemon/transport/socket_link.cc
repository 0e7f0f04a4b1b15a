#include "transport/socket_link.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <deque>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "epfabric/common/status_macros.h"
#include "logging.h"
#include "transport/region_io.h"
#include "transport/socket_protocol.h"

namespace epfabric::daemon::transport::socket_wire {
namespace {

struct Item {
  FrameType type;
  uint64_t dst_offset;
  uint64_t src_offset;
  uint64_t arg;
  uint64_t cookie;
};

// The issuer side of one (destination rank, channel): a sender thread (connects, proves the group, writes frames in
// order) and an ack thread (completes them). Once it fails it stays failed: every queued and later command completes
// with the error naming the rank, at once.
class Connection {
 public:
  Connection(const GroupSetup& setup, int dest_rank, int channel, std::string address, LinkOptions options)
      : setup_(setup),
        dest_rank_(dest_rank),
        channel_(channel),
        address_(std::move(address)),
        options_(options),
        peer_(absl::StrCat("group '", setup.group, "' rank ", dest_rank, " (channel ", channel, ", ", address_, ")")) {
    // A host can run out of threads (three per peer and channel on this wire, both sides counted: a group of many
    // ranks with several channels needs thousands): the connection then fails with the reason instead of the daemon.
    try {
      sender_ = std::thread([this] { Send(); });
    } catch (const std::system_error& e) {
      Fail(OutOfThreads("sender", e));
    }
  }
  ~Connection() { Shutdown(); }

  void Enqueue(const Item& item) ABSL_LOCKS_EXCLUDED(mutex_) {
    absl::Status dead;
    {
      absl::MutexLock lock(&mutex_);
      if (failed_.ok()) {
        queue_.push_back(item);
        return;
      }
      dead = failed_;
    }
    setup_.sink->Complete(item.cookie, dead);
  }

  void Shutdown() ABSL_LOCKS_EXCLUDED(mutex_) {
    Fail(absl::CancelledError(absl::StrCat(peer_, ": the group's transport is shutting down")));
    if (sender_.joinable()) sender_.join();
    if (acker_.joinable()) acker_.join();
    absl::MutexLock lock(&mutex_);
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  // Marks the connection failed (the first status wins), wakes the threads and completes everything outstanding.
  void Fail(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mutex_) {
    std::vector<uint64_t> cookies;
    absl::Status failed;
    {
      absl::MutexLock lock(&mutex_);
      if (!failed_.ok()) return;
      failed_ = absl::IsCancelled(status) ? status : absl::UnavailableError(status.message());
      failed = failed_;
      for (const auto& [seq, cookie] : awaiting_) cookies.push_back(cookie);
      for (const Item& item : queue_) cookies.push_back(item.cookie);
      awaiting_.clear();
      queue_.clear();
      if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);  // unblocks both threads
    }
    if (!absl::IsCancelled(status)) Logger("transport")->warn("{}", std::string(status.message()));
    for (uint64_t cookie : cookies) setup_.sink->Complete(cookie, failed);
  }

  absl::Status OutOfThreads(const char* role, const std::system_error& e) const {
    return absl::ResourceExhaustedError(absl::StrCat(
        peer_, ": cannot start its ", role, " thread (", e.what(),
        "): this host has too many threads; the socket wire takes three per (peer rank, channel): fewer transport "
        "channels (CreateGroup's transport_channels) or the verbs wire"));
  }

  absl::Status Handshake(int fd) {
    Hello hello = {};
    hello.magic = kHelloMagic;
    hello.version = kProtocolVersion;
    // Up to 64 characters, NUL-padded (a name of exactly 64 has no terminator; the listener reads at most 64).
    std::memcpy(hello.group, setup_.group.data(), std::min(setup_.group.size(), sizeof(hello.group)));
    hello.issuer_rank = setup_.self_rank;
    hello.dest_rank = dest_rank_;
    hello.channel = channel_;
    RandomBytes(hello.nonce, kNonceBytes);
    SetIoTimeout(fd, options_.handshake_timeout);
    EPF_RETURN_IF_ERROR(WriteFull(fd, &hello, sizeof(hello), peer_));
    uint8_t server_nonce[kNonceBytes];
    std::string proof(kMacHexBytes, '\0');
    absl::Status read = ReadFull(fd, server_nonce, kNonceBytes, peer_);
    if (read.ok()) read = ReadFull(fd, proof.data(), proof.size(), peer_);
    if (!read.ok()) {
      return absl::UnavailableError(absl::StrCat(peer_, ": refused the group's handshake (", read.message(), ")"));
    }
    if (proof != ServerProof(setup_.data_key, hello, server_nonce)) {
      return absl::UnavailableError(absl::StrCat(peer_, ": the listener could not prove it holds the group's key"));
    }
    const std::string mine = ClientProof(setup_.data_key, hello, server_nonce);
    EPF_RETURN_IF_ERROR(WriteFull(fd, mine.data(), mine.size(), peer_));
    SetIoTimeout(fd, absl::ZeroDuration());
    return absl::OkStatus();
  }

  void Send() {
    absl::StatusOr<int> fd = ConnectTcp(address_, options_.connect_timeout);
    if (!fd.ok()) return Fail(absl::UnavailableError(absl::StrCat(peer_, ": ", fd.status().message())));
    {
      absl::MutexLock lock(&mutex_);
      fd_ = *fd;
      if (!failed_.ok()) return;
    }
    if (absl::Status shaken = Handshake(*fd); !shaken.ok()) return Fail(shaken);
    try {
      acker_ = std::thread([this, fd = *fd] { Acknowledge(fd); });
    } catch (const std::system_error& e) {
      return Fail(OutOfThreads("acknowledgement", e));
    }
    std::unique_ptr<RegionIo> io;
    uint64_t seq = 0;
    while (true) {
      Item item;
      {
        absl::MutexLock lock(&mutex_);
        mutex_.Await(absl::Condition(
            +[](Connection* c) ABSL_NO_THREAD_SAFETY_ANALYSIS { return !c->queue_.empty() || !c->failed_.ok(); },
            this));
        if (!failed_.ok()) return;
        item = queue_.front();
        queue_.pop_front();
        awaiting_.emplace_back(++seq, item.cookie);  // before the frame leaves, so that its ack finds it
      }
      if (absl::Status sent = SendFrame(*fd, item, seq, io); !sent.ok()) return Fail(sent);
    }
  }

  absl::Status SendFrame(int fd, const Item& item, uint64_t seq, std::unique_ptr<RegionIo>& io) {
    FrameHeader header = {static_cast<uint32_t>(item.type), 0, seq, item.dst_offset, item.arg};
    EPF_RETURN_IF_ERROR(WriteFull(fd, &header, sizeof(header), peer_));
    if (item.type != FrameType::kPut) return absl::OkStatus();
    if (io == nullptr) {
      EPF_ASSIGN_OR_RETURN(io, MakeRegionIo(setup_.region));
    }
    for (uint64_t done = 0; done < item.arg;) {
      const uint64_t n = std::min(io->chunk_bytes(), item.arg - done);
      EPF_ASSIGN_OR_RETURN(const void* source, io->Source(item.src_offset + done, n));
      EPF_RETURN_IF_ERROR(WriteFull(fd, source, n, peer_));
      done += n;
    }
    return absl::OkStatus();
  }

  void Acknowledge(int fd) {
    uint64_t acked = 0;
    while (true) {
      FrameHeader ack;
      if (absl::Status read = ReadFull(fd, &ack, sizeof(ack), peer_); !read.ok()) {
        return Fail(absl::UnavailableError(absl::StrCat(read.message(), " (rank ", dest_rank_, " lost)")));
      }
      std::vector<uint64_t> done;
      {
        absl::MutexLock lock(&mutex_);
        const uint64_t sent = awaiting_.empty() ? acked : awaiting_.back().first;
        if (ack.type != static_cast<uint32_t>(FrameType::kAck) || ack.seq <= acked || ack.seq > sent) {
          // Not from an honest listener: stop trusting the connection.
        } else {
          while (!awaiting_.empty() && awaiting_.front().first <= ack.seq) {
            done.push_back(awaiting_.front().second);
            awaiting_.pop_front();
          }
          acked = ack.seq;
        }
      }
      if (done.empty()) return Fail(absl::UnavailableError(absl::StrCat(peer_, ": bad acknowledgement")));
      for (uint64_t cookie : done) setup_.sink->Complete(cookie, absl::OkStatus());
    }
  }

  const GroupSetup& setup_;
  const int dest_rank_;
  const int channel_;
  const std::string address_;
  const LinkOptions options_;
  const std::string peer_;
  absl::Mutex mutex_;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mutex_);
  std::deque<std::pair<uint64_t, uint64_t>> awaiting_ ABSL_GUARDED_BY(mutex_);  // (seq, cookie), sent in order
  absl::Status failed_ ABSL_GUARDED_BY(mutex_);
  int fd_ ABSL_GUARDED_BY(mutex_) = -1;
  std::thread sender_;
  std::thread acker_;  // started by the sender thread, joined after it
};

class SocketLink final : public GroupLink {
 public:
  SocketLink(const GroupSetup& setup, const LinkOptions& options) : setup_(setup), options_(options) {}
  ~SocketLink() override { Shutdown(); }

  absl::Status Connect(const std::vector<v1::TransportEndpoint>& members) override {
    if (static_cast<int>(members.size()) != setup_.world) {
      return absl::InvalidArgumentError(
          absl::StrCat("transport: ", members.size(), " endpoints for a group of ", setup_.world));
    }
    EPF_ASSIGN_OR_RETURN(std::unique_ptr<RegionIo> local, MakeRegionIo(setup_.region));
    {
      absl::MutexLock lock(&local_mutex_);
      local_ = std::move(local);
    }
    absl::MutexLock lock(&connections_mutex_);
    addresses_.clear();
    for (const v1::TransportEndpoint& member : members) addresses_.push_back(member.data_address());
    connections_.resize(static_cast<size_t>(setup_.world) * setup_.channels);
    return absl::OkStatus();
  }

  void Put(int channel, int dst_rank, uint64_t dst_offset, uint64_t src_offset, uint64_t bytes,
           uint64_t cookie) override {
    if (dst_rank == setup_.self_rank) {
      absl::Status copied;
      {
        absl::MutexLock lock(&local_mutex_);
        copied = local_ != nullptr ? local_->CopyWithin(dst_offset, src_offset, bytes)
                                   : absl::FailedPreconditionError("transport: not connected");
      }
      return setup_.sink->Complete(cookie, copied);
    }
    Route(channel, dst_rank, {FrameType::kPut, dst_offset, src_offset, bytes, cookie});
  }

  void SignalAdd(int channel, int dst_rank, uint64_t dst_offset, int64_t value, uint64_t cookie) override {
    if (dst_rank == setup_.self_rank) {
      absl::Status added;
      {
        absl::MutexLock lock(&local_mutex_);
        added = local_ != nullptr ? local_->SignalAdd(dst_offset, value)
                                  : absl::FailedPreconditionError("transport: not connected");
      }
      return setup_.sink->Complete(cookie, added);
    }
    Route(channel, dst_rank, {FrameType::kSignal, dst_offset, 0, static_cast<uint64_t>(value), cookie});
  }

  void Shutdown() override {
    // Not under the lock: a connection's shutdown completes its commands (the sink), while a proxy thread may be
    // waiting in Route for the lock. No connection is made after this, and none is destroyed before the link.
    std::vector<Connection*> made;
    {
      absl::MutexLock lock(&connections_mutex_);
      shut_down_ = true;
      for (auto& connection : connections_) {
        if (connection != nullptr) made.push_back(connection.get());
      }
    }
    for (Connection* connection : made) connection->Shutdown();
  }

 private:
  // A (rank, channel) connection is made when its first command comes: the paths use few of them (normal mode one
  // peer per host on one ring, low latency one ring per rank on another host), and each costs three threads across
  // the two daemons, so a group of many ranks would otherwise start thousands (72 ranks x 4 channels ran a host out
  // of threads).
  void Route(int channel, int dst_rank, const Item& item) {
    const size_t at = static_cast<size_t>(dst_rank) * setup_.channels + channel;
    Connection* connection = nullptr;
    {
      absl::MutexLock lock(&connections_mutex_);
      if (!shut_down_ && at < connections_.size() && dst_rank >= 0 && dst_rank != setup_.self_rank) {
        if (connections_[at] == nullptr) {
          connections_[at] = std::make_unique<Connection>(setup_, dst_rank, channel, addresses_[dst_rank], options_);
        }
        connection = connections_[at].get();
      }
    }
    if (connection == nullptr) {
      return setup_.sink->Complete(item.cookie, absl::FailedPreconditionError("transport: not connected"));
    }
    connection->Enqueue(item);  // a connection lives until the link is destroyed
  }

  const GroupSetup setup_;
  const LinkOptions options_;
  absl::Mutex connections_mutex_;
  std::vector<std::string> addresses_ ABSL_GUARDED_BY(connections_mutex_);  // [rank]: its data address
  // [rank * channels + channel], made on first use; null for this member.
  std::vector<std::unique_ptr<Connection>> connections_ ABSL_GUARDED_BY(connections_mutex_);
  bool shut_down_ ABSL_GUARDED_BY(connections_mutex_) = false;
  absl::Mutex local_mutex_;
  std::unique_ptr<RegionIo> local_ ABSL_GUARDED_BY(local_mutex_);
};

}  // namespace

std::unique_ptr<GroupLink> MakeSocketLink(const GroupSetup& setup, const LinkOptions& options) {
  return std::make_unique<SocketLink>(setup, options);
}

}  // namespace epfabric::daemon::transport::socket_wire
