// Host backend: each region is a POSIX shared-memory object that clients map by name.
#include <fcntl.h>
#include <limits.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "epfabric/common/fd_passing.h"
#include "epfabric/common/status_macros.h"
#include "logging.h"
#include "memory/region.h"
#include "memory/region_common.h"

namespace epfabric::daemon::memory {
namespace {

// Exactly these permissions, whatever the umask: the owner (daemon) and its group (clients run under the same group
// in a pod's securityContext) read and write; nobody else may see the communication memory.
constexpr mode_t kShmMode = 0660;

std::string ErrnoText(int error) { return absl::StrCat(std::strerror(error), " (errno ", error, ")"); }

// Names of the regions this allocator holds now. An existing object of a name that is not here is stale (left by a
// crashed daemon) and may be replaced; one that is here belongs to a live region and must not be.
class LiveNames {
 public:
  bool Insert(const std::string& name) {
    absl::MutexLock lock(&mutex_);
    return names_.insert(name).second;
  }
  void Erase(const std::string& name) {
    absl::MutexLock lock(&mutex_);
    names_.erase(name);
  }

 private:
  absl::Mutex mutex_;
  absl::flat_hash_set<std::string> names_ ABSL_GUARDED_BY(mutex_);
};

class HostRegion final : public Region {
 public:
  HostRegion(v1::RegionDescriptor descriptor, void* base, std::shared_ptr<LiveNames> live_names)
      : descriptor_(std::move(descriptor)), base_(base), live_names_(std::move(live_names)) {}
  HostRegion(const HostRegion&) = delete;
  HostRegion& operator=(const HostRegion&) = delete;

  ~HostRegion() override {
    // Unlink first: a client that still has it mapped keeps its pages until it unmaps, but nobody can open the
    // name any more, and a new region of the same name can be created right away.
    if (shm_unlink(descriptor_.shm_name().c_str()) != 0 && errno != ENOENT) {
      const std::string error = ErrnoText(errno);  // before the logger can touch errno
      Logger("memory")->warn("shm_unlink({}) failed: {}", descriptor_.shm_name(), error);
    }
    if (munmap(base_, descriptor_.size_bytes()) != 0) {
      const std::string error = ErrnoText(errno);
      Logger("memory")->warn("munmap of {} failed: {}", descriptor_.shm_name(), error);
    }
    live_names_->Erase(descriptor_.shm_name());
  }

  const v1::RegionDescriptor& descriptor() const override { return descriptor_; }
  void* base() const override { return base_; }

  absl::Status Zero(uint64_t offset, uint64_t bytes) override {
    EPF_RETURN_IF_ERROR(CheckZeroRange(offset, bytes, descriptor_.size_bytes()));
    std::memset(static_cast<char*>(base_) + offset, 0, bytes);
    return absl::OkStatus();
  }

 private:
  v1::RegionDescriptor descriptor_;
  void* base_;
  std::shared_ptr<LiveNames> live_names_;  // shared: a region may outlive its allocator
};

class HostAllocator final : public RegionAllocator {
 public:
  HostAllocator(std::string shm_prefix, uint64_t max_region_bytes)
      : shm_prefix_(std::move(shm_prefix)), max_region_bytes_(max_region_bytes) {}

  v1::Backend backend() const override { return v1::BACKEND_HOST; }

  absl::StatusOr<std::unique_ptr<Region>> Allocate(const RegionSpec& spec) override {
    EPF_RETURN_IF_ERROR(ValidateRegionSpec(spec));
    if (spec.sharing != v1::MEMORY_SHARING_UNSPECIFIED && spec.sharing != v1::MEMORY_SHARING_POSIX_SHM) {
      return absl::InvalidArgumentError(absl::StrCat("RegionSpec.sharing ", v1::MemorySharing_Name(spec.sharing),
                                                     " is not supported by the host backend (POSIX_SHM only)"));
    }
    EPF_RETURN_IF_ERROR(ValidatePrefix());
    EPF_RETURN_IF_ERROR(CheckRegionLimit(spec, max_region_bytes_, "host"));
    if (spec.bytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
      return absl::ResourceExhaustedError(
          absl::StrCat(DescribeRegion(spec), ": ", spec.bytes, " bytes do not fit a shared-memory object"));
    }

    const std::string name = absl::StrCat("/", shm_prefix_, ".", spec.group, ".", spec.rank, ".", KindName(spec.kind));
    if (name.size() > NAME_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("shm name '", name, "' is longer than NAME_MAX=", NAME_MAX, "; shorten the prefix or group"));
    }

