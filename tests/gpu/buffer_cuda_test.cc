// The Buffer API on the cuda backend: two real daemons (--backend=cuda), a 2-rank group per mode sized with
// RequiredRegionBytes, and two client processes (this binary started again with --epf_buffer_cuda_helper), each with
// a Client + Lease + Buffer on its rank's GPU, running normal-mode and low-latency round trips on device memory;
// every output is copied back and compared element by element with the host references (the same seeded inputs in
// both processes). Rank r uses GPU r mod (visible GPUs) (gpu_placement.h): with one GPU both daemons run with
// --device=0 and both clients map each other's regions on that GPU (CUDA IPC / cuMem fds between processes of one
// device). Needs one GPU; skips cleanly without.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <iostream>
#include <random>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "epfabric/client/buffer.h"
#include "epfabric/client/client.h"
#include "epfabric/common/status_macros.h"
#include "gpu_env.h"
#include "integration/buffer_test_cases.h"
#include "integration/client_test_util.h"
#include "integration/fabric_under_test.h"

namespace epfabric::testing {
namespace {

using client::BufferConfig;

constexpr uint64_t kGranularity = 2ull << 20;  // POSIX_FD regions map whole 2 MiB pages

BufferConfig ConfigFor(bool low_latency) {
  if (low_latency) {
    return BufferConfig{
        .max_tokens_per_rank = 64, .hidden = 7168, .max_topk = 8, .num_experts = 16, .low_latency = true};
  }
  return BufferConfig{.max_tokens_per_rank = 512, .hidden = 7168, .max_topk = 8, .num_experts = 64, .num_sms = 8};
}

std::vector<hbt::IntranodeCase> NormalCases(uint64_t seed) {
  const BufferConfig config = ConfigFor(false);
  std::vector<hbt::IntranodeCase> cases;
  auto make = [&](std::vector<int> tokens, int hidden) {
    hbt::IntranodeCase c;
    c.num_tokens = std::move(tokens);
    c.hidden = hidden;
    c.num_topk = 8;
    c.num_experts = config.num_experts;
    c.num_channels = config.num_sms;
    c.seed = seed * 31 + cases.size();
    return c;
  };
  hbt::IntranodeCase bf16 = make({512, 300}, 7168);
  bf16.bias = true;
  cases.push_back(bf16);
  hbt::IntranodeCase fp8 = make({0, 128}, 4096);
  fp8.fp8 = true;
  fp8.topk = hbt::TopkMode::kIdsOnly;
  cases.push_back(fp8);
  hbt::IntranodeCase packed = make({200, 77}, 7168);  // DeepEP's packed UE8M0 int32 scales
  packed.fp8 = true;
  packed.packed_scales = true;
  cases.push_back(packed);
  hbt::IntranodeCase none = make({100, 1}, 256);
  none.topk = hbt::TopkMode::kNone;
  cases.push_back(none);
  hbt::IntranodeCase one = make({64, 64}, 1024);
  one.routing.all_to_one_expert = true;
  one.expert_alignment = 8;
  cases.push_back(one);
  return cases;
}

std::vector<hbt::LowLatencyCase> LowLatencyCases(uint64_t seed) {
  const BufferConfig config = ConfigFor(true);
  std::vector<hbt::LowLatencyCase> cases;
  auto make = [&] {
    hbt::LowLatencyCase c;
    c.num_ranks = 2;
    c.max_tokens = config.max_tokens_per_rank;
    c.hidden = config.hidden;
    c.num_experts = config.num_experts;
    c.num_topk = 8;
    c.seed = seed * 37 + cases.size();
    return c;
  };
  hbt::LowLatencyCase plain = make();
  plain.iterations = 3;
  cases.push_back(plain);
  hbt::LowLatencyCase round = make();
  round.round_scale = true;
  round.hook = true;
  cases.push_back(round);
  hbt::LowLatencyCase ue8m0 = make();
  ue8m0.round_scale = true;
  ue8m0.ue8m0 = true;
  ue8m0.zero_copy = true;
  ue8m0.iterations = 2;
  cases.push_back(ue8m0);
  hbt::LowLatencyCase bf16 = make();
  bf16.fp8 = false;
  bf16.hook = true;
  bf16.zero_copy = true;
  bf16.num_tokens = {0, 64};
  cases.push_back(bf16);
  return cases;
}

// Device memory for inputs; outputs are read back with synchronous copies (after the Buffer's stream work).
class DeviceTestMemory final : public TestMemory {
 public:
  ~DeviceTestMemory() override {
    for (void* p : owned_) cudaFree(p);
  }
  client::TensorView Upload(const void* data, size_t bytes, kernels::DType dtype, std::vector<int64_t> shape) override {
    void* device = nullptr;
    if (cudaMalloc(&device, std::max<size_t>(bytes, 256)) != cudaSuccess) return {};
    owned_.push_back(device);
    if (bytes > 0) cudaMemcpy(device, data, bytes, cudaMemcpyHostToDevice);
    return client::TensorView{device, dtype, std::move(shape)};
  }
  void Read(void* to, const void* from, size_t bytes) override {
    cudaDeviceSynchronize();
    cudaMemcpy(to, from, bytes, cudaMemcpyDefault);
  }
  void Write(void* to, const void* from, size_t bytes) override {
    cudaDeviceSynchronize();
    cudaMemcpy(to, from, bytes, cudaMemcpyDefault);
  }

