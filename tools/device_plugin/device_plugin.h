// epfabric's Kubernetes device plugin (kubelet's device-plugin API v1beta1, proto/deviceplugin_v1beta1.proto).
//
// It advertises EP slots: `slots_per_gpu` devices per GPU of the node, "gpu<G>-slot<S>", healthy while the daemon of
// GPU G answers on `<socket_dir>/gpu<G>.sock`. With one slot per GPU (the default) a slot is the GPU itself, handed
// out by the scheduler: a container granted slots on GPUs G1 < G2 < ... gets, from Allocate,
//  - those GPUs, the way NVIDIA's device plugin hands them out: NVIDIA_VISIBLE_DEVICES=G1,G2,... (`envvar`) or one
//    /var/run/nvidia-container-devices/<G> mount each (`volume-mounts`, for a toolkit that ignores the variable in
//    unprivileged pods), so that the container's CUDA device i is GPU Gi+1;
//  - EPFABRIC_SOCKET=<socket_dir>/gpuG1.sock,<socket_dir>/gpuG2.sock,...: the socket of local rank i is the i-th;
//  - the daemons' socket directory mounted read-only at the same path (a client reaches the other ranks' fd side
//    channels at the paths their daemons announce, which are host paths).
// So a tenant pod needs no hostPath volume and no NVIDIA_VISIBLE_DEVICES=all (Pod Security "restricted"), and the
// scheduler hands out GPUs and slots. A group's processes map every same-host rank's memory: a tenant's group on a
// node is the GPUs of its pod.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "deviceplugin_v1beta1.pb.h"

namespace epfabric::device_plugin {

struct PluginOptions {
  std::string plugin_dir = "/var/lib/kubelet/device-plugins";
  std::string kubelet_socket;  // "" = <plugin_dir>/kubelet.sock
  std::string endpoint = "epfabric.sock";
  std::string resource_name = "epfabric.io/ep-slot";
  std::string socket_dir = "/run/epfabric";  // the daemons' --client_socket directory, gpu<G>.sock each
  int gpus = 0;                              // GPUs on the node
  int slots_per_gpu = 1;
  // How the allocated GPUs reach the container: "envvar" (NVIDIA_VISIBLE_DEVICES), "volume-mounts" or "none".
  std::string gpu_strategy = "envvar";
  absl::Duration poll = absl::Seconds(1);
};

// Errors name the flag ("--gpus: ...").
absl::Status ValidatePluginOptions(const PluginOptions& options);

// GPUs of the node as /dev/nvidia<N> files under `dev_dir` (N = 0, 1, ... without gaps).
int CountGpuDeviceFiles(const std::string& dev_dir);

// "<socket_dir>/gpu<G>.sock".
std::string DaemonSocket(const PluginOptions& options, int gpu);

// Every device with its health now (a daemon socket that accepts a connection: Healthy).
std::vector<v1beta1::Device> CurrentDevices(const PluginOptions& options);

// Allocate's answer for one container granted `device_ids`; InvalidArgument for an id that is not ours.
absl::StatusOr<v1beta1::ContainerAllocateResponse> AllocateContainer(const PluginOptions& options,
                                                                     const std::vector<std::string>& device_ids);

// GetPreferredAllocation for one container: `must_include` first, then one slot per GPU, lowest GPUs first, round
// by round, until `size`.
std::vector<std::string> PreferredDevices(const std::vector<std::string>& available,
                                          const std::vector<std::string>& must_include, int size);

class DevicePlugin {
 public:
  explicit DevicePlugin(PluginOptions options);
  ~DevicePlugin();
  DevicePlugin(const DevicePlugin&) = delete;
  DevicePlugin& operator=(const DevicePlugin&) = delete;

  // Serves and registers until Stop(); an error only for what retrying cannot fix (the socket cannot be served).
  absl::Status Run();
  // Safe from any thread (a signal waiter); Run returns soon after.
  void Stop();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace epfabric::device_plugin
