// Host backend regions (POSIX shared memory) and their import by another process through client/memory.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "epfabric/common/fd_passing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "memory/region.h"
#include "memory/region_import.h"
#include "memory_test_util.h"

namespace epfabric {
namespace {

using daemon::memory::MakeHostAllocator;
using daemon::memory::Region;
using daemon::memory::RegionAllocator;
using daemon::memory::RegionSpec;
using ::testing::HasSubstr;

// Unique per test process: /dev/shm is shared with everything else on the machine.
std::string TestPrefix() { return absl::StrCat("epftest", getpid()); }

RegionSpec Spec(uint64_t bytes, int rank = 0, v1::RegionDescriptor::Kind kind = v1::RegionDescriptor::KIND_NVL) {
  RegionSpec spec;
  spec.group = "tenant-a.1";
  spec.rank = rank;
  spec.bytes = bytes;
  spec.kind = kind;
  return spec;
}

bool ShmExists(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  close(fd);
  return true;
}

void FillPattern(void* base, uint64_t bytes, uint32_t seed) {
  auto* words = static_cast<uint32_t*>(base);
  for (uint64_t i = 0; i < bytes / 4; ++i) words[i] = testing::PatternValue(i, seed);
}

uint64_t CountMismatches(const void* base, uint64_t bytes, uint32_t seed) {
  const auto* words = static_cast<const uint32_t*>(base);
  uint64_t mismatches = 0;
  for (uint64_t i = 0; i < bytes / 4; ++i) mismatches += words[i] != testing::PatternValue(i, seed) ? 1 : 0;
  return mismatches;
}

TEST(HostRegionTest, AllocateDescribesAZeroedRegion) {
  std::unique_ptr<RegionAllocator> allocator = MakeHostAllocator(TestPrefix(), 0);
  EXPECT_EQ(allocator->backend(), v1::BACKEND_HOST);
  absl::StatusOr<std::unique_ptr<Region>> region =
      allocator->Allocate(Spec(1 << 20, 3, v1::RegionDescriptor::KIND_RDMA));
  ASSERT_TRUE(region.ok()) << region.status();
  const v1::RegionDescriptor& descriptor = (*region)->descriptor();
  EXPECT_EQ(descriptor.rank(), 3);
  EXPECT_EQ(descriptor.sharing(), v1::MEMORY_SHARING_POSIX_SHM);
  EXPECT_EQ(descriptor.size_bytes(), 1u << 20);
  EXPECT_EQ(descriptor.shm_name(), absl::StrCat("/", TestPrefix(), ".tenant-a.1.3.rdma"));
  EXPECT_EQ(descriptor.device(), -1);
  EXPECT_EQ(descriptor.kind(), v1::RegionDescriptor::KIND_RDMA);
  EXPECT_TRUE(descriptor.handle().empty());
  EXPECT_EQ((*region)->shareable_fd(), -1);
  const auto* bytes = static_cast<const unsigned char*>((*region)->base());
  for (uint64_t i = 0; i < descriptor.size_bytes(); ++i) ASSERT_EQ(bytes[i], 0) << "byte " << i;

  // Exactly 0660 whatever the umask.
  const int fd = shm_open(descriptor.shm_name().c_str(), O_RDONLY, 0);
  ASSERT_GE(fd, 0);
  struct stat info {};
  ASSERT_EQ(fstat(fd, &info), 0);
  close(fd);
  EXPECT_EQ(info.st_mode & 0777, 0660u);
  EXPECT_EQ(static_cast<uint64_t>(info.st_size), descriptor.size_bytes());
}

TEST(HostRegionTest, AnotherProcessMapsAndWrites) {
  std::unique_ptr<RegionAllocator> allocator = MakeHostAllocator(TestPrefix(), 0);
  constexpr uint64_t kBytes = (8 << 20) + 4096;
  absl::StatusOr<std::unique_ptr<Region>> region = allocator->Allocate(Spec(kBytes));
  ASSERT_TRUE(region.ok()) << region.status();
  FillPattern((*region)->base(), kBytes, 1);

  absl::StatusOr<testing::ChildChannel> channel = testing::ChildChannel::Listen();
  ASSERT_TRUE(channel.ok()) << channel.status();
  absl::StatusOr<pid_t> child = testing::SpawnSelf(
      {"--epf_host_import_helper", "--socket=" + channel->path(), "--seed_read=1", "--seed_write=2"});
  ASSERT_TRUE(child.ok()) << child.status();
  absl::StatusOr<common::UniqueFd> connection = channel->Accept(absl::Seconds(20));
  ASSERT_TRUE(connection.ok()) << connection.status();
  absl::StatusOr<common::PeerCredentials> peer = common::GetPeerCredentials(connection->get());
  ASSERT_TRUE(peer.ok()) << peer.status();
  if (testing::ChildWrapper().empty()) EXPECT_EQ(peer->pid, *child);
  EXPECT_EQ(peer->uid, getuid());
  ASSERT_TRUE(
      common::SendFds(connection->get(), {}, (*region)->descriptor().SerializeAsString(), absl::Seconds(5)).ok());
  absl::StatusOr<common::ReceivedFds> result = common::ReceiveFds(connection->get(), absl::Seconds(20));
  absl::StatusOr<int> exit_code = testing::WaitChild(*child, absl::Seconds(20));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->payload, "ok");
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
  // Every element the child wrote, seen through the daemon's own mapping.
  EXPECT_EQ(CountMismatches((*region)->base(), kBytes, 2), 0u);
}

TEST(HostRegionTest, OverTheLimitIsResourceExhaustedNamingBothSizes) {
  std::unique_ptr<RegionAllocator> allocator = MakeHostAllocator(TestPrefix(), 4096);
  absl::StatusOr<std::unique_ptr<Region>> region = allocator->Allocate(Spec(4097));
  EXPECT_TRUE(absl::IsResourceExhausted(region.status())) << region.status();
  EXPECT_THAT(region.status().message(), HasSubstr("4097"));
  EXPECT_THAT(region.status().message(), HasSubstr("4096"));
  EXPECT_FALSE(ShmExists(absl::StrCat("/", TestPrefix(), ".tenant-a.1.0.nvl")));
  EXPECT_TRUE(allocator->Allocate(Spec(4096)).ok());
}

TEST(HostRegionTest, DestructionUnlinksButAClientMappingSurvives) {
  std::unique_ptr<RegionAllocator> allocator = MakeHostAllocator(TestPrefix(), 0);
  absl::StatusOr<std::unique_ptr<Region>> region = allocator->Allocate(Spec(65536));
  ASSERT_TRUE(region.ok()) << region.status();
  const v1::RegionDescriptor descriptor = (*region)->descriptor();
  ASSERT_TRUE(ShmExists(descriptor.shm_name()));
  absl::StatusOr<client::memory::MappedRegion> mapped = client::memory::ImportRegion(descriptor);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  static_cast<char*>((*region)->base())[100] = 42;

  region->reset();
  EXPECT_FALSE(ShmExists(descriptor.shm_name()));
  EXPECT_EQ(static_cast<char*>(mapped->data())[100], 42);  // the pages live until the last mapping goes
  absl::StatusOr<client::memory::MappedRegion> late = client::memory::ImportRegion(descriptor);
  EXPECT_TRUE(absl::IsNotFound(late.status())) << late.status();
  EXPECT_TRUE(mapped->Unmap().ok());
  EXPECT_EQ(mapped->data(), nullptr);
  EXPECT_TRUE(mapped->Unmap().ok());  // idempotent
}

TEST(HostRegionTest, StaleObjectFromACrashedDaemonIsReplaced) {
  const std::string name = absl::StrCat("/", TestPrefix(), ".tenant-a.1.5.nvl");
  // What a crashed daemon leaves: an object of the name, with old data in it.
  const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 8192), 0);
  ASSERT_EQ(pwrite(fd, "stale", 5, 0), 5);
  close(fd);

  std::unique_ptr<RegionAllocator> allocator = MakeHostAllocator(TestPrefix(), 0);
  absl::StatusOr<std::unique_ptr<Region>> region = allocator->Allocate(Spec(4096, 5));
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ((*region)->descriptor().shm_name(), name);
  EXPECT_EQ(std::memcmp((*region)->base(), "\0\0\0\0\0", 5), 0);  // a fresh object, not the stale one
}

