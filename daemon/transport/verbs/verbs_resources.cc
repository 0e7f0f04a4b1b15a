#include "transport/verbs/verbs_resources.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "epfabric/common/cuda_driver.h"
#include "epfabric/common/status_macros.h"

namespace epfabric::daemon::transport::verbs {
namespace {

struct DeviceListDeleter {
  void operator()(ibv_device** list) const { ibv_free_device_list(list); }
};

absl::StatusOr<PortInfo> QueryPort(ibv_context* context, uint8_t port_num) {
  ibv_port_attr attr{};
  if (int rc = ibv_query_port(context, port_num, &attr); rc != 0) {
    return ErrnoStatus(rc, absl::StrCat("ibv_query_port(", port_num, ")"));
  }
  PortInfo port;
  port.port = port_num;
  port.active = attr.state == IBV_PORT_ACTIVE;
  port.ethernet = attr.link_layer == IBV_LINK_LAYER_ETHERNET;
  port.active_mtu = attr.active_mtu;
  port.lid = attr.lid;
  // Unused table entries answer ENODATA (and RoCE entries come and go with the netdev's addresses): keep the rest.
  for (int index = 0; index < attr.gid_tbl_len; ++index) {
    ibv_gid_entry entry{};
    if (ibv_query_gid_ex(context, port_num, static_cast<uint32_t>(index), &entry, 0) != 0) continue;
    GidInfo gid;
    gid.index = entry.gid_index;
    std::memcpy(gid.gid.data(), entry.gid.raw, gid.gid.size());
    gid.type = static_cast<ibv_gid_type>(entry.gid_type);
    port.gids.push_back(gid);
  }
  return port;
}

absl::StatusOr<DeviceInfo> QueryDevice(ibv_context* context, std::string name) {
  ibv_device_attr attr{};
  if (int rc = ibv_query_device(context, &attr); rc != 0) return ErrnoStatus(rc, "ibv_query_device");
  DeviceInfo info;
  info.name = std::move(name);
  for (int p = 1; p <= attr.phys_port_cnt; ++p) {
    EPF_ASSIGN_OR_RETURN(PortInfo port, QueryPort(context, static_cast<uint8_t>(p)));
    info.ports.push_back(std::move(port));
  }
  return info;
}

absl::StatusOr<MrPtr> RegisterDmaBuf(ibv_pd* pd, int device, uint64_t base, uint64_t bytes) {
  EPF_ASSIGN_OR_RETURN(const cuda::DriverApi* driver, cuda::Driver());
  EPF_RETURN_IF_ERROR(cuda::UseDevice(device));
  const long page = sysconf(_SC_PAGESIZE);
  const DmaBufRange range = DmaBufRangeFor(base, bytes, page > 0 ? static_cast<uint64_t>(page) : 4096);
  int fd = -1;
  EPF_RETURN_IF_ERROR(
      cuda::CuStatus(*driver,
                     driver->cuMemGetHandleForAddressRange(&fd, static_cast<CUdeviceptr>(range.start), range.size,
                                                           CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0),
                     "cuMemGetHandleForAddressRange(DMA_BUF_FD)"));
  // The MR holds its own reference to the DMA-BUF: our descriptor is not needed after registration.
  absl::Cleanup close_fd = [fd] { close(fd); };
  ibv_mr* mr = ibv_reg_dmabuf_mr(pd, range.offset, bytes, base, fd, kRegionAccess);
  if (mr == nullptr) return ErrnoStatus(errno, "ibv_reg_dmabuf_mr");
  return MrPtr(mr);
}

absl::StatusOr<MrPtr> RegisterPlain(ibv_pd* pd, void* base, uint64_t bytes) {
  ibv_mr* mr = ibv_reg_mr(pd, base, bytes, kRegionAccess);
  if (mr == nullptr) return ErrnoStatus(errno, "ibv_reg_mr");
  return MrPtr(mr);
}

}  // namespace

absl::Status ErrnoStatus(int error, absl::string_view what) {
  // Some calls return a negative errno, others set errno and return -1 or NULL.
  if (error < 0) error = -error;
  const std::string message = absl::StrCat("verbs: ", what, ": ", std::strerror(error), " (errno ", error, ")");
  switch (error) {
    case ETIMEDOUT:
    case ENETUNREACH:
    case EHOSTUNREACH:
    case EAGAIN:
      return absl::UnavailableError(message);
    case ENOMEM:
    case ENOSPC:
      return absl::ResourceExhaustedError(message);
    case EOPNOTSUPP:
    case ENODEV:
    case ENXIO:
    case EPERM:
    case EACCES:
    case EFAULT:
      return absl::FailedPreconditionError(message);
    case EINVAL:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

// DMA-BUF export needs the open kernel modules or a recent proprietary driver, and Linux 5.12+ on the NIC side.
bool DmaBufSupported(int device) {
  absl::StatusOr<const cuda::DriverApi*> driver = cuda::Driver();
  if (!driver.ok() || (*driver)->cuMemGetHandleForAddressRange == nullptr) return false;
  CUdevice cu_device = 0;
  int supported = 0;
  if ((*driver)->cuDeviceGet(&cu_device, device) != CUDA_SUCCESS) return false;
  if ((*driver)->cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, cu_device) != CUDA_SUCCESS) {
    return false;
  }
  return supported != 0;
}

bool PeerMemLoaded() { return access("/sys/module/nvidia_peermem", F_OK) == 0; }

std::vector<DeviceInfo> ListDevices(std::vector<std::string>* skipped) {
  int count = 0;
  std::unique_ptr<ibv_device*, DeviceListDeleter> list(ibv_get_device_list(&count));
  std::vector<DeviceInfo> devices;
  if (list == nullptr) return devices;  // no rdma-core provider or no /sys/class/infiniband: no device
  for (int i = 0; i < count; ++i) {
    const std::string name = ibv_get_device_name(list.get()[i]);
    ContextPtr context(ibv_open_device(list.get()[i]));
    absl::StatusOr<DeviceInfo> info = context != nullptr
                                          ? QueryDevice(context.get(), name)
                                          : absl::StatusOr<DeviceInfo>(ErrnoStatus(errno, "ibv_open_device"));
    if (info.ok()) {
      devices.push_back(*std::move(info));
    } else if (skipped != nullptr) {
      skipped->push_back(absl::StrCat(name, ": ", info.status().message()));
    }
  }
  return devices;
}

absl::StatusOr<std::unique_ptr<Device>> Device::Open(const VerbsOptions& options) {
  EPF_ASSIGN_OR_RETURN(PortChoice choice, ChoosePort(options, ListDevices()));
  int count = 0;
  std::unique_ptr<ibv_device*, DeviceListDeleter> list(ibv_get_device_list(&count));
  ibv_device* found = nullptr;
  for (int i = 0; list != nullptr && i < count; ++i) {
    if (choice.device == ibv_get_device_name(list.get()[i])) found = list.get()[i];
  }
  if (found == nullptr) return absl::UnavailableError(absl::StrCat("verbs: device ", choice.device, " disappeared"));

  std::unique_ptr<Device> device(new Device());
  device->port_ = choice;
  device->context_.reset(ibv_open_device(found));
  if (device->context_ == nullptr) return ErrnoStatus(errno, absl::StrCat("ibv_open_device(", choice.device, ")"));
  if (int rc = ibv_query_device(device->context(), &device->attr_); rc != 0) return ErrnoStatus(rc, "ibv_query_device");
  // Signals are IB atomics: a device without them cannot run this wire (the socket wire can).
  if (device->attr_.atomic_cap == IBV_ATOMIC_NONE) {
    return absl::FailedPreconditionError(
        absl::StrCat("--transport=verbs: device ", choice.device, " does not support atomic operations"));
  }
  ibv_port_attr port_attr{};
  if (int rc = ibv_query_port(device->context(), choice.port, &port_attr); rc != 0) {
    return ErrnoStatus(rc, "ibv_query_port");
  }
  device->max_msg_sz_ = port_attr.max_msg_sz;
  device->pd_.reset(ibv_alloc_pd(device->context()));
  if (device->pd_ == nullptr) return ErrnoStatus(errno, "ibv_alloc_pd");
  return device;
}

absl::StatusOr<Registration> RegisterRegion(ibv_pd* pd, const memory::Region& region, bool allow_peermem) {
  const int cuda_device = region.descriptor().device();
  const uint64_t base = reinterpret_cast<uint64_t>(region.base());
  const uint64_t bytes = region.descriptor().size_bytes();
  if (base == 0 || bytes == 0) return absl::InvalidArgumentError("verbs: cannot register an empty region");
  RegistrationCaps caps;
  caps.device_memory = cuda_device >= 0;
  caps.dmabuf_supported = caps.device_memory && DmaBufSupported(cuda_device);
  caps.allow_peermem = allow_peermem;
  const std::vector<RegistrationPath> order = RegistrationOrder(caps);
  if (order.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "verbs: GPU ", cuda_device, " cannot export DMA-BUF and registration through nvidia-peermem is disabled"));
  }
  std::vector<std::string> failures;
  for (RegistrationPath path : order) {
    absl::StatusOr<MrPtr> mr = path == RegistrationPath::kDmaBuf ? RegisterDmaBuf(pd, cuda_device, base, bytes)
                                                                 : RegisterPlain(pd, region.base(), bytes);
    if (mr.ok()) return Registration{*std::move(mr), path, base, bytes};
    failures.push_back(absl::StrCat(RegistrationPathName(path), ": ", mr.status().message()));
  }
  return absl::FailedPreconditionError(absl::StrCat("verbs: cannot register ", bytes, " bytes of ",
                                                    caps.device_memory ? "device" : "host", " memory (",
                                                    absl::StrJoin(failures, "; "), ")"));
}

absl::StatusOr<QpPtr> CreateRcQp(ibv_pd* pd, ibv_cq* cq, int depth) {
  ibv_qp_init_attr init{};
  init.send_cq = cq;
  init.recv_cq = cq;
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;
  init.cap.max_send_wr = static_cast<uint32_t>(depth);
  init.cap.max_recv_wr = 1;  // some providers refuse 0; nothing is ever posted to it
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  ibv_qp* qp = ibv_create_qp(pd, &init);
  if (qp == nullptr) return ErrnoStatus(errno, absl::StrCat("ibv_create_qp(RC, ", depth, " send work requests)"));
  return QpPtr(qp);
}

absl::Status ModifyQp(ibv_qp* qp, QpTransition transition, absl::string_view what) {
  if (int rc = ibv_modify_qp(qp, &transition.attr, transition.mask); rc != 0) return ErrnoStatus(rc, what);
  return absl::OkStatus();
}

absl::Status ToErrorState(ibv_qp* qp) {
  QpTransition t;
  t.attr.qp_state = IBV_QPS_ERR;
  t.mask = IBV_QP_STATE;
  return ModifyQp(qp, t, "ibv_modify_qp(ERR)");
}

}  // namespace epfabric::daemon::transport::verbs
