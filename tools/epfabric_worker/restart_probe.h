// epfabric_worker --restart_probe (restart cost, issue #5; see main.cc): the early CUDA context and the probe.
#pragma once

#include <cstdint>
#include <future>
#include <thread>

#include "absl/status/status.h"
#include "worker.h"

namespace epfabric::worker {

// Creates the CUDA context of this rank's device on a thread of its own, started first thing in main(): context
// creation is the largest single cost of a fresh CUDA process (docs/memory.md: 120-160 ms), and nothing before the
// region imports at the end of Attach needs it, so it runs while the main thread connects and makes the Attach RPC
// instead of after them. The imports' own cudaSetDevice on the main thread waits for it inside the runtime (primary
// context creation is serialised there); Buffer::Create runs after Wait(). A serving process can do the same.
class EarlyCudaContext {
 public:
  explicit EarlyCudaContext(int rank) : thread_([this, rank] { Run(rank); }) {}
  ~EarlyCudaContext() {
    if (thread_.joinable()) thread_.join();
  }
  EarlyCudaContext(const EarlyCudaContext&) = delete;
  EarlyCudaContext& operator=(const EarlyCudaContext&) = delete;

  // The device (ChooseDevice), known once the driver is initialised, before the context exists.
  int device() const { return device_.get(); }
  // Waits for the context; the status of its creation.
  absl::Status Wait() {
    if (thread_.joinable()) thread_.join();
    return status_;
  }
  // After Wait(): when the context was ready (CLOCK_REALTIME ns), 0 without a device.
  int64_t ready_unix_ns() const { return ready_unix_ns_; }

 private:
  void Run(int rank) {
    const int device = ChooseDevice(rank);
    device_promise_.set_value(device);
    if (device < 0) return;
    cudaError_t error = cudaSetDevice(device);
    if (error == cudaSuccess) error = cudaFree(nullptr);  // forces the context into existence
    if (error != cudaSuccess) {
      status_ = absl::UnavailableError(absl::StrCat("creating the CUDA context of device ", device, ": ",
                                                    cudaGetErrorName(error), ": ", cudaGetErrorString(error)));
      return;
    }
    ready_unix_ns_ = absl::ToUnixNanos(absl::Now());
  }

  std::promise<int> device_promise_;
  std::shared_future<int> device_ = device_promise_.get_future().share();
  absl::Status status_;
  int64_t ready_unix_ns_ = 0;
  std::thread thread_;  // last: it starts once the members it writes exist
};

// --restart_probe: see main.cc's file comment. Every stage is stamped as milliseconds since --launch_unix_ns.
int RunRestartProbe(const Scenario& s, const BufferConfig& config, int64_t main_unix_ns, EarlyCudaContext& early);

}  // namespace epfabric::worker
