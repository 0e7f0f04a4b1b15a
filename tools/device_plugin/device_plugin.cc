#include "device_plugin/device_plugin.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include <grpcpp/grpcpp.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "deviceplugin_v1beta1.grpc.pb.h"

namespace epfabric::device_plugin {
namespace {

constexpr char kApiVersion[] = "v1beta1";
constexpr char kHealthy[] = "Healthy";
constexpr char kUnhealthy[] = "Unhealthy";

std::string KubeletSocket(const PluginOptions& options) {
  return options.kubelet_socket.empty() ? options.plugin_dir + "/kubelet.sock" : options.kubelet_socket;
}

std::string DeviceId(int gpu, int slot) { return absl::StrCat("gpu", gpu, "-slot", slot); }

// (gpu, slot) of "gpu<G>-slot<S>", or nullopt.
std::optional<std::pair<int, int>> ParseDeviceId(const std::string& id, const PluginOptions& options) {
  if (id.rfind("gpu", 0) != 0) return std::nullopt;
  const size_t dash = id.find("-slot");
  if (dash == std::string::npos) return std::nullopt;
  int gpu = -1, slot = -1;
  if (!absl::SimpleAtoi(id.substr(3, dash - 3), &gpu) || !absl::SimpleAtoi(id.substr(dash + 5), &slot)) {
    return std::nullopt;
  }
  if (gpu < 0 || gpu >= options.gpus || slot < 0 || slot >= options.slots_per_gpu) return std::nullopt;
  if (id != DeviceId(gpu, slot)) return std::nullopt;  // no "gpu01-slot1"
  return std::make_pair(gpu, slot);
}

// True when a process listens on the Unix socket at `path` (a non-blocking connect that succeeds).
bool Answers(const std::string& path) {
  sockaddr_un address{};
  if (path.size() >= sizeof(address.sun_path)) return false;
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.c_str(), path.size());
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 || errno == EAGAIN;
  ::close(fd);
  return ok;
}

// The inode of `path`, 0 when there is none (a file that a restarted kubelet replaced has a new one).
ino_t InodeOf(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 ? st.st_ino : 0;
}

bool SameDevices(const std::vector<v1beta1::Device>& a, const std::vector<v1beta1::Device>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].id() != b[i].id() || a[i].health() != b[i].health()) return false;
  }
  return true;
}

}  // namespace

absl::Status ValidatePluginOptions(const PluginOptions& o) {
  if (o.gpus < 1 || o.gpus > 64)
    return absl::InvalidArgumentError(absl::StrCat("--gpus: ", o.gpus, " is not in 1..64"));
  if (o.slots_per_gpu < 1 || o.slots_per_gpu > 256) {
    return absl::InvalidArgumentError(absl::StrCat("--slots_per_gpu: ", o.slots_per_gpu, " is not in 1..256"));
  }
  if (o.resource_name.find('/') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--resource_name: '", o.resource_name, "' is not vendor-domain/resource"));
  }
  if (o.endpoint.empty() || o.endpoint.find('/') != std::string::npos) {
    return absl::InvalidArgumentError("--endpoint: a file name in --plugin_dir (no '/')");
  }
  std::error_code ec;
  if (!std::filesystem::is_directory(o.plugin_dir, ec)) {
    return absl::InvalidArgumentError(absl::StrCat("--plugin_dir: '", o.plugin_dir, "' is not a directory"));
  }
  if (o.socket_dir.empty() || o.socket_dir[0] != '/') {
    return absl::InvalidArgumentError("--socket_dir: an absolute path (the daemons' socket directory)");
  }
  if (o.poll < absl::Milliseconds(10)) return absl::InvalidArgumentError("--poll_ms: at least 10");
  if (o.gpu_strategy != "envvar" && o.gpu_strategy != "volume-mounts" && o.gpu_strategy != "none") {
    return absl::InvalidArgumentError(
        absl::StrCat("--gpu_strategy: '", o.gpu_strategy, "' is not envvar, volume-mounts or none"));
  }
  return absl::OkStatus();
}

int CountGpuDeviceFiles(const std::string& dev_dir) {
  int gpus = 0;
  std::error_code ec;
  while (std::filesystem::exists(absl::StrCat(dev_dir, "/nvidia", gpus), ec)) ++gpus;
  return gpus;
}

std::string DaemonSocket(const PluginOptions& options, int gpu) {
  return absl::StrCat(options.socket_dir, "/gpu", gpu, ".sock");
}

std::vector<v1beta1::Device> CurrentDevices(const PluginOptions& options) {
  std::vector<v1beta1::Device> devices;
  for (int gpu = 0; gpu < options.gpus; ++gpu) {
    const bool healthy = Answers(DaemonSocket(options, gpu));
    for (int slot = 0; slot < options.slots_per_gpu; ++slot) {
      v1beta1::Device device;
      device.set_id(DeviceId(gpu, slot));
      device.set_health(healthy ? kHealthy : kUnhealthy);
      devices.push_back(std::move(device));
    }
  }
  return devices;
}