    if (!live_names_->Insert(name)) {
      return absl::AlreadyExistsError(absl::StrCat(DescribeRegion(spec), " already exists (", name, ")"));
    }
    absl::StatusOr<common::UniqueFd> fd = CreateExclusive(name);
    if (!fd.ok()) {
      live_names_->Erase(name);
      return fd.status();
    }
    // From here on, any failure must remove the object again.
    auto fail = [this, &name](absl::Status status) {
      shm_unlink(name.c_str());
      live_names_->Erase(name);
      return status;
    };
    // O_EXCL guarantees a new, empty object; exact permissions regardless of the umask.
    if (fchmod(fd->get(), kShmMode) != 0) {
      return fail(absl::InternalError(absl::StrCat("fchmod(", name, ", 0660): ", ErrnoText(errno))));
    }
    // posix_fallocate instead of ftruncate: it reserves the pages now, so a full /dev/shm is an error here and not
    // a SIGBUS in a client later. New pages read as zero, so the region starts zeroed without touching it twice.
    if (const int error = posix_fallocate(fd->get(), 0, static_cast<off_t>(spec.bytes)); error != 0) {
      if (error == ENOSPC || error == ENOMEM || error == EFBIG) {
        return fail(
            absl::ResourceExhaustedError(absl::StrCat(DescribeRegion(spec), ": no room for ", spec.bytes,
                                                      " bytes in shared memory (", name, "): ", ErrnoText(error))));
      }
      return fail(
          absl::InternalError(absl::StrCat("posix_fallocate(", name, ", ", spec.bytes, "): ", ErrnoText(error))));
    }
    void* base = mmap(nullptr, spec.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd->get(), 0);
    if (base == MAP_FAILED) {
      const int error = errno;
      absl::Status status = absl::InternalError(absl::StrCat("mmap(", name, ", ", spec.bytes, "): ", ErrnoText(error)));
      if (error == ENOMEM) {
        status = absl::ResourceExhaustedError(
            absl::StrCat(DescribeRegion(spec), ": cannot map ", spec.bytes, " bytes: ", ErrnoText(error)));
      }
      return fail(std::move(status));
    }
    // The mapping keeps the object alive; the descriptor is not needed any more (`fd` closes it).

    v1::RegionDescriptor descriptor;
    descriptor.set_rank(spec.rank);
    descriptor.set_sharing(v1::MEMORY_SHARING_POSIX_SHM);
    descriptor.set_size_bytes(spec.bytes);
    descriptor.set_shm_name(name);
    descriptor.set_device(-1);
    descriptor.set_kind(spec.kind);
    return std::make_unique<HostRegion>(std::move(descriptor), base, live_names_);
  }

 private:
  absl::Status ValidatePrefix() const {
    if (shm_prefix_.empty()) return absl::InvalidArgumentError("host allocator: shm_prefix is empty");
    for (char c : shm_prefix_) {
      if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
        return absl::InvalidArgumentError(
            absl::StrCat("host allocator: shm_prefix '", shm_prefix_, "' may only contain [A-Za-z0-9._-]"));
      }
    }
    return absl::OkStatus();
  }

  // Creates `name` exclusively. An object of that name left by a daemon that crashed (its destructor never ran) is
  // removed and the creation retried once; if that fails too, somebody is racing us for the name.
  static absl::StatusOr<common::UniqueFd> CreateExclusive(const std::string& name) {
    for (int attempt = 0; attempt < 2; ++attempt) {
      const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, kShmMode);
      if (fd >= 0) return common::UniqueFd(fd);
      if (errno != EEXIST || attempt == 1) {
        return absl::Status(errno == EEXIST ? absl::StatusCode::kAlreadyExists : absl::StatusCode::kInternal,
                            absl::StrCat("shm_open(", name, ", O_CREAT|O_EXCL): ", ErrnoText(errno)));
      }
      Logger("memory")->warn("removing stale shared-memory object {} (left by an earlier daemon)", name);
      if (shm_unlink(name.c_str()) != 0 && errno != ENOENT) {
        return absl::InternalError(absl::StrCat("shm_unlink of stale ", name, ": ", ErrnoText(errno)));
      }
    }
    return absl::InternalError("unreachable");
  }

  const std::string shm_prefix_;
  const uint64_t max_region_bytes_;
  const std::shared_ptr<LiveNames> live_names_ = std::make_shared<LiveNames>();
};

}  // namespace

std::unique_ptr<RegionAllocator> MakeHostAllocator(std::string shm_prefix, uint64_t max_region_bytes) {
  return std::make_unique<HostAllocator>(std::move(shm_prefix), max_region_bytes);
}

}  // namespace epfabric::daemon::memory
