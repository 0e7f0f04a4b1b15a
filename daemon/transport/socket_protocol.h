// The socket wire's protocol (docs/internode.md, "Socket wire"). One TCP connection per (group, issuer rank,
// destination rank, channel), opened by the issuer's daemon to the destination daemon's data listener.
//
// Handshake (both directions proven with the group's data key, a key derived from the group token that only the
// group's daemons hold; nonces from both sides, so nothing can be replayed):
//   issuer → destination  Hello (100 bytes): magic, version, group, issuer rank, destination rank, channel, nonce
//   destination → issuer  nonce (16 bytes) + hex HMAC(key, "epfd-server|" hello | nonce) (64 bytes)
//   issuer → destination  hex HMAC(key, "epfd-client|" hello | nonce) (64 bytes)
// A destination that does not know the group, or sees a wrong proof, closes the connection: a stranger writes
// nothing. Then frames: issuer → destination Put (header + payload) and Signal; destination → issuer Ack (the
// highest sequence number applied, cumulative).
//
// Every frame is sealed (AES-256-GCM) with a key of its direction and connection, derived from the group's data key
// and both handshake nonces (SessionKeys): a frame's header travels in the clear, followed by the tag of a record
// with no plaintext and the header as associated data; a Put's payload follows in records of at most kRecordBytes,
// each ciphertext followed by its tag, the header again the associated data. The GCM nonce of record i of frame seq is
// (seq, i): the sequence numbers of a connection never repeat, so neither does a nonce under its key, and a frame
// replayed, reordered, cut or moved to another connection fails its tag or the sequence check. A receiver writes a
// record into the region only after its tag checked out; a frame that fails closes the connection.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace epfabric::daemon::transport::socket_wire {

inline constexpr uint32_t kHelloMagic = 0x44465045;  // "EPFD"
inline constexpr uint32_t kProtocolVersion = 2;
inline constexpr size_t kTagBytes = 16;
inline constexpr size_t kKeyBytes = 32;
// A Put's payload travels in sealed records of at most this many bytes (a receiver buffers one before it lands).
inline constexpr uint64_t kRecordBytes = 64 << 10;
// Sealed records sent (and received) with one call: fewer system calls, and the buffer stays in the cache.
inline constexpr uint64_t kRecordsPerBatch = 4;
inline constexpr size_t kSealedHeaderBytes = 32 + kTagBytes;  // a FrameHeader and its tag
inline constexpr size_t kNonceBytes = 16;
inline constexpr size_t kMacHexBytes = 64;

struct Hello {
  uint32_t magic;
  uint32_t version;
  char group[64];  // NUL-padded
  int32_t issuer_rank;
  int32_t dest_rank;
  int32_t channel;
  uint8_t nonce[kNonceBytes];
};
static_assert(sizeof(Hello) == 100);

enum class FrameType : uint32_t { kPut = 1, kSignal = 2, kAck = 3 };

struct FrameHeader {
  uint32_t type;  // FrameType
  uint32_t reserved;
  uint64_t seq;     // 1, 2, ... per connection; Ack: the highest applied
  uint64_t offset;  // destination offset
  uint64_t arg;     // Put: payload bytes; Signal: the value
};
static_assert(sizeof(FrameHeader) == 32);

// The proofs of the handshake.
std::string ServerProof(const std::string& key, const Hello& hello, const uint8_t* server_nonce);
std::string ClientProof(const std::string& key, const Hello& hello, const uint8_t* server_nonce);

// The keys of one connection: each direction its own, from the group's data key and both nonces (the issuer's is in
// the hello, which also binds the group, the ranks and the channel).
struct SessionKeys {
  uint8_t to_destination[kKeyBytes];  // frames issuer → destination
  uint8_t to_issuer[kKeyBytes];       // acknowledgements
};
SessionKeys DeriveSessionKeys(const std::string& data_key, const Hello& hello, const uint8_t* server_nonce);

// AES-256-GCM of one direction of one connection (FrameCipher is used by one thread at a time).
class FrameCipher {
 public:
  explicit FrameCipher(const uint8_t key[kKeyBytes]);
  ~FrameCipher();
  FrameCipher(const FrameCipher&) = delete;
  FrameCipher& operator=(const FrameCipher&) = delete;

  // Encrypts `bytes` of `in` into `out` (they may be the same) as record `index` of frame `header.seq`, the header
  // as associated data, and writes the tag. bytes = 0 seals the header alone.
  void Seal(const FrameHeader& header, uint32_t index, const void* in, void* out, size_t bytes, uint8_t tag[kTagBytes]);
  // Decrypts and checks record `index` of frame `header.seq`; false when the tag does not match (then `out` holds
  // bytes nobody may use).
  bool Open(const FrameHeader& header, uint32_t index, const void* in, void* out, size_t bytes,
            const uint8_t tag[kTagBytes]);

 private:
  void* context_;  // EVP_CIPHER_CTX
  uint8_t key_[kKeyBytes];
  int mode_ = 0;  // 1: set up to seal, 2: to open
};

// Fills `bytes` with random bytes (the OS's generator).
void RandomBytes(uint8_t* bytes, size_t n);

// Blocking I/O on a connected socket: the whole buffer or an error (Unavailable on EOF/reset, DeadlineExceeded
// when SO_RCVTIMEO/SO_SNDTIMEO expire). `peer` names the other side in messages.
absl::Status ReadFull(int fd, void* data, size_t bytes, const std::string& peer);
absl::Status WriteFull(int fd, const void* data, size_t bytes, const std::string& peer);
// The same with one deadline for the whole exchange, however the bytes trickle in (the data listener's handshake:
// a peer that sends one byte every half second cannot hold a connection past `deadline`). DeadlineExceeded after.
absl::Status ReadFullBefore(int fd, void* data, size_t bytes, absl::Time deadline, const std::string& peer);
absl::Status WriteFullBefore(int fd, const void* data, size_t bytes, absl::Time deadline, const std::string& peer);
// SO_RCVTIMEO and SO_SNDTIMEO (zero: none).
void SetIoTimeout(int fd, absl::Duration timeout);

// Connects to "host:port" within `timeout`; TCP_NODELAY set.
absl::StatusOr<int> ConnectTcp(const std::string& address, absl::Duration timeout);

}  // namespace epfabric::daemon::transport::socket_wire
