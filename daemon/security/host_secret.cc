#include "security/host_secret.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "epfabric/common/peer_auth.h"

namespace epfabric::daemon::security {

namespace {

bool SafeFileNamePart(const std::string& text) {
  if (text.empty() || text == "." || text == "..") return false;
  for (char c : text) {
    const bool ok =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

absl::Status ErrnoError(const std::string& what, int error) {
  return absl::FailedPreconditionError(absl::StrCat(what, ": ", std::strerror(error)));
}

}  // namespace

std::string HostFabricSecretPath(const std::string& client_socket, const std::string& fabric_id) {
  const std::string name = SafeFileNamePart(fabric_id) ? fabric_id : common::Sha256Hex(fabric_id).substr(0, 16);
  return (std::filesystem::absolute(client_socket).parent_path() / absl::StrCat(".", name, ".fabric-secret")).string();
}

absl::StatusOr<std::string> RandomSecret() {
  char bytes[32];
  size_t filled = 0;
  while (filled < sizeof(bytes)) {
    const ssize_t got = ::getrandom(bytes + filled, sizeof(bytes) - filled, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return ErrnoError("getrandom", errno);
    filled += static_cast<size_t>(got);
  }
  return absl::BytesToHexString(absl::string_view(bytes, sizeof(bytes)));
}

absl::StatusOr<HostSecret> LoadOrCreateHostFabricSecret(const std::string& path) {
  constexpr const char* kWhat = "fabric_secret_file (none given: the host's fabric secret)";
  // Two rounds: a daemon that loses the race to create the file reads the winner's.
  for (int round = 0; round < 2; ++round) {
    struct stat st {};
    if (::lstat(path.c_str(), &st) == 0) {
      auto secret = common::ReadFabricSecretFile(path, kWhat);
      if (!secret.ok()) return secret.status();
      return HostSecret{*std::move(secret), false};
    }
    if (errno != ENOENT) return ErrnoError(absl::StrCat("--", kWhat, ": cannot look at '", path, "'"), errno);

    auto secret = RandomSecret();
    if (!secret.ok()) return secret.status();
    auto suffix = RandomSecret();
    if (!suffix.ok()) return suffix.status();
    const std::string temporary = absl::StrCat(path, ".", suffix->substr(0, 12), ".tmp");
    const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return ErrnoError(absl::StrCat("--", kWhat, ": cannot create '", temporary, "'"), errno);
    const std::string contents = absl::StrCat(*secret, "\n");
    const bool written = ::write(fd, contents.data(), contents.size()) == static_cast<ssize_t>(contents.size()) &&
                         ::fchmod(fd, 0600) == 0 && ::fsync(fd) == 0;
    const int write_errno = errno;
    ::close(fd);
    if (!written) {
      ::unlink(temporary.c_str());
      return ErrnoError(absl::StrCat("--", kWhat, ": cannot write '", temporary, "'"), write_errno);
    }
    // link() fails with EEXIST when another daemon put its file there first: the next round reads that one.
    const int linked = ::link(temporary.c_str(), path.c_str());
    const int link_errno = errno;
    ::unlink(temporary.c_str());
    if (linked == 0) return HostSecret{*std::move(secret), true};
    if (link_errno != EEXIST) {
      return ErrnoError(absl::StrCat("--", kWhat, ": cannot create '", path, "'"), link_errno);
    }
  }
  return absl::FailedPreconditionError(absl::StrCat("--", kWhat, ": '", path, "' appeared and vanished again"));
}

}  // namespace epfabric::daemon::security
