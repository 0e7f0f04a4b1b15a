// Host backend regions (sealed memfds) and their import, from the fd, by another process through client/memory.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

#include "absl/strings/match.h"
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

// Unique per test process, so that the memfd labels found in /proc/self/fd are this test's.
std::string TestPrefix() { return absl::StrCat("epftest", getpid()); }

RegionSpec Spec(uint64_t bytes, int rank = 0, v1::RegionDescriptor::Kind kind = v1::RegionDescriptor::KIND_NVL) {
  RegionSpec spec;
  spec.group = "tenant-a.1";
  spec.rank = rank;
  spec.bytes = bytes;
  spec.kind = kind;
  return spec;
}

// What /proc/self/fd/<fd> points to ("/memfd:<label> (deleted)" for a memfd), or "" when it is not open.
std::string FdTarget(int fd) {
  std::error_code ec;
  const std::filesystem::path target = std::filesystem::read_symlink(absl::StrCat("/proc/self/fd/", fd), ec);
  return ec ? std::string() : target.string();
}

// Open descriptors of this process that are memfds whose label starts with `label`.
int OpenMemfds(const std::string& label) {
  int count = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    std::error_code link_ec;
    const std::string target = std::filesystem::read_symlink(entry.path(), link_ec).string();
    if (!link_ec && absl::StartsWith(target, "/memfd:" + label)) ++count;
  }
  return count;
}

// Entries of /dev/shm whose name contains `text`.
int ShmEntriesContaining(const std::string& text) {
  int count = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    if (absl::StrContains(entry.path().filename().string(), text)) ++count;
  }
  return count;
}

