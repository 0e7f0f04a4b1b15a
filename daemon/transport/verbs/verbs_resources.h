// rdma-core objects of the verbs wire, owned by RAII handles: the device (context, protection domain, chosen port),
// memory registrations, completion queues and RC queue pairs. Everything here talks to a NIC, so unit tests reach
// only the paths that end without one (ListDevices on a machine with none); the decisions come from verbs_logic.h.
#pragma once

#include <infiniband/verbs.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "memory/region.h"
#include "transport/verbs/verbs_logic.h"
#include "transport/verbs/verbs_probe.h"

namespace epfabric::daemon::transport::verbs {

struct IbvDeleter {
  void operator()(ibv_context* p) const { ibv_close_device(p); }
  void operator()(ibv_pd* p) const { ibv_dealloc_pd(p); }
  void operator()(ibv_comp_channel* p) const { ibv_destroy_comp_channel(p); }
  void operator()(ibv_cq* p) const { ibv_destroy_cq(p); }
  void operator()(ibv_qp* p) const { ibv_destroy_qp(p); }
  void operator()(ibv_mr* p) const { ibv_dereg_mr(p); }
};
using ContextPtr = std::unique_ptr<ibv_context, IbvDeleter>;
using PdPtr = std::unique_ptr<ibv_pd, IbvDeleter>;
using CompChannelPtr = std::unique_ptr<ibv_comp_channel, IbvDeleter>;
using CqPtr = std::unique_ptr<ibv_cq, IbvDeleter>;
using QpPtr = std::unique_ptr<ibv_qp, IbvDeleter>;
using MrPtr = std::unique_ptr<ibv_mr, IbvDeleter>;

// `what` failed with errno `error`: Unavailable for transient conditions (ETIMEDOUT, ENETUNREACH, EHOSTUNREACH:
// RoCE address resolution of a peer's GID), ResourceExhausted for ENOMEM/ENOSPC, FailedPrecondition for
// EOPNOTSUPP/ENODEV/EPERM/EACCES/EFAULT (the kernel module or the memory does not allow it), InvalidArgument for
// EINVAL, Internal otherwise. The message is "verbs: <what>: <strerror> (errno N)".
absl::Status ErrnoStatus(int error, absl::string_view what);

// Every device ibv_get_device_list returns, with its ports and valid GID entries. Devices that cannot be opened or
// queried are left out (their names go to `skipped` when given). Empty when the machine has none.
std::vector<DeviceInfo> ListDevices(std::vector<std::string>* skipped = nullptr);

// The daemon's device: one context and one protection domain for every group, on the port ChoosePort selected.
class Device {
 public:
  static absl::StatusOr<std::unique_ptr<Device>> Open(const VerbsOptions& options);

  ibv_context* context() const { return context_.get(); }
  ibv_pd* pd() const { return pd_.get(); }
  const PortChoice& port() const { return port_; }
  const ibv_device_attr& attr() const { return attr_; }
  uint32_t max_msg_sz() const { return max_msg_sz_; }

 private:
  Device() = default;
  ContextPtr context_;
  PdPtr pd_;  // declared after the context: destroyed before it
  PortChoice port_;
  ibv_device_attr attr_{};
  uint32_t max_msg_sz_ = 0;
};

// CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED of `device` (and the driver entry point exists); false without a driver.
bool DmaBufSupported(int device);

// Whether the nvidia-peermem kernel module is loaded (ibv_reg_mr on device pointers needs it).
bool PeerMemLoaded();

struct Registration {
  MrPtr mr;
  RegistrationPath path = RegistrationPath::kHostRegMr;
  uint64_t address = 0;  // the iova peers address (the region's base pointer)
  uint64_t bytes = 0;
};

// Registers all of `region` (descriptor().size_bytes from base()) with kRegionAccess, trying RegistrationOrder's
// paths in turn. The error names every path tried and why it failed.
absl::StatusOr<Registration> RegisterRegion(ibv_pd* pd, const memory::Region& region, bool allow_peermem);

// A reliable-connection queue pair on `cq` (send and receive), `depth` send work requests of one SGE each, no
// receives (one-sided operations only), every work request signaled explicitly (sq_sig_all = 0).
absl::StatusOr<QpPtr> CreateRcQp(ibv_pd* pd, ibv_cq* cq, int depth);

// ibv_modify_qp with the transition's attributes and mask.
absl::Status ModifyQp(ibv_qp* qp, QpTransition transition, absl::string_view what);

// Moves a queue pair to the error state: its outstanding work requests are flushed and nothing more is sent.
absl::Status ToErrorState(ibv_qp* qp);

}  // namespace epfabric::daemon::transport::verbs
