// NVML, loaded at run time. The daemon must start on machines without an NVIDIA driver (CI, the host backend),
// and the CUDA toolkit here ships no NVML header, so the few entry points topology needs are resolved with dlopen.
#pragma once

#include <map>
#include <string>

#include "absl/status/statusor.h"

namespace epfabric::daemon::topology {

class Nvml {
 public:
  // The process-wide instance, loaded and initialised on first use.
  static Nvml& Get();

  // Whether libnvidia-ml.so.1 was found and nvmlInit succeeded.
  bool available() const { return available_; }

  // For the GPU with this UUID ("GPU-..."): active NVLink links per remote PCI bus id (normalised, see
  // NormalizePciBusId). The map is empty for a GPU without NVLink.
  absl::StatusOr<std::map<std::string, int>> ActiveNvLinksByRemote(const std::string& gpu_uuid) const;

 private:
  Nvml();
  bool available_ = false;
  void* library_ = nullptr;
  // Resolved entry points, typed in nvml.cc.
  void* get_handle_by_uuid_ = nullptr;
  void* get_nvlink_state_ = nullptr;
  void* get_nvlink_remote_pci_ = nullptr;
};

}  // namespace epfabric::daemon::topology
