// epfabric_device_plugin against a fake kubelet over real Unix sockets (kubelet's device-plugin API v1beta1):
// registration, ListAndWatch with health that follows the daemons' sockets, GetPreferredAllocation, Allocate's mounts
// and EPFABRIC_SOCKET, re-registration when kubelet removes the plugin's socket and when kubelet restarts, and a real
// daemon whose socket makes its GPU's slots healthy.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "device_plugin/device_plugin.h"
#include "deviceplugin_v1beta1.grpc.pb.h"
#include "integration/subprocess.h"

namespace epfabric::testing {
namespace {

// kubelet's Registration service: records every RegisterRequest.
class FakeKubelet final : public v1beta1::Registration::Service {
 public:
  explicit FakeKubelet(const std::string& socket) : socket_(socket) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + socket, grpc::InsecureServerCredentials());
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~FakeKubelet() override { Stop(); }

  void Stop() {
    if (server_ == nullptr) return;
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    server_->Wait();
    server_.reset();
    std::filesystem::remove(socket_);
  }

  grpc::Status Register(grpc::ServerContext*, const v1beta1::RegisterRequest* request, v1beta1::Empty*) override {
    absl::MutexLock lock(&mutex_);
    registrations_.push_back(*request);
    return grpc::Status::OK;
  }

  // Waits until at least `count` registrations arrived; returns them.
  std::vector<v1beta1::RegisterRequest> WaitRegistrations(size_t count, absl::Duration timeout = absl::Seconds(10)) {
    absl::MutexLock lock(&mutex_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) { return registrations_.size() >= count; };
    mutex_.AwaitWithTimeout(absl::Condition(&enough), timeout);
    return registrations_;
  }

 private:
  const std::string socket_;
  std::unique_ptr<grpc::Server> server_;
  absl::Mutex mutex_;
  std::vector<v1beta1::RegisterRequest> registrations_ ABSL_GUARDED_BY(mutex_);
};

// A listening Unix socket standing in for a daemon's client socket.
class Listener {
 public:
  explicit Listener(const std::string& path) : path_(path) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0) << path;
    EXPECT_EQ(::listen(fd_, 16), 0);
  }
  ~Listener() {
    ::close(fd_);
    ::unlink(path_.c_str());
  }

 private:
  std::string path_;
  int fd_ = -1;
};

class DevicePluginTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir();
    plugin_dir_ = dir_ + "/plugins";
    socket_dir_ = dir_ + "/run";
    std::filesystem::create_directories(plugin_dir_);
    std::filesystem::create_directories(socket_dir_);
    kubelet_ = std::make_unique<FakeKubelet>(plugin_dir_ + "/kubelet.sock");
  }
  void TearDown() override {
    if (plugin_.has_value()) {
      plugin_->Signal(SIGTERM);
      auto code = plugin_->Wait(absl::Seconds(10));
      EXPECT_TRUE(code.ok() && *code == 0) << "the plugin did not stop cleanly on SIGTERM: " << plugin_->Stderr();
    }
    kubelet_.reset();
    std::filesystem::remove_all(dir_);
  }

  void StartPlugin(int gpus = 2, int slots = 3) {
    auto plugin =
        Subprocess::Start({EPF_DEVICE_PLUGIN_BINARY, "--plugin_dir=" + plugin_dir_, "--socket_dir=" + socket_dir_,
                           absl::StrCat("--gpus=", gpus), absl::StrCat("--slots_per_gpu=", slots), "--poll_ms=50"});
    ASSERT_TRUE(plugin.ok()) << plugin.status();
    plugin_.emplace(std::move(*plugin));
  }

  std::unique_ptr<v1beta1::DevicePlugin::Stub> Plugin(const std::string& endpoint) {
    return v1beta1::DevicePlugin::NewStub(
        grpc::CreateChannel("unix:" + plugin_dir_ + "/" + endpoint, grpc::InsecureChannelCredentials()));
  }

  std::string dir_, plugin_dir_, socket_dir_;
  std::unique_ptr<FakeKubelet> kubelet_;
  std::optional<Subprocess> plugin_;
};

// "id=health" of every device in one ListAndWatch answer, in order.
std::string Describe(const v1beta1::ListAndWatchResponse& response) {
  std::vector<std::string> parts;
  for (const auto& device : response.devices()) parts.push_back(device.id() + "=" + device.health());
  return absl::StrJoin(parts, " ");
}

