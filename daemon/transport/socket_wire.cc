#include "transport/socket_wire.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <list>
#include <map>
#include <set>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/daemon/options.h"
#include "logging.h"
#include "transport/region_io.h"
#include "transport/socket_link.h"
#include "transport/socket_protocol.h"

namespace epfabric::daemon::transport {
namespace {

using socket_wire::FrameHeader;
using socket_wire::FrameType;
using socket_wire::Hello;

// What the listener knows of a group this daemon is a member of.
struct ReceiveGroup {
  std::string name;
  std::string key;
  memory::Region* region = nullptr;
  uint64_t region_bytes = 0;
  int self_rank = -1;
  int world = 0;
  int channels = 0;
  absl::Mutex mutex;
  bool closed ABSL_GUARDED_BY(mutex) = false;
  std::set<int> fds ABSL_GUARDED_BY(mutex);  // accepted connections, shut down when the group goes
  // The proven connection of each (issuer rank, channel): one accepted later replaces it (the issuer reconnected).
  // Accept order, not handshake order, decides: handshakes of one issuer may finish in any order on a loaded host.
  struct Proven {
    int fd = -1;
    uint64_t accept_serial = 0;
  };
  std::map<std::pair<int, int>, Proven> by_issuer ABSL_GUARDED_BY(mutex);
};

// Descriptors the data listener's connections may hold: a third of what the process may open beyond a reserve for
// gRPC, regions and peer channels (read at every accept: `ulimit -n` may change).
int DescriptorBudget(int configured) {
  constexpr rlim_t kReserved = 64;
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return configured;
  const rlim_t budget = limit.rlim_cur > kReserved ? (limit.rlim_cur - kReserved) / 3 : 0;
  return static_cast<int>(std::min<rlim_t>(budget, static_cast<rlim_t>(configured)));
}

class SocketWireImpl;

// The group's link plus its registration with the listener: destroying it closes the group's accepted connections
// (and waits until no receiver thread uses its region).
class RegisteredLink final : public GroupLink {
 public:
  RegisteredLink(SocketWireImpl* wire, std::shared_ptr<ReceiveGroup> group, std::unique_ptr<GroupLink> link)
      : wire_(wire), group_(std::move(group)), link_(std::move(link)) {}
  ~RegisteredLink() override { Shutdown(); }
  absl::Status Connect(const std::vector<v1::TransportEndpoint>& members) override { return link_->Connect(members); }
  void Put(int channel, int dst_rank, uint64_t dst_offset, uint64_t src_offset, uint64_t bytes,
           uint64_t cookie) override {
    link_->Put(channel, dst_rank, dst_offset, src_offset, bytes, cookie);
  }
  void SignalAdd(int channel, int dst_rank, uint64_t dst_offset, int64_t value, uint64_t cookie) override {
    link_->SignalAdd(channel, dst_rank, dst_offset, value, cookie);
  }
  void Shutdown() override;

 private:
  SocketWireImpl* const wire_;
  std::shared_ptr<ReceiveGroup> group_;
  std::unique_ptr<GroupLink> link_;
};

class SocketWireImpl final : public SocketWire {
 public:
  explicit SocketWireImpl(SocketWireOptions options) : options_(std::move(options)) {}
  ~SocketWireImpl() override {
    stop_.store(true);
    if (listen_fd_ >= 0) shutdown(listen_fd_, SHUT_RDWR);
    if (acceptor_.joinable()) acceptor_.join();
    if (listen_fd_ >= 0) close(listen_fd_);
    if (spare_fd_ >= 0) close(spare_fd_);
    absl::MutexLock lock(&mutex_);
    for (int fd : pending_) shutdown(fd, SHUT_RDWR);
    for (auto& [name, group] : groups_) Close(*group);
    mutex_.Await(absl::Condition(
        +[](int* n) { return *n == 0; }, &receivers_));
  }

