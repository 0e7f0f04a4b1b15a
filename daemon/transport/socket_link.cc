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
#include "transport/command_ring.h"
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
// order) and, per connection, an ack thread (completes them). A fault (the peer closed, reset or refused the
// connection, a bad acknowledgement) completes everything queued and unacknowledged with the error naming the rank;
// a later command of the same ring generation (lease) fails at once with that error too, because an earlier command
// of its stream was lost (a signal must never land after a put that did not), while the first command of a later
// generation connects anew: a link outlives a fault of the peer or of the network, and a dead peer costs one connect
// per lease, not one per command. A connection idle for idle_close is closed and made again on the next command.
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
      absl::MutexLock lock(&mutex_);
      dead_ = absl::UnavailableError(OutOfThreads("sender", e).message());
    }
  }
  ~Connection() { Shutdown(); }

  void Enqueue(const Item& item) ABSL_LOCKS_EXCLUDED(mutex_) {
    absl::Status refused;
    {
      absl::MutexLock lock(&mutex_);
      const bool quarantined = !quarantine_.ok() && CommandRing::CookieGeneration(item.cookie) == quarantined_;
      if (dead_.ok() && !quarantined) {
        queue_.push_back(item);
        return;
      }
      refused = dead_.ok() ? quarantine_ : dead_;
    }
    setup_.sink->Complete(item.cookie, refused);
  }

  void Shutdown() ABSL_LOCKS_EXCLUDED(mutex_) {
    {
      absl::MutexLock lock(&mutex_);
      if (dead_.ok()) dead_ = absl::CancelledError(absl::StrCat(peer_, ": the group's transport is shutting down"));
      if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);  // unblocks both threads
    }
    if (sender_.joinable()) sender_.join();
    FailOutstanding(absl::CancelledError(absl::StrCat(peer_, ": the group's transport is shutting down")));
  }

 private:
  // Completes everything queued and unacknowledged with `status` (the first fault of a connection wins: later
  // calls for the same connection find nothing left), quarantines their ring generation, and shuts the connection
  // down, which ends its threads.
  void FailOutstanding(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mutex_) {
    std::vector<uint64_t> cookies;
    const absl::Status failed = absl::IsCancelled(status) ? status : absl::UnavailableError(status.message());
    {
      absl::MutexLock lock(&mutex_);
      for (const auto& [seq, cookie] : awaiting_) cookies.push_back(cookie);
      for (const Item& item : queue_) cookies.push_back(item.cookie);
      awaiting_.clear();
      queue_.clear();
      if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);
      if (!cookies.empty()) {
        quarantine_ = failed;
        quarantined_ = CommandRing::CookieGeneration(cookies.back());
      }
    }
    if (cookies.empty()) return;
    if (!absl::IsCancelled(status)) Logger("transport")->warn("{}", std::string(status.message()));
    for (uint64_t cookie : cookies) setup_.sink->Complete(cookie, failed);
  }

  // The current connection ends (a fault, idle, or shutdown): its ack thread is joined, its descriptor closed.
  void Disconnect(std::thread& acker) ABSL_LOCKS_EXCLUDED(mutex_) {
    {
      absl::MutexLock lock(&mutex_);
      if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);
    }
    if (acker.joinable()) acker.join();
    absl::MutexLock lock(&mutex_);
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
    faulted_ = false;
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
    cut_short_ = absl::IsUnavailable(read);  // closed or reset, not timed out
    if (!read.ok()) {
      return absl::UnavailableError(absl::StrCat(peer_, ": refused the group's handshake (", read.message(), ")"));
    }
    if (proof != ServerProof(setup_.data_key, hello, server_nonce)) {
      return absl::UnavailableError(absl::StrCat(peer_, ": the listener could not prove it holds the group's key"));
    }
    const std::string mine = ClientProof(setup_.data_key, hello, server_nonce);
    EPF_RETURN_IF_ERROR(WriteFull(fd, mine.data(), mine.size(), peer_));
    SetIoTimeout(fd, absl::ZeroDuration());
    keys_ = DeriveSessionKeys(setup_.data_key, hello, server_nonce);
    return absl::OkStatus();
  }

  void Send() {
    while (true) {
      {
        absl::MutexLock lock(&mutex_);
        mutex_.Await(absl::Condition(
            +[](Connection* c) ABSL_NO_THREAD_SAFETY_ANALYSIS { return !c->queue_.empty() || !c->dead_.ok(); }, this));
        if (!dead_.ok()) return;
      }
      absl::Status connected = Connect();
      if (!connected.ok()) {
        FailOutstanding(connected);
        std::thread none;
        Disconnect(none);
        continue;
      }
      std::thread acker;
      try {
        acker = std::thread([this, fd = fd_unlocked_, key = keys_] { Acknowledge(fd, key.to_issuer); });
      } catch (const std::system_error& e) {
        FailOutstanding(OutOfThreads("acknowledgement", e));
        std::thread none;
        Disconnect(none);
        continue;
      }
      absl::Status ended = Stream(fd_unlocked_, keys_.to_destination);
      if (!ended.ok()) FailOutstanding(ended);
      Disconnect(acker);
    }
  }

  // Connects and proves the group; the descriptor is fd_ (and fd_unlocked_ for this thread).
  // A listener under a flood of stalling strangers closes its oldest unproven connections, which can be ours when the
  // machine is slow: a handshake cut short (the listener closed it) is tried again, a few times. A refused connect or
  // a handshake that timed out (a dead or stopped peer) is not.
  absl::Status Connect() {
    constexpr int kAttempts = 4;
    absl::Status last;
    for (int attempt = 0; attempt < kAttempts; ++attempt) {
      if (attempt > 0) {
        std::thread none;
        Disconnect(none);
        absl::SleepFor(absl::Milliseconds(10 * attempt));
      }
      absl::StatusOr<int> fd = ConnectTcp(address_, options_.connect_timeout);
      if (!fd.ok()) return absl::UnavailableError(absl::StrCat(peer_, ": ", fd.status().message()));
      {
        absl::MutexLock lock(&mutex_);
        fd_ = *fd;
        fd_unlocked_ = *fd;
        if (!dead_.ok()) return dead_;
      }
      last = Handshake(*fd);
      if (last.ok() || !absl::IsUnavailable(last) || !cut_short_) return last;
    }
    return last;
  }

  // Frames of this connection in order until a fault (its status), idle_close without anything outstanding, or
  // shutdown (OK for both).
  absl::Status Stream(int fd, const uint8_t key[kKeyBytes]) {
    FrameCipher cipher(key);
    std::unique_ptr<RegionIo> io;
    uint64_t seq = 0;
    while (true) {
      Item item;
      {
        absl::MutexLock lock(&mutex_);
        auto ready = +[](Connection* c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return !c->queue_.empty() || !c->dead_.ok() || c->faulted_;
        };
        if (!mutex_.AwaitWithTimeout(absl::Condition(ready, this), options_.idle_close) && awaiting_.empty()) {
          return absl::OkStatus();  // idle: closed now, made again on the next command
        }
        if (!dead_.ok()) return absl::OkStatus();
        if (faulted_) return fault_;
        if (queue_.empty()) continue;
        item = queue_.front();
        queue_.pop_front();
        awaiting_.emplace_back(++seq, item.cookie);  // before the frame leaves, so that its ack finds it
      }
      if (absl::Status sent = SendFrame(fd, item, seq, io, cipher); !sent.ok()) return sent;
    }
  }

  // The header and its tag, then (Put) the payload in sealed records (socket_protocol.h), a batch of them per write.
  absl::Status SendFrame(int fd, const Item& item, uint64_t seq, std::unique_ptr<RegionIo>& io, FrameCipher& cipher) {
    const FrameHeader header = {static_cast<uint32_t>(item.type), 0, seq, item.dst_offset, item.arg};
    if (out_.empty()) out_.resize(kSealedHeaderBytes + kRecordsPerBatch * (kRecordBytes + kTagBytes));
    std::memcpy(out_.data(), &header, sizeof(header));
    cipher.Seal(header, 0, nullptr, nullptr, 0, out_.data() + sizeof(header));
    size_t used = kSealedHeaderBytes;
    if (item.type == FrameType::kPut && io == nullptr) {
      EPF_ASSIGN_OR_RETURN(io, MakeRegionIo(setup_.region));
    }
    const uint64_t payload = item.type == FrameType::kPut ? item.arg : 0;
    uint32_t index = 0;
    for (uint64_t done = 0; done < payload;) {
      const uint64_t n = std::min(io->chunk_bytes(), payload - done);
      EPF_ASSIGN_OR_RETURN(const void* source, io->Source(item.src_offset + done, n));
      for (uint64_t at = 0; at < n;) {
        const size_t r = static_cast<size_t>(std::min(kRecordBytes, n - at));
        if (used + r + kTagBytes > out_.size()) {
          EPF_RETURN_IF_ERROR(WriteFull(fd, out_.data(), used, peer_));
          used = 0;
        }
        uint8_t* sealed = out_.data() + used;
        cipher.Seal(header, ++index, static_cast<const uint8_t*>(source) + at, sealed, r, sealed + r);
        used += r + kTagBytes;
        at += r;
      }
      done += n;
    }
    return WriteFull(fd, out_.data(), used, peer_);
  }

  // An acknowledgement counts only when its tag (the listener's key of this connection) checks out.
  void Acknowledge(int fd, const uint8_t key[kKeyBytes]) {
    FrameCipher cipher(key);
    uint64_t acked = 0;
    while (true) {
      FrameHeader ack;
      uint8_t tag[kTagBytes];
      absl::Status fault;
      std::vector<uint64_t> done;
      uint8_t sealed[kSealedHeaderBytes];
      const absl::Status read = ReadFull(fd, sealed, sizeof(sealed), peer_);
      std::memcpy(&ack, sealed, sizeof(ack));
      std::memcpy(tag, sealed + sizeof(ack), sizeof(tag));
      if (!read.ok()) {
        fault = absl::UnavailableError(absl::StrCat(read.message(), " (rank ", dest_rank_, " lost)"));
      } else if (!cipher.Open(ack, 0, nullptr, nullptr, 0, tag)) {
        fault = absl::UnavailableError(absl::StrCat(peer_, ": an acknowledgement failed its authentication"));
      } else {
        absl::MutexLock lock(&mutex_);
        const uint64_t sent = awaiting_.empty() ? acked : awaiting_.back().first;
        if (ack.type == static_cast<uint32_t>(FrameType::kAck) && ack.seq > acked && ack.seq <= sent) {
          while (!awaiting_.empty() && awaiting_.front().first <= ack.seq) {
            done.push_back(awaiting_.front().second);
            awaiting_.pop_front();
          }
          acked = ack.seq;
        }
        // Otherwise not from an honest listener: stop trusting the connection.
        if (done.empty()) fault = absl::UnavailableError(absl::StrCat(peer_, ": bad acknowledgement"));
      }
      for (uint64_t cookie : done) setup_.sink->Complete(cookie, absl::OkStatus());
      if (!fault.ok()) {
        absl::MutexLock lock(&mutex_);
        if (!faulted_) {
          faulted_ = true;
          fault_ = fault;
        }
        if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);  // a sender blocked in a write sees the end too
        return;
      }
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
  absl::Status dead_ ABSL_GUARDED_BY(mutex_);        // shut down (Cancelled) or no sender thread: for good
  absl::Status quarantine_ ABSL_GUARDED_BY(mutex_);  // the last fault, for the rest of its ring generation
  uint32_t quarantined_ ABSL_GUARDED_BY(mutex_) = 0;
  bool faulted_ ABSL_GUARDED_BY(mutex_) = false;  // the ack thread saw the current connection fail
  absl::Status fault_ ABSL_GUARDED_BY(mutex_);
  int fd_ ABSL_GUARDED_BY(mutex_) = -1;
  int fd_unlocked_ = -1;      // fd_, for the sender thread that sets it
  bool cut_short_ = false;    // the sender thread's: the last handshake ended by the listener closing it
  SessionKeys keys_ = {};     // the sender thread's: of the current connection
  std::vector<uint8_t> out_;  // the sender thread's: a sealed header and a batch of sealed records
  std::thread sender_;
};