TEST(HostRegionTest, ALiveRegionIsNotReplaced) {
  std::unique_ptr<RegionAllocator> allocator = MakeHostAllocator(TestPrefix(), 0);
  absl::StatusOr<std::unique_ptr<Region>> first = allocator->Allocate(Spec(4096, 6));
  ASSERT_TRUE(first.ok()) << first.status();
  static_cast<char*>((*first)->base())[0] = 7;
  absl::StatusOr<std::unique_ptr<Region>> second = allocator->Allocate(Spec(4096, 6));
  EXPECT_TRUE(absl::IsAlreadyExists(second.status())) << second.status();
  EXPECT_TRUE(ShmExists((*first)->descriptor().shm_name()));
  EXPECT_EQ(static_cast<char*>((*first)->base())[0], 7);
  first->reset();
  EXPECT_TRUE(allocator->Allocate(Spec(4096, 6)).ok());  // free again once the first is gone
}

TEST(HostRegionTest, ZeroClearsExactlyTheRange) {
  std::unique_ptr<RegionAllocator> allocator = MakeHostAllocator(TestPrefix(), 0);
  absl::StatusOr<std::unique_ptr<Region>> region = allocator->Allocate(Spec(8192));
  ASSERT_TRUE(region.ok()) << region.status();
  auto* bytes = static_cast<unsigned char*>((*region)->base());
  std::memset(bytes, 0xAB, 8192);
  ASSERT_TRUE((*region)->Zero(1000, 3000).ok());
  for (int i = 0; i < 8192; ++i) ASSERT_EQ(bytes[i], (i >= 1000 && i < 4000) ? 0 : 0xAB) << "byte " << i;
  EXPECT_TRUE((*region)->Zero(8192, 0).ok());
  EXPECT_TRUE(absl::IsInvalidArgument((*region)->Zero(8000, 193)));
  EXPECT_TRUE(absl::IsInvalidArgument((*region)->Zero(1, UINT64_MAX)));  // no wrap-around
  EXPECT_TRUE(absl::IsInvalidArgument((*region)->Zero(8193, 0)));
}

