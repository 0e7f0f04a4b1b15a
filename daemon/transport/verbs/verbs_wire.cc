#include "transport/verbs/verbs_wire.h"

#include <infiniband/verbs.h>
#include <sys/random.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "epfabric/common/cuda_driver.h"
#include "epfabric/common/status_macros.h"
#include "logging.h"
#include "transport/verbs/verbs_logic.h"

namespace epfabric::daemon::transport::verbs {
namespace {

constexpr uint64_t kMaxWrite = 1ull << 30;  // one RDMA WRITE moves at most this much; larger puts are split

absl::Status Errno(const std::string& what) {
  return absl::InternalError(absl::StrCat("verbs: ", what, ": ", strerror(errno)));
}

uint32_t RandomPsn() {
  uint32_t value = 0;
  while (getrandom(&value, sizeof(value), 0) != sizeof(value)) {
  }
  return value & 0xffffff;
}

// The daemon's device: context, protection domain, the port and its addressing.
struct Device {
  ibv_context* context = nullptr;
  ibv_pd* pd = nullptr;
  uint8_t port = 1;
  ibv_port_attr port_attr{};
  uint8_t gid_index = 0;
  std::array<uint8_t, 16> gid{};
  bool roce = false;
  std::string name;

  ~Device() {
    if (pd != nullptr) ibv_dealloc_pd(pd);
    if (context != nullptr) ibv_close_device(context);
  }
};

// A RoCE v2 GID of the port (the first non-zero one); IB ports use GID 0.
absl::Status PickGid(Device& device) {
  device.roce = device.port_attr.link_layer == IBV_LINK_LAYER_ETHERNET;
  for (int index = 0; index < device.port_attr.gid_tbl_len; ++index) {
    ibv_gid_entry entry{};
    if (ibv_query_gid_ex(device.context, device.port, index, &entry, 0) != 0) continue;
    bool zero = true;
    for (uint8_t b : entry.gid.raw) zero = zero && b == 0;
    if (zero) continue;
    if (device.roce && entry.gid_type != IBV_GID_TYPE_ROCE_V2) continue;
    ibv_gid gid = entry.gid;
    device.gid_index = static_cast<uint8_t>(index);
    std::memcpy(device.gid.data(), gid.raw, 16);
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      absl::StrCat("--transport=verbs: device ", device.name, " port ", device.port, " has no ",
                   device.roce ? "RoCE v2 GID (is an IP address configured on the interface?)" : "GID"));
}

absl::StatusOr<std::unique_ptr<Device>> OpenDevice(const VerbsOptions& options) {
  EPF_RETURN_IF_ERROR(ProbeVerbs());
  int count = 0;
  ibv_device** list = ibv_get_device_list(&count);
  auto device = std::make_unique<Device>();
  for (int i = 0; i < count && device->context == nullptr; ++i) {
    if (!options.device.empty() && options.device != ibv_get_device_name(list[i])) continue;
    ibv_context* context = ibv_open_device(list[i]);
    if (context == nullptr) continue;
    ibv_device_attr attr{};
    bool found = false;
    if (ibv_query_device(context, &attr) == 0) {
      for (uint8_t port = 1; port <= attr.phys_port_cnt && !found; ++port) {
        if (ibv_query_port(context, port, &device->port_attr) == 0 && device->port_attr.state == IBV_PORT_ACTIVE) {
          device->port = port;
          found = true;
        }
      }
    }
    if (!found) {
      ibv_close_device(context);
      continue;
    }
    device->context = context;
    device->name = ibv_get_device_name(list[i]);
  }
  ibv_free_device_list(list);
  if (device->context == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("--transport=verbs: no active port on ", options.device.empty() ? "any device" : options.device));
  }
  device->pd = ibv_alloc_pd(device->context);
  if (device->pd == nullptr) return Errno("ibv_alloc_pd");
  EPF_RETURN_IF_ERROR(PickGid(*device));
  return device;
}

bool DmaBufSupported(int gpu) {
  bool dmabuf = false;
  if (gpu >= 0) {
    auto driver = cuda::Driver();
    if (driver.ok()) {
      CUdevice cu_device = 0;
      int supported = 0;
      if ((*driver)->cuDeviceGet(&cu_device, gpu) == CUDA_SUCCESS &&
          (*driver)->cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, cu_device) ==
              CUDA_SUCCESS) {
        dmabuf = supported != 0;
      }
    }
  }
  return dmabuf;
}

bool PeerMemLoaded() { return std::filesystem::exists("/sys/module/nvidia_peermem"); }