TEST_F(DevicePluginTest, RegistersListsAllocatesAndFollowsHealth) {
  StartPlugin();
  const auto registrations = kubelet_->WaitRegistrations(1);
  ASSERT_EQ(registrations.size(), 1u) << plugin_->Stderr();
  EXPECT_EQ(registrations[0].version(), "v1beta1");
  EXPECT_EQ(registrations[0].resource_name(), "epfabric.io/ep-slot");
  EXPECT_EQ(registrations[0].endpoint(), "epfabric.sock");
  EXPECT_TRUE(registrations[0].options().get_preferred_allocation_available());

  auto stub = Plugin(registrations[0].endpoint());
  {
    grpc::ClientContext context;
    v1beta1::DevicePluginOptions options;
    ASSERT_TRUE(stub->GetDevicePluginOptions(&context, v1beta1::Empty(), &options).ok());
    EXPECT_TRUE(options.get_preferred_allocation_available());
    EXPECT_FALSE(options.pre_start_required());
  }

  // No daemon yet: every slot is there, unhealthy; a daemon socket on GPU 1 makes GPU 1's slots healthy.
  grpc::ClientContext watch_context;
  watch_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto watch = stub->ListAndWatch(&watch_context, v1beta1::Empty());
  v1beta1::ListAndWatchResponse listed;
  ASSERT_TRUE(watch->Read(&listed));
  EXPECT_EQ(Describe(listed),
            "gpu0-slot0=Unhealthy gpu0-slot1=Unhealthy gpu0-slot2=Unhealthy gpu1-slot0=Unhealthy "
            "gpu1-slot1=Unhealthy gpu1-slot2=Unhealthy");
  {
    Listener daemon1(socket_dir_ + "/gpu1.sock");
    ASSERT_TRUE(watch->Read(&listed));
    EXPECT_EQ(Describe(listed),
              "gpu0-slot0=Unhealthy gpu0-slot1=Unhealthy gpu0-slot2=Unhealthy gpu1-slot0=Healthy "
              "gpu1-slot1=Healthy gpu1-slot2=Healthy");
  }
  ASSERT_TRUE(watch->Read(&listed));  // the daemon went away again
  EXPECT_EQ(listed.devices(3).health(), "Unhealthy");

  // Preferred: one slot per GPU, lowest GPUs first.
  {
    grpc::ClientContext context;
    v1beta1::PreferredAllocationRequest request;
    auto* container = request.add_container_requests();
    for (const char* id : {"gpu1-slot0", "gpu1-slot1", "gpu0-slot2", "gpu0-slot1"})
      container->add_available_device_ids(id);
    container->set_allocation_size(2);
    v1beta1::PreferredAllocationResponse response;
    ASSERT_TRUE(stub->GetPreferredAllocation(&context, request, &response).ok());
    ASSERT_EQ(response.container_responses_size(), 1);
    EXPECT_EQ(absl::StrJoin(response.container_responses(0).device_ids(), ","), "gpu0-slot1,gpu1-slot0");
  }

  // Allocate: the sockets of the slots' GPUs in GPU order, those GPUs for the NVIDIA runtime, the socket dir mounted
  // read-only at the same path; no device files of our own.
  auto allocate = [&](std::vector<std::vector<std::string>> containers, v1beta1::AllocateResponse* response) {
    grpc::ClientContext context;
    v1beta1::AllocateRequest request;
    for (const auto& ids : containers) {
      auto* container = request.add_container_requests();
      for (const auto& id : ids) container->add_device_ids(id);
    }
    return stub->Allocate(&context, request, response);
  };
  v1beta1::AllocateResponse response;
  grpc::Status status = allocate({{"gpu1-slot2"}, {"gpu1-slot0", "gpu0-slot0"}}, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(response.container_responses_size(), 2);
  EXPECT_EQ(response.container_responses(0).envs().at("EPFABRIC_SOCKET"), socket_dir_ + "/gpu1.sock");
  EXPECT_EQ(response.container_responses(0).envs().at("NVIDIA_VISIBLE_DEVICES"), "1");
  EXPECT_EQ(response.container_responses(1).envs().at("EPFABRIC_SOCKET"),
            socket_dir_ + "/gpu0.sock," + socket_dir_ + "/gpu1.sock");
  EXPECT_EQ(response.container_responses(1).envs().at("NVIDIA_VISIBLE_DEVICES"), "0,1");
  for (const auto& container : response.container_responses()) {
    ASSERT_EQ(container.mounts_size(), 1);
    EXPECT_EQ(container.mounts(0).host_path(), socket_dir_);
    EXPECT_EQ(container.mounts(0).container_path(), socket_dir_);
    EXPECT_TRUE(container.mounts(0).read_only());
    EXPECT_EQ(container.devices_size(), 0);
  }
  v1beta1::AllocateResponse refused;
  status = allocate({{"gpu7-slot0"}}, &refused);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("'gpu7-slot0' is not an EP slot of this plugin"), std::string::npos)
      << status.error_message();
  watch_context.TryCancel();
}

