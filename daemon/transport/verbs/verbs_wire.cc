#include "transport/verbs/verbs_wire.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "epfabric/common/status_macros.h"
#include "epfabric/kernels/transport/ring.h"
#include "spdlog/spdlog.h"
#include "transport/verbs/send_queue.h"
#include "transport/verbs/verbs_logic.h"
#include "transport/verbs/verbs_resources.h"

namespace epfabric::daemon::transport::verbs {
namespace {

// One queue pair of a link: to `peer` on `channel` (to itself, looped back, when peer is this rank).
struct QueuePair {
  int peer = 0;
  int channel = 0;
  QpPtr qp;
  uint32_t psn = 0;
  std::unique_ptr<SendQueue> queue;
  // Set by Connect before `connected_` is published; read-only afterwards.
  uint64_t remote_address = 0;
  uint32_t remote_rkey = 0;
};

class VerbsLink final : public GroupLink {
 public:
  VerbsLink(std::shared_ptr<const Device> device, const VerbsOptions& options, const GroupSetup& setup)
      : device_(std::move(device)),
        options_(options),
        logger_(options.logger != nullptr ? options.logger : spdlog::default_logger()),
        group_(setup.group),
        self_(setup.self_rank),
        world_(setup.world),
        channels_(setup.channels),
        region_(setup.region),
        sink_(setup.sink),
        max_write_(MaxWriteBytes(device_->max_msg_sz())) {}

  ~VerbsLink() override {
    Shutdown();
    if (wake_fd_ >= 0) close(wake_fd_);
  }

  absl::Status Open(v1::TransportEndpoint* local) {
    const ibv_device_attr& attr = device_->attr();
    const int num_qps = world_ * channels_;
    EPF_ASSIGN_OR_RETURN(QueueSizes sizes,
                         SizeQueues(num_qps, options_.send_queue_depth, attr.max_qp_wr, attr.max_cqe));
    EPF_ASSIGN_OR_RETURN(region_mr_, RegisterRegion(device_->pd(), *region_, options_.allow_peermem));
    // Fetch-and-add writes the old value back to the initiator; nobody reads it, so all atomics share one word.
    const int result_access = IBV_ACCESS_LOCAL_WRITE;  // an int: ibv_reg_mr's macro mixes enum types otherwise
    result_mr_.reset(ibv_reg_mr(device_->pd(), atomic_result_.data(), sizeof(atomic_result_), result_access));
    if (result_mr_ == nullptr) return ErrnoStatus(errno, "ibv_reg_mr(atomic result)");

    channel_.reset(ibv_create_comp_channel(device_->context()));
    if (channel_ == nullptr) return ErrnoStatus(errno, "ibv_create_comp_channel");
    cq_.reset(ibv_create_cq(device_->context(), sizes.cq_entries, nullptr, channel_.get(), 0));
    if (cq_ == nullptr) return ErrnoStatus(errno, absl::StrCat("ibv_create_cq(", sizes.cq_entries, ")"));
    wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_fd_ < 0) return ErrnoStatus(errno, "eventfd");

    std::random_device seed;
    std::mt19937 random(seed());
    EndpointData endpoint;
    qps_.resize(static_cast<size_t>(num_qps));
    for (int peer = 0; peer < world_; ++peer) {
      for (int channel = 0; channel < channels_; ++channel) {
        QueuePair& q = qps_[QpIndex(peer, channel, channels_)];
        q.peer = peer;
        q.channel = channel;
        q.queue = std::make_unique<SendQueue>(sizes.send_queue_depth, sink_, Where(peer, channel));
        EPF_ASSIGN_OR_RETURN(q.qp, CreateRcQp(device_->pd(), cq_.get(), sizes.send_queue_depth));
        EPF_RETURN_IF_ERROR(ModifyQp(q.qp.get(), InitTransition(device_->port().port), "ibv_modify_qp(INIT)"));
        // A random starting PSN keeps stray packets of an earlier queue pair with a reused number from matching.
        q.psn = random() & kMax24Bit;
        endpoint.qp_numbers.push_back(q.qp->qp_num);
        endpoint.psns.push_back(q.psn);
      }
    }
    const PortChoice& port = device_->port();
    endpoint.rank = self_;
    endpoint.address = region_mr_.address;
    endpoint.region_bytes = region_mr_.bytes;
    endpoint.rkey = region_mr_.mr->rkey;
    endpoint.gid = port.gid;
    endpoint.lid = port.lid;
    endpoint.mtu = port.mtu;
    endpoint.gid_index = port.gid_index;
    endpoint.port = port.port;
    endpoint.roce = port.roce;
    FillEndpoint(endpoint, local);
    logger_->info("verbs: group {} rank {}: {} queue pairs of {} send slots, region of {} bytes registered with {}",
                  group_, self_, num_qps, sizes.send_queue_depth, region_mr_.bytes,
                  std::string(RegistrationPathName(region_mr_.path)));
    return absl::OkStatus();
  }

