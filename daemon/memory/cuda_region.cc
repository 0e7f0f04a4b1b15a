// Cuda backend: device memory on the daemon's GPU, shared with clients either as a classic CUDA IPC handle
// (cudaMalloc + cudaIpcGetMemHandle) or as a cuMem allocation exported as a POSIX file descriptor
// (cuMemCreate + cuMemExportToShareableHandle). Driver calls go through entry points resolved at run time
// (epfabric/common/cuda_driver.h): the daemon does not link libcuda and starts on machines without a driver.
#include <fcntl.h>
#include <unistd.h>

#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "epfabric/common/cuda_driver.h"
#include "epfabric/common/status_macros.h"
#include "logging.h"
#include "memory/region.h"
#include "memory/region_common.h"
#include "topology/system_files.h"

namespace epfabric::daemon::memory {
namespace {

using cuda::CudaStatus;
using cuda::CuStatus;

// Zeroes device memory and waits for it, on the calling thread's own stream so that it neither waits for nor
// serialises with anything else running on the device.
absl::Status ZeroDevice(int device, void* base, uint64_t size, uint64_t offset, uint64_t bytes) {
  EPF_RETURN_IF_ERROR(CheckZeroRange(offset, bytes, size));
  if (bytes == 0) return absl::OkStatus();
  EPF_RETURN_IF_ERROR(cuda::UseDevice(device));
  EPF_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(static_cast<char*>(base) + offset, 0, bytes, cudaStreamPerThread),
                                 absl::StrCat("cudaMemsetAsync(", bytes, " bytes at offset ", offset, ")")));
  return CudaStatus(cudaStreamSynchronize(cudaStreamPerThread), "cudaStreamSynchronize after zeroing");
}

// Device memory state for messages about out-of-memory.
std::string DeviceMemoryText(int device) {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::StrCat("device ", device);
  }
  return absl::StrCat("device ", device, " has ", free_bytes, " of ", total_bytes, " bytes free");
}

// A status from an allocation call, with out-of-memory rewritten to say which region and how much.
absl::Status AllocationStatus(absl::Status status, const RegionSpec& spec, uint64_t bytes, int device) {
  if (status.ok() || !absl::IsResourceExhausted(status)) return status;
  return absl::ResourceExhaustedError(absl::StrCat(DescribeRegion(spec), ": out of device memory allocating ", bytes,
                                                   " bytes (", DeviceMemoryText(device), "): ", status.message()));
}

class CudaIpcRegion final : public Region {
 public:
  CudaIpcRegion(v1::RegionDescriptor descriptor, int device, void* base)
      : descriptor_(std::move(descriptor)), device_(device), base_(base) {}
  CudaIpcRegion(const CudaIpcRegion&) = delete;
  CudaIpcRegion& operator=(const CudaIpcRegion&) = delete;

  ~CudaIpcRegion() override {
    absl::Status freed = cuda::UseDevice(device_);
    if (freed.ok()) freed = CudaStatus(cudaFree(base_), "cudaFree");
    if (!freed.ok()) {
      Logger("memory")->warn("freeing cuda region on device {}: {}", device_, std::string(freed.message()));
    }
  }

  const v1::RegionDescriptor& descriptor() const override { return descriptor_; }
  void* base() const override { return base_; }
  absl::Status Zero(uint64_t offset, uint64_t bytes) override {
    return ZeroDevice(device_, base_, descriptor_.size_bytes(), offset, bytes);
  }

 private:
  v1::RegionDescriptor descriptor_;
  int device_;
  void* base_;
};

// A cuMem allocation, the daemon's own mapping of it and the exported file descriptor. Each step's resource is
// recorded as soon as it exists, so that the destructor releases exactly what was acquired (also when Allocate
// fails half-way).
class PosixFdRegion final : public Region {
 public:
  PosixFdRegion(const cuda::DriverApi& driver, int device) : driver_(driver), device_(device) {}
  PosixFdRegion(const PosixFdRegion&) = delete;
  PosixFdRegion& operator=(const PosixFdRegion&) = delete;

  ~PosixFdRegion() override {
    if (fd_ >= 0) close(fd_);
    absl::Status use = cuda::UseDevice(device_);
    if (!use.ok()) Warn(use);
    if (mapped_) Warn(CuStatus(driver_, driver_.cuMemUnmap(address_, size_), "cuMemUnmap"));
    if (address_ != 0) Warn(CuStatus(driver_, driver_.cuMemAddressFree(address_, size_), "cuMemAddressFree"));
    // Clients that imported the handle hold their own reference; the memory goes away when the last one releases.
    if (has_handle_) Warn(CuStatus(driver_, driver_.cuMemRelease(handle_), "cuMemRelease"));
  }

