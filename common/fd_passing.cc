#include "epfabric/common/fd_passing.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace epfabric::common {
namespace {

constexpr size_t kHeaderBytes = 4;

std::string ErrnoText(int error) { return absl::StrCat(std::strerror(error), " (errno ", error, ")"); }

// Waits until `socket_fd` is ready for `events` or `deadline` passes.
absl::Status WaitReady(int socket_fd, short events, absl::Time deadline, absl::string_view what) {
  for (;;) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
    pollfd entry{.fd = socket_fd, .events = events, .revents = 0};
    // Round up so that a sub-millisecond remainder still waits instead of spinning; cap for poll's int (an infinite
    // timeout simply polls again after ~24 days).
    const int64_t left_ms = absl::ToInt64Milliseconds(left + absl::Milliseconds(1) - absl::Nanoseconds(1));
    const int wait_ms = static_cast<int>(std::min<int64_t>(left_ms, std::numeric_limits<int>::max()));
    const int ready = poll(&entry, 1, wait_ms);
    if (ready > 0) return absl::OkStatus();  // readable, writable, or an error that the next call reports
    if (ready < 0 && errno != EINTR) {
      return absl::InternalError(absl::StrCat(what, ": poll on fd ", socket_fd, ": ", ErrnoText(errno)));
    }
  }
}

bool IsPeerGone(int error) { return error == EPIPE || error == ECONNRESET || error == ENOTCONN; }

void CloseAll(std::vector<UniqueFd>& fds) { fds.clear(); }

// Takes every SCM_RIGHTS descriptor out of `message` into `out` (so that they are closed on any error path).
void CollectFds(msghdr& message, std::vector<UniqueFd>& out) {
  for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr; header = CMSG_NXTHDR(&message, header)) {
    if (header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const unsigned char* data = CMSG_DATA(header);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, data + i * sizeof(int), sizeof(int));
      out.emplace_back(fd);
    }
  }
}

}  // namespace

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) reset(other.release());
  return *this;
}

int UniqueFd::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

