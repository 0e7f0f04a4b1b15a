// epf_create_group with a token buffer too small for the token (issue #34, Low): the old C ABI created the group and
// then failed, so the group existed with a token nobody had. Now the buffer is checked first and nothing is created.
// Only the C ABI and a real daemon in this process (libepfabric_client.so brings its own protobuf code, which must not
// meet the tree's in one process); the group list comes from epctl.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "epfabric/epfabric.h"
#include "integration/subprocess.h"

namespace epfabric::testing {
namespace {

using ::testing::HasSubstr;

TEST(CreateGroupAbi, ATooSmallTokenBufferCreatesNoGroup) {
  const std::string dir = MakeTempDir();
  const std::string socket = dir + "/d.sock";
  auto daemon = Subprocess::Start({EPF_DAEMON_BINARY, "--client_socket=" + socket, "--insecure_peer_port",
                                   "--backend=host", "--fabric_id=abi-test"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  epf_client* client = nullptr;
  epf_status connected = EPF_UNAVAILABLE;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline && daemon->running()) {
    struct stat st {};
    if (stat(socket.c_str(), &st) == 0 &&
        (connected = epf_client_connect(socket.c_str(), "abi", 5.0, &client)) == EPF_OK) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_EQ(connected, EPF_OK) << epf_last_error() << daemon->Stderr();
  const int32_t ranks[1] = {0};
  char token[8];
  epf_status created = EPF_OK;
  // The fabric of one completes within a moment of the socket's appearance: retry while it is not complete yet.
  for (int attempt = 0; attempt < 50; ++attempt) {
    created = epf_create_group(client, "small-buffer", ranks, 1, 1 << 20, 0, 0, token, sizeof(token));
    if (created != EPF_UNAVAILABLE && created != EPF_ABORTED) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(created, EPF_INVALID_ARGUMENT) << epf_last_error();
  EXPECT_THAT(epf_last_error(), HasSubstr("token_capacity"));
  // A buffer of the documented size works, so the group list below is not empty for a broken daemon.
  char enough[65];
  ASSERT_EQ(epf_create_group(client, "right-buffer", ranks, 1, 1 << 20, 0, 0, enough, sizeof(enough)), EPF_OK)
      << epf_last_error();
  epf_client_destroy(client);
  RunResult groups = RunBinary({EPF_EPCTL_BINARY, "--socket=" + socket, "groups", "--json"});
  ASSERT_EQ(groups.exit_code, 0) << groups.err;
  EXPECT_THAT(groups.out, HasSubstr("right-buffer"));
  EXPECT_THAT(groups.out, ::testing::Not(HasSubstr("small-buffer")));
  daemon->Signal(SIGTERM);
  (void)daemon->Wait(absl::Seconds(10));
}

}  // namespace
}  // namespace epfabric::testing