TEST(HostRegionTest, BadSpecsAreInvalidArgument) {
  std::unique_ptr<RegionAllocator> allocator = MakeHostAllocator(TestPrefix(), 0);
  RegionSpec spec = Spec(4096);
  spec.group = "bad/name";
  EXPECT_THAT(allocator->Allocate(spec).status().message(), HasSubstr("RegionSpec.group 'bad/name'"));
  spec.group = std::string(65, 'g');
  EXPECT_TRUE(absl::IsInvalidArgument(allocator->Allocate(spec).status()));
  spec = Spec(0);
  EXPECT_THAT(allocator->Allocate(spec).status().message(), HasSubstr("RegionSpec.bytes"));
  spec = Spec(4096, -1);
  EXPECT_TRUE(absl::IsInvalidArgument(allocator->Allocate(spec).status()));
  spec = Spec(4096);
  spec.kind = v1::RegionDescriptor::KIND_UNSPECIFIED;
  EXPECT_TRUE(absl::IsInvalidArgument(allocator->Allocate(spec).status()));
  spec = Spec(4096);
  spec.sharing = v1::MEMORY_SHARING_CUDA_IPC;
  EXPECT_THAT(allocator->Allocate(spec).status().message(), HasSubstr("MEMORY_SHARING_CUDA_IPC"));
  EXPECT_TRUE(absl::IsInvalidArgument(MakeHostAllocator("bad prefix", 0)->Allocate(Spec(4096)).status()));
}

TEST(HostRegionTest, ImportRefusesDescriptorsThatDoNotHoldTogether) {
  std::unique_ptr<RegionAllocator> allocator = MakeHostAllocator(TestPrefix(), 0);
  absl::StatusOr<std::unique_ptr<Region>> region = allocator->Allocate(Spec(4096));
  ASSERT_TRUE(region.ok()) << region.status();
  v1::RegionDescriptor descriptor = (*region)->descriptor();
  descriptor.set_size_bytes(8192);  // larger than the object
  EXPECT_TRUE(absl::IsInvalidArgument(client::memory::ImportRegion(descriptor).status()));
  descriptor = (*region)->descriptor();
  descriptor.set_shm_name("../etc/passwd");
  EXPECT_TRUE(absl::IsInvalidArgument(client::memory::ImportRegion(descriptor).status()));
  descriptor = (*region)->descriptor();
  descriptor.set_sharing(v1::MEMORY_SHARING_UNSPECIFIED);
  EXPECT_TRUE(absl::IsInvalidArgument(client::memory::ImportRegion(descriptor).status()));
  descriptor = (*region)->descriptor();
  descriptor.set_sharing(v1::MEMORY_SHARING_POSIX_FD);  // cuda sharing needs an fd (and a GPU)
  EXPECT_FALSE(client::memory::ImportRegion(descriptor).ok());
}

// Helper mode: receives a descriptor over the socket, maps the region, checks the parent's pattern, writes its own.
int RunHostImportHelper(int argc, char** argv) {
  uint32_t seed_read = 0;
  uint32_t seed_write = 0;
  if (!absl::SimpleAtoi(testing::FlagValue(argc, argv, "seed_read"), &seed_read) ||
      !absl::SimpleAtoi(testing::FlagValue(argc, argv, "seed_write"), &seed_write)) {
    return 2;
  }
  absl::StatusOr<common::UniqueFd> connection = testing::ConnectTo(testing::FlagValue(argc, argv, "socket"));
  if (!connection.ok()) return 3;
  auto reply = [&](const std::string& text, int code) {
    (void)common::SendFds(connection->get(), {}, text, absl::Seconds(5));
    return code;
  };
  absl::StatusOr<common::ReceivedFds> message = common::ReceiveFds(connection->get(), absl::Seconds(20));
  if (!message.ok()) return reply(message.status().ToString(), 4);
  v1::RegionDescriptor descriptor;
  if (!descriptor.ParseFromString(message->payload)) return reply("bad descriptor", 5);
  absl::StatusOr<client::memory::MappedRegion> mapped = client::memory::ImportRegion(descriptor);
  if (!mapped.ok()) return reply(mapped.status().ToString(), 6);
  if (const uint64_t bad = CountMismatches(mapped->data(), mapped->size(), seed_read); bad != 0) {
    return reply(absl::StrCat(bad, " elements differ from the owner's pattern"), 7);
  }
  FillPattern(mapped->data(), mapped->size(), seed_write);
  if (absl::Status unmapped = mapped->Unmap(); !unmapped.ok()) return reply(unmapped.ToString(), 8);
  return reply("ok", 0);
}

}  // namespace
}  // namespace epfabric

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--epf_host_import_helper") == 0) return epfabric::RunHostImportHelper(argc, argv);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
