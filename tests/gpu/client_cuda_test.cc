// libepfabric_client on the cuda backend: two real daemons (--backend=cuda), a 2-rank group per sharing mechanism
// (POSIX_FD: fds fetched from each owning daemon's fd side channel; CUDA_IPC: handles from Attach), and two client
// processes (this binary started again with --epf_client_cuda_helper), each on its rank's GPU: each writes a pattern
// into its own region, then reads every same-host rank's region through its own mapping (cudaMemcpy from the mapped
// device pointer) and checks it; then a client killed with SIGKILL must give its rank back at once. Rank r uses GPU
// r mod (visible GPUs) (gpu_placement.h): on one GPU both daemons run with --device=0 and each client maps the
// other daemon's region of the same GPU. Needs one GPU; skips cleanly without.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstring>
#include <iostream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "epfabric/client/client.h"
#include "gpu_env.h"
#include "integration/client_test_util.h"
#include "integration/fabric_under_test.h"

namespace epfabric::testing {
namespace {

constexpr uint64_t kRegionBytes = 8ull << 20;  // a multiple of the 2 MiB granularity: POSIX_FD maps it as is

std::vector<uint32_t> Pattern(uint64_t bytes, uint32_t seed) {
  std::vector<uint32_t> words(bytes / 4);
  for (uint64_t i = 0; i < words.size(); ++i) words[i] = PatternValue(i, seed);
  return words;
}

void RunGroup(v1::MemorySharing sharing) {
  EPF_REQUIRE_GPUS(1);
  auto placement = PlaceRanks(2);
  ASSERT_TRUE(placement.ok()) << placement.status();
  std::cout << "client_cuda_test: " << placement->ToString() << "\n";
  const std::string gpus_flag = absl::StrCat("--gpus=", placement->num_gpus);
  auto fabric = FabricUnderTest::Start(2, {"--heartbeat_ms=100", "--heartbeat_misses=5"},
                                       {{0, {"--backend=cuda", absl::StrCat("--device=", placement->device(0))}},
                                        {1, {"--backend=cuda", absl::StrCat("--device=", placement->device(1))}}});
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  ASSERT_TRUE((*fabric)->WaitComplete().ok());
  const std::string name = sharing == v1::MEMORY_SHARING_POSIX_FD ? "gpu-fd" : "gpu-ipc";
  v1::CreateGroupRequest request;
  request.set_name(name);
  request.add_ranks(0);
  request.add_ranks(1);
  request.set_num_nvl_bytes(kRegionBytes);
  request.set_memory_sharing(sharing);
  grpc::ClientContext context;
  v1::CreateGroupResponse group;
  const grpc::Status created = (*fabric)->Control(0)->CreateGroup(&context, request, &group);
  ASSERT_TRUE(created.ok()) << created.error_message();

  auto parent = ChildChannel::Listen();
  ASSERT_TRUE(parent.ok()) << parent.status();
  std::vector<Helper> helpers = StartHelpers(*parent, **fabric, "--epf_client_cuda_helper", "exchange", name,
                                             group.token(), {0, 1}, 0, {gpus_flag});
  ASSERT_EQ(helpers.size(), 2u);
  for (Helper& helper : helpers) ASSERT_TRUE(Say(helper.channel.get(), "check").ok());
  for (Helper& helper : helpers) {
    auto said = Hear(helper.channel.get());
    ASSERT_TRUE(said.ok()) << said.status();
    ASSERT_EQ(said->size(), 3u) << absl::StrJoin(*said, " ");
    EXPECT_EQ((*said)[0], "checked") << absl::StrJoin(*said, " ");
    EXPECT_EQ((*said)[1], "2") << "rank " << helper.rank << " mapped both ranks";
    EXPECT_EQ((*said)[2], "0") << "rank " << helper.rank << " saw both patterns";
  }
  for (Helper& helper : helpers) ASSERT_TRUE(Say(helper.channel.get(), "detach").ok());
  for (Helper& helper : helpers) {
    auto exit_code = WaitChild(helper.pid, absl::Seconds(60));
    EXPECT_TRUE(exit_code.ok() && *exit_code == 0) << "helper rank " << helper.rank;
  }
  // A client process killed with SIGKILL gives its rank back at once (default TTL 10 s; the side channel closed).
  std::vector<Helper> doomed =
      StartHelpers(*parent, **fabric, "--epf_client_cuda_helper", "exchange", name, group.token(), {0}, 0, {gpus_flag});
  ASSERT_EQ(doomed.size(), 1u);
  kill(doomed[0].pid, SIGKILL);
  ASSERT_TRUE(WaitChild(doomed[0].pid, absl::Seconds(10)).ok());
  std::vector<Helper> successor =
      StartHelpers(*parent, **fabric, "--epf_client_cuda_helper", "exchange", name, group.token(), {0}, 0, {gpus_flag});
  ASSERT_EQ(successor.size(), 1u) << "rank 0 attachable again after its client was killed";
  ASSERT_TRUE(Say(successor[0].channel.get(), "detach").ok());
  auto successor_exit = WaitChild(successor[0].pid, absl::Seconds(60));
  EXPECT_TRUE(successor_exit.ok() && *successor_exit == 0);

  std::cout << "[ ATTACH   ] " << v1::MemorySharing_Name(sharing)
            << ": fresh client process (CUDA context created before), connect + attach + map 2 regions of "
            << (kRegionBytes >> 20) << " MiB: rank 0 " << helpers[0].attach_ms << " ms, rank 1 " << helpers[1].attach_ms
            << " ms\n";
}

TEST(ClientCuda, PosixFdGroupTwoRanks) { RunGroup(v1::MEMORY_SHARING_POSIX_FD); }
TEST(ClientCuda, CudaIpcGroupTwoRanks) { RunGroup(v1::MEMORY_SHARING_CUDA_IPC); }

}  // namespace

// The client process: its GPU's context first (not part of the attach time; the GPU is rank mod --gpus, as its
// daemon's), then attach with that GPU as the accessing device, write its pattern, and on "check" read back every
// same-host rank's region.
int RunClientCudaHelper(int argc, char** argv) {
  auto parent = ConnectTo(FlagValue(argc, argv, "parent"));
  if (!parent.ok()) return 2;
  const int channel = parent->get();
  int rank = -1, gpus = 0;
  if (!absl::SimpleAtoi(FlagValue(argc, argv, "rank"), &rank) ||
      !absl::SimpleAtoi(FlagValue(argc, argv, "gpus"), &gpus) || gpus < 1) {
    (void)Say(channel, "failed bad-arguments");
    return 2;
  }
  const int device = GpuPlacement{.num_ranks = rank + 1, .num_gpus = gpus}.device(rank);
  if (cudaSetDevice(device) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) {
    (void)Say(channel, absl::StrCat("failed cuda-device-", device));
    return 1;
  }
  const absl::Time start = absl::Now();
  auto connected = client::Client::Connect(FlagValue(argc, argv, "socket"), {.client_name = "client_cuda_test"});
  if (!connected.ok()) {
    (void)Say(channel, absl::StrCat("failed ", connected.status().ToString()));
    return 1;
  }
  auto lease =
      (*connected)
          ->Attach(FlagValue(argc, argv, "group"), rank, FlagValue(argc, argv, "token"), {.accessing_device = device});
  const double attach_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  if (!lease.ok()) {
    (void)Say(channel, absl::StrCat("failed ", lease.status().ToString()));
    return 1;
  }
  const uint64_t bytes = (*lease)->region_bytes(rank);
  const std::vector<uint32_t> mine = Pattern(bytes, static_cast<uint32_t>(rank + 1));
  if (cudaMemcpy((*lease)->region(rank), mine.data(), bytes, cudaMemcpyHostToDevice) != cudaSuccess ||
      cudaDeviceSynchronize() != cudaSuccess) {
    (void)Say(channel, "failed writing-own-region");
    return 1;
  }
  if (!Say(channel, absl::StrCat("attached ", rank, " ", getpid(), " ", (*lease)->lease_id(), " ", attach_ms)).ok()) {
    return 1;
  }
  while (true) {
    auto said = Hear(channel, absl::Minutes(2));
    if (!said.ok()) return 1;
    if ((*said)[0] == "check") {
      uint64_t wrong = 0;
      int seen = 0;
      for (int peer : (*lease)->nvl_ranks()) {
        void* mapped = (*lease)->region(peer);
        if (mapped == nullptr) continue;
        ++seen;
        // Device to device through the mapping (NVLink for the peer), then back to the host to compare.
        void* local = nullptr;
        std::vector<uint32_t> seen_words((*lease)->region_bytes(peer) / 4);
        const uint64_t peer_bytes = seen_words.size() * 4;
        if (cudaMalloc(&local, peer_bytes) != cudaSuccess ||
            cudaMemcpy(local, mapped, peer_bytes, cudaMemcpyDeviceToDevice) != cudaSuccess ||
            cudaMemcpy(seen_words.data(), local, peer_bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
          (void)Say(channel, absl::StrCat("failed copying-rank-", peer, " ", cudaGetErrorString(cudaGetLastError())));
          return 1;
        }
        cudaFree(local);
        const std::vector<uint32_t> expected = Pattern(peer_bytes, static_cast<uint32_t>(peer + 1));
        for (uint64_t i = 0; i < expected.size(); ++i) wrong += seen_words[i] != expected[i];
      }
      if (!Say(channel, absl::StrCat("checked ", seen, " ", wrong)).ok()) return 1;
    } else if ((*said)[0] == "detach") {
      return (*lease)->Detach().ok() ? 0 : 1;
    }
  }
}

}  // namespace epfabric::testing

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--epf_client_cuda_helper") == 0) {
      return epfabric::testing::RunClientCudaHelper(argc, argv);
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
