// Moving bytes in and out of a region for a wire that cannot address it directly (the socket wire): host regions
// are plain memory; cuda regions go through a pinned staging buffer and a stream of their own. One RegionIo per
// connection (it owns a staging buffer and a stream), used by one thread at a time.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "memory/region.h"

namespace epfabric::daemon::transport {

class RegionIo {
 public:
  virtual ~RegionIo() = default;
  // The largest piece Stage and Source hand out at once.
  virtual uint64_t chunk_bytes() const = 0;

  // Sender: host memory holding [offset, offset + bytes) of the region (bytes <= chunk_bytes()). Host regions: the
  // region itself; cuda regions: a staging buffer, filled (and synchronised) before this returns.
  virtual absl::StatusOr<const void*> Source(uint64_t offset, uint64_t bytes) = 0;

  // Receiver: where to receive `bytes` (<= chunk_bytes()) bound for `offset`; then Land(offset, bytes) puts them in
  // place (a no-op for host regions, a copy to the device for cuda regions). Land returns once the bytes are visible
  // to the region's other users.
  virtual absl::StatusOr<void*> Stage(uint64_t offset, uint64_t bytes) = 0;
  virtual absl::Status Land(uint64_t offset, uint64_t bytes) = 0;

  // Adds `value` to the 8-byte word at `offset` atomically (after every earlier Land of this RegionIo).
  virtual absl::Status SignalAdd(uint64_t offset, int64_t value) = 0;

  // Local destination (the issuer is the destination): copies within the region.
  virtual absl::Status CopyWithin(uint64_t dst_offset, uint64_t src_offset, uint64_t bytes) = 0;
};

// For `region` (descriptor().device < 0: host memory; otherwise device memory on that device).
absl::StatusOr<std::unique_ptr<RegionIo>> MakeRegionIo(memory::Region* region);

}  // namespace epfabric::daemon::transport