absl::StatusOr<v1beta1::ContainerAllocateResponse> AllocateContainer(const PluginOptions& options,
                                                                     const std::vector<std::string>& device_ids) {
  if (device_ids.empty()) return absl::InvalidArgumentError("device_ids: empty");
  std::set<int> gpus;
  for (const std::string& id : device_ids) {
    auto parsed = ParseDeviceId(id, options);
    if (!parsed.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("device id '", id, "' is not an EP slot of this plugin (gpu0..gpu",
                                                     options.gpus - 1, ", slot0..slot", options.slots_per_gpu - 1,
                                                     ")"));
    }
    gpus.insert(parsed->first);
  }
  v1beta1::ContainerAllocateResponse response;
  v1beta1::Mount* mount = response.add_mounts();
  mount->set_container_path(options.socket_dir);
  mount->set_host_path(options.socket_dir);
  mount->set_read_only(true);
  std::vector<std::string> sockets;
  for (int gpu : gpus) sockets.push_back(DaemonSocket(options, gpu));
  (*response.mutable_envs())["EPFABRIC_SOCKET"] = absl::StrJoin(sockets, ",");
  if (options.gpu_strategy == "envvar") {
    (*response.mutable_envs())["NVIDIA_VISIBLE_DEVICES"] = absl::StrJoin(gpus, ",");
  } else if (options.gpu_strategy == "volume-mounts") {
    for (int gpu : gpus) {
      v1beta1::Mount* device = response.add_mounts();
      device->set_container_path(absl::StrCat("/var/run/nvidia-container-devices/", gpu));
      device->set_host_path("/dev/null");
    }
  }
  return response;
}

std::vector<std::string> PreferredDevices(const std::vector<std::string>& available,
                                          const std::vector<std::string>& must_include, int size) {
  std::vector<std::string> chosen(must_include.begin(), must_include.end());
  std::set<std::string> taken(chosen.begin(), chosen.end());
  // Per GPU, its free slots in order.
  std::map<int, std::vector<std::string>> by_gpu;
  for (const std::string& id : available) {
    if (taken.count(id) != 0) continue;
    int gpu = 0;
    const size_t dash = id.find("-slot");
    if (id.rfind("gpu", 0) != 0 || dash == std::string::npos || !absl::SimpleAtoi(id.substr(3, dash - 3), &gpu)) {
      continue;
    }
    by_gpu[gpu].push_back(id);
  }
  for (auto& [gpu, ids] : by_gpu) std::sort(ids.begin(), ids.end());
  for (size_t round = 0; static_cast<int>(chosen.size()) < size; ++round) {
    bool any = false;
    for (auto& [gpu, ids] : by_gpu) {
      if (static_cast<int>(chosen.size()) >= size) break;
      if (round < ids.size()) {
        chosen.push_back(ids[round]);
        any = true;
      }
    }
    if (!any) break;
  }
  return chosen;
}

// ---- the gRPC side ----

struct DevicePlugin::State {
  explicit State(PluginOptions o) : options(std::move(o)) {}

  class Service final : public v1beta1::DevicePlugin::Service {
   public:
    explicit Service(State* state) : state_(state) {}

    grpc::Status GetDevicePluginOptions(grpc::ServerContext*, const v1beta1::Empty*,
                                        v1beta1::DevicePluginOptions* response) override {
      response->set_pre_start_required(false);
      response->set_get_preferred_allocation_available(true);
      return grpc::Status::OK;
    }

    grpc::Status ListAndWatch(grpc::ServerContext* context, const v1beta1::Empty*,
                              grpc::ServerWriter<v1beta1::ListAndWatchResponse>* writer) override {
      std::vector<v1beta1::Device> sent;
      bool first = true;
      while (!context->IsCancelled()) {
        std::vector<v1beta1::Device> now = CurrentDevices(state_->options);
        if (first || !SameDevices(now, sent)) {
          v1beta1::ListAndWatchResponse response;
          for (const auto& device : now) *response.add_devices() = device;
          if (!writer->Write(response)) return grpc::Status::OK;  // kubelet went away
          sent = std::move(now);
          first = false;
        }
        absl::MutexLock lock(&state_->mutex);
        if (state_->mutex.AwaitWithTimeout(absl::Condition(&state_->serving_ended), state_->options.poll)) break;
      }
      return grpc::Status::OK;
    }

