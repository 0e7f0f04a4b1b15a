// The worst-case internode steps' CUDA kernels (kernels/cuda/internode_worst.cu, and the pack's count words) against
// their host twins (kernels/host_backend/host_internode.cc) on fresh random inputs, compared element by element:
// plan (over more than one 512-token round and up to 8 hosts), gather (rows, padding, counts), scatter, and the
// gather's record of a count outside [0, max_rows] or unlike a cached dispatch's. The product-level checks
// (device-checks internode_worst) run them with the transport; these cover shapes those runs do not.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "epfabric/kernels/common.h"
#include "epfabric/kernels/internode.h"
#include "epfabric/kernels/intranode.h"
#include "gpu/gpu_env.h"
#include "gtest/gtest.h"

namespace epfabric::kernels {
namespace {

// A device copy of a host vector, copied back on demand.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(const std::vector<T>& host) : size_(host.size()) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&ptr_), std::max<size_t>(bytes(), 16)), cudaSuccess);
    if (!host.empty()) EXPECT_EQ(cudaMemcpy(ptr_, host.data(), bytes(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceArray() { cudaFree(ptr_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return ptr_; }
  std::vector<T> Download() const {
    std::vector<T> host(size_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (size_ > 0) EXPECT_EQ(cudaMemcpy(host.data(), ptr_, bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  size_t bytes() const { return size_ * sizeof(T); }
  T* ptr_ = nullptr;
  size_t size_;
};

template <typename T>
std::vector<T> Random(std::mt19937& rng, size_t n) {
  std::vector<T> v(n);
  for (T& x : v) x = static_cast<T>(rng());
  return v;
}

struct Shape {
  int hosts, per_host, max_rows, hidden, topk;
};

InternodeRdmaLayout LayoutOf(const Shape& s) {
  auto layout = ComputeInternodeRdmaLayout({.num_hosts = s.hosts,
                                            .ranks_per_host = s.per_host,
                                            .max_tokens_per_rank = s.max_rows,
                                            .max_hidden = s.hidden,
                                            .max_topk = s.topk});
  EXPECT_TRUE(layout.ok()) << layout.status();
  return *layout;
}

TEST(InternodeSteps, PlanMatchesTheHostTwin) {
  EPF_REQUIRE_GPUS(1);
  std::mt19937 rng(std::random_device{}());
  for (const Shape& s :
       {Shape{1, 2, 64, 0, 0}, Shape{2, 2, 600, 0, 0}, Shape{3, 1, 1500, 0, 0}, Shape{8, 4, 4096, 0, 0}}) {
    for (const int tokens : {0, 1, 511, 512, 513, s.max_rows}) {
      if (tokens > s.max_rows) continue;
      const int R = s.hosts * s.per_host;
      std::vector<uint8_t> in_rank(static_cast<size_t>(tokens) * R);
      for (uint8_t& b : in_rank) b = rng() % 10 < 2;  // 20%: some tokens go to no host, some to several
      const std::vector<int32_t> poison(s.hosts + static_cast<size_t>(s.hosts) * s.max_rows, -7);
      std::vector<int32_t> plan = poison, slot(static_cast<size_t>(tokens) * s.hosts, -7);
      DeviceArray<uint8_t> d_in_rank(in_rank);
      DeviceArray<int32_t> d_plan(plan), d_slot(slot);
      InternodePlanParams p{.is_token_in_rank = reinterpret_cast<const bool*>(in_rank.data()),
                            .num_tokens = tokens,
                            .num_hosts = s.hosts,
                            .ranks_per_host = s.per_host,
                            .max_rows = s.max_rows,
                            .send_plan = plan.data(),
                            .send_slot = slot.data()};
      ASSERT_TRUE(host_backend::InternodePlan(p).ok());
      p.is_token_in_rank = reinterpret_cast<const bool*>(d_in_rank.get());
      p.send_plan = d_plan.get();
      p.send_slot = d_slot.get();
      ASSERT_TRUE(InternodePlan(p, nullptr).ok());
      EXPECT_EQ(d_plan.Download(), plan) << s.hosts << " hosts x " << s.per_host << ", " << tokens << " tokens";
      EXPECT_EQ(d_slot.Download(), slot) << s.hosts << " hosts x " << s.per_host << ", " << tokens << " tokens";
    }
  }
}

// One gather on both backends from the same region; returns the device's status record.
struct GatherRun {
  std::vector<uint8_t> x, x_host;
  std::vector<uint32_t> scales, scales_host;
  std::vector<int64_t> idx, idx_host;
  std::vector<float> w, w_host;
  std::vector<int32_t> counts, counts_host;
  absl::Status device_status, host_status;
};

GatherRun Gather(const Shape& s, int self, int row_bytes, int num_scales, const std::vector<uint8_t>& region,
                 const std::vector<int32_t>& send_counts, const std::vector<int32_t>* expected) {
  const InternodeRdmaLayout layout = LayoutOf(s);
  const size_t rows = static_cast<size_t>(s.hosts) * s.max_rows;
  GatherRun r;
  r.x_host.assign(rows * row_bytes, 0xAB);
  r.scales_host.assign(rows * num_scales, 0xABABABAB);
  r.idx_host.assign(rows * s.topk, 77);
  r.w_host.assign(rows * s.topk, 77.0f);
  r.counts_host.assign(s.hosts, -7);
  std::vector<uint8_t> host_region = region;
  DeviceArray<uint8_t> d_region(region), d_x(r.x_host);
  DeviceArray<uint32_t> d_scales(r.scales_host);
  DeviceArray<int64_t> d_idx(r.idx_host);
  DeviceArray<float> d_w(r.w_host);
  DeviceArray<int32_t> d_send(send_counts), d_counts(r.counts_host);
  DeviceArray<int32_t> d_expected(expected != nullptr ? *expected : std::vector<int32_t>(s.hosts, 0));
  DeviceArray<KernelStatus> d_status(std::vector<KernelStatus>(1, KernelStatus{}));
  InternodeGatherParams p{.region = host_region.data(),
                          .layout = layout,
                          .num_hosts = s.hosts,
                          .self_host = self,
                          .ranks_per_host = s.per_host,
                          .rank = self * s.per_host + 1 % s.per_host,
                          .max_rows = s.max_rows,
                          .send_counts = send_counts.data(),
                          .expected_counts = expected != nullptr ? expected->data() : nullptr,
                          .recv_counts = r.counts_host.data(),
                          .row_bytes = row_bytes,
                          .num_scales = num_scales,
                          .num_topk = s.topk,
                          .x = r.x_host.data(),
                          .x_scales = r.scales_host.data(),
                          .topk_idx = r.idx_host.data(),
                          .topk_weights = r.w_host.data()};
  r.host_status = host_backend::InternodeGather(p);
  p.region = d_region.get();
  p.send_counts = d_send.get();
  p.expected_counts = expected != nullptr ? d_expected.get() : nullptr;
  p.recv_counts = d_counts.get();
  p.x = d_x.get();
  p.x_scales = d_scales.get();
  p.topk_idx = d_idx.get();
  p.topk_weights = d_w.get();
  p.status = d_status.get();
  EXPECT_TRUE(InternodeGather(p, nullptr).ok());
  r.x = d_x.Download();
  r.scales = d_scales.Download();
  r.idx = d_idx.Download();
  r.w = d_w.Download();
  r.counts = d_counts.Download();
  r.device_status = KernelStatusToStatus(d_status.Download()[0]);
  return r;
}

// A region of random bytes whose count words say `counts` (host h's rows at word h).
std::vector<uint8_t> RegionWithCounts(std::mt19937& rng, const Shape& s, const std::vector<int64_t>& counts) {
  const InternodeRdmaLayout layout = LayoutOf(s);
  std::vector<uint8_t> region = Random<uint8_t>(rng, layout.total_bytes);
  std::memcpy(region.data() + layout.dispatch_count, counts.data(), counts.size() * sizeof(int64_t));
  return region;
}

TEST(InternodeSteps, GatherMatchesTheHostTwin) {
  EPF_REQUIRE_GPUS(1);
  std::mt19937 rng(std::random_device{}());
  for (const Shape& s : {Shape{2, 2, 64, 256, 4}, Shape{3, 1, 100, 1024, 8}, Shape{8, 2, 33, 7168, 8}}) {
    for (const bool fp8 : {false, true}) {
      const int row_bytes = fp8 ? s.hidden : 2 * s.hidden, num_scales = fp8 ? s.hidden / 128 : 0;
      const int self = static_cast<int>(rng() % s.hosts);
      std::vector<int64_t> counts(s.hosts);
      std::vector<int32_t> send_counts(s.hosts);
      for (int h = 0; h < s.hosts; ++h) {
        counts[h] = h % 3 == 1 ? 0 : (h % 3 == 2 ? s.max_rows : static_cast<int64_t>(rng() % (s.max_rows + 1)));
        send_counts[h] = static_cast<int32_t>(rng() % (s.max_rows + 1));
      }
      const GatherRun r =
          Gather(s, self, row_bytes, num_scales, RegionWithCounts(rng, s, counts), send_counts, nullptr);
      ASSERT_TRUE(r.host_status.ok()) << r.host_status;
      ASSERT_TRUE(r.device_status.ok()) << r.device_status;
      EXPECT_EQ(r.counts, r.counts_host);
      EXPECT_EQ(r.counts[self], send_counts[self]);
      EXPECT_TRUE(r.x == r.x_host) << s.hosts << " hosts, fp8 " << fp8;
      EXPECT_EQ(r.scales, r.scales_host);
      EXPECT_EQ(r.idx, r.idx_host);
      EXPECT_TRUE(std::memcmp(r.w.data(), r.w_host.data(), r.w.size() * sizeof(float)) == 0);
      // Padding: top-k -1 past each host's rows.
      for (int h = 0; h < s.hosts; ++h) {
        const size_t pad = static_cast<size_t>(h) * s.max_rows + r.counts[h];
        if (r.counts[h] < s.max_rows) EXPECT_EQ(r.idx[pad * s.topk], -1) << "host " << h;
      }
    }
  }
}

TEST(InternodeSteps, GatherRecordsABadCountAndACachedMismatch) {
  EPF_REQUIRE_GPUS(1);
  std::mt19937 rng(std::random_device{}());
  const Shape s{3, 2, 40, 256, 4};
  const std::vector<int32_t> send_counts{5, 6, 7};
  // Host 2's count past max_rows: recorded (naming host 2's rank with this local index), read as 0.
  GatherRun r = Gather(s, 0, 512, 0, RegionWithCounts(rng, s, {0, 3, s.max_rows + 1}), send_counts, nullptr);
  EXPECT_TRUE(absl::IsDataLoss(r.device_status)) << r.device_status;
  EXPECT_NE(r.device_status.message().find("internode row count = 41 from rank 5 (host 2; valid [0, 40])"),
            std::string::npos)
      << r.device_status;
  EXPECT_TRUE(absl::IsDataLoss(r.host_status)) << r.host_status;
  EXPECT_EQ(r.counts[2], 0);
  // A cached dispatch whose hosts sent other counts than its handle's.
  const std::vector<int32_t> expected{5, 4, 9};
  r = Gather(s, 0, 512, 0, RegionWithCounts(rng, s, {0, 4, 8}), send_counts, &expected);
  EXPECT_TRUE(absl::IsDataLoss(r.device_status)) << r.device_status;
  EXPECT_NE(r.device_status.message().find("cached handle"), std::string::npos) << r.device_status;
  EXPECT_TRUE(absl::IsDataLoss(r.host_status)) << r.host_status;
  EXPECT_EQ(r.counts[1], 4);
  EXPECT_EQ(r.counts[2], 0);
}

TEST(InternodeSteps, ScatterAndPackMatchTheHostTwins) {
  EPF_REQUIRE_GPUS(1);
  std::mt19937 rng(std::random_device{}());
  for (const Shape& s : {Shape{2, 2, 64, 256, 4}, Shape{5, 1, 37, 1024, 8}}) {
    const InternodeRdmaLayout layout = LayoutOf(s);
    const int self = static_cast<int>(rng() % s.hosts);
    const size_t rows = static_cast<size_t>(s.hosts) * s.max_rows;
    std::vector<int32_t> counts(s.hosts);
    for (int32_t& c : counts) c = static_cast<int32_t>(rng() % (s.max_rows + 1));
    const std::vector<uint16_t> x = Random<uint16_t>(rng, rows * s.hidden);
    std::vector<float> w(rows * s.topk);
    for (float& v : w) v = static_cast<float>(rng() % 1000) / 7.0f;
    std::vector<uint8_t> region(layout.total_bytes, 0), host_region = region;
    DeviceArray<uint8_t> d_region(region);
    DeviceArray<uint16_t> d_x(x);
    DeviceArray<float> d_w(w);
    DeviceArray<int32_t> d_counts(counts);
    InternodeScatterParams p{.x = x.data(),
                             .topk_weights = w.data(),
                             .hidden = s.hidden,
                             .num_topk = s.topk,
                             .num_hosts = s.hosts,
                             .self_host = self,
                             .max_rows = s.max_rows,
                             .recv_counts = counts.data(),
                             .region = host_region.data(),
                             .layout = layout};
    ASSERT_TRUE(host_backend::InternodeScatter(p).ok());
    p.x = d_x.get();
    p.topk_weights = d_w.get();
    p.recv_counts = d_counts.get();
    p.region = d_region.get();
    ASSERT_TRUE(InternodeScatter(p, nullptr).ok());
    EXPECT_TRUE(d_region.Download() == host_region) << s.hosts << " hosts";

    // The pack also stores each host's count into its send_count word, on both backends.
    const int tokens = s.max_rows;
    std::vector<int32_t> plan(s.hosts + rows, 0);
    for (int h = 0; h < s.hosts; ++h) {
      plan[h] = counts[h];
      for (int i = 0; i < counts[h]; ++i) plan[s.hosts + static_cast<size_t>(h) * s.max_rows + i] = i;
    }
    std::vector<int64_t> idx(static_cast<size_t>(tokens) * s.topk);
    for (int64_t& e : idx) e = static_cast<int64_t>(rng() % (4 * s.hosts)) - 1;
    DeviceArray<int32_t> d_plan(plan);
    DeviceArray<int64_t> d_idx(idx);
    std::fill(host_region.begin(), host_region.end(), 0);
    DeviceArray<uint8_t> d_pack_region(host_region);
    InternodePackParams pack{.x = x.data(),
                             .row_bytes = 2 * s.hidden,
                             .topk_idx = idx.data(),
                             .topk_weights = w.data(),
                             .num_topk = s.topk,
                             .num_tokens = tokens,
                             .num_hosts = s.hosts,
                             .self_host = self,
                             .experts_per_host = 4,
                             .send_tokens = plan.data() + s.hosts,
                             .send_counts = plan.data(),
                             .max_rows = s.max_rows,
                             .region = host_region.data(),
                             .layout = layout};
    ASSERT_TRUE(host_backend::InternodePack(pack).ok());
    pack.x = d_x.get();
    pack.topk_idx = d_idx.get();
    pack.topk_weights = d_w.get();
    pack.send_tokens = d_plan.get() + s.hosts;
    pack.send_counts = d_plan.get();
    pack.region = d_pack_region.get();
    ASSERT_TRUE(InternodePack(pack, nullptr).ok());
    const std::vector<uint8_t> packed = d_pack_region.Download();
    EXPECT_TRUE(packed == host_region) << s.hosts << " hosts";
    for (int h = 0; h < s.hosts; ++h) {
      int64_t word = -1;
      std::memcpy(&word, packed.data() + layout.send_count + h * sizeof(int64_t), sizeof(word));
      EXPECT_EQ(word, counts[h]) << "host " << h;
    }
  }
}

}  // namespace
}  // namespace epfabric::kernels