TEST_F(DevicePluginTest, RegistersAgainWhenItsSocketIsRemovedAndWhenKubeletRestarts) {
  StartPlugin();
  ASSERT_EQ(kubelet_->WaitRegistrations(1).size(), 1u) << plugin_->Stderr();
  // kubelet removes every plugin socket when it starts: the plugin serves afresh and registers again.
  std::filesystem::remove(plugin_dir_ + "/epfabric.sock");
  ASSERT_EQ(kubelet_->WaitRegistrations(2).size(), 2u) << plugin_->Stderr();
  {
    auto stub = Plugin("epfabric.sock");
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1beta1::DevicePluginOptions options;
    const grpc::Status status = stub->GetDevicePluginOptions(&context, v1beta1::Empty(), &options);
    EXPECT_TRUE(status.ok()) << status.error_message();
  }
  // A kubelet restart: the old one goes (socket and all), a new one listens on a new kubelet.sock.
  kubelet_->Stop();
  std::filesystem::remove(plugin_dir_ + "/epfabric.sock");
  kubelet_ = std::make_unique<FakeKubelet>(plugin_dir_ + "/kubelet.sock");
  const auto again = kubelet_->WaitRegistrations(1);
  ASSERT_EQ(again.size(), 1u) << plugin_->Stderr();
  EXPECT_EQ(again[0].resource_name(), "epfabric.io/ep-slot");
  EXPECT_TRUE(std::filesystem::exists(plugin_dir_ + "/epfabric.sock"));
}

TEST_F(DevicePluginTest, ARealDaemonMakesItsGpuHealthy) {
  // A daemon as the per-node DaemonSet starts it: one GPU's worth, no peer, no credential.
  auto daemon = Subprocess::Start(
      {EPF_DAEMON_BINARY, "--client_socket=" + socket_dir_ + "/gpu0.sock", "--backend=host", "--log_level=warn"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  for (int i = 0; i < 300 && !std::filesystem::exists(socket_dir_ + "/gpu0.sock"); ++i)
    absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(std::filesystem::exists(socket_dir_ + "/gpu0.sock")) << daemon->Stderr();
  StartPlugin(/*gpus=*/1, /*slots=*/2);
  ASSERT_EQ(kubelet_->WaitRegistrations(1).size(), 1u) << plugin_->Stderr();
  auto stub = Plugin("epfabric.sock");
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto watch = stub->ListAndWatch(&context, v1beta1::Empty());
  v1beta1::ListAndWatchResponse listed;
  ASSERT_TRUE(watch->Read(&listed));
  EXPECT_EQ(Describe(listed), "gpu0-slot0=Healthy gpu0-slot1=Healthy");
  daemon->Signal(SIGTERM);
  ASSERT_TRUE(daemon->Wait(absl::Seconds(5)).ok());
  ASSERT_TRUE(watch->Read(&listed));  // the daemon stopped: its slots are unhealthy
  EXPECT_EQ(Describe(listed), "gpu0-slot0=Unhealthy gpu0-slot1=Unhealthy");
  context.TryCancel();
}

TEST(DevicePluginAllocate, VolumeMountsStrategyMountsOneDeviceFilePerGpu) {
  device_plugin::PluginOptions options;
  options.gpus = 8;
  options.slots_per_gpu = 2;
  options.gpu_strategy = "volume-mounts";
  auto response = device_plugin::AllocateContainer(options, {"gpu5-slot1", "gpu2-slot0"});
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->envs().count("NVIDIA_VISIBLE_DEVICES"), 0u);
  EXPECT_EQ(response->envs().at("EPFABRIC_SOCKET"), "/run/epfabric/gpu2.sock,/run/epfabric/gpu5.sock");
  ASSERT_EQ(response->mounts_size(), 3);
  EXPECT_EQ(response->mounts(1).container_path(), "/var/run/nvidia-container-devices/2");
  EXPECT_EQ(response->mounts(2).container_path(), "/var/run/nvidia-container-devices/5");
  EXPECT_EQ(response->mounts(2).host_path(), "/dev/null");
  EXPECT_FALSE(device_plugin::AllocateContainer(options, {"gpu8-slot0"}).ok());
  EXPECT_FALSE(device_plugin::AllocateContainer(options, {"gpu02-slot0"}).ok());
  EXPECT_FALSE(device_plugin::AllocateContainer(options, {}).ok());
}

TEST(DevicePluginFlags, BadFlagsExitTwoNamingTheFlag) {
  RunResult result = RunBinary({EPF_DEVICE_PLUGIN_BINARY, "--gpus=0", "--plugin_dir=/"});
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_NE(result.err.find("--gpus: 0 is not in 1..64"), std::string::npos) << result.err;
  result = RunBinary({EPF_DEVICE_PLUGIN_BINARY, "--gpus=1", "--plugin_dir=/nonexistent-dir"});
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_NE(result.err.find("--plugin_dir: '/nonexistent-dir' is not a directory"), std::string::npos) << result.err;
}

}  // namespace
}  // namespace epfabric::testing
