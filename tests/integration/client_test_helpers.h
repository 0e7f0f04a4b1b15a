// Helpers of client_integration_test (client_test.cc, fd_channel_test.cc, isolation_test.cc): groups, leases and
// region patterns, and the daemons' fd side channel spoken directly.
#pragma once

#include <sys/types.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "epfabric/client/client.h"
#include "epfabric/common/fd_passing.h"
#include "epfabric/v1/fdchannel.pb.h"
#include "integration/fabric_under_test.h"
#include "memory_test_util.h"

namespace epfabric::testing {

using ::testing::HasSubstr;

inline const std::vector<std::string> kFast = {"--heartbeat_ms=100", "--heartbeat_misses=3"};
inline constexpr uint64_t kRegionBytes = 1 << 20;

inline absl::StatusOr<v1::CreateGroupResponse> CreateGroup(FabricUnderTest& fabric, const std::string& name,
                                                           std::vector<int> ranks, uint64_t rdma_bytes = 0) {
  v1::CreateGroupRequest request;
  request.set_name(name);
  for (int r : ranks) request.add_ranks(r);
  request.set_num_nvl_bytes(kRegionBytes);
  request.set_num_rdma_bytes(rdma_bytes);
  grpc::ClientContext context;
  v1::CreateGroupResponse response;
  const grpc::Status status = fabric.Control(0)->CreateGroup(&context, request, &response);
  if (!status.ok()) return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  return response;
}

inline uint32_t* Words(void* region) { return static_cast<uint32_t*>(region); }

inline void WritePattern(void* region, uint64_t bytes, uint32_t seed) {
  for (uint64_t i = 0; i < bytes / 4; ++i) Words(region)[i] = PatternValue(i, seed);
}

// Words that differ from the pattern (from `expected_zero`: words that are not zero).
inline uint64_t Mismatches(const void* region, uint64_t bytes, uint32_t seed, bool expected_zero = false) {
  uint64_t wrong = 0;
  const uint32_t* words = static_cast<const uint32_t*>(region);
  for (uint64_t i = 0; i < bytes / 4; ++i) wrong += words[i] != (expected_zero ? 0u : PatternValue(i, seed));
  return wrong;
}

inline absl::StatusOr<std::unique_ptr<client::Lease>> AttachVia(const std::string& socket, const std::string& group,
                                                                int rank, const std::string& token,
                                                                client::AttachOptions options = {}) {
  auto connected = client::Client::Connect(socket, {.client_name = "client_test"});
  if (!connected.ok()) return connected.status();
  return (*connected)->Attach(group, rank, token, options);
}

// ---- the fd side channel, spoken directly ----

struct RawAnswer {
  v1::FdResponse response;
  std::vector<common::UniqueFd> fds;
};

inline absl::StatusOr<RawAnswer> Ask(int connection, const v1::FdRequest& request) {
  if (absl::Status sent = common::SendFds(connection, {}, request.SerializeAsString(), absl::Seconds(5)); !sent.ok()) {
    return sent;
  }
  auto message = common::ReceiveFds(connection, absl::Seconds(5));
  if (!message.ok()) return message.status();
  RawAnswer answer;
  if (!answer.response.ParseFromString(message->payload)) return absl::InternalError("not an FdResponse");
  answer.fds = std::move(message->fds);
  return answer;
}

inline int OpenFdCount(pid_t pid) {
  std::error_code ec;
  int count = 0;
  for (auto it = std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"), ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++count;
  }
  return count;
}

// Polls `condition` every 5 ms for up to `timeout`.
template <typename Condition>
inline bool Eventually(Condition condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

inline double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0 : values[values.size() / 2];
}

// Helper modes of the test binary (main in client_test.cc): a client process (client_test.cc) and the probe run as
// another uid (isolation_test.cc).
int RunClientHelper(int argc, char** argv);
int RunNoTokenProbe(int argc, char** argv);

}  // namespace epfabric::testing
