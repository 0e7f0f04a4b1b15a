#include "topology/nvml.h"

#include <dlfcn.h>

#include "absl/strings/str_cat.h"
#include "topology/system_files.h"

namespace epfabric::daemon::topology {
namespace {

// The subset of nvml.h's ABI used here (stable since NVML 2.285).
using nvmlReturn_t = int;
using nvmlDevice_t = struct nvmlDevice_st*;
constexpr nvmlReturn_t kNvmlSuccess = 0;
constexpr int kNvmlFeatureEnabled = 1;
// Links are numbered from 0; Hopper has 18. Past the last link NVML answers an error, which ends the scan.
constexpr unsigned int kMaxNvLinks = 64;

struct NvmlPciInfo {
  char bus_id_legacy[16];
  unsigned int domain;
  unsigned int bus;
  unsigned int device;
  unsigned int pci_device_id;
  unsigned int pci_subsystem_id;
  char bus_id[32];
};

using InitFn = nvmlReturn_t (*)();
using GetHandleByUuidFn = nvmlReturn_t (*)(const char*, nvmlDevice_t*);
using GetNvLinkStateFn = nvmlReturn_t (*)(nvmlDevice_t, unsigned int, int*);
using GetNvLinkRemotePciInfoFn = nvmlReturn_t (*)(nvmlDevice_t, unsigned int, NvmlPciInfo*);

}  // namespace

Nvml& Nvml::Get() {
  static Nvml* instance = new Nvml();
  return *instance;
}

Nvml::Nvml() {
  library_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library_ == nullptr) return;
  auto init = reinterpret_cast<InitFn>(dlsym(library_, "nvmlInit_v2"));
  get_handle_by_uuid_ = dlsym(library_, "nvmlDeviceGetHandleByUUID");
  get_nvlink_state_ = dlsym(library_, "nvmlDeviceGetNvLinkState");
  get_nvlink_remote_pci_ = dlsym(library_, "nvmlDeviceGetNvLinkRemotePciInfo_v2");
  if (init == nullptr || get_handle_by_uuid_ == nullptr || get_nvlink_state_ == nullptr ||
      get_nvlink_remote_pci_ == nullptr) {
    return;
  }
  available_ = init() == kNvmlSuccess;
}

absl::StatusOr<std::map<std::string, int>> Nvml::ActiveNvLinksByRemote(const std::string& gpu_uuid) const {
  if (!available_) return absl::UnavailableError("NVML is not available");
  nvmlDevice_t device = nullptr;
  nvmlReturn_t rc = reinterpret_cast<GetHandleByUuidFn>(get_handle_by_uuid_)(gpu_uuid.c_str(), &device);
  if (rc != kNvmlSuccess) return absl::NotFoundError(absl::StrCat("NVML has no GPU ", gpu_uuid, " (error ", rc, ")"));
  std::map<std::string, int> links;
  for (unsigned int link = 0; link < kMaxNvLinks; ++link) {
    int active = 0;
    if (reinterpret_cast<GetNvLinkStateFn>(get_nvlink_state_)(device, link, &active) != kNvmlSuccess) break;
    if (active != kNvmlFeatureEnabled) continue;
    NvmlPciInfo remote{};
    if (reinterpret_cast<GetNvLinkRemotePciInfoFn>(get_nvlink_remote_pci_)(device, link, &remote) != kNvmlSuccess) {
      continue;
    }
    ++links[NormalizePciBusId(remote.bus_id)];
  }
  return links;
}

}  // namespace epfabric::daemon::topology