  absl::Status Listen() {
    EPF_ASSIGN_OR_RETURN(const HostPort hp, ParseHostPort(options_.listen));
    addrinfo hints = {};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const std::string port = std::to_string(hp.port);
    if (int err = getaddrinfo(hp.host.c_str(), port.c_str(), &hints, &found); err != 0) {
      return absl::InvalidArgumentError(absl::StrCat("--data_listen: ", options_.listen, ": ", gai_strerror(err)));
    }
    std::string error = "no address";
    for (addrinfo* a = found; a != nullptr && listen_fd_ < 0; a = a->ai_next) {
      int fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) continue;
      int one = 1;
      setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 256) == 0) {
        listen_fd_ = fd;
      } else {
        error = strerror(errno);
        close(fd);
      }
    }
    freeaddrinfo(found);
    if (listen_fd_ < 0) {
      return absl::UnavailableError(absl::StrCat("--data_listen: cannot listen on ", options_.listen, ": ", error));
    }
    sockaddr_storage bound = {};
    socklen_t len = sizeof(bound);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
    const int bound_port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                             : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    address_ = hp.host.find(':') != std::string::npos ? absl::StrCat("[", hp.host, "]:", bound_port)
                                                      : absl::StrCat(hp.host, ":", bound_port);
    acceptor_ = std::thread([this] { Accept(); });
    return absl::OkStatus();
  }

  v1::Transport kind() const override { return v1::TRANSPORT_SOCKET; }
  std::string Describe() const override { return absl::StrCat("socket ", address_); }
  std::string address() const override { return address_; }
  SocketWireCounters counters() const override {
    absl::MutexLock lock(&mutex_);
    return counters_;
  }

  absl::StatusOr<std::unique_ptr<GroupLink>> Open(const GroupSetup& setup, v1::TransportEndpoint* local) override {
    if (setup.region == nullptr || setup.sink == nullptr || setup.data_key.empty()) {
      return absl::InvalidArgumentError("socket wire: a group needs a region, a completion sink and a data key");
    }
    auto group = std::make_shared<ReceiveGroup>();
    group->name = setup.group;
    group->key = setup.data_key;
    group->region = setup.region;
    group->region_bytes = setup.region->descriptor().size_bytes();
    group->self_rank = setup.self_rank;
    group->world = setup.world;
    group->channels = setup.channels;
    {
      absl::MutexLock lock(&mutex_);
      if (groups_.count(setup.group) != 0) {
        return absl::AlreadyExistsError(absl::StrCat("socket wire: group '", setup.group, "' is open already"));
      }
      groups_[setup.group] = group;
    }
    local->set_transport(v1::TRANSPORT_SOCKET);
    local->set_region_bytes(group->region_bytes);
    local->set_data_address(address_);
    socket_wire::LinkOptions link_options{options_.connect_timeout, options_.handshake_timeout,
                                          options_.idle_timeout / 2};
    return std::make_unique<RegisteredLink>(this, group, socket_wire::MakeSocketLink(setup, link_options, &copies_));
  }

  // The group stops receiving: its connections are shut down and it leaves the registry; returns once no receiver
  // thread writes its region any more.
  void Unregister(const std::shared_ptr<ReceiveGroup>& group) {
    absl::MutexLock lock(&mutex_);
    auto it = groups_.find(group->name);
    if (it != groups_.end() && it->second == group) groups_.erase(it);
    Close(*group);
    mutex_.Await(absl::Condition(
        +[](ReceiveGroup* g) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          absl::MutexLock inner(&g->mutex);
          return g->fds.empty();
        },
        group.get()));
  }

 private:
  static void Close(ReceiveGroup& group) {
    absl::MutexLock lock(&group.mutex);
    group.closed = true;
    for (int fd : group.fds) shutdown(fd, SHUT_RDWR);
  }

  void Accept() {
    while (!stop_.load()) {
      pollfd p = {listen_fd_, POLLIN, 0};
      if (poll(&p, 1, 200) <= 0) continue;
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        const int error = errno;
        if (error == EMFILE || error == ENFILE) {
          // Out of descriptors: the spare one sheds the pending connection (so it leaves the backlog and poll does
          // not report it again at once), then accepting pauses.
          ShedWithSpare();
          Count(&SocketWireCounters::connections_refused);
          if (absl::Now() - last_emfile_warning_ > absl::Seconds(10)) {
            last_emfile_warning_ = absl::Now();
            Logger("transport")->warn("data listener: out of descriptors ({}); shedding connections", strerror(error));
          }
          absl::SleepFor(absl::Milliseconds(100));
        } else if (error != EINTR && error != EAGAIN && error != ECONNABORTED) {
          absl::SleepFor(absl::Milliseconds(10));
        }
        continue;
      }
      {
        absl::MutexLock lock(&mutex_);
        const int budget = DescriptorBudget(options_.max_connections);
        // Unproven connections make room for a new one, oldest first; proven ones are bounded per group.
        if (static_cast<int>(pending_.size()) >= options_.max_pending_handshakes ||
            (receivers_ - shed_ >= budget && !pending_.empty())) {
          ShedOldestPendingLocked();
        }
        if (receivers_ - shed_ >= budget) {
          ++counters_.connections_refused;
          close(fd);
          continue;
        }
        ++receivers_;
        pending_.push_back(fd);
      }
      try {
        std::thread([this, fd, accepted = absl::Now(), serial = ++accept_serial_] {
          Receive(fd, accepted, serial);
        }).detach();
      } catch (const std::system_error& e) {
        // Out of threads: the peer's connection fails (its issuer reports the rank), this daemon stays up.
        Logger("transport")->warn("refused a data connection: cannot start a receiver thread ({})", e.what());
        absl::MutexLock lock(&mutex_);
        pending_.remove(fd);
        close(fd);
        --receivers_;
        ++counters_.connections_refused;
      }
    }
  }

  // Shuts the oldest unproven connection down, preferring one whose hello has not arrived whole (a trickling
  // stranger; an issuing daemon sends its hello at once); its thread sees the end at once, counts it and exits.
  void ShedOldestPendingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
    // A plain loop: the thread-safety analysis does not see that a lambda called here runs under mutex_.
    auto victim = pending_.begin();
    while (victim != pending_.end() && hello_done_.count(*victim) != 0) ++victim;
    if (victim == pending_.end()) victim = pending_.begin();
    const int oldest = *victim;
    pending_.erase(victim);
    hello_done_.erase(oldest);
    shed_fds_.insert(oldest);
    ++shed_;
    shutdown(oldest, SHUT_RDWR);
  }

  void ShedWithSpare() {
    if (spare_fd_ >= 0) close(spare_fd_);
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) close(fd);
    spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  }

  void Count(uint64_t SocketWireCounters::*counter) {
    absl::MutexLock lock(&mutex_);
    ++(counters_.*counter);
  }

  // One accepted connection, from handshake to close.
  // `accept_serial` orders the connections by accept.
  void Receive(int fd, absl::Time accepted, uint64_t accept_serial) {
    const std::pair<int, int> issuer_channel = {-1, -1};
    std::pair<int, int> key = issuer_channel;
    socket_wire::SessionKeys keys = {};
    std::shared_ptr<ReceiveGroup> group =
        Handshake(fd, accepted + options_.handshake_timeout, accept_serial, &key, &keys);
    {
      absl::MutexLock lock(&mutex_);
      pending_.remove(fd);
      hello_done_.erase(fd);
      if (shed_fds_.erase(fd) != 0) --shed_;
    }
    if (group != nullptr) {
      absl::Status ended = Serve(fd, *group, keys);
      OPENSSL_cleanse(&keys, sizeof(keys));
      if (absl::IsDeadlineExceeded(ended)) {
        Logger("transport")
            ->info("data connection of group '{}' idle for {}: closed", group->name,
                   absl::FormatDuration(options_.idle_timeout));
      } else if (!absl::IsUnavailable(ended)) {
        Logger("transport")->warn("data connection of group '{}': {}", group->name, ended.ToString());
      }
      absl::MutexLock lock(&group->mutex);
      group->fds.erase(fd);
      auto it = group->by_issuer.find(key);
      if (it != group->by_issuer.end() && it->second.fd == fd) group->by_issuer.erase(it);
    }
    close(fd);
    absl::MutexLock lock(&mutex_);
    --receivers_;
  }

  // The group the connection proved it belongs to (registered in its fds, replacing the connection of the same
  // issuer rank and channel if that one was accepted earlier), or null (nothing written: refused and counted, or
  // superseded by a later connection of the same issuer rank and channel). The whole exchange ends by `deadline`.
  std::shared_ptr<ReceiveGroup> Handshake(int fd, absl::Time deadline, uint64_t accept_serial, std::pair<int, int>* key,
                                          socket_wire::SessionKeys* keys) {
    const std::string peer = "data connection";
    Hello hello;
    if (!socket_wire::ReadFullBefore(fd, &hello, sizeof(hello), deadline, peer).ok()) {
      Count(&SocketWireCounters::handshakes_refused);
      return nullptr;
    }
    std::shared_ptr<ReceiveGroup> group;
    const std::string name(hello.group, strnlen(hello.group, sizeof(hello.group)));
    {
      absl::MutexLock lock(&mutex_);
      if (shed_fds_.count(fd) == 0) hello_done_.insert(fd);
      auto it = groups_.find(name);
      if (it != groups_.end()) group = it->second;
    }
    const bool plausible = hello.magic == socket_wire::kHelloMagic && hello.version == socket_wire::kProtocolVersion &&
                           group != nullptr && hello.dest_rank == group->self_rank && hello.issuer_rank >= 0 &&
                           hello.issuer_rank < group->world && hello.channel >= 0 && hello.channel < group->channels;
    // A stranger gets the same 80 bytes whether or not the group exists here (random ones when it does not), and
    // the refusal comes after its proof either way: the data port is no oracle of group names.
    uint8_t nonce[socket_wire::kNonceBytes];
    socket_wire::RandomBytes(nonce, sizeof(nonce));
    std::string proof(socket_wire::kMacHexBytes, '\0');
    if (plausible) {
      proof = socket_wire::ServerProof(group->key, hello, nonce);
    } else {
      uint8_t noise[socket_wire::kMacHexBytes / 2];
      socket_wire::RandomBytes(noise, sizeof(noise));
      static constexpr char kHex[] = "0123456789abcdef";
      for (size_t i = 0; i < sizeof(noise); ++i) {
        proof[2 * i] = kHex[noise[i] >> 4];
        proof[2 * i + 1] = kHex[noise[i] & 15];
      }
    }
    std::string answer(socket_wire::kMacHexBytes, '\0');
    absl::Status io = socket_wire::WriteFullBefore(fd, nonce, sizeof(nonce), deadline, peer);
    if (io.ok()) io = socket_wire::WriteFullBefore(fd, proof.data(), proof.size(), deadline, peer);
    if (io.ok()) io = socket_wire::ReadFullBefore(fd, answer.data(), answer.size(), deadline, peer);
    const std::string expected =
        plausible ? socket_wire::ClientProof(group->key, hello, nonce) : std::string(socket_wire::kMacHexBytes, 'x');
    if (!plausible || !io.ok() || CRYPTO_memcmp(answer.data(), expected.data(), expected.size()) != 0) {
      Count(&SocketWireCounters::handshakes_refused);
      return nullptr;
    }
    // Proven: from now on a connection that carries nothing for idle_timeout is closed.
    socket_wire::SetIoTimeout(fd, options_.idle_timeout);
    *keys = socket_wire::DeriveSessionKeys(group->key, hello, nonce);
    *key = {hello.issuer_rank, hello.channel};
    absl::MutexLock lock(&group->mutex);
    if (group->closed) return nullptr;
    auto [it, fresh] = group->by_issuer.emplace(*key, ReceiveGroup::Proven{fd, accept_serial});
    if (!fresh) {
      // The issuer reconnected (or someone holding the group's key opened another): the last accepted one serves.
      if (it->second.accept_serial > accept_serial) return nullptr;
      shutdown(it->second.fd, SHUT_RDWR);
      it->second = {fd, accept_serial};
    }
    group->fds.insert(fd);
    return group;
  }

  // Frames until the connection ends. Every frame is authenticated (its header's tag, then each record of a Put's
  // payload before that record is written) and checked against the region before a byte is written; a frame that
  // fails either closes the connection and is counted. Records of a Put that checked out before a forged one may have
  // landed (they are the issuer's bytes); the issuer sees the connection end and fails the put.
  absl::Status Serve(int fd, ReceiveGroup& group, const socket_wire::SessionKeys& keys) {
    const std::string peer = absl::StrCat("group '", group.name, "' data connection");
    socket_wire::FrameCipher opener(keys.to_destination);
    socket_wire::FrameCipher sealer(keys.to_issuer);
    std::unique_ptr<RegionIo> io;
    std::vector<uint8_t> batch;  // sealed records as they arrive, opened in place
    uint64_t expected_seq = 1;
    auto refuse = [&](const FrameHeader& header, absl::string_view why) {
      Count(&SocketWireCounters::frames_refused);
      return absl::InvalidArgumentError(absl::StrCat(peer, ": refused frame (type ", header.type, ", seq ", header.seq,
                                                     ", offset ", header.offset, ", arg ", header.arg, "; region of ",
                                                     group.region_bytes, " bytes): ", why, "; connection closed"));
    };
    while (true) {
      uint8_t sealed_header[socket_wire::kSealedHeaderBytes];
      EPF_RETURN_IF_ERROR(socket_wire::ReadFull(fd, sealed_header, sizeof(sealed_header), peer));
      FrameHeader header;
      std::memcpy(&header, sealed_header, sizeof(header));
      if (!opener.Open(header, 0, nullptr, nullptr, 0, sealed_header + sizeof(header))) {
        return refuse(header, "its header failed authentication");
      }
      const uint64_t size = group.region_bytes;
      const bool put = header.type == static_cast<uint32_t>(FrameType::kPut);
      const bool signal = header.type == static_cast<uint32_t>(FrameType::kSignal);
      const uint64_t bytes = put ? header.arg : 8;
      const bool valid = (put || signal) && header.seq == expected_seq && bytes > 0 && header.offset <= size &&
                         bytes <= size - header.offset && (!signal || header.offset % 8 == 0);
      if (!valid) return refuse(header, "outside the region, out of sequence or of no known type");
      if (io == nullptr) {
        EPF_ASSIGN_OR_RETURN(io, MakeRegionIo(group.region));
      }
      if (put) {
        constexpr uint64_t kSealedRecord = socket_wire::kRecordBytes + socket_wire::kTagBytes;
        if (batch.empty()) batch.resize(socket_wire::kRecordsPerBatch * kSealedRecord);
        uint32_t index = 0;
        for (uint64_t done = 0; done < bytes;) {
          const uint64_t n = std::min(io->chunk_bytes(), bytes - done);
          EPF_ASSIGN_OR_RETURN(void* staged, io->Stage(header.offset + done, n));
          for (uint64_t at = 0; at < n;) {
            // A batch of records at once: whole records of kRecordBytes, the chunk's last one shorter.
            const uint64_t records = std::min(socket_wire::kRecordsPerBatch,
                                              (n - at + socket_wire::kRecordBytes - 1) / socket_wire::kRecordBytes);
            const uint64_t plain = std::min(records * socket_wire::kRecordBytes, n - at);
            EPF_RETURN_IF_ERROR(
                socket_wire::ReadFull(fd, batch.data(), plain + records * socket_wire::kTagBytes, peer));
            for (uint64_t i = 0; i < records; ++i) {
              const size_t r = static_cast<size_t>(std::min(socket_wire::kRecordBytes, n - at));
              uint8_t* sealed = batch.data() + i * kSealedRecord;
              if (!opener.Open(header, ++index, sealed, sealed, r, sealed + r)) {
                return refuse(header, absl::StrCat("record ", index, " of its payload failed authentication"));
              }
              std::memcpy(static_cast<uint8_t*>(staged) + at, sealed, r);
              at += r;
            }
          }
          EPF_RETURN_IF_ERROR(io->Land(header.offset + done, n));
          done += n;
        }
      } else {
        EPF_RETURN_IF_ERROR(io->SignalAdd(header.offset, static_cast<int64_t>(header.arg)));
      }
      Count(&SocketWireCounters::frames_applied);
      const FrameHeader ack = {static_cast<uint32_t>(FrameType::kAck), 0, header.seq, 0, 0};
      uint8_t sealed_ack[sizeof(FrameHeader) + socket_wire::kTagBytes];
      std::memcpy(sealed_ack, &ack, sizeof(ack));
      sealer.Seal(ack, 0, nullptr, nullptr, 0, sealed_ack + sizeof(ack));
      EPF_RETURN_IF_ERROR(socket_wire::WriteFull(fd, sealed_ack, sizeof(sealed_ack), peer));
      ++expected_seq;
    }
  }

  const SocketWireOptions options_;
  LocalCopies copies_;  // every group's commands to this member itself
  int listen_fd_ = -1;
  std::string address_;
  std::thread acceptor_;
  std::atomic<bool> stop_{false};
  mutable absl::Mutex mutex_;
  std::map<std::string, std::shared_ptr<ReceiveGroup>> groups_ ABSL_GUARDED_BY(mutex_);
  int receivers_ ABSL_GUARDED_BY(mutex_) = 0;
  std::list<int> pending_ ABSL_GUARDED_BY(mutex_);    // connections in their handshake, oldest first
  std::set<int> hello_done_ ABSL_GUARDED_BY(mutex_);  // in pending_, their hello arrived whole
  std::set<int> shed_fds_ ABSL_GUARDED_BY(mutex_);    // shed from pending_, their threads not yet past the handshake
  int shed_ ABSL_GUARDED_BY(mutex_) = 0;              // shed_fds_.size(): receivers that are about to go
  SocketWireCounters counters_ ABSL_GUARDED_BY(mutex_);
  int spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);  // the accept thread's
  absl::Time last_emfile_warning_ = absl::InfinitePast();   // the accept thread's
  uint64_t accept_serial_ = 0;                              // the accept thread's: connections in accept order
};

void RegisteredLink::Shutdown() {
  link_->Shutdown();
  if (group_ != nullptr) {
    wire_->Unregister(group_);
    group_ = nullptr;
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<SocketWire>> SocketWire::Start(const SocketWireOptions& options) {
  auto wire = std::make_unique<SocketWireImpl>(options);
  EPF_RETURN_IF_ERROR(wire->Listen());
  return wire;
}

}  // namespace epfabric::daemon::transport
