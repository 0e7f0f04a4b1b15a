// The lifetimes of the C ABI's handles (issue #35): a dispatch handle, a low-latency handle and a receive hook may be
// destroyed before or after their Buffer, lease and client, in any order (epfabric.h). What they free goes back
// through the Buffer's allocator: every block the allocator handed out is freed exactly once, after the Buffer is
// gone too. A hook that runs after its Buffer was destroyed is refused. And epf_lease_group_bytes gives the sizes the
// group was created with. Only the C ABI and a real host-backend daemon in this process, as security_c_abi_test.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "epfabric/epfabric.h"
#include "integration/subprocess.h"

namespace epfabric::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kTokens = 16, kHidden = 128, kTopk = 2, kExperts = 8;

// The caller's allocator: host memory (the host backend). The library calls free_fn when it lets go of a block (the
// caller may still use what it references, as a framework's tensors are refcounted): each block it holds is in
// `held`; the memory itself is freed when the allocator goes.
struct CountingAllocator {
  std::mutex mu;
  std::set<void*> held;
  std::vector<void*> released;
  int allocated = 0, unknown_frees = 0;

  ~CountingAllocator() {
    for (void* ptr : released) std::free(ptr);
    for (void* ptr : held) std::free(ptr);
  }
  static void* Alloc(void* ctx, size_t bytes, void* /*stream*/) {
    auto* self = static_cast<CountingAllocator*>(ctx);
    void* ptr = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
    std::lock_guard<std::mutex> lock(self->mu);
    self->held.insert(ptr);
    ++self->allocated;
    return ptr;
  }
  static void Free(void* ctx, void* ptr, void* /*stream*/) {
    auto* self = static_cast<CountingAllocator*>(ctx);
    std::lock_guard<std::mutex> lock(self->mu);
    if (self->held.erase(ptr) == 0) {
      ++self->unknown_frees;  // twice, or never handed out
      return;
    }
    self->released.push_back(ptr);
  }
  int Held() {
    std::lock_guard<std::mutex> lock(mu);
    return static_cast<int>(held.size());
  }
};

epf_tensor Tensor2(void* data, int32_t dtype, int64_t rows, int64_t cols) {
  epf_tensor t{};
  t.data = data;
  t.dtype = dtype;
  t.ndim = 2;
  t.shape[0] = rows;
  t.shape[1] = cols;
  return t;
}

class CAbiLifetimeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir();
    socket_ = dir_ + "/d.sock";
    auto daemon = Subprocess::Start({EPF_DAEMON_BINARY, "--client_socket=" + socket_, "--insecure_peer_port",
                                     "--backend=host", "--fabric_id=abi-lifetime"});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_.emplace(std::move(*daemon));
    ASSERT_TRUE(Connect(&client_)) << epf_last_error() << daemon_->Stderr();
  }
  void TearDown() override {
    if (client_ != nullptr) epf_client_destroy(client_);
    if (daemon_.has_value()) {
      daemon_->Signal(SIGTERM);
      (void)daemon_->Wait(absl::Seconds(10));
    }
  }

  bool Connect(epf_client** out) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline && daemon_->running()) {
      struct stat st {};
      if (stat(socket_.c_str(), &st) == 0 && epf_client_connect(socket_.c_str(), "abi", 5.0, out) == EPF_OK) {
        return true;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    return false;
  }

  // A one-rank group of this mode; its token in `token`.
  void CreateGroup(const std::string& name, bool low_latency, char* token, uint64_t* nvl_bytes) {
    epf_buffer_config config = Config(low_latency);
    uint64_t nvl = 0, rdma = 0;
    ASSERT_EQ(epf_required_group_bytes(&config, 1, 1, &nvl, &rdma), EPF_OK) << epf_last_error();
    nvl += 1000;  // not a multiple of any page or granularity: the group's size is what was asked for
    const int32_t ranks[1] = {0};
    epf_status created = EPF_UNAVAILABLE;
    for (int attempt = 0; attempt < 50; ++attempt) {  // the fabric of one completes a moment after the socket exists
      created = epf_create_group(client_, name.c_str(), ranks, 1, nvl, rdma, low_latency ? 1 : 0, token, 65);
      if (created != EPF_UNAVAILABLE && created != EPF_ABORTED) break;
      absl::SleepFor(absl::Milliseconds(100));
    }
    ASSERT_EQ(created, EPF_OK) << epf_last_error();
    *nvl_bytes = nvl;
  }

  static epf_buffer_config Config(bool low_latency) {
    epf_buffer_config config{};
    config.max_tokens_per_rank = kTokens;
    config.hidden = kHidden;
    config.max_topk = kTopk;
    config.num_experts = kExperts;
    config.low_latency = low_latency ? 1 : 0;
    return config;
  }

  std::string dir_, socket_;
  std::optional<Subprocess> daemon_;
  epf_client* client_ = nullptr;
};

