// Internode groups driven from the test process (internode_fixture.h): Buffers on in-process leases of the fabric's
// daemons, for what a worker process cannot show: a rank whose dispatch fails inside the path, a killed daemon, a
// rank that never calls, the choice of who issues low latency's puts.
#include "integration/internode_fixture.h"

namespace epfabric::testing {
namespace {

using ::testing::HasSubstr;

// An allocator that refuses every request once armed: a dispatch that fails inside the internode path on one rank.
class RefusingAllocator final : public client::Allocator {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes, cudaStream_t stream) override {
    if (armed) return absl::ResourceExhaustedError("refused by the test");
    return base_->Allocate(bytes, stream);
  }
  void Free(void* ptr, cudaStream_t stream) override { base_->Free(ptr, stream); }
  std::atomic<bool> armed{false};

 private:
  std::shared_ptr<client::Allocator> base_ = client::DefaultAllocator(client::Backend::kHost);
};

// A rank whose dispatch fails before it sent its rows (its allocator refuses: the same path as a lost rank's peer, bad
// peer data or a broken transport) tells the ranks on other hosts that wait for it: their wait ends at once with
// UNAVAILABLE naming it, not at their 10 s timeout. After both reset, the group dispatches and combines correctly. A
// call that every rank refuses (bad arguments) tells nobody: the next round works without a reset.
TEST_F(InternodeTest, ARankWhoseDispatchFailsTellsThePeersThatWaitForIt) {
  ASSERT_NO_FATAL_FAILURE(StartFabric(2, 1));
  const client::BufferConfig config{.max_tokens_per_rank = 16,
                                    .hidden = 256,
                                    .max_topk = 2,
                                    .num_experts = 4,
                                    .num_sms = 2,
                                    .timeout = absl::Seconds(10)};
  auto refusing = std::make_shared<RefusingAllocator>();
  InProcess group;
  ASSERT_NO_FATAL_FAILURE(AttachInProcess("leave", config, &group, {nullptr, refusing}));
  std::vector<std::unique_ptr<client::Buffer>>& buffers = group.buffers;
  // Fresh random rows in [1, 2) (bf16: exponent 0, random mantissa), each token to two distinct random experts of 4:
  // both ranks (2 experts each) or one of them.
  const unsigned seed = std::random_device()();
  std::cout << "seed " << seed << "\n";
  std::mt19937 random(seed);
  constexpr int kTokens = 8;
  std::vector<uint16_t> x(kTokens * 256);
  for (uint16_t& v : x) v = static_cast<uint16_t>(0x3f80 | (random() & 0x7f));
  std::vector<int64_t> idx(kTokens * 2);
  for (int t = 0; t < kTokens; ++t) {
    idx[2 * t] = random() % 4;
    idx[2 * t + 1] = (idx[2 * t] + 1 + random() % 3) % 4;
  }
  const client::TensorView x_view{x.data(), kernels::DType::kBF16, {kTokens, 256}};
  const client::TensorView idx_view{idx.data(), kernels::DType::kInt64, {kTokens, 2}};
  // One round on both ranks. kRefused: a dispatch without topk_idx, which every rank refuses. kFailing: rank 1's
  // allocator refuses its dispatch's memory. kChecked: dispatch, then combine the received rows unchanged, which sums
  // a token once per rank that received it: x * (1 or 2), exact in bf16.
  // kWorst: kChecked with num_worst_tokens (outputs of 2 * kTokens rows; rows past the received ones are padding with
  // top-k -1).
  enum class Round { kRefused, kFailing, kChecked, kWorst };
  std::vector<absl::Status> status(2);
  std::vector<double> took_ms(2);
  auto run = [&](Round kind) {
    std::vector<std::vector<uint16_t>> combined(2);
    auto rank = [&](int r) -> absl::Status {
      if (r == 1) refusing->armed = false;
      auto layout = buffers[r]->GetDispatchLayout(idx_view);
      if (!layout.ok()) return layout.status();
      if (r == 1) refusing->armed = kind == Round::kFailing;
      client::DispatchArgs args{.x = x_view, .topk_idx = idx_view, .layout = &*layout};
      if (kind == Round::kRefused) args.topk_idx = {};
      if (kind == Round::kWorst) args.num_worst_tokens = 2 * kTokens;
      auto recv = buffers[r]->Dispatch(args);
      if (!recv.ok() || (kind != Round::kChecked && kind != Round::kWorst)) return recv.status();
      if (kind == Round::kWorst) {
        // Both ranks send the same tokens: this rank receives each token with an expert here once from each.
        int received = 0;
        for (int t = 0; t < kTokens; ++t) received += (idx[2 * t] / 2 == r || idx[2 * t + 1] / 2 == r) ? 2 : 0;
        if (recv->recv_x.view.shape[0] != 2 * kTokens || recv->recv_topk_idx.view.shape[0] != 2 * kTokens) {
          return absl::InternalError(absl::StrCat("worst-case outputs have ", recv->recv_x.view.shape[0], " rows"));
        }
        const auto* recv_idx = static_cast<const int64_t*>(recv->recv_topk_idx.view.data);
        for (int row = 0; row < 2 * kTokens; ++row) {
          const bool padding = recv_idx[2 * row] == -1 && recv_idx[2 * row + 1] == -1;
          if (padding != (row >= received)) {
            return absl::InternalError(absl::StrCat("row ", row, " of ", received, " received: recv_topk_idx ",
                                                    recv_idx[2 * row], ",", recv_idx[2 * row + 1]));
          }
        }
      }
      auto out = buffers[r]->Combine({.x = recv->recv_x.view, .handle = recv->handle});
      if (!out.ok()) return out.status();
      const auto* rows = static_cast<const uint16_t*>(out->combined_x.view.data);
      combined[r].assign(rows, rows + x.size());
      return absl::OkStatus();
    };
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        const absl::Time start = absl::Now();
        status[r] = rank(r);
        took_ms[r] = absl::ToDoubleMilliseconds(absl::Now() - start);
      });
    }
    for (std::thread& t : threads) t.join();
    if (kind != Round::kChecked && kind != Round::kWorst) return;
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r] << " (rank " << 1 - r << ": " << status[1 - r]
                                  << ")";
      for (int t = 0; t < kTokens; ++t) {
        const int ranks = idx[2 * t] / 2 == idx[2 * t + 1] / 2 ? 1 : 2;
        for (int h = 0; h < 256; ++h) {
          const uint16_t want = ranks == 1 ? x[t * 256 + h] : static_cast<uint16_t>(x[t * 256 + h] + 0x80);
          ASSERT_EQ(combined[r][t * 256 + h], want) << "rank " << r << " token " << t << " column " << h;
        }
      }
    }
  };

  // A call every rank refuses tells nobody: the group is as it was, the next round is correct.
  run(Round::kRefused);
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(absl::IsInvalidArgument(status[r])) << "rank " << r << ": " << status[r];
  ASSERT_NO_FATAL_FAILURE(run(Round::kChecked));

  run(Round::kFailing);
  EXPECT_TRUE(absl::IsResourceExhausted(status[1])) << status[1];
  EXPECT_TRUE(absl::IsUnavailable(status[0])) << status[0];
  EXPECT_THAT(std::string(status[0].message()), HasSubstr("from rank 1 (host 1): rank 1 left the call"));
  EXPECT_LT(took_ms[0], 2000) << "rank 0 waited for its timeout";

  for (auto& buffer : buffers) ASSERT_TRUE(buffer->Reset().ok());
  ASSERT_NO_FATAL_FAILURE(run(Round::kChecked));
  // num_worst_tokens across hosts: DeepEP's output shapes, the rows at fixed places (the padded path); its calls and
  // the host path's alternate on one Buffer (they count calls in the same region words).
  ASSERT_NO_FATAL_FAILURE(run(Round::kWorst));
  ASSERT_NO_FATAL_FAILURE(run(Round::kWorst));
  ASSERT_NO_FATAL_FAILURE(run(Round::kChecked));
  ASSERT_NO_FATAL_FAILURE(run(Round::kWorst));
}