  absl::Status Create(const RegionSpec& spec) {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device_;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    if (spec.kind == v1::RegionDescriptor::KIND_RDMA) {
      // The RDMA region is registered with the NIC (GPUDirect RDMA); VMM allocations must ask for it up front.
      CUdevice cu_device = 0;
      int rdma_with_vmm = 0;
      if (driver_.cuDeviceGet(&cu_device, device_) != CUDA_SUCCESS ||
          driver_.cuDeviceGetAttribute(&rdma_with_vmm, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                                       cu_device) != CUDA_SUCCESS) {
        rdma_with_vmm = 0;  // without the flag the region still works over NVLink; RDMA registration will say why
      }
      prop.allocFlags.gpuDirectRDMACapable = rdma_with_vmm != 0 ? 1 : 0;
    }

    size_t granularity = 0;
    EPF_RETURN_IF_ERROR(CuStatus(
        driver_, driver_.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        "cuMemGetAllocationGranularity"));
    if (granularity == 0) granularity = 2u << 20;
    // cuMemCreate and cuMemMap need whole granules; clients map the whole allocation, so the descriptor says so.
    if (spec.bytes > UINT64_MAX - granularity) {
      return absl::ResourceExhaustedError(absl::StrCat(DescribeRegion(spec), ": ", spec.bytes, " bytes is too large"));
    }
    size_ = (spec.bytes + granularity - 1) / granularity * granularity;

    EPF_RETURN_IF_ERROR(AllocationStatus(
        CuStatus(driver_, driver_.cuMemCreate(&handle_, size_, &prop, 0), absl::StrCat("cuMemCreate(", size_, ")")),
        spec, size_, device_));
    has_handle_ = true;
    if (absl::Status status =
            CuStatus(driver_, driver_.cuMemAddressReserve(&address_, size_, granularity, 0, 0), "cuMemAddressReserve");
        !status.ok()) {
      address_ = 0;
      return status;
    }
    EPF_RETURN_IF_ERROR(CuStatus(driver_, driver_.cuMemMap(address_, size_, 0, handle_, 0), "cuMemMap"));
    mapped_ = true;
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device_;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    EPF_RETURN_IF_ERROR(CuStatus(driver_, driver_.cuMemSetAccess(address_, size_, &access, 1), "cuMemSetAccess"));
    int fd = -1;
    EPF_RETURN_IF_ERROR(CuStatus(
        driver_, driver_.cuMemExportToShareableHandle(&fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)"));
    fd_ = fd;
    // Clients get their copy over the socket; a process the daemon might start must not inherit the memory.
    (void)fcntl(fd_, F_SETFD, FD_CLOEXEC);
    return ZeroDevice(device_, base(), size_, 0, size_);
  }

  void set_descriptor(v1::RegionDescriptor descriptor) { descriptor_ = std::move(descriptor); }
  uint64_t size() const { return size_; }

  const v1::RegionDescriptor& descriptor() const override { return descriptor_; }
  void* base() const override { return reinterpret_cast<void*>(address_); }
  int shareable_fd() const override { return fd_; }
  absl::Status Zero(uint64_t offset, uint64_t bytes) override {
    return ZeroDevice(device_, base(), size_, offset, bytes);
  }

 private:
  void Warn(const absl::Status& status) const {
    if (!status.ok()) {
      Logger("memory")->warn("releasing cuda region on device {}: {}", device_, std::string(status.message()));
    }
  }

  const cuda::DriverApi& driver_;
  const int device_;
  v1::RegionDescriptor descriptor_;
  CUmemGenericAllocationHandle handle_ = 0;
  bool has_handle_ = false;
  CUdeviceptr address_ = 0;
  bool mapped_ = false;
  uint64_t size_ = 0;
  int fd_ = -1;
};

class CudaAllocator final : public RegionAllocator {
 public:
  CudaAllocator(int device, v1::MemorySharing default_sharing, uint64_t max_region_bytes)
      : device_(device),
        default_sharing_(default_sharing == v1::MEMORY_SHARING_UNSPECIFIED ? kDefaultCudaSharing : default_sharing),
        max_region_bytes_(max_region_bytes) {}

  v1::Backend backend() const override { return v1::BACKEND_CUDA; }

  absl::StatusOr<std::unique_ptr<Region>> Allocate(const RegionSpec& spec) override {
    EPF_RETURN_IF_ERROR(ValidateRegionSpec(spec));
    const v1::MemorySharing sharing = spec.sharing == v1::MEMORY_SHARING_UNSPECIFIED ? default_sharing_ : spec.sharing;
    if (sharing != v1::MEMORY_SHARING_CUDA_IPC && sharing != v1::MEMORY_SHARING_POSIX_FD) {
      return absl::InvalidArgumentError(
          absl::StrCat("RegionSpec.sharing ", v1::MemorySharing_Name(sharing),
                       " is not supported by the cuda backend (MEMORY_SHARING_CUDA_IPC or MEMORY_SHARING_POSIX_FD)"));
    }
    EPF_RETURN_IF_ERROR(CheckRegionLimit(spec, max_region_bytes_, "cuda"));
    int device_count = 0;
    if (absl::Status count = CudaStatus(cudaGetDeviceCount(&device_count), "cudaGetDeviceCount"); !count.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("cuda backend: no usable CUDA device: ", count.message()));
    }
    if (device_ < 0 || device_ >= device_count) {
      return absl::FailedPreconditionError(
          absl::StrCat("cuda backend: device ", device_, " does not exist (", device_count, " visible)"));
    }
    EPF_RETURN_IF_ERROR(cuda::UseDevice(device_));

    v1::RegionDescriptor descriptor;
    descriptor.set_rank(spec.rank);
    descriptor.set_sharing(sharing);
    descriptor.set_device(device_);
    descriptor.set_kind(spec.kind);
    char bus_id[32] = {};
    EPF_RETURN_IF_ERROR(CudaStatus(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device_),
                                   absl::StrCat("cudaDeviceGetPCIBusId(", device_, ")")));
    // The same spelling as Ops.GetTopology, so that clients and tools can match the two.
    descriptor.set_device_pci_bus_id(topology::NormalizePciBusId(bus_id));

    if (sharing == v1::MEMORY_SHARING_CUDA_IPC) return AllocateCudaIpc(spec, std::move(descriptor));
    return AllocatePosixFd(spec, std::move(descriptor));
  }

