// Client test helpers shared by the host and GPU client tests: client processes are the test binary started again
// in a helper mode; they talk to the test with one-string messages over a Unix socket (memory_test_util.h).
#pragma once

#include <gtest/gtest.h>
#include <sys/types.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "epfabric/common/fd_passing.h"
#include "integration/fabric_under_test.h"
#include "memory_test_util.h"

namespace epfabric::testing {

inline constexpr absl::Duration kHelperMessageTimeout = absl::Seconds(30);

inline absl::Status Say(int fd, const std::string& text) {
  return common::SendFds(fd, {}, text, kHelperMessageTimeout);
}

inline absl::StatusOr<std::vector<std::string>> Hear(int fd, absl::Duration timeout = kHelperMessageTimeout) {
  auto message = common::ReceiveFds(fd, timeout);
  if (!message.ok()) return message.status();
  return std::vector<std::string>(absl::StrSplit(message->payload, ' '));
}

// A helper process holding one rank.
struct Helper {
  pid_t pid = -1;
  common::UniqueFd channel;
  int rank = -1;
  std::string lease_id;
  double attach_ms = 0;
};

// Starts this binary as a helper (`helper_flag` plus --mode, --socket of the rank's daemon, --group, --rank,
// --token, --parent, --ttl_ms and `extra` with "{rank}" replaced) for each of `ranks`, and waits until each said
// "attached <rank> <pid> <lease_id> <attach_ms>".
inline std::vector<Helper> StartHelpers(ChildChannel& parent, FabricUnderTest& fabric, const std::string& helper_flag,
                                        const std::string& mode, const std::string& group, const std::string& token,
                                        const std::vector<int>& ranks, int lease_ttl_ms = 0,
                                        const std::vector<std::string>& extra = {}) {
  std::map<pid_t, int> rank_of;
  for (int rank : ranks) {
    std::vector<std::string> args = {helper_flag,
                                     "--mode=" + mode,
                                     "--socket=" + fabric.daemon(rank).socket(),
                                     "--group=" + group,
                                     absl::StrCat("--rank=", rank),
                                     "--token=" + token,
                                     "--parent=" + parent.path(),
                                     absl::StrCat("--ttl_ms=", lease_ttl_ms)};
    for (const std::string& arg : extra) args.push_back(absl::StrReplaceAll(arg, {{"{rank}", absl::StrCat(rank)}}));
    auto pid = SpawnSelf(args);
    EXPECT_TRUE(pid.ok()) << pid.status();
    if (pid.ok()) rank_of[*pid] = rank;
  }
  std::vector<Helper> helpers;
  for (size_t i = 0; i < rank_of.size(); ++i) {
    auto connection = parent.Accept(absl::Seconds(30));
    EXPECT_TRUE(connection.ok()) << connection.status();
    if (!connection.ok()) break;
    Helper helper;
    helper.channel = std::move(*connection);
    auto said = Hear(helper.channel.get());
    EXPECT_TRUE(said.ok()) << said.status();
    if (!said.ok()) break;
    // "attached <rank> <pid> <lease_id> <attach_ms>" or "failed <status...>"
    EXPECT_EQ((*said)[0], "attached") << absl::StrJoin(*said, " ");
    if ((*said)[0] != "attached" || said->size() != 5) break;
    EXPECT_TRUE(absl::SimpleAtoi((*said)[1], &helper.rank));
    EXPECT_TRUE(absl::SimpleAtoi((*said)[2], &helper.pid));
    helper.lease_id = (*said)[3];
    EXPECT_TRUE(absl::SimpleAtod((*said)[4], &helper.attach_ms));
    EXPECT_EQ(rank_of.count(helper.pid), 1u);
    helpers.push_back(std::move(helper));
  }
  std::sort(helpers.begin(), helpers.end(), [](const Helper& a, const Helper& b) { return a.rank < b.rank; });
  return helpers;
}

}  // namespace epfabric::testing
