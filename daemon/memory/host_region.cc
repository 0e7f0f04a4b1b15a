// Host backend: each region is an anonymous, sealed memfd. It has no name anywhere in the file system, so nothing
// can collide with it or open it: a client gets it only as a file descriptor from the daemon's fd side channel,
// which checks the group token (like a cuda POSIX_FD region).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "epfabric/common/fd_passing.h"
#include "epfabric/common/status_macros.h"
#include "logging.h"
#include "memory/region.h"
#include "memory/region_common.h"

namespace epfabric::daemon::memory {
namespace {

// memfd_create refuses names longer than this (NAME_MAX minus "memfd:"); the name is only a label, so it is cut.
constexpr size_t kMaxMemfdName = 249;

std::string ErrnoText(int error) { return absl::StrCat(std::strerror(error), " (errno ", error, ")"); }

class HostRegion final : public Region {
 public:
  HostRegion(v1::RegionDescriptor descriptor, common::UniqueFd fd, void* base, std::string name)
      : descriptor_(std::move(descriptor)), fd_(std::move(fd)), base_(base), name_(std::move(name)) {}
  HostRegion(const HostRegion&) = delete;
  HostRegion& operator=(const HostRegion&) = delete;

  ~HostRegion() override {
    // The memory goes once the last reference goes: this mapping, `fd_` (closed after this body), and whatever
    // clients still map or hold. A client that outlives the region keeps its pages, which nobody else can reach.
    if (munmap(base_, descriptor_.size_bytes()) != 0) {
      const std::string error = ErrnoText(errno);  // before the logger can touch errno
      Logger("memory")->warn("munmap of memfd {} failed: {}", name_, error);
    }
  }

  const v1::RegionDescriptor& descriptor() const override { return descriptor_; }
  void* base() const override { return base_; }
  int shareable_fd() const override { return fd_.get(); }

  // The whole pages of the range are replaced by fresh ones (a hole punched in the memfd, then reserved again, as at
  // creation: the region keeps its pages, and a full tmpfs is an error here, not a SIGBUS in a client); only the
  // partial pages at the ends are written. Writing zeros through this mapping instead faults in every page it has
  // not touched yet: 64 MiB took 400 ms that way on a virtual machine here, against 40 ms.
  absl::Status Zero(uint64_t offset, uint64_t bytes) override {
    EPF_RETURN_IF_ERROR(CheckZeroRange(offset, bytes, descriptor_.size_bytes()));
    char* base = static_cast<char*>(base_);
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    const uint64_t first = (offset + page - 1) / page * page;
    const uint64_t last = (offset + bytes) / page * page;
    if (last <= first || fallocate(fd_.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(first),
                                   static_cast<off_t>(last - first)) != 0) {
      std::memset(base + offset, 0, bytes);
      return absl::OkStatus();
    }
    std::memset(base + offset, 0, first - offset);
    std::memset(base + last, 0, offset + bytes - last);
    if (const int error = posix_fallocate(fd_.get(), static_cast<off_t>(first), static_cast<off_t>(last - first));
        error != 0) {
      return absl::ResourceExhaustedError(absl::StrCat("zeroing memfd ", name_, ": its pages were released and ",
                                                       last - first,
                                                       " bytes could not be reserved again: ", ErrnoText(error)));
    }
    return absl::OkStatus();
  }

 private:
  v1::RegionDescriptor descriptor_;
  common::UniqueFd fd_;
  void* base_;
  std::string name_;  // the memfd's label, for messages
};

class HostAllocator final : public RegionAllocator {
 public:
  HostAllocator(std::string name_prefix, uint64_t max_region_bytes)
      : name_prefix_(std::move(name_prefix)), max_region_bytes_(max_region_bytes) {}

  v1::Backend backend() const override { return v1::BACKEND_HOST; }

