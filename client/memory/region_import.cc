#include "memory/region_import.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "epfabric/common/cuda_driver.h"
#include "epfabric/common/fd_passing.h"
#include "epfabric/common/status_macros.h"

namespace epfabric::client::memory {
namespace {

using cuda::CudaStatus;
using cuda::CuStatus;

std::string ErrnoText(int error) { return absl::StrCat(std::strerror(error), " (errno ", error, ")"); }

// Switches the calling thread to `device` and back to the device it used before: importing a region must not change
// where the caller's later CUDA calls go. A thread that had no current context is left on `device` rather than
// "restored" to device 0, which would create a context (and spend memory) on a GPU the caller never asked for.
class ScopedDevice {
 public:
  ScopedDevice() = default;
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  ~ScopedDevice() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  absl::Status Use(int device) {
    absl::StatusOr<const cuda::DriverApi*> driver = cuda::Driver();
    CUcontext current_context = nullptr;
    int current = -1;
    if (driver.ok() && (*driver)->cuCtxGetCurrent(&current_context) == CUDA_SUCCESS && current_context != nullptr &&
        cudaGetDevice(&current) == cudaSuccess && current != device) {
      previous_ = current;
    }
    (void)cudaGetLastError();
    return cuda::UseDevice(device);
  }

 private:
  int previous_ = -1;
};

// The accessing device as an ordinal of this process.
absl::StatusOr<int> ResolveAccessingDevice(const ImportOptions& options) {
  int count = 0;
  if (absl::Status status = CudaStatus(cudaGetDeviceCount(&count), "cudaGetDeviceCount"); !status.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("no usable CUDA device in this process: ", status.message()));
  }
  int device = options.accessing_device;
  if (device < 0) {
    EPF_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), "cudaGetDevice"));
  }
  if (device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("ImportOptions.accessing_device ", device, " does not exist (", count, " visible)"));
  }
  return device;
}