  absl::Status Connect(const std::vector<v1::TransportEndpoint>& members) override {
    absl::MutexLock lock(&lifecycle_mu_);
    if (connected_.load(std::memory_order_relaxed) || shut_down_) {
      return absl::FailedPreconditionError(
          absl::StrCat("verbs: group ", group_, ": Connect after Connect or Shutdown"));
    }
    if (static_cast<int>(members.size()) != world_) {
      return absl::InvalidArgumentError(
          absl::StrCat("verbs: group ", group_, ": ", members.size(), " endpoints for a group of ", world_));
    }
    std::vector<EndpointData> remote;
    remote.reserve(members.size());
    for (int rank = 0; rank < world_; ++rank) {
      EPF_ASSIGN_OR_RETURN(EndpointData data, ParseEndpoint(members[rank], EndpointExpectations{rank, world_, channels_,
                                                                                                device_->port().roce}));
      remote.push_back(std::move(data));
    }
    const ibv_device_attr& attr = device_->attr();
    const int max_dest_rd_atomic = std::min(options_.max_rd_atomic, attr.max_qp_rd_atom);
    const int max_rd_atomic = std::min(options_.max_rd_atomic, attr.max_qp_init_rd_atom);
    for (int peer = 0; peer < world_; ++peer) {
      absl::Status peer_status;
      for (int channel = 0; channel < channels_ && peer_status.ok(); ++channel) {
        QueuePair& q = qps_[QpIndex(peer, channel, channels_)];
        q.remote_address = remote[peer].address;
        q.remote_rkey = remote[peer].rkey;
        const int their = QpIndex(self_, channel, channels_);
        peer_status = ModifyQp(q.qp.get(),
                               RtrTransition(device_->port(), remote[peer], remote[peer].qp_numbers[their],
                                             remote[peer].psns[their], options_, max_dest_rd_atomic),
                               "ibv_modify_qp(RTR)");
        if (peer_status.ok()) {
          peer_status = ModifyQp(q.qp.get(), RtsTransition(q.psn, options_, max_rd_atomic), "ibv_modify_qp(RTS)");
        }
      }
      // An unreachable peer (RoCE cannot resolve its GID, say) fails its commands, not the group.
      if (!peer_status.ok()) {
        FailPeer(peer,
                 absl::UnavailableError(
                     absl::StrCat("verbs: group ", group_, ", rank ", peer, ": connect: ", peer_status.message())),
                 -1);
      }
    }
    thread_ = std::thread([this] { CompletionLoop(); });
    connected_.store(true, std::memory_order_release);
    return absl::OkStatus();
  }

  void Put(int channel, int dst_rank, uint64_t dst_offset, uint64_t src_offset, uint64_t bytes,
           uint64_t cookie) override {
    QueuePair* q = nullptr;
    if (absl::Status usable = Target(channel, dst_rank, &q); !usable.ok()) {
      sink_->Complete(cookie, std::move(usable));
      return;
    }
    const uint64_t local = region_mr_.address + src_offset;
    const uint64_t remote = q->remote_address + dst_offset;
    const int index = QpIndex(dst_rank, channel, channels_);
    q->queue->Submit(cookie, WriteCount(bytes, max_write_), absl::Now() + options_.post_timeout,
                     [&](uint64_t i) -> absl::Status {
                       const uint64_t offset = i * max_write_;
                       ibv_sge sge{};
                       sge.addr = local + offset;
                       sge.length = static_cast<uint32_t>(std::min(max_write_, bytes - offset));
                       sge.lkey = region_mr_.mr->lkey;
                       ibv_send_wr wr{};
                       wr.wr_id = static_cast<uint64_t>(index);
                       wr.sg_list = &sge;
                       wr.num_sge = bytes == 0 ? 0 : 1;
                       wr.opcode = IBV_WR_RDMA_WRITE;
                       wr.send_flags = IBV_SEND_SIGNALED;
                       wr.wr.rdma.remote_addr = remote + offset;
                       wr.wr.rdma.rkey = q->remote_rkey;
                       return PostSend(*q, &wr);
                     });
  }