    grpc::Status GetPreferredAllocation(grpc::ServerContext*, const v1beta1::PreferredAllocationRequest* request,
                                        v1beta1::PreferredAllocationResponse* response) override {
      for (const auto& container : request->container_requests()) {
        const std::vector<std::string> chosen =
            PreferredDevices({container.available_device_ids().begin(), container.available_device_ids().end()},
                             {container.must_include_device_ids().begin(), container.must_include_device_ids().end()},
                             container.allocation_size());
        auto* out = response->add_container_responses();
        for (const std::string& id : chosen) out->add_device_ids(id);
      }
      return grpc::Status::OK;
    }

    grpc::Status Allocate(grpc::ServerContext*, const v1beta1::AllocateRequest* request,
                          v1beta1::AllocateResponse* response) override {
      for (const auto& container : request->container_requests()) {
        auto allocated =
            AllocateContainer(state_->options, {container.device_ids().begin(), container.device_ids().end()});
        if (!allocated.ok()) {
          return grpc::Status(static_cast<grpc::StatusCode>(allocated.status().code()),
                              std::string(allocated.status().message()));
        }
        *response->add_container_responses() = *std::move(allocated);
      }
      return grpc::Status::OK;
    }

    grpc::Status PreStartContainer(grpc::ServerContext*, const v1beta1::PreStartContainerRequest*,
                                   v1beta1::PreStartContainerResponse*) override {
      return grpc::Status::OK;
    }

   private:
    State* const state_;
  };

  absl::Status Register() {
    auto channel =
        grpc::CreateChannel(absl::StrCat("unix:", KubeletSocket(options)), grpc::InsecureChannelCredentials());
    auto stub = v1beta1::Registration::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1beta1::RegisterRequest request;
    request.set_version(kApiVersion);
    request.set_endpoint(options.endpoint);
    request.set_resource_name(options.resource_name);
    request.mutable_options()->set_get_preferred_allocation_available(true);
    v1beta1::Empty response;
    const grpc::Status status = stub->Register(&context, request, &response);
    if (!status.ok()) {
      return absl::UnavailableError(
          absl::StrCat("Register with kubelet at ", KubeletSocket(options), ": ", status.error_message()));
    }
    return absl::OkStatus();
  }

  // Waits up to `pause`; true when Stop() was called.
  bool Pause(absl::Duration pause) {
    absl::MutexLock lock(&mutex);
    return mutex.AwaitWithTimeout(absl::Condition(&stopping), pause);
  }

  const PluginOptions options;
  absl::Mutex mutex;
  bool stopping ABSL_GUARDED_BY(mutex) = false;
  // True while no server runs: ends the ListAndWatch streams of a server being replaced.
  bool serving_ended ABSL_GUARDED_BY(mutex) = false;
};

DevicePlugin::DevicePlugin(PluginOptions options) : state_(std::make_unique<State>(std::move(options))) {}

DevicePlugin::~DevicePlugin() { Stop(); }

void DevicePlugin::Stop() {
  absl::MutexLock lock(&state_->mutex);
  state_->stopping = true;
  state_->serving_ended = true;
}

absl::Status DevicePlugin::Run() {
  State* s = state_.get();
  const std::string endpoint_path = absl::StrCat(s->options.plugin_dir, "/", s->options.endpoint);
  const std::string kubelet_path = KubeletSocket(s->options);
  while (true) {
    {
      absl::MutexLock lock(&s->mutex);
      if (s->stopping) return absl::OkStatus();
      s->serving_ended = false;
    }
    // A socket left by an earlier run, or by us before kubelet restarted: serve afresh.
    ::unlink(endpoint_path.c_str());
    State::Service service(s);
    grpc::ServerBuilder builder;
    builder.AddListeningPort(absl::StrCat("unix:", endpoint_path), grpc::InsecureServerCredentials());
    builder.RegisterService(&service);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    if (server == nullptr) {
      return absl::UnavailableError(absl::StrCat("cannot serve the device plugin on unix:", endpoint_path));
    }
    const ino_t endpoint_inode = InodeOf(endpoint_path);
    // Register until kubelet takes it (kubelet may not be up yet).
    ino_t kubelet_inode = 0;
    bool registered = false;
    while (!registered) {
      kubelet_inode = InodeOf(kubelet_path);
      registered = kubelet_inode != 0 && s->Register().ok();
      if (!registered && s->Pause(s->options.poll)) break;
    }
    // Watch for kubelet's restart: our socket removed, or kubelet.sock replaced.
    while (registered && !s->Pause(s->options.poll)) {
      if (InodeOf(endpoint_path) != endpoint_inode || InodeOf(kubelet_path) != kubelet_inode) break;
    }
    {
      absl::MutexLock lock(&s->mutex);
      s->serving_ended = true;
    }
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    server->Wait();
    if (InodeOf(endpoint_path) == endpoint_inode) ::unlink(endpoint_path.c_str());
  }
}

}  // namespace epfabric::device_plugin
