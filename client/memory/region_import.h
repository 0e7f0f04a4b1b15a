// Client side of daemon-owned regions: maps a region that the daemon described with a v1::RegionDescriptor into this
// process. Host regions (POSIX_SHM) are a sealed memfd received over the daemon's Unix socket; cuda regions either
// a classic CUDA IPC handle (CUDA_IPC) or a cuMem allocation's POSIX file descriptor received over the same socket
// (POSIX_FD, see epfabric/common/fd_passing.h). No libcuda link: driver calls are resolved at run time.
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epfabric/v1/control.pb.h"

namespace epfabric::client::memory {

struct ImportOptions {
  // Cuda regions: the CUDA device (ordinal in this process) whose kernels will access the region; -1 = the calling
  // thread's current device. It may differ from the device that owns the memory (a peer over NVLink).
  int accessing_device = -1;
  // Host regions (POSIX_SHM): also register the mapping with CUDA (cudaHostRegister, mapped and portable) so that
  // kernels on `accessing_device` can write it (the transport's command rings); device_data() is then its device
  // pointer. Unregistered before the mapping goes.
  bool register_with_cuda = false;
};

// A region mapped into this process. Move-only; unmaps on destruction. The memory itself belongs to the daemon and
// stays alive while either side still maps it.
class MappedRegion {
 public:
  MappedRegion(MappedRegion&& other) noexcept;
  MappedRegion& operator=(MappedRegion&& other) noexcept;
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;
  ~MappedRegion();

  // A host pointer (POSIX_SHM) or a device pointer usable from `device()` (cuda).
  void* data() const { return data_; }
  // Bytes mapped: the descriptor's size_bytes.
  uint64_t size() const { return size_; }
  v1::MemorySharing sharing() const { return sharing_; }
  // The accessing device (cuda), -1 for host memory.
  int device() const { return device_; }
  // The pointer for kernels: data() for cuda regions, the registered device pointer of a host region imported with
  // register_with_cuda, nullptr for other host regions.
  void* device_data() const { return device_data_; }

  // Unmaps now and reports the first error (the destructor can only log). Idempotent.
  absl::Status Unmap();

 private:
  friend absl::StatusOr<MappedRegion> ImportRegion(const v1::RegionDescriptor&, int, const ImportOptions&);
  friend absl::StatusOr<MappedRegion> RegisterHostWithCuda(MappedRegion, const ImportOptions&);
  MappedRegion(void* data, uint64_t size, v1::MemorySharing sharing, int device, std::function<absl::Status()> unmap)
      : data_(data), size_(size), sharing_(sharing), device_(device), unmap_(std::move(unmap)) {}

  void* data_ = nullptr;
  void* device_data_ = nullptr;
  uint64_t size_ = 0;
  v1::MemorySharing sharing_ = v1::MEMORY_SHARING_UNSPECIFIED;
  int device_ = -1;
  std::function<absl::Status()> unmap_;  // empty once unmapped or moved from
};

// Maps the region described by `descriptor`. `fd` is the file descriptor received with it for POSIX_FD and
// POSIX_SHM (borrowed: the caller may close it once this returns) and is ignored for CUDA_IPC.
// Errors: InvalidArgument for a descriptor that does not hold together (sizes, handle length), a missing fd, or a
// host fd that is not a memory file sealed against shrinking (F_SEAL_SHRINK | F_SEAL_SEAL); NotFound when the
// owning device is not there; FailedPrecondition when this process has no usable CUDA device or driver; other CUDA
// failures carry the CUDA error name.
absl::StatusOr<MappedRegion> ImportRegion(const v1::RegionDescriptor& descriptor, int fd = -1,
                                          const ImportOptions& options = {});
// Internal to ImportRegion (register_with_cuda), declared for the friendship.
absl::StatusOr<MappedRegion> RegisterHostWithCuda(MappedRegion mapped, const ImportOptions& options);

}  // namespace epfabric::client::memory