enum class Order { kHandleFirst, kBufferFirst, kEverythingFirst };

// One normal-mode dispatch; the handle is released in `order` relative to the Buffer, lease and client.
// With kEverythingFirst the client is destroyed too, before the handle.
void DispatchAndRelease(epf_client* client, const std::string& group, const char* token, Order order,
                        CountingAllocator* allocator) {
  epf_lease* lease = nullptr;
  ASSERT_EQ(epf_attach(client, group.c_str(), 0, token, -1, &lease), EPF_OK) << epf_last_error();
  epf_allocator callbacks{};
  callbacks.struct_size = sizeof(callbacks);
  callbacks.alloc = &CountingAllocator::Alloc;
  callbacks.free_fn = &CountingAllocator::Free;
  callbacks.ctx = allocator;
  epf_buffer_config config{};
  config.max_tokens_per_rank = kTokens;
  config.hidden = kHidden;
  config.max_topk = kTopk;
  config.num_experts = kExperts;
  epf_buffer* buffer = nullptr;
  ASSERT_EQ(epf_buffer_create_ex(lease, &config, &callbacks, &buffer), EPF_OK) << epf_last_error();

  std::vector<uint16_t> x(kTokens * kHidden);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<uint16_t>(0x3f80 + i % 64);  // bf16 around 1.0
  std::vector<int64_t> idx(kTokens * kTopk);
  for (int t = 0; t < kTokens; ++t) {
    idx[t * kTopk] = t % kExperts;
    idx[t * kTopk + 1] = t % 3 == 0 ? -1 : (t + 3) % kExperts;
  }
  epf_tensor topk_idx = Tensor2(idx.data(), EPF_INT64, kTokens, kTopk);
  epf_layout layout{};
  ASSERT_EQ(epf_get_dispatch_layout(buffer, &topk_idx, nullptr, &layout), EPF_OK) << epf_last_error();
  epf_dispatch_args args{};
  args.x = Tensor2(x.data(), EPF_BF16, kTokens, kHidden);
  args.topk_idx = topk_idx;
  args.layout = &layout;
  epf_dispatch_result result{};
  ASSERT_EQ(epf_dispatch(buffer, &args, nullptr, &result), EPF_OK) << epf_last_error();
  ASSERT_NE(result.handle, nullptr);
  // Every token chose an expert of the only rank: all of them come back, row for row.
  ASSERT_EQ(result.num_recv_tokens, kTokens);
  EXPECT_EQ(std::memcmp(result.recv_x.data, x.data(), x.size() * sizeof(uint16_t)), 0);
  EXPECT_EQ(epf_dispatch_handle_num_tokens(result.handle), kTokens);
  epf_layout_release(&layout);

  switch (order) {
    case Order::kHandleFirst:
      epf_dispatch_handle_destroy(result.handle);
      epf_buffer_destroy(buffer);
      ASSERT_EQ(epf_lease_detach(lease), EPF_OK) << epf_last_error();
      epf_lease_destroy(lease);
      break;
    case Order::kBufferFirst: {
      epf_buffer_destroy(buffer);
      const int held = allocator->Held();
      EXPECT_GT(held, 0) << "the handle holds blocks of the allocator";
      EXPECT_EQ(epf_dispatch_handle_num_recv_tokens(result.handle), kTokens) << "the handle outlives its Buffer";
      epf_dispatch_handle_destroy(result.handle);
      ASSERT_EQ(epf_lease_detach(lease), EPF_OK) << epf_last_error();
      epf_lease_destroy(lease);
      break;
    }
    case Order::kEverythingFirst:
      epf_buffer_destroy(buffer);
      ASSERT_EQ(epf_lease_detach(lease), EPF_OK) << epf_last_error();
      epf_lease_destroy(lease);
      epf_client_destroy(client);
      epf_dispatch_handle_destroy(result.handle);  // after the Buffer, the lease and the client
      break;
  }
  // Every block went back through the allocator exactly once, the handle's after its Buffer.
  EXPECT_EQ(allocator->Held(), 0) << "blocks the library never let go of";
  EXPECT_EQ(allocator->unknown_frees, 0) << "frees of blocks the allocator did not hand out, or twice";
  EXPECT_EQ(static_cast<int>(allocator->released.size()), allocator->allocated);
}