// Combines of one dispatch back to back, with no dispatch or barrier between them (DeepEP's benchmarks and
// ElasticBuffer's emulation call combine this way): a rank that finished combine i may start combine i + 1 while its
// peer on the other host still sums combine i's rows, and its rows must not land in that peer's receive slab before
// the peer released it. Every element of every combine is checked; fresh expert outputs per combine (the received
// rows times 2^(i % 4), exact in bf16).
TEST_F(InternodeTest, BackToBackCombinesOfOneDispatchAreEachExact) {
  ASSERT_NO_FATAL_FAILURE(StartFabric(2, 1));
  const client::BufferConfig config{.max_tokens_per_rank = 64,
                                    .hidden = 256,
                                    .max_topk = 2,
                                    .num_experts = 4,
                                    .num_sms = 2,
                                    .timeout = absl::Seconds(10)};
  InProcess group;
  ASSERT_NO_FATAL_FAILURE(AttachInProcess("back-to-back", config, &group));
  const unsigned seed = std::random_device()();
  std::cout << "seed " << seed << "\n";
  std::mt19937 random(seed);
  constexpr int kTokens = 64, kHidden = 256, kCombines = 24;
  std::vector<uint16_t> x(kTokens * kHidden);  // [1, 2): exponent 0, random mantissa
  for (uint16_t& v : x) v = static_cast<uint16_t>(0x3f80 | (random() & 0x7f));
  std::vector<int64_t> idx(kTokens * 2);
  for (int t = 0; t < kTokens; ++t) {
    idx[2 * t] = random() % 4;
    idx[2 * t + 1] = (idx[2 * t] + 1 + random() % 3) % 4;
  }
  const client::TensorView x_view{x.data(), kernels::DType::kBF16, {kTokens, kHidden}};
  const client::TensorView idx_view{idx.data(), kernels::DType::kInt64, {kTokens, 2}};
  std::vector<std::string> errors(2);
  auto rank = [&](int r) -> std::string {
    client::Buffer& buffer = *group.buffers[r];
    auto layout = buffer.GetDispatchLayout(idx_view);
    if (!layout.ok()) return layout.status().ToString();
    auto recv = buffer.Dispatch({.x = x_view, .topk_idx = idx_view, .layout = &*layout});
    if (!recv.ok()) return recv.status().ToString();
    const int64_t rows = recv->recv_x.view.shape[0];
    const auto* received = static_cast<const uint16_t*>(recv->recv_x.view.data);
    std::vector<uint16_t> expert(static_cast<size_t>(rows) * kHidden);
    for (int i = 0; i < kCombines; ++i) {
      const int scale = i % 4;  // the expert's output: the received row times 2^scale (exponent + scale)
      for (size_t e = 0; e < expert.size(); ++e) expert[e] = static_cast<uint16_t>(received[e] + (scale << 7));
      const client::TensorView expert_view{expert.data(), kernels::DType::kBF16, {rows, kHidden}};
      auto out = buffer.Combine({.x = expert_view, .handle = recv->handle});
      if (!out.ok()) return absl::StrCat("combine ", i, ": ", out.status().ToString());
      const auto* combined = static_cast<const uint16_t*>(out->combined_x.view.data);
      for (int t = 0; t < kTokens; ++t) {
        const int ranks = idx[2 * t] / 2 == idx[2 * t + 1] / 2 ? 1 : 2;  // a token is summed once per rank
        for (int h = 0; h < kHidden; ++h) {
          const uint16_t want = static_cast<uint16_t>(x[t * kHidden + h] + ((scale + ranks - 1) << 7));
          if (combined[t * kHidden + h] != want) {
            return absl::StrCat("combine ", i, " token ", t, " column ", h, ": 0x",
                                absl::Hex(combined[t * kHidden + h]), " != 0x", absl::Hex(want));
          }
        }
      }
    }
    return "";
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) threads.emplace_back([&, r] { errors[r] = rank(r); });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// A host's daemon killed mid-run: the transport to it breaks, so the rank that sends to it fails at once
// (UNAVAILABLE naming it) instead of waiting out its timeout; every other call ends within its own bound.
TEST_F(InternodeTest, AKilledDaemonFailsTheCallsThatNeedItAtOnce) {
  ASSERT_NO_FATAL_FAILURE(StartFabric(2, 2));
  const std::vector<std::string> scenario = Scenario(32, 512, 4, 16, false, 71, {"--timeout_ms=3000"});
  auto token = CreateGroup("daemon-kill", scenario);
  ASSERT_TRUE(token.ok()) << token.status();
  std::vector<Subprocess> workers;
  for (int r = 0; r < world(); ++r) {
    std::vector<std::string> argv = {WorkerBinary(),        "--socket=" + fabric_->daemon(r).socket(),
                                     "--group=daemon-kill", absl::StrCat("--rank=", r),
                                     "--token=" + *token,   "--until_timeout",
                                     "--max_seconds=60"};
    argv.insert(argv.end(), scenario.begin(), scenario.end());
    auto worker = Subprocess::Start(argv);
    ASSERT_TRUE(worker.ok()) << worker.status();
    workers.push_back(std::move(*worker));
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  for (Subprocess& worker : workers) {
    while (worker.Stdout().find(" running") == std::string::npos && worker.running() && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  absl::SleepFor(absl::Milliseconds(100));
  fabric_->Kill(3);  // returns once the daemon exited (see the client kill above)
  const absl::Time killed = absl::Now();
  // Rank 1 is rank 3's gateway and sends to it every call.
  auto code = workers[1].Wait(absl::Seconds(10));
  const double ms = absl::ToDoubleMilliseconds(absl::Now() - killed);
  ASSERT_TRUE(code.ok()) << "rank 1 did not finish";
  std::cout << "rank 1 ended " << ms << " ms after the kill: " << workers[1].Stdout() << "\n";
  EXPECT_LT(ms, 2000);
  EXPECT_THAT(workers[1].Stdout(), HasSubstr("UNAVAILABLE"));
  EXPECT_THAT(workers[1].Stdout(), HasSubstr("rank 3"));
  for (int r : {0, 2, 3}) {
    auto ended = workers[r].Wait(absl::Seconds(20));
    EXPECT_TRUE(ended.ok()) << "rank " << r << " hangs: " << workers[r].Stdout();
    if (!ended.ok()) workers[r].Signal(SIGKILL);
  }
}

// Low latency through the relay with a rank that never calls: the other rank's host-side wait ends at its deadline
// (once, not twice: the kernel then runs without the silent rank), the call fails with DEADLINE_EXCEEDED naming it, and
// the rank stays masked for later calls, as a kernel's timed-out wait would leave it.
TEST_F(InternodeTest, TheRelayMasksARankThatStaysSilent) {
  ASSERT_NO_FATAL_FAILURE(StartFabric(2, 1));
  const client::BufferConfig config{.max_tokens_per_rank = 8,
                                    .hidden = 128,
                                    .max_topk = 2,
                                    .num_experts = 4,
                                    .low_latency = true,
                                    .timeout = absl::Milliseconds(500),
                                    .enable_shrink = true,
                                    .low_latency_relay = true};
  InProcess group;
  ASSERT_NO_FATAL_FAILURE(AttachInProcess("silent", config, &group));
  std::vector<uint16_t> x(4 * 128, 0x3f80);
  std::vector<int64_t> idx = {0, 2, 1, 3, 2, 0, 3, 1};  // every token to both ranks
  const client::TensorView x_view{x.data(), kernels::DType::kBF16, {4, 128}};
  const client::TensorView idx_view{idx.data(), kernels::DType::kInt64, {4, 2}};
  const absl::Time start = absl::Now();
  auto recv = group.buffers[0]->LowLatencyDispatch({.x = x_view, .topk_idx = idx_view, .use_fp8 = false});
  const double took_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  ASSERT_FALSE(recv.ok());
  EXPECT_TRUE(absl::IsDeadlineExceeded(recv.status())) << recv.status();
  EXPECT_THAT(std::string(recv.status().message()), HasSubstr("from rank 1"));
  EXPECT_GE(took_ms, 450);
  EXPECT_LT(took_ms, 950 * kSanitizerSlowdown) << "the wait ran twice";
  const client::TensorView mask = group.buffers[0]->LowLatencyRankMask();
  ASSERT_EQ(mask.shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(static_cast<const int32_t*>(mask.data)[1], 1) << "rank 1 is not masked";
}

// Who issues low latency's puts across hosts (decision 84): the lease reports its daemon's wire, and the device-side
// issuer is refused on the host backend with a message that says why, before anything is set up.
TEST_F(InternodeTest, TheLowLatencyIssuerFollowsTheWireAndNeedsCudaToIssueFromTheDevice) {
  ASSERT_NO_FATAL_FAILURE(StartFabric(2, 1));
  client::BufferConfig config{.max_tokens_per_rank = 8,
                              .hidden = 128,
                              .max_topk = 2,
                              .num_experts = 4,
                              .low_latency = true,
                              .timeout = absl::Seconds(5)};
  InProcess group;
  ASSERT_NO_FATAL_FAILURE(AttachInProcess("issuer", config, &group));  // kAuto: the host backend's own sends
  for (const auto& lease : group.leases) EXPECT_EQ(lease->transport(), v1::TRANSPORT_SOCKET);
  group.buffers.clear();
  config.low_latency_issue = client::BufferConfig::LowLatencyIssue::kDevice;
  auto refused = client::Buffer::Create(group.leases[0].get(), config);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("needs a cuda group"));
  // The environment's choice is for cuda groups; the host backend has none to make. A value that is no choice is
  // refused everywhere, before anything is set up.
  config.low_latency_issue = client::BufferConfig::LowLatencyIssue::kAuto;
  setenv("EPF_LOW_LATENCY_ISSUE", "gpu", 1);
  auto misspelt = client::Buffer::Create(group.leases[0].get(), config);
  setenv("EPF_LOW_LATENCY_ISSUE", "device", 1);
  auto created = client::Buffer::Create(group.leases[0].get(), config);
  unsetenv("EPF_LOW_LATENCY_ISSUE");
  ASSERT_FALSE(misspelt.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(misspelt.status())) << misspelt.status();
  EXPECT_THAT(std::string(misspelt.status().message()), HasSubstr("EPF_LOW_LATENCY_ISSUE='gpu'"));
  EXPECT_TRUE(created.ok()) << created.status();
}

}  // namespace
}  // namespace epfabric::testing
