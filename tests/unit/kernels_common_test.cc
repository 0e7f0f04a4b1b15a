#include <gtest/gtest.h>

#include "epfabric/kernels/common.h"

namespace epfabric::kernels {
namespace {

TEST(KernelStatus, OkIsOk) {
  KernelStatus status{};
  EXPECT_TRUE(KernelStatusToStatus(status).ok());
}

TEST(KernelStatus, TimeoutNamesTheRankWaitedFor) {
  KernelStatus status{};
  status.code = kKernelStatusTimeout;
  status.site = static_cast<int32_t>(WaitSite::kDispatchFifoData);
  status.waiting_rank = 1;
  status.peer_rank = 3;
  status.channel = 7;
  const absl::Status s = KernelStatusToStatus(status);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(s.message(), "rank 1 timed out waiting for dispatch FIFO data from rank 3 (channel 7)");
}

TEST(KernelStatus, BadPeerDataNamesThePeerTheFieldAndTheRange) {
  const KernelStatus status = BadPeerDataRecord(PeerDataField::kNotifyRankCount, 0, 1, 0, 2147483000, 0, 4096);
  const absl::Status s = KernelStatusToStatus(status);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(s.message(),
            "rank 0 read notify token count = 2147483000 from rank 1 (destination rank 0; valid [0, 4096]): stale or "
            "corrupt peer data");
  // Values are saturated to int32 (a 64-bit range word, for instance).
  const KernelStatus big = BadPeerDataRecord(PeerDataField::kDispatchRangeBegin, 2, 3, 5, int64_t{1} << 40, 0, 7);
  EXPECT_EQ(big.value, INT32_MAX);
  EXPECT_EQ(
      KernelStatusToStatus(big).message(),
      "rank 2 read dispatch slot range begin = 2147483647 from rank 3 (channel 5; valid [0, 7]): stale or corrupt "
      "peer data");
}

TEST(KernelStatus, UnknownCodeIsInternal) {
  KernelStatus status{};
  status.code = 42;
  EXPECT_EQ(KernelStatusToStatus(status).code(), absl::StatusCode::kInternal);
}

TEST(DType, Sizes) {
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kFP8E4M3), 1u);
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4u);
  EXPECT_EQ(DTypeSize(DType::kInt64), 8u);
}

}  // namespace
}  // namespace epfabric::kernels