// Registers `region` along the path its memory allows.
absl::StatusOr<ibv_mr*> Register(const Device& device, memory::Region* region) {
  void* base = region->base();
  const uint64_t size = region->descriptor().size_bytes();
  const int gpu = region->descriptor().device();
  EPF_ASSIGN_OR_RETURN(const RegistrationPath path,
                       ChooseRegistrationPath(gpu >= 0, DmaBufSupported(gpu), PeerMemLoaded()));
  ibv_mr* mr = nullptr;
  if (path == RegistrationPath::kDmaBuf) {
    EPF_ASSIGN_OR_RETURN(const cuda::DriverApi* driver, cuda::Driver());
    int fd = -1;
    EPF_RETURN_IF_ERROR(
        cuda::CuStatus(*driver,
                       driver->cuMemGetHandleForAddressRange(&fd, reinterpret_cast<CUdeviceptr>(base), size,
                                                             CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0),
                       "cuMemGetHandleForAddressRange(DMA_BUF_FD)"));
    mr = ibv_reg_dmabuf_mr(device.pd, 0, size, reinterpret_cast<uint64_t>(base), fd, kAccessFlags);
    close(fd);  // the registration holds the buffer
  } else {
    mr = ibv_reg_mr(device.pd, base, size, kAccessFlags);
  }
  if (mr == nullptr) return Errno(absl::StrCat("registering ", size, " bytes (", RegistrationPathName(path), ")"));
  return mr;
}

class VerbsLink final : public GroupLink {
 public:
  VerbsLink(const Device& device, const GroupSetup& setup, int queue_depth)
      : device_(device), setup_(setup), queue_depth_(queue_depth) {}
  ~VerbsLink() override {
    Shutdown();
    for (ibv_qp* qp : qps_) {
      if (qp != nullptr) ibv_destroy_qp(qp);
    }
    if (scratch_mr_ != nullptr) ibv_dereg_mr(scratch_mr_);
    if (mr_ != nullptr) ibv_dereg_mr(mr_);
    if (cq_ != nullptr) ibv_destroy_cq(cq_);
  }

  absl::Status Open(v1::TransportEndpoint* local) {
    EPF_ASSIGN_OR_RETURN(mr_, Register(device_, setup_.region));
    scratch_mr_ = ibv_reg_mr(device_.pd, &scratch_, sizeof(scratch_), IBV_ACCESS_LOCAL_WRITE);
    if (scratch_mr_ == nullptr) return Errno("registering the atomic result word");
    const int queue_pairs = setup_.world * setup_.channels;
    cq_ = ibv_create_cq(device_.context, std::max(1, queue_pairs) * queue_depth_, nullptr, nullptr, 0);
    if (cq_ == nullptr) return Errno("ibv_create_cq");
    VerbsEndpoint endpoint;
    endpoint.address = reinterpret_cast<uint64_t>(setup_.region->base());
    endpoint.rkey = mr_->rkey;
    endpoint.gid = device_.gid;
    endpoint.lid = device_.port_attr.lid;
    endpoint.mtu = device_.port_attr.active_mtu;
    endpoint.gid_index = device_.gid_index;
    endpoint.port = device_.port;
    endpoint.roce = device_.roce;
    qps_.assign(queue_pairs, nullptr);
    failed_ = std::vector<std::atomic<bool>>(queue_pairs);
    for (int i = 0; i < queue_pairs; ++i) {
      const bool self = i / setup_.channels == setup_.self_rank;
      uint32_t qpn = 0, psn = 0;
      if (!self) {
        ibv_qp_init_attr init{};
        init.send_cq = cq_;
        init.recv_cq = cq_;
        init.qp_type = IBV_QPT_RC;
        init.cap.max_send_wr = static_cast<uint32_t>(queue_depth_);
        init.cap.max_recv_wr = 1;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        qps_[i] = ibv_create_qp(device_.pd, &init);
        if (qps_[i] == nullptr) return Errno("ibv_create_qp");
        QpTransition to_init = InitTransition(device_.port);
        if (ibv_modify_qp(qps_[i], &to_init.attr, to_init.mask) != 0) return Errno("queue pair to INIT");
        qpn = qps_[i]->qp_num;
        psn = RandomPsn();
      }
      endpoint.qp_numbers.push_back(qpn);
      endpoint.psns.push_back(psn);
    }
    local_ = endpoint;
    local->set_transport(v1::TRANSPORT_VERBS);
    local->set_region_bytes(setup_.region->descriptor().size_bytes());
    *local->mutable_rdma() = ToProto(endpoint, setup_.self_rank);
    return absl::OkStatus();
  }