 private:
  absl::StatusOr<std::unique_ptr<Region>> AllocateCudaIpc(const RegionSpec& spec, v1::RegionDescriptor descriptor) {
    void* base = nullptr;
    EPF_RETURN_IF_ERROR(
        AllocationStatus(CudaStatus(cudaMalloc(&base, spec.bytes), absl::StrCat("cudaMalloc(", spec.bytes, ")")), spec,
                         spec.bytes, device_));
    absl::Cleanup free_on_error = [base] { (void)cudaFree(base); };
    cudaIpcMemHandle_t handle;
    EPF_RETURN_IF_ERROR(CudaStatus(cudaIpcGetMemHandle(&handle, base), "cudaIpcGetMemHandle"));
    EPF_RETURN_IF_ERROR(ZeroDevice(device_, base, spec.bytes, 0, spec.bytes));
    static_assert(sizeof(handle) == 64, "the descriptor documents a 64-byte cudaIpcMemHandle_t");
    descriptor.set_handle(std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)));
    descriptor.set_size_bytes(spec.bytes);
    std::move(free_on_error).Cancel();
    return std::make_unique<CudaIpcRegion>(std::move(descriptor), device_, base);
  }

  absl::StatusOr<std::unique_ptr<Region>> AllocatePosixFd(const RegionSpec& spec, v1::RegionDescriptor descriptor) {
    EPF_ASSIGN_OR_RETURN(const cuda::DriverApi* driver, cuda::Driver());
    auto region = std::make_unique<PosixFdRegion>(*driver, device_);
    EPF_RETURN_IF_ERROR(region->Create(spec));  // ~PosixFdRegion cleans up
    descriptor.set_size_bytes(region->size());
    region->set_descriptor(std::move(descriptor));
    return region;
  }

  const int device_;
  const v1::MemorySharing default_sharing_;
  const uint64_t max_region_bytes_;
};

}  // namespace

std::unique_ptr<RegionAllocator> MakeCudaAllocator(int device, v1::MemorySharing default_sharing,
                                                   uint64_t max_region_bytes) {
  return std::make_unique<CudaAllocator>(device, default_sharing, max_region_bytes);
}

}  // namespace epfabric::daemon::memory
