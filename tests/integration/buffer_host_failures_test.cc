// The Buffer API on the host backend against real daemons: bad input is refused before anything runs, a missing peer
// times out naming it, too small a num_worst_tokens fails cleanly, and after Reset the group works (fixture:
// buffer_host_fixture.h; part of the buffer_host_test binary).
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "integration/buffer_host_fixture.h"

namespace epfabric::testing {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Bad input: refused with InvalidArgument before anything runs; the next valid call still works.

TEST_F(BufferHostTest, NormalBadInputIsRefusedAndTheNextCallWorks) {
  const BufferConfig config = NormalConfig(256, 32);
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(MakeRanks(2, config, &ranks));
  Buffer& b = *ranks.buffers[0];
  const std::vector<int64_t> topk(8 * 4, 1);
  const std::vector<uint16_t> x(8 * 256, 0);
  auto layout = b.GetDispatchLayout(View(topk, DType::kInt64, {8, 4}));  // local only: no peer involved
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto expect_invalid = [](const absl::Status& status, const std::string& needle) {
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
    EXPECT_NE(status.message().find(needle), std::string::npos) << status;
  };
  client::DispatchArgs args;
  args.x = View(x, DType::kFloat32, {8, 256});
  args.topk_idx = View(topk, DType::kInt64, {8, 4});
  args.layout = &*layout;
  expect_invalid(b.Dispatch(args).status(), "x.dtype = float32");
  args.x = View(x, DType::kBF16, {8, 256, 1});
  expect_invalid(b.Dispatch(args).status(), "x.shape = [8, 256, 1]");
  args.x = View(x, DType::kBF16, {8, 256});
  args.topk_idx = View(topk, DType::kInt64, {4, 8});
  expect_invalid(b.Dispatch(args).status(), "topk_idx.shape = [4, 8]");
  args.topk_idx = View(topk, DType::kInt32, {8, 4});
  expect_invalid(b.Dispatch(args).status(), "topk_idx.dtype = int32");
  args.topk_idx = View(topk, DType::kInt64, {8, 4});
  args.x = View(x, DType::kFP8E4M3, {16, 200});
  expect_invalid(b.Dispatch(args).status(), "x.shape[1] (hidden) = 200: must be a multiple of 128");
  std::vector<int64_t> bad_topk = topk;
  bad_topk[5] = 16;
  expect_invalid(b.GetDispatchLayout(View(bad_topk, DType::kInt64, {8, 4})).status(), "topk_idx[1][1] = 16");
  bad_topk[5] = -2;
  expect_invalid(b.GetDispatchLayout(View(bad_topk, DType::kInt64, {8, 4})).status(), "= -2");
  const std::vector<int64_t> many(40 * 4, 0);
  expect_invalid(b.GetDispatchLayout(View(many, DType::kInt64, {40, 4})).status(), "= 40");
  const std::vector<int64_t> wide(8 * 9, 0);
  expect_invalid(b.GetDispatchLayout(View(wide, DType::kInt64, {8, 9})).status(), "num_topk) = 9");
  client::CombineArgs cargs;
  expect_invalid(b.Combine(cargs).status(), "handle is null");
  EXPECT_TRUE(absl::IsFailedPrecondition(b.LowLatencyDispatch({}).status()));

  // Afterwards a full valid case on every rank.
  hbt::IntranodeCase c = CaseFor(config, {32, 9}, 900);
  RunNormalCases(ranks, {c});
}

TEST_F(BufferHostTest, NormalFp8UnalignedHiddenAndBadExpertIndexInDispatch) {
  const BufferConfig config = NormalConfig(512, 16);
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(MakeRanks(2, config, &ranks));
  Buffer& b = *ranks.buffers[1];
  const std::vector<int64_t> topk(4 * 2, 3);
  const std::vector<uint8_t> x(4 * 512, 0);
  const std::vector<float> scales(4 * 4, 1.0f);
  auto layout = b.GetDispatchLayout(View(topk, DType::kInt64, {4, 2}));
  ASSERT_TRUE(layout.ok()) << layout.status();
  client::DispatchArgs args;
  args.x = View(x, DType::kFP8E4M3, {4, 200});
  args.x_scales = View(scales, DType::kFloat32, {4, 1});
  args.topk_idx = View(topk, DType::kInt64, {4, 2});
  args.layout = &*layout;
  absl::Status status = b.Dispatch(args).status();
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_NE(status.message().find("x.shape[1] (hidden) = 200: must be a multiple of 128"), std::string::npos) << status;
  args.x = View(x, DType::kFP8E4M3, {4, 512});
  status = b.Dispatch(args).status();  // scales [4, 1] instead of [4, 4]
  EXPECT_NE(status.message().find("x_scales.shape = [4, 1]"), std::string::npos) << status;
  args.x_scales = {};
  status = b.Dispatch(args).status();
  EXPECT_NE(status.message().find("x_scales is not given"), std::string::npos) << status;
  const std::vector<int32_t> words(4 * 4, 0x7f7f7f7f);
  args.x_scales = View(words, DType::kInt32, {4, 4});  // packed UE8M0: [4, 512 / 512]
  status = b.Dispatch(args).status();
  EXPECT_NE(status.message().find("x_scales.shape = [4, 4]: expected [4, 1]"), std::string::npos) << status;
  args.x_scales = View(words, DType::kInt64, {4, 2});
  status = b.Dispatch(args).status();
  EXPECT_NE(status.message().find("x_scales.dtype = int64"), std::string::npos) << status;
  std::vector<int64_t> bad = topk;
  bad[3] = 99;
  args.x_scales = View(scales, DType::kFloat32, {4, 4});
  args.topk_idx = View(bad, DType::kInt64, {4, 2});
  status = b.Dispatch(args).status();
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_NE(status.message().find("topk_idx[1][1] = 99"), std::string::npos) << status;
  hbt::IntranodeCase c = CaseFor(config, {16, 11}, 901);
  c.fp8 = true;
  c.hidden = 512;
  RunNormalCases(ranks, {c});
}

TEST_F(BufferHostTest, LowLatencyBadInputIsRefusedAndTheNextCallWorks) {
  const BufferConfig config = LowLatencyConfig(256, 8, 8);
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(MakeRanks(2, config, &ranks));
  Buffer& b = *ranks.buffers[0];
  const std::vector<uint16_t> x(16 * 256, 0);
  const std::vector<int64_t> topk(16 * 4, 0);
  client::LowLatencyDispatchArgs d;
  d.x = View(x, DType::kBF16, {16, 256});
  d.topk_idx = View(topk, DType::kInt64, {16, 4});
  absl::Status status = b.LowLatencyDispatch(d).status();
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_NE(status.message().find("x.shape[0] (num_tokens) = 16"), std::string::npos) << status;
  d.x = View(x, DType::kBF16, {4, 128});
  status = b.LowLatencyDispatch(d).status();
  EXPECT_NE(status.message().find("x.shape = [4, 128]"), std::string::npos) << status;
  d.x = View(x, DType::kFP8E4M3, {4, 256});
  status = b.LowLatencyDispatch(d).status();
  EXPECT_NE(status.message().find("x.dtype = fp8_e4m3"), std::string::npos) << status;
  d.x = View(x, DType::kBF16, {4, 256});
  d.topk_idx = View(topk, DType::kInt64, {4, 4});
  d.use_ue8m0 = true;
  d.round_scale = true;
  status = b.LowLatencyDispatch(d).status();
  EXPECT_NE(status.message().find("multiple of 512"), std::string::npos) << status;
  d.use_ue8m0 = false;
  std::vector<int64_t> bad = topk;
  bad[2] = 8;
  d.topk_idx = View(bad, DType::kInt64, {4, 4});
  status = b.LowLatencyDispatch(d).status();
  EXPECT_NE(status.message().find("topk_idx[0][2] = 8"), std::string::npos) << status;
  d.topk_idx = View(topk, DType::kInt64, {4, 4});
  const std::vector<int64_t> cost(3, 0);
  d.wait_recv_cost_stats = View(cost, DType::kInt64, {3});
  status = b.LowLatencyDispatch(d).status();
  EXPECT_NE(status.message().find("wait_recv_cost_stats.shape = [3]"), std::string::npos) << status;
  d.wait_recv_cost_stats = View(cost, DType::kInt32, {2});
  status = b.LowLatencyDispatch(d).status();
  EXPECT_NE(status.message().find("wait_recv_cost_stats.dtype = int32"), std::string::npos) << status;
  EXPECT_TRUE(absl::IsFailedPrecondition(b.Dispatch({}).status()));
  // Nothing ran, so both ranks' cursors still agree: a valid sequence works.
  hbt::LowLatencyCase c = LowLatencyCaseFor(config, 2, 902);
  c.iterations = 2;
  RunLowLatencyCases(ranks, {c});
}

TEST_F(BufferHostTest, PendingRecvHookBlocksTheNextLowLatencyCall) {
  const BufferConfig config = LowLatencyConfig(256, 8, 8);
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(MakeRanks(2, config, &ranks));
  hbt::LowLatencyCase c = LowLatencyCaseFor(config, 2, 903);
  c.num_tokens = {5, 8};
  const std::vector<hbt::LowLatencyIteration> its = hbt::MakeLowLatencyExpected(c);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Buffer& b = *ranks.buffers[r];
      const auto& in = its[0].inputs[r];
      client::LowLatencyDispatchArgs d;
      d.x = View(in.x, DType::kBF16, {in.num_tokens, 256});
      d.topk_idx = View(in.topk_idx, DType::kInt64, {in.num_tokens, c.num_topk});
      d.return_recv_hook = true;
      auto first = b.LowLatencyDispatch(d);
      if (!first.ok()) return void(errors[r] = first.status().ToString());
      absl::Status early = b.LowLatencyDispatch(d).status();
      if (!absl::IsFailedPrecondition(early) || early.message().find("recv_hook") == std::string::npos) {
        errors[r] = absl::StrCat("second dispatch before the hook: ", early.ToString());
      }
      if (absl::Status hooked = first->recv_hook(nullptr); !hooked.ok()) return void(errors[r] = hooked.ToString());
      client::LowLatencyCombineArgs cb;
      const TensorView into = b.NextLowLatencyCombineBuffer();
      std::memcpy(into.data, its[0].expert_outputs[r].data(), into.bytes());
      cb.zero_copy = true;
      cb.topk_idx = d.topk_idx;
      cb.topk_weights = View(in.topk_weights, DType::kFloat32, {in.num_tokens, c.num_topk});
      cb.handle = first->handle;
      auto combined = b.LowLatencyCombine(cb);
      if (!combined.ok()) return void(errors[r] = combined.status().ToString());
      if (std::memcmp(combined->combined_x.view.data, its[0].combined[r].data(), its[0].combined[r].size() * 2) != 0) {
        errors[r] = "combined_x differs";
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// A rank that never calls: its peer's wait ends with DeadlineExceeded naming it; after Reset on every rank the
// group works again.
TEST_F(BufferHostTest, MissingPeerTimesOutNamingItAndResetRecovers) {
  for (bool low_latency : {false, true}) {
    SCOPED_TRACE(low_latency ? "low latency" : "normal");
    BufferConfig config = low_latency ? LowLatencyConfig(256, 8, 8) : NormalConfig(256, 16);
    config.timeout = absl::Seconds(1);  // short, yet long enough for a loaded 2-core machine in the checked case
    Ranks ranks;
    ASSERT_NO_FATAL_FAILURE(MakeRanks(2, config, &ranks));
    Buffer& b = *ranks.buffers[0];
    const std::vector<int64_t> topk(4 * 2, 3);
    const std::vector<uint16_t> x(4 * 256, 0);
    absl::Status status;
    const absl::Time start = absl::Now();
    if (low_latency) {
      client::LowLatencyDispatchArgs d;
      d.x = View(x, DType::kBF16, {4, 256});
      d.topk_idx = View(topk, DType::kInt64, {4, 2});
      status = b.LowLatencyDispatch(d).status();
    } else {
      auto layout = b.GetDispatchLayout(View(topk, DType::kInt64, {4, 2}));
      ASSERT_TRUE(layout.ok()) << layout.status();
      status = b.Dispatch({.x = View(x, DType::kBF16, {4, 256}),
                           .topk_idx = View(topk, DType::kInt64, {4, 2}),
                           .layout = &*layout})
                   .status();
    }
    const absl::Duration took = absl::Now() - start;
    EXPECT_TRUE(absl::IsDeadlineExceeded(status)) << status;
    EXPECT_NE(status.message().find("rank 0 timed out waiting for"), std::string::npos) << status;
    EXPECT_NE(status.message().find("from rank 1"), std::string::npos) << status;
    EXPECT_LT(took, absl::Seconds(5));
    for (auto& buffer : ranks.buffers) ASSERT_TRUE(buffer->Reset().ok());
    if (low_latency) {
      hbt::LowLatencyCase c = LowLatencyCaseFor(config, 2, 904);
      c.iterations = 2;
      RunLowLatencyCases(ranks, {c});
    } else {
      RunNormalCases(ranks, {CaseFor(config, {16, 7}, 905)});
    }
  }
}

// A peer whose client changed (detached, then a new client attached) is not part of the generation the Buffer took:
// the next call is refused with UNAVAILABLE naming it before anything runs (normal mode, and low latency without
// enable_shrink); after Reset on the old Buffer and a new Buffer for the new client, the group works again.
TEST_F(BufferHostTest, ACallAfterAPeerGotANewClientIsRefusedNamingIt) {
  for (bool low_latency : {false, true}) {
    SCOPED_TRACE(low_latency ? "low latency" : "normal");
    const BufferConfig config = low_latency ? LowLatencyConfig(256, 8, 8) : NormalConfig(256, 16);
    Ranks ranks;
    ASSERT_NO_FATAL_FAILURE(MakeRanks(2, config, &ranks));
    auto run = [&](uint64_t seed) {
      if (low_latency) {
        RunLowLatencyCases(ranks, {LowLatencyCaseFor(config, 2, seed)});
      } else {
        RunNormalCases(ranks, {CaseFor(config, {16, 7}, seed)});
      }
    };
    run(910);  // both Buffers take the generation
    const std::string group = ranks.leases[1]->group_name();
    ranks.buffers[1].reset();
    ASSERT_TRUE(ranks.leases[1]->Detach().ok());
    auto lease = ranks.clients[1]->Attach(group, 1, ranks.token);
    ASSERT_TRUE(lease.ok()) << lease.status();
    ranks.leases[1] = std::move(*lease);

    const std::vector<int64_t> topk(4 * 2, 3);
    const std::vector<uint16_t> x(4 * 256, 0);
    absl::Status status;
    if (low_latency) {
      client::LowLatencyDispatchArgs d;
      d.x = View(x, DType::kBF16, {4, 256});
      d.topk_idx = View(topk, DType::kInt64, {4, 2});
      status = ranks.buffers[0]->LowLatencyDispatch(d).status();
    } else {
      auto layout = ranks.buffers[0]->GetDispatchLayout(View(topk, DType::kInt64, {4, 2}));
      ASSERT_TRUE(layout.ok()) << layout.status();
      status = ranks.buffers[0]
                   ->Dispatch({.x = View(x, DType::kBF16, {4, 256}),
                               .topk_idx = View(topk, DType::kInt64, {4, 2}),
                               .layout = &*layout})
                   .status();
    }
    EXPECT_TRUE(absl::IsUnavailable(status)) << status;
    EXPECT_NE(status.message().find("rank 1 has a new client"), std::string::npos) << status;

    auto buffer = Buffer::Create(ranks.leases[1].get(), config);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    ranks.buffers[1] = std::move(*buffer);
    ASSERT_TRUE(ranks.buffers[0]->Reset().ok());
    run(911);
  }
}

TEST_F(BufferHostTest, AnEndedLeaseIsUnavailableBeforeAnythingRuns) {
  const BufferConfig config = NormalConfig(256, 16);
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(MakeRanks(2, config, &ranks));
  ASSERT_TRUE(ranks.leases[0]->Detach().ok());
  const std::vector<int64_t> topk(4 * 2, 3);
  absl::Status status = ranks.buffers[0]->GetDispatchLayout(View(topk, DType::kInt64, {4, 2})).status();
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
}

TEST_F(BufferHostTest, CreateRefusesASmallRegionAndAModeMismatch) {
  ASSERT_TRUE(fabrics_[2] != nullptr) << "the 2-rank fabric did not start";
  const BufferConfig config = NormalConfig(256, 32);
  auto bytes = client::RequiredRegionBytes(config, 2);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto group = CreateGroup(2, *bytes - 4096, false);
  ASSERT_TRUE(group.ok()) << group.status();
  auto connected = Client::Connect(fabrics_[2]->daemon(0).socket());
  ASSERT_TRUE(connected.ok()) << connected.status();
  auto lease = (*connected)->Attach(group->group().name(), 0, group->token());
  ASSERT_TRUE(lease.ok()) << lease.status();
  auto buffer = Buffer::Create(lease->get(), config);
  EXPECT_TRUE(absl::IsInvalidArgument(buffer.status())) << buffer.status();
  EXPECT_NE(buffer.status().message().find(absl::StrCat("needs RequiredRegionBytes = ", *bytes)), std::string::npos)
      << buffer.status();
  BufferConfig low_latency = config;
  low_latency.low_latency = true;
  buffer = Buffer::Create(lease->get(), low_latency);
  EXPECT_TRUE(absl::IsInvalidArgument(buffer.status())) << buffer.status();
  EXPECT_NE(buffer.status().message().find("low_latency"), std::string::npos) << buffer.status();
  BufferConfig odd = config;
  odd.num_experts = 15;
  EXPECT_TRUE(absl::IsInvalidArgument(client::RequiredRegionBytes(odd, 2).status()));
}

// A socket file whose daemon is gone (bound, nobody listening): Connect fails at once with UNAVAILABLE instead of
// waiting out its timeout (the chaos test saw 5 s).
TEST(ClientConnect, ASocketNobodyListensOnFailsAtOnce) {
  char dir[] = "/tmp/epf-dead-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/d.sock";
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0) << std::strerror(errno);
  close(fd);  // the file stays; connecting to it is refused
  const absl::Time start = absl::Now();
  auto connected = client::Client::Connect(path, {.timeout = absl::Seconds(5)});
  const absl::Duration took = absl::Now() - start;
  EXPECT_TRUE(absl::IsUnavailable(connected.status())) << connected.status();
  EXPECT_LT(took, absl::Milliseconds(500)) << "waited for the connect timeout";
  unlink(path.c_str());
  rmdir(dir);
}

}  // namespace
}  // namespace epfabric::testing
