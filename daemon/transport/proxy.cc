#include "transport/proxy.h"

#include <algorithm>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace epfabric::daemon::transport {

Proxy::Proxy(ProxyOptions options) : options_(options) {
  const int threads = std::max(1, options_.threads);
  for (int i = 0; i < threads; ++i) {
    workers_.push_back(std::make_unique<Worker>());
    Worker* worker = workers_.back().get();
    worker->thread = std::thread([this, worker] { Run(worker); });
  }
}

Proxy::~Proxy() {
  stop_.store(true);
  for (auto& worker : workers_) {
    // Releasing the mutex re-evaluates the condition a worker without rings waits on.
    { absl::MutexLock lock(&worker->mutex); }
    worker->thread.join();
  }
}

void Proxy::Add(const ProxiedRing& ring) {
  Worker* worker;
  {
    absl::MutexLock lock(&mutex_);
    worker = workers_[next_++ % workers_.size()].get();
  }
  absl::MutexLock lock(&worker->mutex);
  worker->rings.push_back(ring);
}

void Proxy::Remove(const CommandRing* ring) {
  for (auto& worker : workers_) {
    absl::MutexLock lock(&worker->mutex);
    auto& rings = worker->rings;
    rings.erase(std::remove_if(rings.begin(), rings.end(), [ring](const ProxiedRing& r) { return r.ring == ring; }),
                rings.end());
  }
}

void Proxy::Run(Worker* worker) {
  absl::Time idle_since = absl::InfinitePast();
  absl::Duration sleep = absl::Microseconds(10);
  while (!stop_.load(std::memory_order_relaxed)) {
    int taken = 0;
    {
      absl::MutexLock lock(&worker->mutex);
      // A worker without rings waits for one: a daemon without groups has no thread waking up.
      auto has_work = [this, worker]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(worker->mutex) {
        return !worker->rings.empty() || stop_.load(std::memory_order_relaxed);
      };
      worker->mutex.Await(absl::Condition(&has_work));
      for (const ProxiedRing& r : worker->rings) taken += r.ring->Poll(r.link, *r.bounds, options_.budget_per_ring);
    }
    if (taken > 0) {
      busy_sweeps_.fetch_add(1, std::memory_order_relaxed);
      idle_since = absl::InfinitePast();
      sleep = absl::Microseconds(10);
      continue;
    }
    idle_sweeps_.fetch_add(1, std::memory_order_relaxed);
    const absl::Time now = absl::Now();
    if (idle_since == absl::InfinitePast()) idle_since = now;
    if (now - idle_since < options_.spin) {
#if defined(__x86_64__)
      _mm_pause();
#endif
      continue;
    }
    // The pause grows with the idle time (at most 1/20 of it): a command that arrives during a pause waits at most 5 %
    // of the time the thread had been idle, and a long-idle group costs a wake-up per max_sleep.
    absl::SleepFor(sleep);
    sleep = std::clamp((now - idle_since) / 20, absl::Microseconds(10), options_.max_sleep);
  }
}

}  // namespace epfabric::daemon::transport
