#include "transport/socket_protocol.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "epfabric/common/peer_auth.h"
#include "epfabric/daemon/options.h"

namespace epfabric::daemon::transport::socket_wire {
namespace {

std::string Transcript(absl::string_view label, const Hello& hello, const uint8_t* server_nonce) {
  std::string text(label);
  text.append(reinterpret_cast<const char*>(&hello), sizeof(hello));
  text.append(reinterpret_cast<const char*>(server_nonce), kNonceBytes);
  return text;
}

}  // namespace

std::string ServerProof(const std::string& key, const Hello& hello, const uint8_t* server_nonce) {
  return common::HmacSha256Hex(key, Transcript("epfd-server|", hello, server_nonce));
}

std::string ClientProof(const std::string& key, const Hello& hello, const uint8_t* server_nonce) {
  return common::HmacSha256Hex(key, Transcript("epfd-client|", hello, server_nonce));
}

namespace {

void SessionKey(const std::string& data_key, absl::string_view label, const Hello& hello, const uint8_t* server_nonce,
                uint8_t out[kKeyBytes]) {
  const std::string text = Transcript(label, hello, server_nonce);
  unsigned int length = 0;
  HMAC(EVP_sha256(), data_key.data(), static_cast<int>(data_key.size()),
       reinterpret_cast<const unsigned char*>(text.data()), text.size(), out, &length);
}

// The GCM nonce of record `index` of frame `seq`.
void RecordNonce(uint64_t seq, uint32_t index, uint8_t nonce[12]) {
  std::memcpy(nonce, &seq, 8);
  std::memcpy(nonce + 8, &index, 4);
}

}  // namespace

SessionKeys DeriveSessionKeys(const std::string& data_key, const Hello& hello, const uint8_t* server_nonce) {
  SessionKeys keys;
  SessionKey(data_key, "epfd-key-to-destination|", hello, server_nonce, keys.to_destination);
  SessionKey(data_key, "epfd-key-to-issuer|", hello, server_nonce, keys.to_issuer);
  return keys;
}

FrameCipher::FrameCipher(const uint8_t key[kKeyBytes]) : context_(EVP_CIPHER_CTX_new()) {
  std::memcpy(key_, key, kKeyBytes);
}

FrameCipher::~FrameCipher() {
  EVP_CIPHER_CTX_free(static_cast<EVP_CIPHER_CTX*>(context_));
  OPENSSL_cleanse(key_, sizeof(key_));
}

void FrameCipher::Seal(const FrameHeader& header, uint32_t index, const void* in, void* out, size_t bytes,
                       uint8_t tag[kTagBytes]) {
  auto* ctx = static_cast<EVP_CIPHER_CTX*>(context_);
  uint8_t nonce[12];
  RecordNonce(header.seq, index, nonce);
  int n = 0;
  // The key schedule once per direction of use; then only the nonce.
  if (mode_ != 1) EVP_EncryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr, key_, nullptr);
  mode_ = 1;
  EVP_EncryptInit_ex(ctx, nullptr, nullptr, nullptr, nonce);
  EVP_EncryptUpdate(ctx, nullptr, &n, reinterpret_cast<const unsigned char*>(&header), sizeof(header));
  if (bytes > 0) {
    EVP_EncryptUpdate(ctx, static_cast<unsigned char*>(out), &n, static_cast<const unsigned char*>(in),
                      static_cast<int>(bytes));
  }
  unsigned char end[kTagBytes];  // GCM's final step writes no bytes
  EVP_EncryptFinal_ex(ctx, end, &n);
  EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, kTagBytes, tag);
}

bool FrameCipher::Open(const FrameHeader& header, uint32_t index, const void* in, void* out, size_t bytes,
                       const uint8_t tag[kTagBytes]) {
  auto* ctx = static_cast<EVP_CIPHER_CTX*>(context_);
  uint8_t nonce[12];
  RecordNonce(header.seq, index, nonce);
  int n = 0;
  uint8_t expected[kTagBytes];
  std::memcpy(expected, tag, kTagBytes);
  if (mode_ != 2 && EVP_DecryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr, key_, nullptr) != 1) return false;
  mode_ = 2;
  if (EVP_DecryptInit_ex(ctx, nullptr, nullptr, nullptr, nonce) != 1) return false;
  if (EVP_DecryptUpdate(ctx, nullptr, &n, reinterpret_cast<const unsigned char*>(&header), sizeof(header)) != 1) {
    return false;
  }
  if (bytes > 0 && EVP_DecryptUpdate(ctx, static_cast<unsigned char*>(out), &n, static_cast<const unsigned char*>(in),
                                     static_cast<int>(bytes)) != 1) {
    return false;
  }
  if (EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, kTagBytes, expected) != 1) return false;
  unsigned char end[kTagBytes];  // GCM's final step writes no bytes
  return EVP_DecryptFinal_ex(ctx, end, &n) == 1;
}

