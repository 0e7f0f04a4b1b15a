// epfabric_device_plugin: kubelet's device plugin for EP slots (device_plugin.h). Runs on every GPU node beside the
// per-node daemons (deploy/kubernetes/per-node), until SIGTERM/SIGINT.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "device_plugin/device_plugin.h"
#include "epfabric/common/cli.h"

ABSL_FLAG(std::string, plugin_dir, "/var/lib/kubelet/device-plugins", "kubelet's device-plugin directory.");
ABSL_FLAG(std::string, kubelet_socket, "", "kubelet's registration socket (default <plugin_dir>/kubelet.sock).");
ABSL_FLAG(std::string, endpoint, "epfabric.sock", "This plugin's socket, a file name in --plugin_dir.");
ABSL_FLAG(std::string, resource_name, "epfabric.io/ep-slot", "The extended resource tenant pods request.");
ABSL_FLAG(std::string, socket_dir, "/run/epfabric",
          "The daemons' socket directory on the node (gpu<G>.sock each); mounted at the same path into tenants.");
ABSL_FLAG(int, gpus, 0, "GPUs on the node (0: count /dev/nvidia0, /dev/nvidia1, ... under --dev_dir).");
ABSL_FLAG(std::string, dev_dir, "/dev", "Where the GPU device files are counted.");
ABSL_FLAG(int, slots_per_gpu, 1,
          "EP slots advertised per GPU (1: a slot is the GPU, exclusive; more: containers share the GPU).");
ABSL_FLAG(std::string, gpu_strategy, "envvar",
          "How allocated GPUs reach the container: envvar (NVIDIA_VISIBLE_DEVICES=G,...), volume-mounts "
          "(/var/run/nvidia-container-devices/G) or none.");
ABSL_FLAG(int, poll_ms, 1000, "How often health and kubelet restarts are checked, in milliseconds.");
ABSL_FLAG(bool, version, false, "Print the version and exit.");

int main(int argc, char** argv) {
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  auto args = epfabric::cli::ParseFlags(argc, argv);
  if (!args.ok()) {
    std::fprintf(stderr, "epfabric_device_plugin: %s\n", std::string(args.status().message()).c_str());
    return epfabric::cli::kExitUsage;
  }
  if (args->help) {
    std::printf(
        "epfabric_device_plugin: kubelet device plugin advertising EP slots of the node's epfabric daemons.\n"
        "Usage: epfabric_device_plugin [flags]\n\nFlags:\n%s",
        epfabric::cli::FlagsHelp("device_plugin/main.cc").c_str());
    return epfabric::cli::kExitOk;
  }
  if (absl::GetFlag(FLAGS_version)) {
    std::printf("epfabric_device_plugin %s\n", EPF_VERSION);
    return epfabric::cli::kExitOk;
  }
  epfabric::device_plugin::PluginOptions options;
  options.plugin_dir = absl::GetFlag(FLAGS_plugin_dir);
  options.kubelet_socket = absl::GetFlag(FLAGS_kubelet_socket);
  options.endpoint = absl::GetFlag(FLAGS_endpoint);
  options.resource_name = absl::GetFlag(FLAGS_resource_name);
  options.socket_dir = absl::GetFlag(FLAGS_socket_dir);
  options.gpus = absl::GetFlag(FLAGS_gpus);
  if (options.gpus == 0) options.gpus = epfabric::device_plugin::CountGpuDeviceFiles(absl::GetFlag(FLAGS_dev_dir));
  options.slots_per_gpu = absl::GetFlag(FLAGS_slots_per_gpu);
  options.gpu_strategy = absl::GetFlag(FLAGS_gpu_strategy);
  options.poll = absl::Milliseconds(absl::GetFlag(FLAGS_poll_ms));
  if (absl::Status valid = epfabric::device_plugin::ValidatePluginOptions(options); !valid.ok()) {
    std::fprintf(stderr, "epfabric_device_plugin: %s\n", std::string(valid.message()).c_str());
    return epfabric::cli::kExitUsage;
  }

  epfabric::device_plugin::DevicePlugin plugin(options);
  std::thread stopper([&] {
    int signal_number = 0;
    sigwait(&stop_signals, &signal_number);
    plugin.Stop();
  });
  std::fprintf(stderr, "epfabric_device_plugin: %s, %d GPUs x %d slots, sockets in %s, kubelet in %s\n",
               options.resource_name.c_str(), options.gpus, options.slots_per_gpu, options.socket_dir.c_str(),
               options.plugin_dir.c_str());
  const absl::Status ran = plugin.Run();
  // Run returns on Stop() (a signal) or on an error; wake the signal thread in the second case.
  if (!ran.ok()) {
    std::fprintf(stderr, "epfabric_device_plugin: %s\n", std::string(ran.message()).c_str());
    pthread_kill(stopper.native_handle(), SIGTERM);
  }
  stopper.join();
  return ran.ok() ? epfabric::cli::kExitOk : epfabric::cli::kExitFailure;
}