  void SignalAdd(int channel, int dst_rank, uint64_t dst_offset, int64_t value, uint64_t cookie) override {
    QueuePair* q = nullptr;
    if (absl::Status usable = Target(channel, dst_rank, &q); !usable.ok()) {
      sink_->Complete(cookie, std::move(usable));
      return;
    }
    const uint64_t remote = q->remote_address + dst_offset;
    if (remote % 8 != 0) {
      // IB atomics need a naturally aligned 8-byte word; the proxy checks offsets, this also covers the base.
      sink_->Complete(
          cookie, absl::InvalidArgumentError(absl::StrCat("verbs: ", Where(dst_rank, channel), ": signal address 0x",
                                                          absl::Hex(remote), " is not 8-byte aligned")));
      return;
    }
    const int index = QpIndex(dst_rank, channel, channels_);
    q->queue->Submit(cookie, 1, absl::Now() + options_.post_timeout, [&](uint64_t) -> absl::Status {
      ibv_sge sge{};
      sge.addr = reinterpret_cast<uint64_t>(atomic_result_.data());
      sge.length = sizeof(uint64_t);
      sge.lkey = result_mr_->lkey;
      ibv_send_wr wr{};
      wr.wr_id = static_cast<uint64_t>(index);
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
      // The fence holds the atomic until earlier RDMA READs and atomics of this queue pair have completed; earlier
      // writes are already executed before it at the responder (RC ordering). docs/internode-verbs.md says more.
      wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_FENCE;
      wr.wr.atomic.remote_addr = remote;
      wr.wr.atomic.compare_add = static_cast<uint64_t>(value);
      wr.wr.atomic.rkey = q->remote_rkey;
      return PostSend(*q, &wr);
    });
  }

