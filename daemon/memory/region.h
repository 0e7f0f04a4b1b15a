// Daemon-owned communication memory. A Region is one rank's symmetric region of one group (NVL or RDMA kind):
// allocated by the daemon, described by a v1::RegionDescriptor that clients use to map it, freed when the Region
// is destroyed. Backends: host shared memory (an anonymous sealed memfd, handed to clients as a file descriptor) and
// CUDA device memory (cuda), the latter shareable either as a classic CUDA IPC handle or as a cuMem allocation
// exported as a POSIX file descriptor.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epfabric/v1/control.pb.h"

namespace epfabric::daemon::memory {

struct RegionSpec {
  std::string group;  // [A-Za-z0-9._-]{1,64}; part of the host memfd's label
  int rank = 0;       // group rank
  uint64_t bytes = 0;
  v1::RegionDescriptor::Kind kind = v1::RegionDescriptor::KIND_NVL;
  // CUDA_IPC or POSIX_FD on the cuda backend; POSIX_SHM on the host backend. UNSPECIFIED: the backend's default.
  v1::MemorySharing sharing = v1::MEMORY_SHARING_UNSPECIFIED;
};

class Region {
 public:
  virtual ~Region() = default;
  // Filled: rank, sharing, size_bytes, handle (CUDA_IPC), device, device_pci_bus_id, kind. Never shm_name.
  virtual const v1::RegionDescriptor& descriptor() const = 0;
  // The daemon's own mapping: a host pointer (host backend) or a device pointer (cuda backend).
  virtual void* base() const = 0;
  // Zeroes [offset, offset + bytes): the daemon cleans a rank's signals and counters when a lease ends.
  virtual absl::Status Zero(uint64_t offset, uint64_t bytes) = 0;
  // POSIX_FD (the exported cuMem handle) and POSIX_SHM (the host region's memfd): the file descriptor to send to
  // clients with SCM_RIGHTS (owned by the Region); -1 for CUDA_IPC.
  virtual int shareable_fd() const { return -1; }
};

class RegionAllocator {
 public:
  virtual ~RegionAllocator() = default;
  // Allocates and zeroes a region. ResourceExhausted when the size is over the allocator's limit or the device is
  // out of memory (the message says which, with the sizes); InvalidArgument for a bad spec.
  virtual absl::StatusOr<std::unique_ptr<Region>> Allocate(const RegionSpec& spec) = 0;
  virtual v1::Backend backend() const = 0;
};

// Host shared memory: each region is a memfd (no name in /dev/shm, so regions of different daemons can neither
// collide nor be opened by anybody who was not handed the fd), sized with posix_fallocate and sealed against
// shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), shared as MEMORY_SHARING_POSIX_SHM through
// shareable_fd(). `name_prefix` only labels the memfds: "epf.<prefix>.<group>.<rank>.<kind>" (other characters than
// [A-Za-z0-9._-] become '_'; labels need not be unique). `max_region_bytes` bounds one region (0 = no limit of ours).
std::unique_ptr<RegionAllocator> MakeHostAllocator(std::string name_prefix, uint64_t max_region_bytes);

// The cuda backend's sharing when neither the allocator nor the spec names one: cuMem + POSIX fd needs only the
// daemon's Unix socket (checked with the client in its own PID, IPC and mount namespaces); see docs/memory.md.
inline constexpr v1::MemorySharing kDefaultCudaSharing = v1::MEMORY_SHARING_POSIX_FD;

// CUDA device memory on `device`, shared as `default_sharing` unless the spec says otherwise (UNSPECIFIED:
// kDefaultCudaSharing). POSIX_FD regions are rounded up to the allocation granularity (2 MiB on Hopper) and
// `descriptor().size_bytes` is the rounded size, which is what a client must map.
std::unique_ptr<RegionAllocator> MakeCudaAllocator(int device, v1::MemorySharing default_sharing,
                                                   uint64_t max_region_bytes);

}  // namespace epfabric::daemon::memory
