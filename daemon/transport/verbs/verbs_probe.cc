#include "transport/verbs/verbs_probe.h"

#include "absl/strings/str_cat.h"
#include "transport/verbs/verbs_logic.h"
#include "transport/verbs/verbs_resources.h"

namespace epfabric::daemon::transport::verbs {

absl::Status ProbeVerbs(const VerbsOptions& options) {
  // Opening the device (context, atomics, protection domain) checks more than the port listing alone, and costs
  // the daemon nothing it would not pay at its first group.
  return Device::Open(options).status();
}

absl::Status CanRegister(int gpu) {
  if (gpu < 0) return absl::OkStatus();
  RegistrationCaps caps;
  caps.device_memory = true;
  caps.dmabuf_supported = DmaBufSupported(gpu);
  caps.allow_peermem = PeerMemLoaded();
  if (!RegistrationOrder(caps).empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("--transport=verbs: GPU ", gpu,
                   " memory cannot be registered with the NIC (no DMA-BUF export and nvidia-peermem is not loaded)"));
}

v1::Transport ChooseTransport(std::string_view flag, bool verbs_usable) {
  if (flag == "socket") return v1::TRANSPORT_SOCKET;
  if (flag == "verbs") return v1::TRANSPORT_VERBS;
  if (flag == "auto") return verbs_usable ? v1::TRANSPORT_VERBS : v1::TRANSPORT_SOCKET;
  return v1::TRANSPORT_UNSPECIFIED;
}

}  // namespace epfabric::daemon::transport::verbs