  void Shutdown() override {
    {
      absl::MutexLock lock(&lifecycle_mu_);
      if (shut_down_) return;
      shut_down_ = true;
    }
    stop_.store(true, std::memory_order_release);
    for (QueuePair& q : qps_) {
      if (q.qp != nullptr) (void)ToErrorState(q.qp.get());
      if (q.queue != nullptr) q.queue->Close();
    }
    if (wake_fd_ >= 0) {
      const uint64_t one = 1;
      (void)!write(wake_fd_, &one, sizeof(one));
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::string Where(int peer, int channel) const {
    return absl::StrCat("group ", group_, ", rank ", peer, ", channel ", channel);
  }

  absl::Status Target(int channel, int dst_rank, QueuePair** q) {
    if (channel < 0 || channel >= channels_ || dst_rank < 0 || dst_rank >= world_) {
      return absl::InvalidArgumentError(
          absl::StrCat("verbs: group ", group_, ": no channel ", channel, " to rank ", dst_rank));
    }
    if (!connected_.load(std::memory_order_acquire)) {
      return absl::FailedPreconditionError(absl::StrCat("verbs: group ", group_, ": not connected"));
    }
    *q = &qps_[QpIndex(dst_rank, channel, channels_)];
    return absl::OkStatus();
  }

  static absl::Status PostSend(QueuePair& q, ibv_send_wr* wr) {
    ibv_send_wr* bad = nullptr;
    if (int rc = ibv_post_send(q.qp.get(), wr, &bad); rc != 0) return ErrnoStatus(rc, "ibv_post_send");
    return absl::OkStatus();
  }

  // Every queue pair to `peer` goes to the error state and fails what it holds: `failing` (the queue whose
  // completion failed, -1 for none) with `status`, the other channels with "peer lost".
  void FailPeer(int peer, const absl::Status& status, int failing) {
    logger_->warn("verbs: {}", std::string(status.message()));
    for (int channel = 0; channel < channels_; ++channel) {
      const int index = QpIndex(peer, channel, channels_);
      QueuePair& q = qps_[index];
      (void)ToErrorState(q.qp.get());
      q.queue->Fail(index == failing || failing < 0
                        ? status
                        : absl::UnavailableError(
                              absl::StrCat("verbs: ", Where(peer, channel), ": peer lost: ", status.message())));
    }
  }

  void HandleCompletion(const ibv_wc& wc) {
    if (wc.wr_id >= qps_.size() || qps_[wc.wr_id].qp->qp_num != wc.qp_num) {
      logger_->error("verbs: group {}: completion for unknown work request {} on qp {}", group_, wc.wr_id, wc.qp_num);
      return;
    }
    QueuePair& q = qps_[wc.wr_id];
    if (wc.status == IBV_WC_SUCCESS) {
      q.queue->OnSuccess();
      return;
    }
    // Flushes after our own transition to the error state: their commands were failed already.
    if (wc.status == IBV_WC_WR_FLUSH_ERR && !q.queue->status().ok()) return;
    if (!q.queue->status().ok()) return;
    FailPeer(q.peer, WcStatusToStatus(wc.status, wc.vendor_err, group_, q.peer, q.channel, "RDMA WRITE or atomic"),
             static_cast<int>(wc.wr_id));
  }

  // Drains the completion queue, then sleeps on the completion channel (re-armed before every drain, so no
  // completion is missed) or the wake-up eventfd. Keeps draining without sleeping while completions keep coming.
  void CompletionLoop() {
    ibv_req_notify_cq(cq_.get(), 0);
    std::array<ibv_wc, 32> wcs;
    while (!stop_.load(std::memory_order_acquire)) {
      int n = 0;
      int total = 0;
      while ((n = ibv_poll_cq(cq_.get(), static_cast<int>(wcs.size()), wcs.data())) > 0) {
        for (int i = 0; i < n; ++i) HandleCompletion(wcs[i]);
        total += n;
      }
      if (n < 0) logger_->error("verbs: group {}: ibv_poll_cq failed ({})", group_, n);
      if (total > 0) continue;
      std::array<pollfd, 2> fds{pollfd{channel_->fd, POLLIN, 0}, pollfd{wake_fd_, POLLIN, 0}};
      if (poll(fds.data(), fds.size(), 100) <= 0) continue;
      if ((fds[0].revents & POLLIN) != 0) {
        ibv_cq* event_cq = nullptr;
        void* event_context = nullptr;
        if (ibv_get_cq_event(channel_.get(), &event_cq, &event_context) == 0) {
          ibv_ack_cq_events(event_cq, 1);
          ibv_req_notify_cq(cq_.get(), 0);
        }
      }
    }
  }

  const std::shared_ptr<const Device> device_;
  const VerbsOptions options_;
  const std::shared_ptr<spdlog::logger> logger_;
  const std::string group_;
  const int self_;
  const int world_;
  const int channels_;
  memory::Region* const region_;
  CompletionSink* const sink_;
  const uint64_t max_write_;

  // Destroyed in reverse order: queue pairs, then registrations, then the completion queue and its channel.
  CompChannelPtr channel_;
  CqPtr cq_;
  Registration region_mr_;
  alignas(64) std::array<uint64_t, 8> atomic_result_{};
  MrPtr result_mr_;
  std::vector<QueuePair> qps_;  // index QpIndex(peer, channel); fixed after Open
  int wake_fd_ = -1;

  absl::Mutex lifecycle_mu_;
  bool shut_down_ ABSL_GUARDED_BY(lifecycle_mu_) = false;
  std::atomic<bool> connected_{false};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

class VerbsWire final : public Wire {
 public:
  VerbsWire(std::shared_ptr<const Device> device, const VerbsOptions& options)
      : device_(std::move(device)), options_(options) {}

  v1::Transport kind() const override { return v1::TRANSPORT_VERBS; }

  absl::StatusOr<std::unique_ptr<GroupLink>> Open(const GroupSetup& setup, v1::TransportEndpoint* local) override {
    if (setup.region == nullptr || setup.sink == nullptr || local == nullptr) {
      return absl::InvalidArgumentError("verbs: Open needs a region, a completion sink and an endpoint to fill");
    }
    if (setup.world < 1 || setup.self_rank < 0 || setup.self_rank >= setup.world || setup.channels < 1 ||
        setup.channels > kernels::transport::kMaxChannels) {
      return absl::InvalidArgumentError(absl::StrCat("verbs: group ", setup.group, ": rank ", setup.self_rank, " of ",
                                                     setup.world, " with ", setup.channels, " channels"));
    }
    auto link = std::make_unique<VerbsLink>(device_, options_, setup);
    EPF_RETURN_IF_ERROR(link->Open(local));
    return link;
  }

  std::string Describe() const override { return absl::StrCat("verbs ", DescribePort(device_->port())); }

 private:
  const std::shared_ptr<const Device> device_;
  const VerbsOptions options_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Wire>> MakeVerbsWire(const VerbsOptions& options) {
  EPF_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, Device::Open(options));
  return std::make_unique<VerbsWire>(std::shared_ptr<const Device>(std::move(device)), options);
}

}  // namespace epfabric::daemon::transport::verbs
