#include "transport/local_copies.h"

#include <algorithm>
#include <vector>

namespace epfabric::daemon::transport {

LocalCopies::LocalCopies() : thread_([this] { Run(); }) {}

LocalCopies::~LocalCopies() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_.notify_all();
  thread_.join();
}

std::unique_ptr<LocalCopies::Channel> LocalCopies::Open(std::unique_ptr<RegionIo> io, CompletionSink* sink) {
  return std::make_unique<Channel>(std::move(io), sink);
}

void LocalCopies::Put(Channel& channel, uint64_t dst_offset, uint64_t src_offset, uint64_t bytes, uint64_t cookie) {
  Post(channel, Item{true, dst_offset, src_offset, bytes, 0, cookie});
}

void LocalCopies::SignalAdd(Channel& channel, uint64_t dst_offset, int64_t value, uint64_t cookie) {
  Post(channel, Item{false, dst_offset, 0, static_cast<uint64_t>(value), 0, cookie});
}

void LocalCopies::Post(Channel& channel, const Item& item) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (channel.closed_) {
      // Answered below, not under the lock: the sink takes the ring's.
    } else if (!channel.queue_.empty() || (item.put && item.arg > kInlineBytes)) {
      if (channel.queue_.empty()) active_.push_back(&channel);
      channel.queue_.push_back(item);
      work_.notify_one();
      return;
    } else {
      channel.inline_ = true;
    }
  }
  if (!channel.inline_) {
    channel.sink_->Complete(item.cookie, absl::CancelledError("transport: the group's transport is shutting down"));
    return;
  }
  // Nothing of this channel is queued, and only this thread queues for it: the copier does not touch io_ now.
  channel.inline_ = false;
  const absl::Status status = item.put ? channel.io_->CopyWithin(item.dst_offset, item.src_offset, item.arg)
                                       : channel.io_->SignalAdd(item.dst_offset, static_cast<int64_t>(item.arg));
  channel.sink_->Complete(item.cookie, status);
}

void LocalCopies::Close(Channel& channel) {
  std::deque<Item> dropped;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    channel.closed_ = true;
    idle_.wait(lock, [&] { return current_ != &channel; });
    active_.remove(&channel);
    dropped.swap(channel.queue_);
  }
  for (const Item& item : dropped) {
    channel.sink_->Complete(item.cookie, absl::CancelledError("transport: the group's transport is shutting down"));
  }
}

absl::Status LocalCopies::Step(Channel& channel, Item& item, bool* finished) {
  if (!item.put) {
    *finished = true;
    return channel.io_->SignalAdd(item.dst_offset, static_cast<int64_t>(item.arg));
  }
  const uint64_t n = std::min(kChunkBytes, item.arg - item.done);
  // memmove's meaning in pieces: when the destination overlaps the source from above, copy from the end.
  const bool backwards = item.dst_offset > item.src_offset && item.dst_offset < item.src_offset + item.arg;
  const uint64_t at = backwards ? item.arg - item.done - n : item.done;
  absl::Status status = channel.io_->CopyWithin(item.dst_offset + at, item.src_offset + at, n);
  item.done += n;
  *finished = item.done == item.arg || !status.ok();
  return status;
}

void LocalCopies::Run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    work_.wait(lock, [&] { return stop_ || !active_.empty(); });
    if (stop_) return;
    Channel* channel = active_.front();
    active_.pop_front();
    current_ = channel;
    Item item = channel->queue_.front();
    lock.unlock();
    bool finished = false;
    const absl::Status status = Step(*channel, item, &finished);
    if (finished) channel->sink_->Complete(item.cookie, status);
    lock.lock();
    if (finished) {
      channel->queue_.pop_front();
    } else {
      channel->queue_.front().done = item.done;
    }
    current_ = nullptr;
    idle_.notify_all();
    // To the back: the others' turn first. A closed channel is Close's to empty.
    if (!channel->closed_ && !channel->queue_.empty()) active_.push_back(channel);
  }
}

}  // namespace epfabric::daemon::transport