// A duplicate of the region's fd, as a client receives it over SCM_RIGHTS (its own open file, same memory).
common::UniqueFd DuplicateFd(const Region& region) {
  return common::UniqueFd(fcntl(region.shareable_fd(), F_DUPFD_CLOEXEC, 0));
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

TEST(HostRegionTest, AllocateDescribesAZeroedSealedMemfdWithNoName) {
  std::unique_ptr<RegionAllocator> allocator = MakeHostAllocator(TestPrefix(), 0);
  EXPECT_EQ(allocator->backend(), v1::BACKEND_HOST);
  absl::StatusOr<std::unique_ptr<Region>> region =
      allocator->Allocate(Spec(1 << 20, 3, v1::RegionDescriptor::KIND_RDMA));
  ASSERT_TRUE(region.ok()) << region.status();
  const v1::RegionDescriptor& descriptor = (*region)->descriptor();
  EXPECT_EQ(descriptor.rank(), 3);
  EXPECT_EQ(descriptor.sharing(), v1::MEMORY_SHARING_POSIX_SHM);
  EXPECT_EQ(descriptor.size_bytes(), 1u << 20);
  EXPECT_EQ(descriptor.device(), -1);
  EXPECT_EQ(descriptor.kind(), v1::RegionDescriptor::KIND_RDMA);
  EXPECT_TRUE(descriptor.handle().empty());
  const auto* bytes = static_cast<const unsigned char*>((*region)->base());
  for (uint64_t i = 0; i < descriptor.size_bytes(); ++i) ASSERT_EQ(bytes[i], 0) << "byte " << i;

  // The region is a memfd held by the Region, labelled for debugging, close-on-exec, of exactly the size, sealed.
  const int fd = (*region)->shareable_fd();
  ASSERT_GE(fd, 0);
  EXPECT_EQ(FdTarget(fd), absl::StrCat("/memfd:epf.", TestPrefix(), ".tenant-a.1.3.rdma (deleted)"));
  EXPECT_EQ(fcntl(fd, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  struct stat info {};
  ASSERT_EQ(fstat(fd, &info), 0);
  EXPECT_EQ(static_cast<uint64_t>(info.st_size), descriptor.size_bytes());
  EXPECT_GE(static_cast<uint64_t>(info.st_blocks) * 512, descriptor.size_bytes()) << "pages reserved up front";
  EXPECT_EQ(fcntl(fd, F_GET_SEALS), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  // Nothing anybody could open by name.
  EXPECT_EQ(ShmEntriesContaining(TestPrefix()), 0);
}

TEST(HostRegionTest, SealsStopAHolderOfTheFdFromResizingOrResealingIt) {
  std::unique_ptr<RegionAllocator> allocator = MakeHostAllocator(TestPrefix(), 0);
  absl::StatusOr<std::unique_ptr<Region>> region = allocator->Allocate(Spec(65536));
  ASSERT_TRUE(region.ok()) << region.status();
  common::UniqueFd client_fd = DuplicateFd(**region);
  ASSERT_TRUE(client_fd.valid());
  // Shrinking would make every other mapping (the daemon's included) SIGBUS on the lost pages.
  errno = 0;
  EXPECT_NE(ftruncate(client_fd.get(), 4096), 0);
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_NE(ftruncate(client_fd.get(), 0), 0);
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_NE(ftruncate(client_fd.get(), 1 << 20), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(posix_fallocate(client_fd.get(), 0, 1 << 20), 0);
  // No further seals: a FUTURE_WRITE seal would stop later clients from mapping it writable.
  errno = 0;
  EXPECT_NE(fcntl(client_fd.get(), F_ADD_SEALS, F_SEAL_FUTURE_WRITE), 0);
  EXPECT_EQ(errno, EPERM);
  // Re-opened through /proc (a new open file of the same memory): the seals belong to the memory, not the fd.
  const int reopened = open(absl::StrCat("/proc/self/fd/", client_fd.get()).c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(reopened, 0);
  common::UniqueFd reopened_fd(reopened);
  errno = 0;
  EXPECT_NE(ftruncate(reopened_fd.get(), 0), 0);
  EXPECT_EQ(errno, EPERM);
  struct stat info {};
  ASSERT_EQ(fstat((*region)->shareable_fd(), &info), 0);
  EXPECT_EQ(info.st_size, 65536);
  static_cast<char*>((*region)->base())[65535] = 1;  // still all there
}

TEST(HostRegionTest, TheFdMapsAndSeesTheDaemonsWrites) {
  std::unique_ptr<RegionAllocator> allocator = MakeHostAllocator(TestPrefix(), 0);
  constexpr uint64_t kBytes = (1 << 20) + 4096;
  absl::StatusOr<std::unique_ptr<Region>> region = allocator->Allocate(Spec(kBytes));
  ASSERT_TRUE(region.ok()) << region.status();
  common::UniqueFd client_fd = DuplicateFd(**region);
  absl::StatusOr<client::memory::MappedRegion> mapped =
      client::memory::ImportRegion((*region)->descriptor(), client_fd.get());
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  client_fd.reset();  // borrowed: the mapping does not need it
  EXPECT_EQ(mapped->size(), kBytes);
  EXPECT_EQ(mapped->sharing(), v1::MEMORY_SHARING_POSIX_SHM);
  EXPECT_EQ(mapped->device(), -1);
  EXPECT_NE(mapped->data(), (*region)->base());  // a mapping of its own
  FillPattern((*region)->base(), kBytes, 11);
  EXPECT_EQ(CountMismatches(mapped->data(), kBytes, 11), 0u);
  FillPattern(mapped->data(), kBytes, 12);
  EXPECT_EQ(CountMismatches((*region)->base(), kBytes, 12), 0u);
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
  ASSERT_TRUE(common::SendFds(connection->get(), {(*region)->shareable_fd()},
                              (*region)->descriptor().SerializeAsString(), absl::Seconds(5))
                  .ok());
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
  const std::string label = absl::StrCat("epf.", TestPrefix(), ".");
  absl::StatusOr<std::unique_ptr<Region>> region = allocator->Allocate(Spec(4097));
  EXPECT_TRUE(absl::IsResourceExhausted(region.status())) << region.status();
  EXPECT_THAT(region.status().message(), HasSubstr("4097"));
  EXPECT_THAT(region.status().message(), HasSubstr("4096"));
  EXPECT_EQ(OpenMemfds(label), 0);
  EXPECT_TRUE(allocator->Allocate(Spec(4096)).ok());
}

TEST(HostRegionTest, DestructionFreesTheMemfdButAClientMappingSurvives) {
  std::unique_ptr<RegionAllocator> allocator = MakeHostAllocator(TestPrefix(), 0);
  const std::string label = absl::StrCat("epf.", TestPrefix(), ".tenant-a.1.4.nvl");
  ASSERT_EQ(OpenMemfds(label), 0);
  absl::StatusOr<std::unique_ptr<Region>> region = allocator->Allocate(Spec(65536, 4));
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ(OpenMemfds(label), 1);
  absl::StatusOr<client::memory::MappedRegion> mapped;
  {
    common::UniqueFd client_fd = DuplicateFd(**region);
    mapped = client::memory::ImportRegion((*region)->descriptor(), client_fd.get());
    ASSERT_TRUE(mapped.ok()) << mapped.status();
  }
  static_cast<char*>((*region)->base())[100] = 42;

  region->reset();
  EXPECT_EQ(OpenMemfds(label), 0) << "the Region's fd is closed";
  EXPECT_EQ(static_cast<char*>(mapped->data())[100], 42);  // the pages live until the last mapping goes
  EXPECT_TRUE(mapped->Unmap().ok());
  EXPECT_EQ(mapped->data(), nullptr);
  EXPECT_TRUE(mapped->Unmap().ok());  // idempotent
}

// Two daemons with the same fabric id, rank and group (the collision of issue #13) get distinct memory: a label is
// not an identity.
TEST(HostRegionTest, SameLabelsGiveIndependentRegions) {
  std::unique_ptr<RegionAllocator> first_daemon = MakeHostAllocator(TestPrefix(), 0);
  std::unique_ptr<RegionAllocator> second_daemon = MakeHostAllocator(TestPrefix(), 0);
  absl::StatusOr<std::unique_ptr<Region>> first = first_daemon->Allocate(Spec(4096, 6));
  ASSERT_TRUE(first.ok()) << first.status();
  static_cast<char*>((*first)->base())[0] = 7;
  absl::StatusOr<std::unique_ptr<Region>> second = second_daemon->Allocate(Spec(4096, 6));
  ASSERT_TRUE(second.ok()) << second.status();
  absl::StatusOr<std::unique_ptr<Region>> again = first_daemon->Allocate(Spec(4096, 6));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(static_cast<char*>((*second)->base())[0], 0);
  EXPECT_EQ(static_cast<char*>((*again)->base())[0], 0);
  static_cast<char*>((*second)->base())[0] = 9;
  EXPECT_EQ(static_cast<char*>((*first)->base())[0], 7);
  EXPECT_EQ(OpenMemfds(absl::StrCat("epf.", TestPrefix(), ".tenant-a.1.6.nvl")), 3);
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

// A range with whole pages inside: every mapping reads zeros exactly there, the memfd keeps its size and its reserved
// pages (a hole would be a SIGBUS risk later), and the pages take writes again afterwards.
TEST(HostRegionTest, ZeroReleasesTheWholePagesAndEveryMappingSeesZeros) {
  std::unique_ptr<RegionAllocator> allocator = MakeHostAllocator(TestPrefix(), 0);
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t size = 6 * page;
  absl::StatusOr<std::unique_ptr<Region>> region = allocator->Allocate(Spec(size));
  ASSERT_TRUE(region.ok()) << region.status();
  common::UniqueFd client_fd = DuplicateFd(**region);
  absl::StatusOr<client::memory::MappedRegion> mapped =
      client::memory::ImportRegion((*region)->descriptor(), client_fd.get());
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  auto* daemon_view = static_cast<unsigned char*>((*region)->base());
  auto* client_view = static_cast<unsigned char*>(mapped->data());
  std::memset(client_view, 0xCD, size);
  struct stat before {};
  ASSERT_EQ(fstat(client_fd.get(), &before), 0);
  const uint64_t begin = page / 2, end = 5 * page - 7;  // pages 1-3 whole, 0 and 4 partly
  ASSERT_TRUE((*region)->Zero(begin, end - begin).ok());
  struct stat after {};
  ASSERT_EQ(fstat(client_fd.get(), &after), 0);
  EXPECT_EQ(after.st_blocks, before.st_blocks) << "the zeroed pages are no longer reserved";
  EXPECT_EQ(after.st_size, static_cast<off_t>(size));
  for (uint64_t i = 0; i < size; ++i) {
    const unsigned char want = (i >= begin && i < end) ? 0 : 0xCD;
    ASSERT_EQ(daemon_view[i], want) << "daemon's mapping, byte " << i;
    ASSERT_EQ(client_view[i], want) << "client's mapping, byte " << i;
  }
  std::memset(client_view + 2 * page, 0x5A, page);
  EXPECT_EQ(daemon_view[2 * page + 17], 0x5A);
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
  // The prefix is only a label now: any fabric id works, odd characters are replaced in the memfd's name.
  absl::StatusOr<std::unique_ptr<Region>> odd = MakeHostAllocator("odd prefix/x", 0)->Allocate(Spec(4096));
  ASSERT_TRUE(odd.ok()) << odd.status();
  EXPECT_EQ(FdTarget((*odd)->shareable_fd()), "/memfd:epf.odd_prefix_x.tenant-a.1.0.nvl (deleted)");
}

TEST(HostRegionTest, ImportRefusesDescriptorsAndFdsThatDoNotHoldTogether) {
  std::unique_ptr<RegionAllocator> allocator = MakeHostAllocator(TestPrefix(), 0);
  absl::StatusOr<std::unique_ptr<Region>> region = allocator->Allocate(Spec(4096));
  ASSERT_TRUE(region.ok()) << region.status();
  const int fd = (*region)->shareable_fd();
  v1::RegionDescriptor descriptor = (*region)->descriptor();
  descriptor.set_size_bytes(8192);  // larger than the memory
  EXPECT_TRUE(absl::IsInvalidArgument(client::memory::ImportRegion(descriptor, fd).status()));
  descriptor = (*region)->descriptor();
  absl::Status no_fd = client::memory::ImportRegion(descriptor).status();  // host memory comes only as an fd
  EXPECT_TRUE(absl::IsInvalidArgument(no_fd)) << no_fd;
  EXPECT_THAT(no_fd.message(), HasSubstr("no file descriptor"));
  descriptor.set_sharing(v1::MEMORY_SHARING_UNSPECIFIED);
  EXPECT_TRUE(absl::IsInvalidArgument(client::memory::ImportRegion(descriptor, fd).status()));
  descriptor = (*region)->descriptor();
  descriptor.set_sharing(v1::MEMORY_SHARING_POSIX_FD);  // cuda sharing needs a GPU
  EXPECT_FALSE(client::memory::ImportRegion(descriptor, fd).ok());

  // Memory that could shrink under the mapping is refused: an unsealed memfd, a plain file (no seals at all).
  descriptor = (*region)->descriptor();
  common::UniqueFd unsealed(memfd_create("epftest-unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_TRUE(unsealed.valid());
  ASSERT_EQ(ftruncate(unsealed.get(), 4096), 0);
  absl::Status refused = client::memory::ImportRegion(descriptor, unsealed.get()).status();
  EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("not sealed against shrinking"));
  ASSERT_EQ(fcntl(unsealed.get(), F_ADD_SEALS, F_SEAL_SHRINK), 0);  // shrink sealed, but seals could still change
  EXPECT_TRUE(absl::IsInvalidArgument(client::memory::ImportRegion(descriptor, unsealed.get()).status()));
  ASSERT_EQ(fcntl(unsealed.get(), F_ADD_SEALS, F_SEAL_SEAL), 0);
  EXPECT_TRUE(client::memory::ImportRegion(descriptor, unsealed.get()).ok());
  char path[] = "/tmp/epftest-host-import-XXXXXX";
  common::UniqueFd file(mkstemp(path));
  ASSERT_TRUE(file.valid());
  unlink(path);
  ASSERT_EQ(ftruncate(file.get(), 4096), 0);
  EXPECT_TRUE(absl::IsInvalidArgument(client::memory::ImportRegion(descriptor, file.get()).status()));
  int pipe_fds[2];
  ASSERT_EQ(pipe2(pipe_fds, O_CLOEXEC), 0);
  common::UniqueFd pipe_read(pipe_fds[0]), pipe_write(pipe_fds[1]);
  EXPECT_TRUE(absl::IsInvalidArgument(client::memory::ImportRegion(descriptor, pipe_read.get()).status()));
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
  if (message->fds.size() != 1) return reply(absl::StrCat(message->fds.size(), " fds arrived, expected 1"), 5);
  absl::StatusOr<client::memory::MappedRegion> mapped = client::memory::ImportRegion(descriptor, message->fds[0].get());
  if (!mapped.ok()) return reply(mapped.status().ToString(), 6);
  message->fds.clear();  // the mapping keeps the memory
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