 private:
  std::vector<void*> owned_;
};

// A bump allocator over one cudaMalloc'd arena, as a CUDA graph needs: outputs stay at the addresses captured, and
// nothing is allocated or freed in stream order while capturing.
class ArenaAllocator final : public client::Allocator {
 public:
  explicit ArenaAllocator(size_t bytes) {
    if (cudaMalloc(&base_, bytes) == cudaSuccess) size_ = bytes;
  }
  ~ArenaAllocator() override { cudaFree(base_); }
  absl::StatusOr<void*> Allocate(size_t bytes, cudaStream_t /*stream*/) override {
    const size_t at = (used_ + 255) / 256 * 256;
    if (at + bytes > size_) return absl::ResourceExhaustedError("the test arena is full");
    used_ = at + bytes;
    return static_cast<char*>(base_) + at;
  }
  void Free(void* /*ptr*/, cudaStream_t /*stream*/) override {}

 private:
  void* base_ = nullptr;
  size_t size_ = 0;
  size_t used_ = 0;
};

// DeepEP's num_worst_tokens path: layout + worst-case dispatch + combine captured in one CUDA graph on a stream of
// its own, then replayed with new inputs written into the captured input tensors, routing included (so the counts
// each rank receives change between replays, which only the kernels see). Every replay is checked against the
// references: the received rows, the padding rows (top-k -1, weight 0), the combined rows. A second Buffer on the
// lease takes its outputs from an arena, so that the captured addresses stay valid.
void RunWorstCaseGraph(client::Lease* lease, int rank, uint64_t seed, hbt::Mismatches* m) {
  using kernels::DType;
  const BufferConfig config = ConfigFor(false);
  auto buffer = client::Buffer::Create(lease, config, std::make_shared<ArenaAllocator>(512ull << 20));
  if (!buffer.ok()) return m->Status("Buffer::Create (arena)", rank, buffer.status());
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return m->Add("stream");
  std::vector<hbt::IntranodeExpected> xs;
  for (int i = 0; i < 4; ++i) {
    hbt::IntranodeCase c;
    c.num_tokens = {192, 160};
    c.hidden = 2048;
    c.num_topk = 8;
    c.num_experts = config.num_experts;
    c.num_channels = config.num_sms;
    c.routing.empty_fraction = 0.1 * i;  // different receive counts per replay
    c.seed = seed * 41 + i;
    xs.push_back(hbt::MakeIntranodeExpected(c));
  }
  const int W = 2 * config.max_tokens_per_rank, H = 2048, K = 8;
  const int64_t T = xs[0].inputs[rank].num_tokens;
  DeviceTestMemory mem;
  // Padding rows of the expert outputs hold NaN and 1e30 weights: the combine must never read them.
  const std::vector<uint16_t> nan_rows(static_cast<size_t>(W) * H, 0x7fc0);
  const std::vector<float> huge_weights(static_cast<size_t>(W) * K, 1e30f);
  const client::TensorView x = Put(mem, xs[0].inputs[rank].x, DType::kBF16, {T, H});
  const client::TensorView topk = Put(mem, xs[0].inputs[rank].topk_idx, DType::kInt64, {T, K});
  const client::TensorView weights = Put(mem, xs[0].inputs[rank].topk_weights, DType::kFloat32, {T, K});
  const client::TensorView expert_out = Put(mem, nan_rows, DType::kBF16, {W, H});
  const client::TensorView expert_w = Put(mem, huge_weights, DType::kFloat32, {W, K});
  struct Outputs {
    client::DispatchLayout layout;
    client::DispatchResult dispatched;
    client::CombineResult combined;
  };
  auto run = [&](Outputs* o) -> absl::Status {
    EPF_ASSIGN_OR_RETURN(o->layout, (*buffer)->GetDispatchLayout(topk, stream));
    EPF_ASSIGN_OR_RETURN(
        o->dispatched,
        (*buffer)->Dispatch(
            {.x = x, .topk_idx = topk, .topk_weights = weights, .layout = &o->layout, .num_worst_tokens = W}, stream));
    EPF_ASSIGN_OR_RETURN(
        o->combined,
        (*buffer)->Combine({.x = expert_out, .topk_weights = expert_w, .handle = o->dispatched.handle}, stream));
    return absl::OkStatus();
  };
  auto load = [&](const hbt::IntranodeExpected& e) {  // case e's inputs into the captured tensors
    const ref::RankInput& in = e.inputs[rank];
    mem.Write(x.data, in.x.data(), in.x.size());
    mem.Write(topk.data, in.topk_idx.data(), in.topk_idx.size() * sizeof(int64_t));
    mem.Write(weights.data, in.topk_weights.data(), in.topk_weights.size() * sizeof(float));
    const ref::CombineInput& cin = e.combine_inputs[rank];
    mem.Write(expert_out.data, nan_rows.data(), nan_rows.size() * 2);
    mem.Write(expert_out.data, cin.x.data(), cin.x.size() * 2);
    mem.Write(expert_w.data, huge_weights.data(), huge_weights.size() * sizeof(float));
    mem.Write(expert_w.data, cin.topk_weights.data(), cin.topk_weights.size() * sizeof(float));
  };
  auto check = [&](const Outputs& o, const hbt::IntranodeExpected& e, const char* what) {
    m->Status(what, rank, (*buffer)->Check(stream));
    const ref::RankOutput& want = e.dispatched[rank];
    CheckWorstCasePadding(mem, m, rank, o.dispatched, want.num_recv_tokens, W, K, true);
    CompareTensor(mem, m, "graph recv_x", rank, o.dispatched.recv_x, want.recv_x, want.recv_x.size());
    CompareTensor(mem, m, "graph recv_topk_idx", rank, o.dispatched.recv_topk_idx, want.recv_topk_idx,
                  want.recv_topk_idx.size());
    CompareTensor(mem, m, "graph recv_topk_weights", rank, o.dispatched.recv_topk_weights, want.recv_topk_weights,
                  want.recv_topk_weights.size());
    const ref::CombineOutput& cwant = e.combined[rank];
    CompareTensor(mem, m, "graph combined_x", rank, o.combined.combined_x, cwant.combined_x, cwant.combined_x.size());
    CompareTensor(mem, m, "graph combined_topk_weights", rank, o.combined.combined_topk_weights,
                  cwant.combined_topk_weights, cwant.combined_topk_weights.size());
  };
  Outputs eager, captured;
  load(xs[0]);
  if (absl::Status s = run(&eager); !s.ok()) return m->Status("eager worst-case sequence", rank, s);
  check(eager, xs[0], "eager worst-case sequence");
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return m->Add("begin capture");
  const absl::Status in_capture = run(&captured);
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  if (!in_capture.ok()) return m->Status("capture", rank, in_capture);
  if (ended != cudaSuccess || cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
    return m->Add(absl::StrCat("rank ", rank, ": capture failed: ", cudaGetErrorString(ended)));
  }
  for (int i = 0; i < static_cast<int>(xs.size()); ++i) {
    load(xs[i]);
    if (cudaGraphLaunch(exec, stream) != cudaSuccess) return m->Add("graph launch");
    check(captured, xs[i], "graph replay");
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

void RunMode(bool low_latency) {
  EPF_REQUIRE_GPUS(1);
  auto placement = PlaceRanks(2);
  ASSERT_TRUE(placement.ok()) << placement.status();
  std::cout << "buffer_cuda_test: " << placement->ToString() << "\n";
  auto fabric = FabricUnderTest::Start(2, {"--heartbeat_ms=100", "--heartbeat_misses=5"},
                                       {{0, {"--backend=cuda", absl::StrCat("--device=", placement->device(0))}},
                                        {1, {"--backend=cuda", absl::StrCat("--device=", placement->device(1))}}});
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  auto bytes = client::RequiredRegionBytes(ConfigFor(low_latency), 2);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  const std::string name = low_latency ? "buffer-ll" : "buffer-normal";
  v1::CreateGroupRequest request;
  request.set_name(name);
  request.add_ranks(0);
  request.add_ranks(1);
  request.set_num_nvl_bytes((*bytes + kGranularity - 1) / kGranularity * kGranularity);
  request.set_low_latency(low_latency);
  grpc::ClientContext context;
  v1::CreateGroupResponse group;
  const grpc::Status created = (*fabric)->Control(0)->CreateGroup(&context, request, &group);
  ASSERT_TRUE(created.ok()) << created.error_message();

  const uint64_t seed = std::random_device{}();
  std::cout << "buffer_cuda_test seed " << seed << "\n";
  auto parent = ChildChannel::Listen();
  ASSERT_TRUE(parent.ok()) << parent.status();
  std::vector<Helper> helpers = StartHelpers(
      *parent, **fabric, "--epf_buffer_cuda_helper", low_latency ? "low_latency" : "normal", name, group.token(),
      {0, 1}, 0, {absl::StrCat("--gpus=", placement->num_gpus), absl::StrCat("--seed=", seed)});
  ASSERT_EQ(helpers.size(), 2u);
  for (Helper& helper : helpers) ASSERT_TRUE(Say(helper.channel.get(), "run").ok());
  for (Helper& helper : helpers) {
    auto said = Hear(helper.channel.get(), absl::Minutes(3));
    ASSERT_TRUE(said.ok()) << said.status();
    // "checked <cases> <mismatches>"
    ASSERT_EQ(said->size(), 3u) << absl::StrJoin(*said, " ");
    EXPECT_EQ((*said)[0], "checked") << absl::StrJoin(*said, " ");
    EXPECT_EQ((*said)[2], "0") << "rank " << helper.rank << " found mismatches (its stderr has them)";
  }
  for (Helper& helper : helpers) ASSERT_TRUE(Say(helper.channel.get(), "detach").ok());
  for (Helper& helper : helpers) {
    auto exit_code = WaitChild(helper.pid, absl::Seconds(60));
    EXPECT_TRUE(exit_code.ok() && *exit_code == 0) << "helper rank " << helper.rank;
  }
}

TEST(BufferCuda, NormalModeRoundTripsTwoRanks) { RunMode(false); }
TEST(BufferCuda, LowLatencyRoundTripsTwoRanks) { RunMode(true); }

}  // namespace

// The client process: its GPU (rank mod --gpus, as its daemon's), attach, a Buffer; on "run" the mode's cases (every
// rank runs the same sequence).
int RunBufferCudaHelper(int argc, char** argv) {
  auto parent = ConnectTo(FlagValue(argc, argv, "parent"));
  if (!parent.ok()) return 2;
  const int channel = parent->get();
  int rank = -1, gpus = 0;
  uint64_t seed = 0;
  if (!absl::SimpleAtoi(FlagValue(argc, argv, "rank"), &rank) ||
      !absl::SimpleAtoi(FlagValue(argc, argv, "gpus"), &gpus) || gpus < 1 ||
      !absl::SimpleAtoi(FlagValue(argc, argv, "seed"), &seed)) {
    (void)Say(channel, "failed bad-arguments");
    return 2;
  }
  const int device = GpuPlacement{.num_ranks = rank + 1, .num_gpus = gpus}.device(rank);
  const bool low_latency = FlagValue(argc, argv, "mode") == "low_latency";
  if (cudaSetDevice(device) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) {
    (void)Say(channel, absl::StrCat("failed cuda-device-", device));
    return 1;
  }
  auto connected = client::Client::Connect(FlagValue(argc, argv, "socket"), {.client_name = "buffer_cuda_test"});
  if (!connected.ok()) {
    (void)Say(channel, "failed connect");
    return 1;
  }
  auto lease =
      (*connected)
          ->Attach(FlagValue(argc, argv, "group"), rank, FlagValue(argc, argv, "token"), {.accessing_device = device});
  if (!lease.ok()) {
    std::cerr << "rank " << rank << ": " << lease.status() << "\n";
    (void)Say(channel, "failed attach");
    return 1;
  }
  auto buffer = client::Buffer::Create(lease->get(), ConfigFor(low_latency));
  if (!buffer.ok()) {
    std::cerr << "rank " << rank << ": " << buffer.status() << "\n";
    (void)Say(channel, "failed buffer");
    return 1;
  }
  if (!Say(channel, absl::StrCat("attached ", rank, " ", getpid(), " ", (*lease)->lease_id(), " 0")).ok()) return 1;
  while (true) {
    auto said = Hear(channel, absl::Minutes(3));
    if (!said.ok()) return 1;
    if ((*said)[0] == "run") {
      hbt::Mismatches found;
      int cases = 0;
      DeviceTestMemory memory;
      if (low_latency) {
        for (const hbt::LowLatencyCase& c : LowLatencyCases(seed)) {
          RunLowLatencyIterations(memory, rank, **buffer, c, hbt::MakeLowLatencyExpected(c), &found);
          ++cases;
        }
      } else {
        for (const hbt::IntranodeCase& c : NormalCases(seed)) {
          RunNormalCase(memory, rank, **buffer, hbt::MakeIntranodeExpected(c), &found);
          ++cases;
        }
        // Worst-case mode eagerly (exactly the most a rank can receive, and more), then in a CUDA graph.
        const std::vector<hbt::IntranodeCase> worst = NormalCases(seed + 1);
        RunNormalCase(memory, rank, **buffer, hbt::MakeIntranodeExpected(worst[0]), &found, nullptr, 1024);
        RunNormalCase(memory, rank, **buffer, hbt::MakeIntranodeExpected(worst[1]), &found, nullptr, 1500);
        RunWorstCaseGraph(lease->get(), rank, seed, &found);
        cases += 3;
      }
      if (!found.empty()) std::cerr << "rank " << rank << " mismatches:\n" << found.str();
      const int mismatches = found.empty() ? 0 : 1;
      if (!Say(channel, absl::StrCat("checked ", cases, " ", mismatches)).ok()) return 1;
    } else if ((*said)[0] == "detach") {
      buffer->reset();
      return (*lease)->Detach().ok() ? 0 : 1;
    }
  }
}

}  // namespace epfabric::testing

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--epf_buffer_cuda_helper") == 0) {
      return epfabric::testing::RunBufferCudaHelper(argc, argv);
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
