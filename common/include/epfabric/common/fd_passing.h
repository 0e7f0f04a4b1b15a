// Passing file descriptors between processes over a connected Unix stream socket (SCM_RIGHTS), and reading the
// credentials of the process at the other end (SO_PEERCRED). The daemon hands cuMem allocations exported as POSIX
// file descriptors to its clients this way: no shared PID or IPC namespace is needed, only the socket.
//
// Wire format of one message: a 4-byte little-endian payload length, then the payload; the descriptors travel as
// SCM_RIGHTS ancillary data attached to the first byte of the length, so that a receiver always finds them with the
// header of the message they belong to.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace epfabric::common {

// Owns one file descriptor and closes it on destruction. -1 means none.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Gives up ownership without closing.
  int release();
  // Closes the current descriptor (if any) and takes `fd`.
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// Limits that keep one message small: the kernel's SCM_MAX_FD is 253, and a message is a control-plane record.
inline constexpr size_t kMaxPassedFds = 16;
inline constexpr size_t kMaxPassedPayloadBytes = 64 * 1024;

// Sends `payload` and duplicates of `fds` (the caller keeps its own) as one message. Waits at most `timeout` for
// the socket to take all bytes. Errors: InvalidArgument (too many fds, payload too large, a negative fd),
// DeadlineExceeded, Unavailable (the peer closed the connection), Internal (any other sendmsg error, with errno).
absl::Status SendFds(int socket_fd, absl::Span<const int> fds, absl::string_view payload, absl::Duration timeout);

struct ReceivedFds {
  std::string payload;
  std::vector<UniqueFd> fds;  // close-on-exec
};

// Receives one message sent by SendFds, waiting at most `timeout` for all of it. Refuses (and closes every
// descriptor received) a message with more than `max_fds` descriptors or a payload over `max_payload_bytes`:
// ResourceExhausted. Unavailable when the peer closed the connection first, DeadlineExceeded on timeout.
absl::StatusOr<ReceivedFds> ReceiveFds(int socket_fd, absl::Duration timeout, size_t max_fds = kMaxPassedFds,
                                       size_t max_payload_bytes = kMaxPassedPayloadBytes);

// The process at the other end of a connected Unix socket, as the kernel recorded it when the connection was made
// (pid as seen from this process's PID namespace; 0 when the peer lives in a namespace this one cannot see).
struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};
absl::StatusOr<PeerCredentials> GetPeerCredentials(int socket_fd);

}  // namespace epfabric::common