absl::Status SendFds(int socket_fd, absl::Span<const int> fds, absl::string_view payload, absl::Duration timeout) {
  if (fds.size() > kMaxPassedFds) {
    return absl::InvalidArgumentError(
        absl::StrCat("SendFds: fds.size()=", fds.size(), " is over the limit of ", kMaxPassedFds));
  }
  if (payload.size() > kMaxPassedPayloadBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("SendFds: payload of ", payload.size(), " bytes is over the limit of ", kMaxPassedPayloadBytes));
  }
  for (int fd : fds) {
    if (fd < 0) return absl::InvalidArgumentError(absl::StrCat("SendFds: fd ", fd, " is not a descriptor"));
  }
  const absl::Time deadline = absl::Now() + timeout;
  const uint32_t length = static_cast<uint32_t>(payload.size());
  const unsigned char header[kHeaderBytes] = {
      static_cast<unsigned char>(length), static_cast<unsigned char>(length >> 8),
      static_cast<unsigned char>(length >> 16), static_cast<unsigned char>(length >> 24)};
  // Control buffer for the descriptors, aligned as cmsghdr requires.
  alignas(cmsghdr) unsigned char control[CMSG_SPACE(kMaxPassedFds * sizeof(int))] = {};

  size_t sent = 0;  // bytes of header + payload sent so far
  const size_t total = kHeaderBytes + payload.size();
  while (sent < total) {
    iovec parts[2];
    int part_count = 0;
    if (sent < kHeaderBytes) {
      parts[part_count++] = {.iov_base = const_cast<unsigned char*>(header + sent), .iov_len = kHeaderBytes - sent};
      if (!payload.empty()) {
        parts[part_count++] = {.iov_base = const_cast<char*>(payload.data()), .iov_len = payload.size()};
      }
    } else {
      const size_t done = sent - kHeaderBytes;
      parts[part_count++] = {.iov_base = const_cast<char*>(payload.data() + done), .iov_len = payload.size() - done};
    }
    msghdr message{};
    message.msg_iov = parts;
    message.msg_iovlen = part_count;
    if (sent == 0 && !fds.empty()) {  // the descriptors ride on the first byte of the message
      message.msg_control = control;
      message.msg_controllen = CMSG_SPACE(fds.size() * sizeof(int));
      cmsghdr* rights = CMSG_FIRSTHDR(&message);
      rights->cmsg_level = SOL_SOCKET;
      rights->cmsg_type = SCM_RIGHTS;
      rights->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
      std::memcpy(CMSG_DATA(rights), fds.data(), fds.size() * sizeof(int));
    }
    const ssize_t n = sendmsg(socket_fd, &message, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n >= 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      absl::Status ready = WaitReady(socket_fd, POLLOUT, deadline, "SendFds");
      if (!ready.ok()) return ready;
      continue;
    }
    if (IsPeerGone(errno)) {
      return absl::UnavailableError(absl::StrCat("SendFds: peer closed the connection on fd ", socket_fd, " after ",
                                                 sent, " of ", total, " bytes: ", ErrnoText(errno)));
    }
    return absl::InternalError(absl::StrCat("SendFds: sendmsg on fd ", socket_fd, ": ", ErrnoText(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<ReceivedFds> ReceiveFds(int socket_fd, absl::Duration timeout, size_t max_fds,
                                       size_t max_payload_bytes) {
  const absl::Time deadline = absl::Now() + timeout;
  ReceivedFds result;
  // Room for one descriptor more than allowed, so that "too many" is seen as a count, not only as MSG_CTRUNC.
  // Stored as cmsghdr-sized elements for the alignment that CMSG_* requires.
  const size_t control_bytes = CMSG_SPACE((max_fds + 1) * sizeof(int));
  std::vector<cmsghdr> control_storage(control_bytes / sizeof(cmsghdr) + 1);
  void* control = control_storage.data();

  unsigned char header[kHeaderBytes];
  size_t header_read = 0;
  size_t payload_length = 0;
  size_t payload_read = 0;
  bool truncated = false;
  for (;;) {
    iovec part;
    if (header_read < kHeaderBytes) {
      part = {.iov_base = header + header_read, .iov_len = kHeaderBytes - header_read};
    } else {
      if (payload_read == payload_length) break;
      part = {.iov_base = result.payload.data() + payload_read, .iov_len = payload_length - payload_read};
    }
    msghdr message{};
    message.msg_iov = &part;
    message.msg_iovlen = 1;
    // Descriptors can only arrive with the header bytes; reading the payload without a control buffer would make the
    // kernel discard any that a misbehaving sender attached there, which is what we want.
    if (header_read < kHeaderBytes) {
      message.msg_control = control;
      message.msg_controllen = control_bytes;
    }
    const ssize_t n = recvmsg(socket_fd, &message, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        absl::Status ready = WaitReady(socket_fd, POLLIN, deadline, "ReceiveFds");
        if (!ready.ok()) return ready;  // `result` closes whatever arrived
        continue;
      }
      if (IsPeerGone(errno)) {
        return absl::UnavailableError(
            absl::StrCat("ReceiveFds: connection on fd ", socket_fd, " was reset: ", ErrnoText(errno)));
      }
      return absl::InternalError(absl::StrCat("ReceiveFds: recvmsg on fd ", socket_fd, ": ", ErrnoText(errno)));
    }
    CollectFds(message, result.fds);
    if ((message.msg_flags & MSG_CTRUNC) != 0) truncated = true;
    if (n == 0) {
      return absl::UnavailableError(absl::StrCat("ReceiveFds: peer closed the connection on fd ", socket_fd, " after ",
                                                 header_read + payload_read, " bytes of a message"));
    }
    if (header_read < kHeaderBytes) {
      header_read += static_cast<size_t>(n);
      if (header_read == kHeaderBytes) {
        payload_length = static_cast<size_t>(header[0]) | (static_cast<size_t>(header[1]) << 8) |
                         (static_cast<size_t>(header[2]) << 16) | (static_cast<size_t>(header[3]) << 24);
        if (truncated || result.fds.size() > max_fds) {
          CloseAll(result.fds);
          return absl::ResourceExhaustedError(absl::StrCat("ReceiveFds: the message on fd ", socket_fd,
                                                           " carries more than max_fds=", max_fds, " descriptors"));
        }
        if (payload_length > max_payload_bytes) {
          CloseAll(result.fds);
          return absl::ResourceExhaustedError(absl::StrCat("ReceiveFds: payload of ", payload_length,
                                                           " bytes is over max_payload_bytes=", max_payload_bytes));
        }
        result.payload.resize(payload_length);
      }
    } else {
      payload_read += static_cast<size_t>(n);
    }
  }
  return result;
}

absl::StatusOr<PeerCredentials> GetPeerCredentials(int socket_fd) {
  ucred credentials{};
  socklen_t length = sizeof(credentials);
  if (getsockopt(socket_fd, SOL_SOCKET, SO_PEERCRED, &credentials, &length) != 0) {
    return absl::InternalError(
        absl::StrCat("GetPeerCredentials: getsockopt(SO_PEERCRED) on fd ", socket_fd, ": ", ErrnoText(errno)));
  }
  return PeerCredentials{.pid = credentials.pid, .uid = credentials.uid, .gid = credentials.gid};
}

}  // namespace epfabric::common
