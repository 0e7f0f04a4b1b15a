// Throughput of the host backend with ranks as threads (not part of CI: the tests are disabled; run
// host_backend_test with --gtest_also_run_disabled_tests). Prints per-call times of the slowest rank.
#include <barrier>
#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "host_backend_threads.h"

namespace epfabric::kernels::host_backend_test {
namespace {

double TimeRanks(int num_ranks, const std::function<void(int)>& body) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < num_ranks; ++r) threads.emplace_back([&, r] { body(r); });
  for (std::thread& t : threads) t.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

TEST(HostBackendThroughput, DISABLED_Intranode4x4096x7168) {
  // The real pipeline per rank (layout, notify, dispatch, combine) on DeepEP's benchmark shape; inputs are random
  // (the reference is not computed: the other tests check the same code on smaller shapes).
  const int R = 4, T = 4096, H = 7168, K = 8, E = 256, C = 4;
  IntranodeCase c = Case({T, T, T, T}, H, K, E, false, 77);
  c.num_channels = C;
  c.routing.empty_fraction = 0.0;
  IntranodeRegions regions(IntranodeConfigFor({c}));
  std::mt19937_64 rng(77);
  struct RankState {
    std::vector<int64_t> topk_idx;
    AlignedBuffer x, recv_x, combined;
    std::vector<int32_t> per_rank, per_expert, prefix, channel_prefix, send_slot, src_idx;
    std::vector<uint8_t> in_rank;
    IntranodeHandle handle;
  };
  std::vector<RankState> st(R);
  for (int r = 0; r < R; ++r) {
    st[r].topk_idx = RandomTopk(rng, T, K, E, r, c.routing);
    st[r].x.Resize(static_cast<size_t>(T) * H * 2);
    for (size_t i = 0; i < static_cast<size_t>(T) * H; ++i)
      reinterpret_cast<uint16_t*>(st[r].x.data)[i] = RandomBf16(rng);
  }
  std::vector<double> notify_ms(R);
  auto prepare = [&](int r) {  // layout + notify, then the outputs sized by the received count
    RankState& s = st[r];
    s.per_rank.resize(R);
    s.per_expert.resize(E);
    s.in_rank.resize(T * R);
    s.prefix.resize(R * R);
    DispatchLayoutParams lp;
    lp.topk_idx = s.topk_idx.data();
    lp.num_tokens = T;
    lp.num_topk = K;
    lp.num_experts = E;
    lp.num_ranks = R;
    lp.num_tokens_per_rank = s.per_rank.data();
    lp.num_tokens_per_expert = s.per_expert.data();
    lp.is_token_in_rank = reinterpret_cast<bool*>(s.in_rank.data());
    EXPECT_TRUE(host_backend::GetDispatchLayout(lp).ok());
    IntranodeNotifyParams np;
    np.num_tokens_per_rank = s.per_rank.data();
    np.num_tokens_per_expert = s.per_expert.data();
    np.num_tokens = T;
    np.num_experts = E;
    np.rank_prefix_matrix = s.prefix.data();
    const auto start = std::chrono::steady_clock::now();
    EXPECT_TRUE(host_backend::IntranodeNotify(regions.Group(r), np).ok());
    notify_ms[r] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    const int N = s.prefix[(R - 1) * R + r];
    s.channel_prefix.resize(R * C);
    s.send_slot.resize(T * R);
    s.src_idx.resize(N);
    s.recv_x.Resize(static_cast<size_t>(N) * H * 2);
    s.combined.Resize(static_cast<size_t>(T) * H * 2);
    IntranodeHandle& h = s.handle;
    h.num_tokens = T;
    h.num_recv_tokens = N;
    h.is_token_in_rank = reinterpret_cast<const bool*>(s.in_rank.data());
    h.rank_prefix_matrix = s.prefix.data();
    h.recv_channel_prefix = s.channel_prefix.data();
    h.send_slot = s.send_slot.data();
    h.recv_src_idx = s.src_idx.data();
  };
  auto dispatch = [&](int r) {
    IntranodeDispatchParams p;
    p.x = st[r].x.data;
    p.hidden = H;
    p.num_experts = E;
    p.num_sms = C;
    p.recv_capacity = st[r].handle.num_recv_tokens;
    p.recv_x = st[r].recv_x.data;
    EXPECT_TRUE(host_backend::IntranodeDispatch(regions.Group(r), p, &st[r].handle).ok());
  };
  auto combine = [&](int r) {
    IntranodeCombineParams p;
    p.x = st[r].recv_x.data;
    p.hidden = H;
    p.combined_x = st[r].combined.data;
    EXPECT_TRUE(host_backend::IntranodeCombine(regions.Group(r), p, st[r].handle).ok());
  };
  TimeRanks(R, prepare);
  TimeRanks(R, dispatch);  // warm-up: first touch of the regions and outputs
  TimeRanks(R, combine);
  const int iters = 3;
  double dispatch_s = 0, combine_s = 0;
  for (int i = 0; i < iters; ++i) {
    dispatch_s += TimeRanks(R, dispatch);
    combine_s += TimeRanks(R, combine);
  }
  size_t recv_bytes = 0;
  for (int r = 0; r < R; ++r) recv_bytes += static_cast<size_t>(st[r].handle.num_recv_tokens) * H * 2;
  std::printf(
      "intranode 4 ranks x 4096 tokens x hidden 7168 bf16, top-8 of 256, %u hw threads: notify %.2f ms (rank 0), "
      "dispatch %.1f ms, combine %.1f ms (all ranks done), %.2f GB received per dispatch over all ranks\n",
      std::thread::hardware_concurrency(), notify_ms[0], 1e3 * dispatch_s / iters, 1e3 * combine_s / iters,
      recv_bytes / 1e9);
}

TEST(HostBackendThroughput, DISABLED_LowLatency4x128x7168) {
  // DeepEP's low-latency benchmark shape on 4 ranks: 128 tokens, hidden 7168, top-8 of 288 experts, FP8. Three
  // dispatch + combine pairs (all checked); the first touches the memory, the median of the others is printed.
  LowLatencyCase c = LLCase(4, 128, 7168, 288, 8, 78);
  c.num_tokens = {128, 128, 128, 128};
  c.routing.empty_fraction = 0;
  c.routing.allow_duplicates = false;
  c.iterations = 3;
  const std::vector<LowLatencyIteration> its = MakeLowLatencyExpected(c);
  LowLatencyRegions regions(c);
  std::vector<LowLatencyTimes> times(4);
  std::barrier<> all_ranks(4);
  for (LowLatencyTimes& t : times) t.before_each_call = [&] { all_ranks.arrive_and_wait(); };
  EXPECT_EQ(
      RunRanks(4, [&](int rank, Mismatches* m) { RunLowLatencyCase(regions.Context(rank), c, its, m, &times[rank]); }),
      "");
  // Per iteration the slowest rank (wall), and the mean CPU time of a rank's thread (its work without the waiting).
  double dispatch_ms = 0, combine_ms = 0, dispatch_cpu = 0, combine_cpu = 0;
  for (int i = 1; i < 3; ++i) {
    double d = 0, cm = 0;
    for (const LowLatencyTimes& t : times) {
      d = std::max(d, t.dispatch_ms[i]);
      cm = std::max(cm, t.combine_ms[i]);
      dispatch_cpu += t.dispatch_cpu_ms[i] / 8;
      combine_cpu += t.combine_cpu_ms[i] / 8;
    }
    dispatch_ms += d / 2;
    combine_ms += cm / 2;
  }
  std::printf(
      "low-latency 4 ranks x 128 tokens x hidden 7168, top-8 of 288, fp8: dispatch %.2f ms wall (CPU %.2f ms per "
      "rank), combine %.2f ms wall (CPU %.2f ms per rank); wall = slowest rank, mean of 2 calls after a warm-up\n",
      dispatch_ms, dispatch_cpu, combine_ms, combine_cpu);
}

}  // namespace
}  // namespace epfabric::kernels::host_backend_test
