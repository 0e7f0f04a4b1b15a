// Commands whose destination is the issuing member itself (a put from a member's region into its own region, and the
// signals ordered after it) on the socket wire. Small ones run at once on the proxy thread; a put above
// kInlineBytes, and everything of the same channel posted after it until it is done, goes to the copier: one thread
// per daemon that serves every channel with work round robin, kChunkBytes at a time. So a tenant's 256 MiB local
// puts cost the proxy threads nothing (they only queue them), and another group's signal waits for at most one
// chunk of someone else's copy, not for whole copies (docs/security.md, "Fair proxying").
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/status/status.h"
#include "transport/region_io.h"
#include "transport/wire.h"

namespace epfabric::daemon::transport {

class LocalCopies {
 public:
  static constexpr uint64_t kInlineBytes = 256ull << 10;
  static constexpr uint64_t kChunkBytes = 4ull << 20;

  LocalCopies();
  ~LocalCopies();  // every channel must have been closed
  LocalCopies(const LocalCopies&) = delete;
  LocalCopies& operator=(const LocalCopies&) = delete;

  // One channel's local commands, applied in the order they are posted. Posted from one thread at a time (the proxy
  // thread of the channel's ring); completions go to `sink`, from the proxy thread or the copier.
  class Channel;
  std::unique_ptr<Channel> Open(std::unique_ptr<RegionIo> io, CompletionSink* sink);
  void Put(Channel& channel, uint64_t dst_offset, uint64_t src_offset, uint64_t bytes, uint64_t cookie);
  void SignalAdd(Channel& channel, uint64_t dst_offset, int64_t value, uint64_t cookie);
  // Fails what is queued (Cancelled) and returns once the copier is not inside the channel; later commands fail.
  void Close(Channel& channel);

 private:
  struct Item {
    bool put = false;
    uint64_t dst_offset = 0;
    uint64_t src_offset = 0;
    uint64_t arg = 0;   // put: bytes; signal: the value
    uint64_t done = 0;  // put: bytes copied so far
    uint64_t cookie = 0;
  };
  void Post(Channel& channel, const Item& item);
  void Run();
  // Copies the next chunk of the item at the front of `channel`; true when the item is finished.
  static absl::Status Step(Channel& channel, Item& item, bool* finished);

  std::mutex mutex_;
  std::condition_variable work_;
  std::condition_variable idle_;
  std::list<Channel*> active_;  // channels with queued items, in round-robin order
  Channel* current_ = nullptr;  // the channel the copier is copying for (outside the lock)
  bool stop_ = false;
  std::thread thread_;
};

class LocalCopies::Channel {
 public:
  explicit Channel(std::unique_ptr<RegionIo> io, CompletionSink* sink) : io_(std::move(io)), sink_(sink) {}

 private:
  friend class LocalCopies;
  std::unique_ptr<RegionIo> io_;  // used by one thread at a time: the poster when nothing is queued, else the copier
  CompletionSink* const sink_;
  std::deque<Item> queue_;  // guarded by LocalCopies::mutex_
  bool closed_ = false;     // guarded by LocalCopies::mutex_
  bool inline_ = false;     // the poster's: this command runs on its thread
};

}  // namespace epfabric::daemon::transport