TEST_F(CAbiLifetimeTest, DispatchHandlesMayOutliveTheirBufferLeaseAndClient) {
  char token[65];
  uint64_t nvl = 0;
  ASSERT_NO_FATAL_FAILURE(CreateGroup("normal", false, token, &nvl));
  for (Order order : {Order::kHandleFirst, Order::kBufferFirst, Order::kEverythingFirst}) {
    SCOPED_TRACE(static_cast<int>(order));
    CountingAllocator allocator;
    if (order == Order::kEverythingFirst) {
      // The handle goes after the client too: a client of its own, which DispatchAndRelease destroys.
      epf_client* client = nullptr;
      ASSERT_EQ(epf_client_connect(socket_.c_str(), "abi-own", 5.0, &client), EPF_OK) << epf_last_error();
      ASSERT_NO_FATAL_FAILURE(DispatchAndRelease(client, "normal", token, order, &allocator));
    } else {
      ASSERT_NO_FATAL_FAILURE(DispatchAndRelease(client_, "normal", token, order, &allocator));
    }
    EXPECT_GT(allocator.allocated, 0);
  }
}

TEST_F(CAbiLifetimeTest, LowLatencyHandlesAndHooksMayOutliveTheirBuffer) {
  char token[65];
  uint64_t nvl = 0;
  ASSERT_NO_FATAL_FAILURE(CreateGroup("ll", true, token, &nvl));
  for (bool hook_first : {true, false}) {
    SCOPED_TRACE(hook_first);
    epf_lease* lease = nullptr;
    ASSERT_EQ(epf_attach(client_, "ll", 0, token, -1, &lease), EPF_OK) << epf_last_error();
    epf_buffer_config config = Config(true);
    epf_buffer* buffer = nullptr;
    ASSERT_EQ(epf_buffer_create_ex(lease, &config, nullptr, &buffer), EPF_OK) << epf_last_error();
    std::vector<uint16_t> x(kTokens * kHidden, 0x3f80);
    std::vector<int64_t> idx(kTokens * kTopk);
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int64_t>(i % kExperts);
    epf_ll_dispatch_args args{};
    args.x = Tensor2(x.data(), EPF_BF16, kTokens, kHidden);
    args.topk_idx = Tensor2(idx.data(), EPF_INT64, kTokens, kTopk);
    args.return_recv_hook = 1;
    epf_ll_dispatch_result result{};
    ASSERT_EQ(epf_low_latency_dispatch(buffer, &args, nullptr, &result), EPF_OK) << epf_last_error();
    ASSERT_NE(result.hook, nullptr);
    ASSERT_NE(result.handle, nullptr);
    epf_buffer_destroy(buffer);
    // A hook runs on its Buffer: refused once that is gone, and it can still be destroyed.
    EXPECT_EQ(epf_hook_run(result.hook, nullptr), EPF_FAILED_PRECONDITION);
    EXPECT_THAT(epf_last_error(), HasSubstr("destroyed"));
    if (hook_first) {
      epf_hook_destroy(result.hook);
      epf_ll_handle_destroy(result.handle);
    } else {
      epf_ll_handle_destroy(result.handle);
      ASSERT_EQ(epf_lease_detach(lease), EPF_OK) << epf_last_error();
      epf_lease_destroy(lease);
      lease = nullptr;
      epf_hook_destroy(result.hook);
    }
    if (lease != nullptr) {
      ASSERT_EQ(epf_lease_detach(lease), EPF_OK) << epf_last_error();
      epf_lease_destroy(lease);
    }
  }
}

TEST_F(CAbiLifetimeTest, GroupBytesAreWhatTheGroupWasCreatedWith) {
  char token[65];
  uint64_t nvl = 0;
  ASSERT_NO_FATAL_FAILURE(CreateGroup("sizes", false, token, &nvl));
  epf_lease* lease = nullptr;
  ASSERT_EQ(epf_attach(client_, "sizes", 0, token, -1, &lease), EPF_OK) << epf_last_error();
  uint64_t group_nvl = 0, group_rdma = 1;
  ASSERT_EQ(epf_lease_group_bytes(lease, &group_nvl, &group_rdma), EPF_OK) << epf_last_error();
  EXPECT_EQ(group_nvl, nvl);
  EXPECT_EQ(group_rdma, 0u);
  void* data = nullptr;
  uint64_t mapped = 0;
  ASSERT_EQ(epf_lease_region(lease, 0, &data, &mapped), EPF_OK) << epf_last_error();
  EXPECT_GE(mapped, nvl) << "a mapping may be rounded up, never down";
  EXPECT_EQ(epf_lease_group_bytes(nullptr, &group_nvl, &group_rdma), EPF_INVALID_ARGUMENT);
  EXPECT_THAT(epf_last_error(), HasSubstr("null"));
  ASSERT_EQ(epf_lease_detach(lease), EPF_OK) << epf_last_error();
  epf_lease_destroy(lease);
}

}  // namespace
}  // namespace epfabric::testing