  absl::StatusOr<std::unique_ptr<Region>> Allocate(const RegionSpec& spec) override {
    EPF_RETURN_IF_ERROR(ValidateRegionSpec(spec));
    if (spec.sharing != v1::MEMORY_SHARING_UNSPECIFIED && spec.sharing != v1::MEMORY_SHARING_POSIX_SHM) {
      return absl::InvalidArgumentError(absl::StrCat("RegionSpec.sharing ", v1::MemorySharing_Name(spec.sharing),
                                                     " is not supported by the host backend (POSIX_SHM only)"));
    }
    EPF_RETURN_IF_ERROR(CheckRegionLimit(spec, max_region_bytes_, "host"));
    if (spec.bytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
      return absl::ResourceExhaustedError(
          absl::StrCat(DescribeRegion(spec), ": ", spec.bytes, " bytes do not fit a shared-memory object"));
    }

    // Only a label (seen in /proc/<pid>/fd and /proc/<pid>/maps as "/memfd:<name> (deleted)"): memfds of the same
    // name are distinct objects.
    std::string name = absl::StrCat("epf.", name_prefix_, ".", spec.group, ".", spec.rank, ".", KindName(spec.kind));
    if (name.size() > kMaxMemfdName) name.resize(kMaxMemfdName);
    for (char& c : name) {
      if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') c = '_';
    }

    const int raw_fd = memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (raw_fd < 0) {
      const int error = errno;
      return absl::Status(error == ENOMEM || error == EMFILE || error == ENFILE ? absl::StatusCode::kResourceExhausted
                                                                                : absl::StatusCode::kInternal,
                          absl::StrCat(DescribeRegion(spec), ": memfd_create(", name, "): ", ErrnoText(error)));
    }
    common::UniqueFd fd(raw_fd);
    const auto bytes = static_cast<off_t>(spec.bytes);
    if (ftruncate(fd.get(), bytes) != 0) {
      const int error = errno;
      return absl::Status(
          error == EFBIG || error == ENOSPC ? absl::StatusCode::kResourceExhausted : absl::StatusCode::kInternal,
          absl::StrCat(DescribeRegion(spec), ": ftruncate(memfd ", name, ", ", spec.bytes, "): ", ErrnoText(error)));
    }
    // Reserve the pages now, so that a full tmpfs or a memory limit is an error here and not a SIGBUS in a client
    // later. New pages read as zero, so the region starts zeroed without touching it twice.
    if (const int error = posix_fallocate(fd.get(), 0, bytes); error != 0) {
      if (error == ENOSPC || error == ENOMEM || error == EFBIG) {
        return absl::ResourceExhaustedError(absl::StrCat(DescribeRegion(spec), ": no room for ", spec.bytes,
                                                         " bytes of shared memory: ", ErrnoText(error)));
      }
      return absl::InternalError(
          absl::StrCat("posix_fallocate(memfd ", name, ", ", spec.bytes, "): ", ErrnoText(error)));
    }
    // Clients get this fd. Without the seals one of them could ftruncate it and every other mapping (the daemon's
    // included) would SIGBUS on the lost pages; F_SEAL_SEAL stops anyone from adding seals (e.g. FUTURE_WRITE,
    // which would make the region unmappable for writing by later clients).
    if (fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
      return absl::InternalError(absl::StrCat("F_ADD_SEALS on memfd ", name, ": ", ErrnoText(errno)));
    }
    void* base = mmap(nullptr, spec.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (base == MAP_FAILED) {
      const int error = errno;
      if (error == ENOMEM) {
        return absl::ResourceExhaustedError(
            absl::StrCat(DescribeRegion(spec), ": cannot map ", spec.bytes, " bytes: ", ErrnoText(error)));
      }
      return absl::InternalError(absl::StrCat("mmap(memfd ", name, ", ", spec.bytes, "): ", ErrnoText(error)));
    }

    v1::RegionDescriptor descriptor;
    descriptor.set_rank(spec.rank);
    descriptor.set_sharing(v1::MEMORY_SHARING_POSIX_SHM);  // host memory whose fd goes over the side channel
    descriptor.set_size_bytes(spec.bytes);
    descriptor.set_device(-1);
    descriptor.set_kind(spec.kind);
    return std::make_unique<HostRegion>(std::move(descriptor), std::move(fd), base, std::move(name));
  }

 private:
  const std::string name_prefix_;
  const uint64_t max_region_bytes_;
};

}  // namespace

std::unique_ptr<RegionAllocator> MakeHostAllocator(std::string name_prefix, uint64_t max_region_bytes) {
  return std::make_unique<HostAllocator>(std::move(name_prefix), max_region_bytes);
}

}  // namespace epfabric::daemon::memory