// The owner's ordinal in this process, or -1 when its GPU is not visible here (CUDA_VISIBLE_DEVICES, a container
// that was given one GPU): sharing may still work through the accessing device, so that is not an error by itself.
int FindOwnerDevice(const v1::RegionDescriptor& descriptor) {
  if (descriptor.device_pci_bus_id().empty()) return -1;
  int owner = -1;
  if (cudaDeviceGetByPCIBusId(&owner, descriptor.device_pci_bus_id().c_str()) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return owner;
}

absl::Status CheckPeerAccess(int accessing, int owner, const v1::RegionDescriptor& descriptor) {
  if (owner < 0 || owner == accessing) return absl::OkStatus();
  int can_access = 0;
  if (cudaDeviceCanAccessPeer(&can_access, accessing, owner) != cudaSuccess) (void)cudaGetLastError();
  if (can_access == 0) {
    return absl::FailedPreconditionError(absl::StrCat("device ", accessing, " cannot access the memory of device ",
                                                      owner, " (", descriptor.device_pci_bus_id(),
                                                      "): no peer access between them"));
  }
  return absl::OkStatus();
}

// The seals a host region must carry before it is mapped: without F_SEAL_SHRINK anyone else holding the fd could
// truncate it and this process would SIGBUS on the lost pages; without F_SEAL_SEAL someone could still add seals.
constexpr int kRequiredHostSeals = F_SEAL_SHRINK | F_SEAL_SEAL;

absl::StatusOr<MappedRegion> ImportHost(
    const v1::RegionDescriptor& descriptor, int fd,
    const std::function<MappedRegion(void*, int, std::function<absl::Status()>)>& make) {
  if (fd < 0) {
    return absl::InvalidArgumentError(
        "POSIX_SHM region: no file descriptor was received with the descriptor (host regions are only handed out "
        "as file descriptors over the daemon's fd side channel)");
  }
  struct stat info {};
  if (fstat(fd, &info) != 0) return absl::InternalError(absl::StrCat("fstat(fd ", fd, "): ", ErrnoText(errno)));
  if (!S_ISREG(info.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("POSIX_SHM region: fd ", fd, " is not a memory file"));
  }
  if (static_cast<uint64_t>(info.st_size) < descriptor.size_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("RegionDescriptor.size_bytes ", descriptor.size_bytes(),
                                                   " is larger than the region's file (", info.st_size, " bytes)"));
  }
  const int seals = fcntl(fd, F_GET_SEALS);
  const int seals_error = errno;
  if (seals < 0 || (seals & kRequiredHostSeals) != kRequiredHostSeals) {
    return absl::InvalidArgumentError(absl::StrCat(
        "POSIX_SHM region: fd ", fd, " is not sealed against shrinking (F_GET_SEALS: ",
        seals < 0 ? ErrnoText(seals_error) : absl::StrCat("0x", absl::Hex(seals)), "); refusing to map it"));
  }
  void* data = mmap(nullptr, descriptor.size_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    return absl::InternalError(
        absl::StrCat("mmap(fd ", fd, ", ", descriptor.size_bytes(), " bytes): ", ErrnoText(errno)));
  }
  // The mapping keeps the memory alive; the caller may close `fd` now.
  const uint64_t size = descriptor.size_bytes();
  return make(data, -1, [data, size]() -> absl::Status {
    if (munmap(data, size) != 0) {
      return absl::InternalError(absl::StrCat("munmap of a host region (", size, " bytes): ", ErrnoText(errno)));
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<MappedRegion> ImportCudaIpc(
    const v1::RegionDescriptor& descriptor, int accessing,
    const std::function<MappedRegion(void*, int, std::function<absl::Status()>)>& make) {
  cudaIpcMemHandle_t handle;
  if (descriptor.handle().size() != sizeof(handle)) {
    return absl::InvalidArgumentError(absl::StrCat("RegionDescriptor.handle has ", descriptor.handle().size(),
                                                   " bytes; a cudaIpcMemHandle_t has ", sizeof(handle)));
  }
  std::memcpy(&handle, descriptor.handle().data(), sizeof(handle));
  const int owner = FindOwnerDevice(descriptor);
  EPF_RETURN_IF_ERROR(CheckPeerAccess(accessing, owner, descriptor));
  // Opened in the accessing device's context, with peer access enabled lazily by the driver, rather than in the
  // owner's: a client on GPU 3 that maps the regions of 8 same-host ranks would otherwise create (and pay memory
  // for) a context on every one of those GPUs.
  ScopedDevice scoped;
  EPF_RETURN_IF_ERROR(scoped.Use(accessing));
  void* data = nullptr;
  if (absl::Status open = CudaStatus(cudaIpcOpenMemHandle(&data, handle, cudaIpcMemLazyEnablePeerAccess),
                                     absl::StrCat("cudaIpcOpenMemHandle (owner ", descriptor.device_pci_bus_id(),
                                                  ", accessing device ", accessing, ")"));
      !open.ok()) {
    return open;
  }
  return make(data, accessing, [data, accessing]() -> absl::Status {
    ScopedDevice scoped;
    EPF_RETURN_IF_ERROR(scoped.Use(accessing));
    return CudaStatus(cudaIpcCloseMemHandle(data), "cudaIpcCloseMemHandle");
  });
}

absl::StatusOr<MappedRegion> ImportPosixFd(
    const v1::RegionDescriptor& descriptor, int fd, int accessing,
    const std::function<MappedRegion(void*, int, std::function<absl::Status()>)>& make) {
  if (fd < 0) {
    return absl::InvalidArgumentError("POSIX_FD region: no file descriptor was received with the descriptor");
  }
  EPF_ASSIGN_OR_RETURN(const cuda::DriverApi* loaded, cuda::Driver());
  const cuda::DriverApi& driver = *loaded;
  const int owner = FindOwnerDevice(descriptor);
  EPF_RETURN_IF_ERROR(CheckPeerAccess(accessing, owner, descriptor));
  ScopedDevice scoped;
  EPF_RETURN_IF_ERROR(scoped.Use(accessing));

  CUmemGenericAllocationHandle handle = 0;
  if (absl::Status status =
          CuStatus(driver,
                   driver.cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                   absl::StrCat("cuMemImportFromShareableHandle(fd ", fd, ")"));
      !status.ok()) {
    return status;
  }
  // The mapping holds its own reference to the memory, so the handle is released whatever happens below.
  absl::Cleanup release_handle = [&driver, handle] { (void)driver.cuMemRelease(handle); };

  // Granularity for the address reservation, asked for the accessing device: the properties of the imported handle
  // name the owner's device, which may not even be visible in this process.
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = accessing;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t granularity = 0;
  if (absl::Status status =
          CuStatus(driver, driver.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                   "cuMemGetAllocationGranularity");
      !status.ok()) {
    return status;
  }
  const uint64_t size = descriptor.size_bytes();
  if (size == 0 || granularity == 0 || size % granularity != 0) {
    return absl::InvalidArgumentError(absl::StrCat("RegionDescriptor.size_bytes ", size,
                                                   " is not a positive multiple of the allocation granularity ",
                                                   granularity));
  }
  CUdeviceptr address = 0;
  if (absl::Status status = CuStatus(driver, driver.cuMemAddressReserve(&address, size, granularity, 0, 0),
                                     absl::StrCat("cuMemAddressReserve(", size, ")"));
      !status.ok()) {
    return status;
  }
  absl::Cleanup free_address = [&driver, address, size] { (void)driver.cuMemAddressFree(address, size); };
  if (absl::Status status = CuStatus(driver, driver.cuMemMap(address, size, 0, handle, 0),
                                     absl::StrCat("cuMemMap(", size,
                                                  " bytes; a size larger than the allocation "
                                                  "fails here)"));
      !status.ok()) {
    return status;
  }
  absl::Cleanup unmap = [&driver, address, size] { (void)driver.cuMemUnmap(address, size); };
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = accessing;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (absl::Status status = CuStatus(driver, driver.cuMemSetAccess(address, size, &access, 1),
                                     absl::StrCat("cuMemSetAccess(device ", accessing, ")"));
      !status.ok()) {
    return status;
  }
  std::move(unmap).Cancel();
  std::move(free_address).Cancel();
  const cuda::DriverApi* driver_ptr = &driver;
  return make(reinterpret_cast<void*>(address), accessing, [driver_ptr, address, size, accessing]() -> absl::Status {
    ScopedDevice scoped;
    EPF_RETURN_IF_ERROR(scoped.Use(accessing));
    absl::Status unmapped = CuStatus(*driver_ptr, driver_ptr->cuMemUnmap(address, size), "cuMemUnmap");
    absl::Status freed = CuStatus(*driver_ptr, driver_ptr->cuMemAddressFree(address, size), "cuMemAddressFree");
    return unmapped.ok() ? freed : unmapped;
  });
}

}  // namespace

MappedRegion::MappedRegion(MappedRegion&& other) noexcept
    : data_(other.data_),
      device_data_(other.device_data_),
      size_(other.size_),
      sharing_(other.sharing_),
      device_(other.device_),
      unmap_(std::move(other.unmap_)) {
  other.unmap_ = nullptr;
  other.data_ = nullptr;
  other.device_data_ = nullptr;
  other.size_ = 0;
}

MappedRegion& MappedRegion::operator=(MappedRegion&& other) noexcept {
  if (this != &other) {
    (void)Unmap();
    data_ = other.data_;
    device_data_ = other.device_data_;
    size_ = other.size_;
    sharing_ = other.sharing_;
    device_ = other.device_;
    unmap_ = std::move(other.unmap_);
    other.unmap_ = nullptr;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

MappedRegion::~MappedRegion() {
  if (absl::Status status = Unmap(); !status.ok()) {
    std::fprintf(stderr, "epfabric: unmapping a region failed: %s\n", status.ToString().c_str());
  }
}

absl::Status MappedRegion::Unmap() {
  if (!unmap_) return absl::OkStatus();
  std::function<absl::Status()> unmap = std::move(unmap_);
  unmap_ = nullptr;
  data_ = nullptr;
  return unmap();
}

absl::StatusOr<MappedRegion> RegisterHostWithCuda(MappedRegion mapped, const ImportOptions& options) {
  EPF_ASSIGN_OR_RETURN(const int accessing, ResolveAccessingDevice(options));
  int previous = -1;
  cudaGetDevice(&previous);
  cudaSetDevice(accessing);
  cudaError_t err = cudaHostRegister(mapped.data(), mapped.size(), cudaHostRegisterMapped | cudaHostRegisterPortable);
  void* device_pointer = nullptr;
  if (err == cudaSuccess) err = cudaHostGetDevicePointer(&device_pointer, mapped.data(), 0);
  if (previous >= 0) cudaSetDevice(previous);
  if (err != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cudaHostRegister of a host region (", mapped.size(), " bytes): ", cudaGetErrorString(err)));
  }
  void* host = mapped.data();
  std::function<absl::Status()> unmap = std::move(mapped.unmap_);
  mapped.unmap_ = [host, unmap = std::move(unmap)]() -> absl::Status {
    cudaHostUnregister(host);
    return unmap();
  };
  mapped.device_data_ = device_pointer;
  mapped.device_ = accessing;
  return mapped;
}

absl::StatusOr<MappedRegion> ImportRegion(const v1::RegionDescriptor& descriptor, int fd,
                                          const ImportOptions& options) {
  if (descriptor.size_bytes() == 0) return absl::InvalidArgumentError("RegionDescriptor.size_bytes is 0");
  const v1::MemorySharing sharing = descriptor.sharing();
  auto make = [&descriptor, sharing](void* data, int device, std::function<absl::Status()> unmap) {
    MappedRegion mapped(data, descriptor.size_bytes(), sharing, device, std::move(unmap));
    if (device >= 0) mapped.device_data_ = data;
    return mapped;
  };
  if (sharing == v1::MEMORY_SHARING_POSIX_SHM) {
    EPF_ASSIGN_OR_RETURN(MappedRegion mapped, ImportHost(descriptor, fd, make));
    if (!options.register_with_cuda) return mapped;
    return RegisterHostWithCuda(std::move(mapped), options);
  }
  if (sharing != v1::MEMORY_SHARING_CUDA_IPC && sharing != v1::MEMORY_SHARING_POSIX_FD) {
    return absl::InvalidArgumentError(
        absl::StrCat("RegionDescriptor.sharing ", v1::MemorySharing_Name(sharing), " cannot be imported"));
  }
  EPF_ASSIGN_OR_RETURN(const int accessing, ResolveAccessingDevice(options));
  if (sharing == v1::MEMORY_SHARING_CUDA_IPC) return ImportCudaIpc(descriptor, accessing, make);
  return ImportPosixFd(descriptor, fd, accessing, make);
}

}  // namespace epfabric::client::memory