void RandomBytes(uint8_t* bytes, size_t n) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = getrandom(bytes + got, n - got, 0);
    if (r > 0) got += static_cast<size_t>(r);
  }
}

absl::Status ReadFull(int fd, void* data, size_t bytes, const std::string& peer) {
  auto* out = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t r = recv(fd, out, bytes, 0);
    if (r > 0) {
      out += r;
      bytes -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return absl::UnavailableError(absl::StrCat(peer, ": connection closed"));
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return absl::DeadlineExceededError(absl::StrCat(peer, ": timed out"));
    return absl::UnavailableError(absl::StrCat(peer, ": ", strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status WriteFull(int fd, const void* data, size_t bytes, const std::string& peer) {
  const auto* in = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t r = send(fd, in, bytes, MSG_NOSIGNAL);
    if (r > 0) {
      in += r;
      bytes -= static_cast<size_t>(r);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return absl::DeadlineExceededError(absl::StrCat(peer, ": send timed out"));
    }
    return absl::UnavailableError(absl::StrCat(peer, ": ", r < 0 ? strerror(errno) : "connection closed"));
  }
  return absl::OkStatus();
}

namespace {

// Waits until `fd` is ready for `events` or `deadline` passes; false on timeout.
bool WaitReady(int fd, short events, absl::Time deadline) {
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    pollfd p = {fd, events, 0};
    const int r = poll(&p, 1, static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(left))));
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return true;  // let the I/O call report the error
  }
}

}  // namespace

absl::Status ReadFullBefore(int fd, void* data, size_t bytes, absl::Time deadline, const std::string& peer) {
  auto* out = static_cast<char*>(data);
  while (bytes > 0) {
    if (!WaitReady(fd, POLLIN, deadline)) return absl::DeadlineExceededError(absl::StrCat(peer, ": timed out"));
    const ssize_t r = recv(fd, out, bytes, MSG_DONTWAIT);
    if (r > 0) {
      out += r;
      bytes -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return absl::UnavailableError(absl::StrCat(peer, ": connection closed"));
    if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
    return absl::UnavailableError(absl::StrCat(peer, ": ", strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status WriteFullBefore(int fd, const void* data, size_t bytes, absl::Time deadline, const std::string& peer) {
  const auto* in = static_cast<const char*>(data);
  while (bytes > 0) {
    if (!WaitReady(fd, POLLOUT, deadline)) return absl::DeadlineExceededError(absl::StrCat(peer, ": send timed out"));
    const ssize_t r = send(fd, in, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r > 0) {
      in += r;
      bytes -= static_cast<size_t>(r);
      continue;
    }
    if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    return absl::UnavailableError(absl::StrCat(peer, ": ", r < 0 ? strerror(errno) : "connection closed"));
  }
  return absl::OkStatus();
}

void SetIoTimeout(int fd, absl::Duration timeout) {
  timeval tv = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

absl::StatusOr<int> ConnectTcp(const std::string& address, absl::Duration timeout) {
  absl::StatusOr<HostPort> parsed = ParseHostPort(address);
  if (!parsed.ok()) return parsed.status();
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(parsed->port);
  if (int err = getaddrinfo(parsed->host.c_str(), port.c_str(), &hints, &found); err != 0) {
    return absl::UnavailableError(absl::StrCat("data address ", address, ": ", gai_strerror(err)));
  }
  std::string last_error = "no address";
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    int r = connect(fd, a->ai_addr, a->ai_addrlen);
    if (r < 0 && errno == EINPROGRESS) {
      pollfd p = {fd, POLLOUT, 0};
      r = poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout)));
      int err = 0;
      socklen_t len = sizeof(err);
      if (r == 1) getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      r = (r == 1 && err == 0) ? 0 : -1;
      if (r < 0) last_error = err != 0 ? strerror(err) : "timed out";
    } else if (r < 0) {
      last_error = strerror(errno);
    }
    if (r < 0) {
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("connecting to ", address, ": ", last_error));
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

}  // namespace epfabric::daemon::transport::socket_wire
