// The device-side transport issuer (kernels/cuda/transport.cuh, through LaunchIssueCommands) against a ring in mapped
// host memory that this test drains by hand in place of the daemon's proxy.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "epfabric/kernels/common.h"
#include "epfabric/kernels/transport/device.h"
#include "epfabric/kernels/transport/ring.h"
#include "gpu/gpu_env.h"
#include "gtest/gtest.h"

namespace epfabric::kernels::transport {
namespace {

constexpr uint32_t kSlots = kMinRingSlots;
constexpr uint64_t kTimeoutNs = 20'000'000;  // 20 ms

#define CUDA_ASSERT(call) ASSERT_EQ((call), cudaSuccess) << #call

// One ring (mapped host memory), its device counter, and the launch's device-side arguments.
class DeviceIssuerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    EPF_REQUIRE_GPUS(1);
    CUDA_ASSERT(cudaSetDevice(0));
    CUDA_ASSERT(cudaHostAlloc(&host_ring_, RingBytes(kSlots), cudaHostAllocMapped));
    std::memset(host_ring_, 0, RingBytes(kSlots));
    CUDA_ASSERT(cudaHostGetDevicePointer(&device_ring_, host_ring_, 0));
    CUDA_ASSERT(cudaMalloc(&next_, sizeof(unsigned long long)));
    CUDA_ASSERT(cudaMemset(next_, 0, sizeof(unsigned long long)));
    CUDA_ASSERT(cudaMalloc(&commands_, 64 * sizeof(Command)));
    CUDA_ASSERT(cudaMalloc(&offsets_, 2 * sizeof(int)));
    CUDA_ASSERT(cudaMalloc(&status_, sizeof(KernelStatus)));
    CUDA_ASSERT(cudaMalloc(&ring_failed_, sizeof(int)));
  }
  void TearDown() override {
    (void)cudaFreeHost(host_ring_);
    (void)cudaFree(next_);
    (void)cudaFree(commands_);
    (void)cudaFree(offsets_);
    (void)cudaFree(status_);
    (void)cudaFree(ring_failed_);
  }

  RingControl* control() { return static_cast<RingControl*>(host_ring_); }
  Command* slots() { return reinterpret_cast<Command*>(control() + 1); }

  // Puts with dst_offset = first_offset + i, issued by one device thread; returns the kernel status.
  absl::Status Issue(int count, uint64_t first_offset) {
    std::vector<Command> commands(count);
    for (int i = 0; i < count; ++i) {
      commands[i] = {.opcode = static_cast<uint8_t>(Opcode::kPut), .dst_offset = first_offset + i, .arg = 64};
    }
    const int offsets[2] = {0, count};
    KernelStatus zero{};
    if (cudaMemcpy(commands_, commands.data(), count * sizeof(Command), cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(offsets_, offsets, sizeof(offsets), cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(status_, &zero, sizeof(zero), cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemset(ring_failed_, 0, sizeof(int)) != cudaSuccess) {
      return absl::InternalError("copying the commands");
    }
    const DeviceRing ring{.ring = device_ring_, .next = next_, .slots = kSlots, .channel = 0};
    if (absl::Status s = LaunchIssueCommands({ring}, commands_, offsets_, /*quiet=*/false, /*self_rank=*/0, kTimeoutNs,
                                             status_, ring_failed_, nullptr);
        !s.ok()) {
      return s;
    }
    if (cudaDeviceSynchronize() != cudaSuccess) return absl::InternalError("synchronize");
    KernelStatus status{};
    if (cudaMemcpy(&status, status_, sizeof(status), cudaMemcpyDeviceToHost) != cudaSuccess) {
      return absl::InternalError("reading the status");
    }
    return KernelStatusToStatus(status);
  }

  uint64_t Next() {
    unsigned long long next = 0;
    EXPECT_EQ(cudaMemcpy(&next, next_, sizeof(next), cudaMemcpyDeviceToHost), cudaSuccess);
    return next;
  }

  void* host_ring_ = nullptr;
  void* device_ring_ = nullptr;
  unsigned long long* next_ = nullptr;
  Command* commands_ = nullptr;
  int* offsets_ = nullptr;
  KernelStatus* status_ = nullptr;
  int* ring_failed_ = nullptr;
};

// A full ring: the issuer fills every free slot, waits (bounded) for the next one and reports the timeout without
// reserving it; once the ring is drained, the next commands take the following indices, so the daemon's proxy (which
// reads the slots in order) finds every one of them. An issuer that reserved the index before waiting left slot 16
// unwritten and put the later commands at 17 and up, where the proxy never looks.
TEST_F(DeviceIssuerTest, AFullRingTimesOutWithoutReservingAndGoesOnAfterADrain) {
  const absl::Status full = Issue(kSlots + 4, 1000);
  EXPECT_EQ(full.code(), absl::StatusCode::kDeadlineExceeded) << full;
  EXPECT_EQ(Next(), kSlots);
  for (uint32_t i = 0; i < kSlots; ++i) {
    EXPECT_EQ(slots()[i].stamp, i + 1) << i;
    EXPECT_EQ(slots()[i].dst_offset, 1000 + i) << i;
  }
  // The daemon's part: every command taken off the ring and complete.
  control()->consumed = kSlots;
  control()->completed = kSlots;
  ASSERT_TRUE(Issue(4, 2000).ok());
  EXPECT_EQ(Next(), kSlots + 4);
  for (uint32_t i = 0; i < 4; ++i) {
    EXPECT_EQ(slots()[i].stamp, kSlots + i + 1) << i;
    EXPECT_EQ(slots()[i].dst_offset, 2000 + i) << i;
    EXPECT_EQ(slots()[i].opcode, static_cast<uint8_t>(Opcode::kPut)) << i;
  }
}

}  // namespace
}  // namespace epfabric::kernels::transport
