// The proxy threads: a few per daemon (--proxy_threads), each sweeping the command rings assigned to it and posting
// their commands on the groups' links. A sweep that finds nothing spins for --proxy_spin_us, then sleeps with a pause
// that grows with the idle time (1/20 of it, up to --proxy_max_sleep_us, 1 ms): a daemon whose groups are idle costs
// a few % of a core per thread, a busy one picks commands up within microseconds. A thread without rings blocks until
// one is added.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "transport/command_ring.h"

namespace epfabric::daemon::transport {

struct ProxyOptions {
  int threads = 2;
  absl::Duration spin = absl::Microseconds(1000);
  absl::Duration max_sleep = absl::Milliseconds(1);
  int budget_per_ring = 64;  // commands taken from one ring per sweep, so that one busy ring cannot starve others
};

// One ring as a proxy thread serves it.
struct ProxiedRing {
  CommandRing* ring = nullptr;
  GroupLink* link = nullptr;
  const CommandBounds* bounds = nullptr;
};

class Proxy {
 public:
  explicit Proxy(ProxyOptions options);
  ~Proxy();  // stops the threads; every ring must have been removed
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  // Assigns `ring` to a thread (round robin). The pointers must stay valid until Remove returns.
  void Add(const ProxiedRing& ring) ABSL_LOCKS_EXCLUDED(mutex_);
  // Takes `ring` out; when it returns no thread is inside its Poll.
  void Remove(const CommandRing* ring) ABSL_LOCKS_EXCLUDED(mutex_);

  // Sweeps that found work, and those that did not (for the CPU-use benchmark).
  uint64_t busy_sweeps() const { return busy_sweeps_.load(std::memory_order_relaxed); }
  uint64_t idle_sweeps() const { return idle_sweeps_.load(std::memory_order_relaxed); }

 private:
  struct Worker {
    absl::Mutex mutex;  // held for a whole sweep; Add/Remove take it
    std::vector<ProxiedRing> rings ABSL_GUARDED_BY(mutex);
    std::thread thread;
  };
  void Run(Worker* worker);

  const ProxyOptions options_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> busy_sweeps_{0};
  std::atomic<uint64_t> idle_sweeps_{0};
  absl::Mutex mutex_;
  size_t next_ ABSL_GUARDED_BY(mutex_) = 0;
};

}  // namespace epfabric::daemon::transport