  absl::Status Connect(const std::vector<v1::TransportEndpoint>& members) override {
    if (static_cast<int>(members.size()) != setup_.world) {
      return absl::InvalidArgumentError(absl::StrCat("verbs: ", members.size(), " endpoints for ", setup_.world));
    }
    const size_t queue_pairs = static_cast<size_t>(setup_.world) * setup_.channels;
    remote_.resize(setup_.world);
    for (int peer = 0; peer < setup_.world; ++peer) {
      if (peer == setup_.self_rank) continue;
      EPF_ASSIGN_OR_RETURN(remote_[peer], FromProto(members[peer].rdma(), queue_pairs));
      for (int c = 0; c < setup_.channels; ++c) {
        ibv_qp* qp = qps_[peer * setup_.channels + c];
        // Our queue pair towards `peer` on channel c pairs with the peer's queue pair towards us on channel c.
        QpTransition rtr = RtrTransition(remote_[peer], static_cast<size_t>(setup_.self_rank) * setup_.channels + c,
                                         device_.gid_index, device_.port_attr.active_mtu);
        if (ibv_modify_qp(qp, &rtr.attr, rtr.mask) != 0)
          return Errno(absl::StrCat("queue pair to RTR (rank ", peer, ")"));
        QpTransition rts = RtsTransition(local_.psns[peer * setup_.channels + c]);
        if (ibv_modify_qp(qp, &rts.attr, rts.mask) != 0)
          return Errno(absl::StrCat("queue pair to RTS (rank ", peer, ")"));
      }
    }
    poller_ = std::thread([this] { Poll(); });
    return absl::OkStatus();
  }

  void Put(int channel, int dst_rank, uint64_t dst_offset, uint64_t src_offset, uint64_t bytes,
           uint64_t cookie) override {
    if (dst_rank == setup_.self_rank) return LocalCopy(dst_offset, src_offset, bytes, cookie);
    const int index = dst_rank * setup_.channels + channel;
    if (failed_[index].load()) return Refuse(dst_rank, cookie);
    // Only the last piece is signalled: RC completes a queue pair's work requests in order.
    for (uint64_t done = 0; done < bytes;) {
      const uint64_t n = std::min(kMaxWrite, bytes - done);
      const bool last = done + n == bytes;
      ibv_sge sge{reinterpret_cast<uint64_t>(setup_.region->base()) + src_offset + done, static_cast<uint32_t>(n),
                  mr_->lkey};
      ibv_send_wr wr{};
      wr.wr_id = cookie;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.opcode = IBV_WR_RDMA_WRITE;
      wr.send_flags = last ? IBV_SEND_SIGNALED : 0;
      wr.wr.rdma.remote_addr = remote_[dst_rank].address + dst_offset + done;
      wr.wr.rdma.rkey = remote_[dst_rank].rkey;
      ibv_send_wr* bad = nullptr;
      if (ibv_post_send(qps_[index], &wr, &bad) != 0) return Broken(index, dst_rank, cookie, "ibv_post_send");
      done += n;
    }
  }

  void SignalAdd(int channel, int dst_rank, uint64_t dst_offset, int64_t value, uint64_t cookie) override {
    if (dst_rank == setup_.self_rank) {
      // Our own region. Host memory: an atomic add here. GPU memory would need a loopback queue pair, which this
      // wire does not open.
      if (setup_.region->descriptor().device() >= 0) {
        return setup_.sink->Complete(cookie, absl::UnimplementedError("verbs: signal_add to the issuing rank itself "
                                                                      "on GPU memory (use the socket wire)"));
      }
      auto* word = reinterpret_cast<int64_t*>(static_cast<char*>(setup_.region->base()) + dst_offset);
      std::atomic_ref<int64_t>(*word).fetch_add(value, std::memory_order_acq_rel);
      return setup_.sink->Complete(cookie, absl::OkStatus());
    }
    const int index = dst_rank * setup_.channels + channel;
    if (failed_[index].load()) return Refuse(dst_rank, cookie);
    ibv_sge sge{reinterpret_cast<uint64_t>(&scratch_), sizeof(scratch_), scratch_mr_->lkey};
    ibv_send_wr wr{};
    wr.wr_id = cookie;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
    // RC executes a queue pair's requests in order at the responder, so the atomic lands after the earlier writes;
    // the fence (earlier reads/atomics complete first) keeps that true if reads are ever posted on the same pair.
    wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_FENCE;
    wr.wr.atomic.remote_addr = remote_[dst_rank].address + dst_offset;
    wr.wr.atomic.compare_add = static_cast<uint64_t>(value);
    wr.wr.atomic.rkey = remote_[dst_rank].rkey;
    ibv_send_wr* bad = nullptr;
    if (ibv_post_send(qps_[index], &wr, &bad) != 0) Broken(index, dst_rank, cookie, "ibv_post_send");
  }

  void Shutdown() override {
    if (stop_.exchange(true)) return;
    // Flush what is posted: the queue pairs go to ERROR, their work requests complete with WR_FLUSH_ERR.
    for (ibv_qp* qp : qps_) {
      if (qp == nullptr) continue;
      ibv_qp_attr attr{};
      attr.qp_state = IBV_QPS_ERR;
      ibv_modify_qp(qp, &attr, IBV_QP_STATE);
    }
    if (poller_.joinable()) poller_.join();
  }

