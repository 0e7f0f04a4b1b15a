// The cuda backend on a machine without a usable GPU or driver (CI, development machines): the daemon and the client
// library must load and answer with clean errors, never crash (libcuda is not linked).
#include <cuda_runtime_api.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "memory/region.h"
#include "memory/region_import.h"

namespace epfabric {
namespace {

bool HaveGpu() {
  int count = 0;
  const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  (void)cudaGetLastError();
  return ok;
}

TEST(RegionWithoutGpuTest, CudaAllocatorFailsCleanly) {
  if (HaveGpu()) GTEST_SKIP() << "a GPU is visible; tests/gpu/cuda_region_test covers this machine";
  for (v1::MemorySharing sharing : {v1::MEMORY_SHARING_POSIX_FD, v1::MEMORY_SHARING_CUDA_IPC}) {
    auto allocator = daemon::memory::MakeCudaAllocator(0, sharing, 0);
    EXPECT_EQ(allocator->backend(), v1::BACKEND_CUDA);
    daemon::memory::RegionSpec spec;
    spec.group = "g";
    spec.bytes = 4096;
    absl::StatusOr<std::unique_ptr<daemon::memory::Region>> region = allocator->Allocate(spec);
    EXPECT_TRUE(absl::IsFailedPrecondition(region.status())) << region.status();
    EXPECT_THAT(region.status().message(), ::testing::HasSubstr("no usable CUDA device"));
  }
}

TEST(RegionWithoutGpuTest, CudaImportFailsCleanly) {
  if (HaveGpu()) GTEST_SKIP() << "a GPU is visible; tests/gpu/cuda_region_test covers this machine";
  v1::RegionDescriptor descriptor;
  descriptor.set_size_bytes(2 << 20);
  descriptor.set_sharing(v1::MEMORY_SHARING_CUDA_IPC);
  descriptor.set_handle(std::string(64, '\0'));
  absl::StatusOr<client::memory::MappedRegion> ipc = client::memory::ImportRegion(descriptor);
  EXPECT_TRUE(absl::IsFailedPrecondition(ipc.status())) << ipc.status();
  descriptor.set_sharing(v1::MEMORY_SHARING_POSIX_FD);
  descriptor.clear_handle();
  absl::StatusOr<client::memory::MappedRegion> fd = client::memory::ImportRegion(descriptor, 0);
  EXPECT_TRUE(absl::IsFailedPrecondition(fd.status())) << fd.status();
}

}  // namespace
}  // namespace epfabric
