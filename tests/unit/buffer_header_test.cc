// The Buffer's public header stands alone without the generated protobuf headers (decision 151): this translation
// unit includes it first and nothing that includes protobuf, so a protobuf include reaching buffer.h fails its build.
// The cases check the parts of the API that need no lease: the default allocator, TensorView sizes, region sizes.
#include "epfabric/client/buffer.h"

#if defined(GOOGLE_PROTOBUF_VERSION) || defined(GOOGLE_PROTOBUF_INCLUDED_epfabric_2fv1_2fcommon_2eproto)
#error "epfabric/client/buffer.h includes generated protobuf headers"
#endif

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

namespace epfabric::client {
namespace {

using kernels::DType;

TEST(BufferHeaderTest, HostDefaultAllocatorGivesAlignedWritableTensors) {
  std::shared_ptr<Allocator> allocator = DefaultAllocator(Backend::kHost);
  ASSERT_NE(allocator, nullptr);
  for (size_t bytes : {size_t{0}, size_t{30}, size_t{4096}}) {
    absl::StatusOr<void*> ptr =
        allocator->AllocateTensor(DType::kBF16, {static_cast<int64_t>(bytes / 2)}, bytes, nullptr);
    ASSERT_TRUE(ptr.ok()) << ptr.status();
    ASSERT_NE(*ptr, nullptr) << bytes;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(*ptr) % 256, 0u) << bytes;
    std::memset(*ptr, 0xab, bytes);  // writable over its whole size (ASan checks the bound)
    allocator->Free(*ptr, nullptr);
  }
}

TEST(BufferHeaderTest, TensorViewSizes) {
  const TensorView given{nullptr, DType::kFloat32, {4, 8}};
  EXPECT_EQ(given.numel(), 32);
  EXPECT_EQ(given.bytes(), 128u);
  EXPECT_FALSE(given.empty());  // a shape says "given" even without data
  EXPECT_TRUE(TensorView{}.empty());
  EXPECT_EQ((TensorView{nullptr, DType::kBF16, {3, 0}}).bytes(), 0u);
}

TEST(BufferHeaderTest, RegionSizesFollowTheGroupShape) {
  const BufferConfig config{.max_tokens_per_rank = 64, .hidden = 256, .max_topk = 4, .num_experts = 16, .num_sms = 4};
  absl::StatusOr<uint64_t> one_host = RequiredRegionBytes(config, 4);
  ASSERT_TRUE(one_host.ok()) << one_host.status();
  EXPECT_GT(*one_host, 0u);
  absl::StatusOr<GroupBytes> same_host = RequiredGroupBytes(config, 1, 4);
  ASSERT_TRUE(same_host.ok()) << same_host.status();
  EXPECT_EQ(same_host->nvl, *one_host);
  EXPECT_EQ(same_host->rdma, 0u);
  absl::StatusOr<GroupBytes> two_hosts = RequiredGroupBytes(config, 2, 4);
  ASSERT_TRUE(two_hosts.ok()) << two_hosts.status();
  EXPECT_GT(two_hosts->rdma, 0u);
  // Bad shapes are refused with a message naming the field.
  absl::StatusOr<uint64_t> bad = RequiredRegionBytes(config, 3);  // 16 experts over 3 ranks
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("config.num_experts"), absl::string_view::npos) << bad.status();
}

}  // namespace
}  // namespace epfabric::client