 private:
  void LocalCopy(uint64_t dst_offset, uint64_t src_offset, uint64_t bytes, uint64_t cookie) {
    if (setup_.region->descriptor().device() >= 0) {
      return setup_.sink->Complete(
          cookie, absl::UnimplementedError("verbs: a put to the issuing rank itself on GPU memory (use the socket "
                                           "wire)"));
    }
    auto* base = static_cast<char*>(setup_.region->base());
    std::memmove(base + dst_offset, base + src_offset, bytes);
    setup_.sink->Complete(cookie, absl::OkStatus());
  }

  void Refuse(int dst_rank, uint64_t cookie) {
    setup_.sink->Complete(cookie, absl::UnavailableError(absl::StrCat("verbs: rank ", dst_rank, " is unreachable")));
  }

  void Broken(int index, int dst_rank, uint64_t cookie, const char* what) {
    failed_[index].store(true);
    setup_.sink->Complete(
        cookie, absl::UnavailableError(absl::StrCat("verbs: ", what, " to rank ", dst_rank, ": ", strerror(errno))));
  }

  int PeerOf(uint32_t qp_num) const {
    for (size_t i = 0; i < qps_.size(); ++i) {
      if (qps_[i] != nullptr && qps_[i]->qp_num == qp_num) return static_cast<int>(i);
    }
    return -1;
  }

  // Completions until Shutdown, then what is left (flushed requests) for up to a second.
  void Poll() {
    ibv_wc wcs[32];
    absl::Time stop_by = absl::InfiniteFuture();
    while (absl::Now() < stop_by) {
      if (stop_.load() && stop_by == absl::InfiniteFuture()) stop_by = absl::Now() + absl::Seconds(1);
      const int n = ibv_poll_cq(cq_, 32, wcs);
      if (n <= 0) {
        std::this_thread::yield();
        continue;
      }
      for (int i = 0; i < n; ++i) {
        const int index = PeerOf(wcs[i].qp_num);
        const int peer = index >= 0 ? index / setup_.channels : -1;
        absl::Status status = CompletionError(wcs[i].status, wcs[i].opcode, peer);
        if (!status.ok() && index >= 0) {
          if (!failed_[index].exchange(true))
            Logger("transport")->warn("group '{}': {}", setup_.group, status.ToString());
        }
        setup_.sink->Complete(wcs[i].wr_id, status);
      }
    }
  }

  const Device& device_;
  const GroupSetup setup_;
  const int queue_depth_;
  ibv_mr* mr_ = nullptr;
  ibv_mr* scratch_mr_ = nullptr;
  uint64_t scratch_ = 0;  // where fetch-and-add results land (discarded)
  ibv_cq* cq_ = nullptr;
  std::vector<ibv_qp*> qps_;               // [peer * channels + channel]; null for this member
  std::vector<std::atomic<bool>> failed_;  // a queue pair that broke: later commands to it fail at once
  VerbsEndpoint local_;
  std::vector<VerbsEndpoint> remote_;  // by group rank
  std::atomic<bool> stop_{false};
  std::thread poller_;
};

class VerbsWire final : public Wire {
 public:
  VerbsWire(std::unique_ptr<Device> device, VerbsOptions options)
      : device_(std::move(device)), options_(std::move(options)) {}
  v1::Transport kind() const override { return v1::TRANSPORT_VERBS; }
  std::string Describe() const override {
    return absl::StrCat("verbs ", device_->name, " port ", device_->port,
                        device_->roce ? " (RoCE v2)" : " (InfiniBand)");
  }
  absl::StatusOr<std::unique_ptr<GroupLink>> Open(const GroupSetup& setup, v1::TransportEndpoint* local) override {
    if (setup.region == nullptr || setup.sink == nullptr) {
      return absl::InvalidArgumentError("verbs: a group needs a region and a completion sink");
    }
    auto link = std::make_unique<VerbsLink>(*device_, setup, options_.queue_depth);
    EPF_RETURN_IF_ERROR(link->Open(local));
    return link;
  }

 private:
  std::unique_ptr<Device> device_;
  const VerbsOptions options_;
};

}  // namespace

absl::Status CanRegister(int gpu) {
  return ChooseRegistrationPath(gpu >= 0, DmaBufSupported(gpu), PeerMemLoaded()).status();
}

absl::StatusOr<std::unique_ptr<Wire>> MakeVerbsWire(const VerbsOptions& options) {
  EPF_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, OpenDevice(options));
  return std::make_unique<VerbsWire>(std::move(device), options);
}

}  // namespace epfabric::daemon::transport::verbs
