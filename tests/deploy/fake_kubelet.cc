// A stand-in for kubelet's side of the device-plugin API, for the pod harness (pod_harness.py):
//   fake_kubelet --plugin_dir=D serve                  serve Registration on D/kubelet.sock; print each RegisterRequest
//                                                      as one JSON line; until SIGTERM
//   fake_kubelet --plugin_dir=D --endpoint=E list      the plugin's first ListAndWatch answer, as JSON
//   fake_kubelet --plugin_dir=D --endpoint=E --size=N allocate
//                                                      what kubelet does for a container asking for N devices: list
//                                                      the healthy ones, GetPreferredAllocation, Allocate; prints the
//                                                      ContainerAllocateResponse as JSON (exit 1 on any error)
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <mutex>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "deviceplugin_v1beta1.grpc.pb.h"
#include "epctl/json_contract.h"

ABSL_FLAG(std::string, plugin_dir, "", "kubelet's device-plugin directory.");
ABSL_FLAG(std::string, endpoint, "epfabric.sock", "The plugin's socket in --plugin_dir.");
ABSL_FLAG(int, size, 1, "allocate: devices the container asks for.");

namespace {

class Registration final : public v1beta1::Registration::Service {
  grpc::Status Register(grpc::ServerContext*, const v1beta1::RegisterRequest* request, v1beta1::Empty*) override {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string line = epfabric::epctl::ContractJson(*request);
    for (char& c : line) c = c == '\n' ? ' ' : c;
    std::cout << line << std::endl;
    return grpc::Status::OK;
  }
  std::mutex mutex_;
};

std::unique_ptr<v1beta1::DevicePlugin::Stub> PluginStub() {
  return v1beta1::DevicePlugin::NewStub(
      grpc::CreateChannel("unix:" + absl::GetFlag(FLAGS_plugin_dir) + "/" + absl::GetFlag(FLAGS_endpoint),
                          grpc::InsecureChannelCredentials()));
}

bool FirstList(v1beta1::DevicePlugin::Stub* stub, v1beta1::ListAndWatchResponse* listed) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto reader = stub->ListAndWatch(&context, v1beta1::Empty());
  const bool ok = reader->Read(listed);
  context.TryCancel();
  return ok;
}

int Fail(const std::string& what, const grpc::Status& status) {
  std::cerr << "fake_kubelet: " << what << ": " << status.error_message() << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  const std::string verb = args.size() > 1 ? args[1] : "";
  if (verb == "serve") {
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGTERM);
    sigaddset(&stop, SIGINT);
    pthread_sigmask(SIG_BLOCK, &stop, nullptr);
    Registration service;
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + absl::GetFlag(FLAGS_plugin_dir) + "/kubelet.sock",
                             grpc::InsecureServerCredentials());
    builder.RegisterService(&service);
    auto server = builder.BuildAndStart();
    if (server == nullptr) return 1;
    int signal_number = 0;
    sigwait(&stop, &signal_number);
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    return 0;
  }
  auto stub = PluginStub();
  v1beta1::ListAndWatchResponse listed;
  if (!FirstList(stub.get(), &listed)) return Fail("ListAndWatch", grpc::Status::CANCELLED);
  if (verb == "list") {
    std::cout << epfabric::epctl::ContractJson(listed) << "\n";
    return 0;
  }
  if (verb != "allocate") {
    std::cerr << "usage: fake_kubelet --plugin_dir=D (serve | list | allocate --size=N)\n";
    return 2;
  }
  v1beta1::PreferredAllocationRequest preferred_request;
  auto* container = preferred_request.add_container_requests();
  for (const auto& device : listed.devices()) {
    if (device.health() == "Healthy") container->add_available_device_ids(device.id());
  }
  container->set_allocation_size(absl::GetFlag(FLAGS_size));
  if (container->available_device_ids_size() < absl::GetFlag(FLAGS_size)) {
    std::cerr << "fake_kubelet: " << container->available_device_ids_size() << " healthy devices, "
              << absl::GetFlag(FLAGS_size) << " asked for\n";
    return 1;
  }
  v1beta1::PreferredAllocationResponse preferred;
  {
    grpc::ClientContext context;
    const grpc::Status status = stub->GetPreferredAllocation(&context, preferred_request, &preferred);
    if (!status.ok()) return Fail("GetPreferredAllocation", status);
  }
  v1beta1::AllocateRequest request;
  auto* wanted = request.add_container_requests();
  for (const auto& id : preferred.container_responses(0).device_ids()) wanted->add_device_ids(id);
  v1beta1::AllocateResponse response;
  grpc::ClientContext context;
  const grpc::Status status = stub->Allocate(&context, request, &response);
  if (!status.ok()) return Fail("Allocate", status);
  std::cout << epfabric::epctl::ContractJson(response.container_responses(0)) << "\n";
  return 0;
}