class SocketLink final : public GroupLink {
 public:
  SocketLink(const GroupSetup& setup, const LinkOptions& options, LocalCopies* copies)
      : setup_(setup), options_(options), copies_(copies) {}
  ~SocketLink() override { Shutdown(); }

  absl::Status Connect(const std::vector<v1::TransportEndpoint>& members) override {
    if (static_cast<int>(members.size()) != setup_.world) {
      return absl::InvalidArgumentError(
          absl::StrCat("transport: ", members.size(), " endpoints for a group of ", setup_.world));
    }
    std::vector<std::unique_ptr<LocalCopies::Channel>> local;
    for (int c = 0; c < setup_.channels; ++c) {
      EPF_ASSIGN_OR_RETURN(std::unique_ptr<RegionIo> io, MakeRegionIo(setup_.region));
      local.push_back(copies_->Open(std::move(io), setup_.sink));
    }
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
      LocalCopies::Channel* local = Local(channel);
      if (local == nullptr) {
        return setup_.sink->Complete(cookie, absl::FailedPreconditionError("transport: not connected"));
      }
      return copies_->Put(*local, dst_offset, src_offset, bytes, cookie);
    }
    Route(channel, dst_rank, {FrameType::kPut, dst_offset, src_offset, bytes, cookie});
  }

  void SignalAdd(int channel, int dst_rank, uint64_t dst_offset, int64_t value, uint64_t cookie) override {
    if (dst_rank == setup_.self_rank) {
      LocalCopies::Channel* local = Local(channel);
      if (local == nullptr) {
        return setup_.sink->Complete(cookie, absl::FailedPreconditionError("transport: not connected"));
      }
      return copies_->SignalAdd(*local, dst_offset, value, cookie);
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
    std::vector<LocalCopies::Channel*> local;
    {
      absl::MutexLock lock(&local_mutex_);
      for (auto& channel : local_) local.push_back(channel.get());
    }
    for (LocalCopies::Channel* channel : local) copies_->Close(*channel);
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
  LocalCopies::Channel* Local(int channel) {
    absl::MutexLock lock(&local_mutex_);
    return channel >= 0 && channel < static_cast<int>(local_.size()) ? local_[channel].get() : nullptr;
  }

  LocalCopies* const copies_;
  absl::Mutex local_mutex_;
  // [channel]: commands to this member itself (made at Connect, kept until the link goes).
  std::vector<std::unique_ptr<LocalCopies::Channel>> local_ ABSL_GUARDED_BY(local_mutex_);
};

}  // namespace

std::unique_ptr<GroupLink> MakeSocketLink(const GroupSetup& setup, const LinkOptions& options, LocalCopies* copies) {
  return std::make_unique<SocketLink>(setup, options, copies);
}

}  // namespace epfabric::daemon::transport::socket_wire
