// The credential a daemon makes when none is named (daemon/security/host_secret.h): one 0600 file per host and
// fabric, the same secret for every daemon that starts, even all at once; a file others can read is refused.
#include "security/host_secret.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace epfabric::daemon::security {
namespace {

// A new directory, removed with everything in it when the test process exits.
std::string FreshDirectory() {
  static std::vector<std::string>* made = [] {
    static std::vector<std::string> directories;
    std::atexit([] {
      for (const std::string& directory : directories) std::filesystem::remove_all(directory);
    });
    return &directories;
  }();
  std::string pattern = (std::filesystem::temp_directory_path() / "epf-host-secret-XXXXXX").string();
  EXPECT_NE(::mkdtemp(pattern.data()), nullptr);
  made->push_back(pattern);
  return pattern;
}

TEST(HostFabricSecret, PathIsBesideTheSocketAndNamedByTheFabric) {
  EXPECT_EQ(HostFabricSecretPath("/run/epfabric/gpu0.sock", "prod"), "/run/epfabric/.prod.fabric-secret");
  const std::string odd = HostFabricSecretPath("/run/epfabric/gpu0.sock", "a/b c");
  EXPECT_EQ(odd.rfind("/run/epfabric/.", 0), 0u) << odd;
  EXPECT_EQ(odd.find("a/b"), std::string::npos) << odd;
}

TEST(HostFabricSecret, TheFirstDaemonCreatesA0600FileTheNextReadsIt) {
  const std::string path = FreshDirectory() + "/.f.fabric-secret";
  auto first = LoadOrCreateHostFabricSecret(path);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->created);
  EXPECT_EQ(first->secret.size(), 64u);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_uid, ::geteuid());
  auto second = LoadOrCreateHostFabricSecret(path);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_FALSE(second->created);
  EXPECT_EQ(second->secret, first->secret);
  // Nothing but the secret is left in the directory (no temporary files).
  int entries = 0;
  for ([[maybe_unused]] const auto& entry :
       std::filesystem::directory_iterator(std::filesystem::path(path).parent_path()))
    ++entries;
  EXPECT_EQ(entries, 1);
}

TEST(HostFabricSecret, DaemonsStartingTogetherAgreeOnOneSecret) {
  for (int trial = 0; trial < 20; ++trial) {
    const std::string path = FreshDirectory() + "/.f.fabric-secret";
    std::vector<std::string> secrets(8);
    std::vector<std::thread> threads;
    for (size_t i = 0; i < secrets.size(); ++i) {
      threads.emplace_back([&, i] {
        auto got = LoadOrCreateHostFabricSecret(path);
        secrets[i] = got.ok() ? got->secret : std::string(got.status().message());
      });
    }
    for (auto& thread : threads) thread.join();
    for (const std::string& secret : secrets) EXPECT_EQ(secret, secrets[0]) << "trial " << trial;
    EXPECT_EQ(secrets[0].size(), 64u) << secrets[0];
  }
}

TEST(HostFabricSecret, AFileOthersCanReadIsRefusedWithItsModeInOctal) {
  const std::string path = FreshDirectory() + "/.f.fabric-secret";
  std::ofstream(path) << "0123456789abcdef0123456789abcdef\n";
  ASSERT_EQ(::chmod(path.c_str(), 0644), 0);
  auto got = LoadOrCreateHostFabricSecret(path);
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("has mode 0644;"), std::string::npos) << got.status();
}

TEST(HostFabricSecret, ASymlinkIsNotFollowed) {
  const std::string directory = FreshDirectory();
  std::ofstream(directory + "/target") << "0123456789abcdef0123456789abcdef\n";
  ASSERT_EQ(::chmod((directory + "/target").c_str(), 0600), 0);
  ASSERT_EQ(::symlink((directory + "/target").c_str(), (directory + "/.f.fabric-secret").c_str()), 0);
  EXPECT_FALSE(LoadOrCreateHostFabricSecret(directory + "/.f.fabric-secret").ok());
}

}  // namespace
}  // namespace epfabric::daemon::security
