#include "epfabric/common/peer_auth.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <vector>

#include <grpcpp/support/byte_buffer.h>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace epfabric::common {
namespace {

constexpr absl::string_view kVersion = "v3";

absl::string_view RoleName(PeerRole role) { return role == PeerRole::kMember ? "member" : "ops"; }

std::string Mac(absl::string_view secret, absl::string_view message) { return HmacSha256Hex(secret, message); }

std::string SignedText(absl::string_view fabric_id, absl::string_view method, absl::string_view role, int rank,
                       int64_t unix_ms, absl::string_view nonce, absl::string_view body_sha256,
                       absl::string_view audience) {
  return absl::StrCat("epfabric-peer-", kVersion, "|", fabric_id, "|", method, "|", role, "|", rank, "|", unix_ms, "|",
                      nonce, "|", body_sha256, "|", audience);
}

bool IsAudience(absl::string_view text) {
  return text.size() <= 5 && std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::string ReplyText(absl::string_view fabric_id, absl::string_view method, absl::string_view request_nonce,
                      absl::string_view response) {
  return absl::StrCat("epfabric-peer-reply-", kVersion, "|", fabric_id, "|", method, "|", request_nonce, "|",
                      Sha256Hex(response));
}

bool IsLowerHex(absl::string_view text, size_t size) {
  return text.size() == size &&
         std::all_of(text.begin(), text.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// The bytes of a serialized message (the ByteBuffer gRPC sends), concatenated.
std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (!buffer.Dump(&slices).ok()) return bytes;
  for (const grpc::Slice& slice : slices) bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  return bytes;
}

class ProofInterceptor final : public grpc::experimental::Interceptor {
 public:
  ProofInterceptor(const std::string* secret, const std::string* fabric_id, PeerProofClaim claim, std::string method,
                   const std::string* audience)
      : secret_(secret), fabric_id_(fabric_id), claim_(claim), method_(std::move(method)), audience_(audience) {}

  // A unary call sends its metadata and its one message in one batch, so the proof can cover the message. A call
  // whose metadata goes out alone (streaming) signs an empty body, which the server refuses unless it is empty.
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      std::multimap<std::string, std::string>* metadata = methods->GetSendInitialMetadata();
      std::string nonce;
      if (auto it = metadata->find(kPeerNonceMetadataKey); it != metadata->end()) {
        nonce = it->second;
        metadata->erase(it);
      }
      std::string body;
      if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE)) {
        body = Flatten(*methods->GetSerializedSendMessage());
      }
      metadata->emplace(kPeerAuthMetadataKey,
                        MakePeerProof(*secret_, *fabric_id_, method_, claim_, body, absl::Now(), nonce, *audience_));
    }
    methods->Proceed();
  }

 private:
  const std::string* secret_;
  const std::string* fabric_id_;
  const PeerProofClaim claim_;
  const std::string method_;
  const std::string* audience_;
};

class ProofInterceptorFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  ProofInterceptorFactory(std::string secret, std::string fabric_id, PeerProofClaim claim, std::string audience)
      : secret_(std::move(secret)), fabric_id_(std::move(fabric_id)), claim_(claim), audience_(std::move(audience)) {}

  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo* info) override {
    return new ProofInterceptor(&secret_, &fabric_id_, claim_, info->method(), &audience_);
  }

 private:
  const std::string secret_;
  const std::string fabric_id_;
  const PeerProofClaim claim_;
  const std::string audience_;
};

}  // namespace

std::string HmacSha256Hex(absl::string_view key, absl::string_view message) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(message.data()),
       message.size(), mac, &length);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(mac), length));
}

absl::StatusOr<std::string> ReadFabricSecretFile(const std::string& path, absl::string_view flag) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": cannot open '", path, "'"));
  struct stat st {};
  std::string secret;
  absl::Status status;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    status = absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", path, "' is not a regular file"));
  } else if (st.st_uid != ::geteuid()) {
    status = absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", path, "' is owned by uid ", st.st_uid,
                                                     ", not by this user (uid ", ::geteuid(), ")"));
  } else if ((st.st_mode & 077) != 0) {
    status = absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": '", path, "' has mode ", absl::StrFormat("%04o", st.st_mode & 0777),
                     "; a fabric secret must not be readable or writable by group or others (chmod 600)"));
  } else if (st.st_size > 4096) {
    status = absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", path, "' is larger than 4096 bytes"));
  } else {
    secret.resize(static_cast<size_t>(st.st_size));
    const ssize_t got = ::read(fd, secret.data(), secret.size());
    if (got != static_cast<ssize_t>(secret.size())) {
      status = absl::InvalidArgumentError(absl::StrCat("--", flag, ": cannot read '", path, "'"));
    }
  }
  ::close(fd);
  if (!status.ok()) return status;
  absl::string_view trimmed = absl::StripTrailingAsciiWhitespace(secret);
  if (trimmed.size() < kMinFabricSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", path, "' holds ", trimmed.size(),
                                                   " bytes; a fabric secret needs at least ", kMinFabricSecretBytes));
  }
  return std::string(trimmed);
}

std::string Sha256Hex(absl::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_Digest(data.data(), data.size(), digest, &length, EVP_sha256(), nullptr);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), length));
}

std::string NewPeerNonce() {
  unsigned char nonce_bytes[12];
  RAND_bytes(nonce_bytes, sizeof(nonce_bytes));
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(nonce_bytes), sizeof(nonce_bytes)));
}

std::string MakePeerProof(absl::string_view secret, absl::string_view fabric_id, absl::string_view method,
                          const PeerProofClaim& claim, absl::string_view body, absl::Time now, absl::string_view nonce,
                          absl::string_view audience) {
  const std::string fresh = nonce.empty() ? NewPeerNonce() : std::string(nonce);
  const int64_t unix_ms = absl::ToUnixMillis(now);
  const absl::string_view role = RoleName(claim.role);
  const std::string body_sha256 = Sha256Hex(body);
  return absl::StrCat(
      kVersion, ":", role, ":", claim.rank, ":", unix_ms, ":", fresh, ":", body_sha256, ":", audience, ":",
      Mac(secret, SignedText(fabric_id, method, role, claim.rank, unix_ms, fresh, body_sha256, audience)));
}

absl::StatusOr<VerifiedPeerProof> VerifyPeerProof(absl::string_view secret, absl::string_view fabric_id,
                                                  absl::string_view method, absl::string_view proof,
                                                  absl::string_view body, absl::Time now,
                                                  absl::string_view expected_audience) {
  if (proof.empty()) {
    return absl::UnauthenticatedError(
        absl::StrCat(method, ": no fabric credential (", kPeerAuthMetadataKey, " metadata) on the call"));
  }
  const std::vector<absl::string_view> parts = absl::StrSplit(proof, ':');
  VerifiedPeerProof verified;
  PeerProofClaim& claim = verified.claim;
  int64_t unix_ms = 0;
  if (parts.size() != 8 || parts[0] != kVersion || !absl::SimpleAtoi(parts[2], &claim.rank) ||
      !absl::SimpleAtoi(parts[3], &unix_ms) || !IsLowerHex(parts[4], 24) || !IsLowerHex(parts[5], 64) ||
      !IsAudience(parts[6]) || parts[7].size() != 64 || absl::StrCat(claim.rank) != parts[2] ||
      absl::StrCat(unix_ms) != parts[3]) {
    // Numbers in their one canonical spelling: a proof has exactly one text.
    return absl::UnauthenticatedError(absl::StrCat(method, ": malformed fabric credential"));
  }
  if (parts[1] == "member") {
    claim.role = PeerRole::kMember;
    if (claim.rank < 0) return absl::UnauthenticatedError(absl::StrCat(method, ": malformed fabric credential"));
  } else if (parts[1] == "ops") {
    claim.role = PeerRole::kOps;
    if (claim.rank != -1) return absl::UnauthenticatedError(absl::StrCat(method, ": malformed fabric credential"));
  } else {
    return absl::UnauthenticatedError(absl::StrCat(method, ": malformed fabric credential"));
  }
  const std::string expected =
      Mac(secret, SignedText(fabric_id, method, parts[1], claim.rank, unix_ms, parts[4], parts[5], parts[6]));
  if (CRYPTO_memcmp(expected.data(), parts[7].data(), expected.size()) != 0) {
    return absl::UnauthenticatedError(absl::StrCat(method, ": the fabric credential does not verify for fabric '",
                                                   fabric_id, "' (another fabric id or secret, or a forgery)"));
  }
  const absl::Duration skew = absl::AbsDuration(now - absl::FromUnixMillis(unix_ms));
  if (skew > kPeerAuthMaxSkew) {
    return absl::UnauthenticatedError(absl::StrCat(method, ": the fabric credential is ", absl::FormatDuration(skew),
                                                   " away from this daemon's clock (limit ",
                                                   absl::FormatDuration(kPeerAuthMaxSkew), ")"));
  }
  // The signed audience is authentic; it must name this daemon (a proof captured by whoever holds a dead member's
  // port is no good at any other member).
  if (!expected_audience.empty() && parts[6] != expected_audience) {
    return absl::UnauthenticatedError(absl::StrCat(method, ": the fabric credential was made for another daemon (port ",
                                                   parts[6].empty() ? "none" : parts[6], ", this one listens on ",
                                                   expected_audience, ")"));
  }
  // The signed digest is authentic; the request must be the one it was made for.
  if (Sha256Hex(body) != parts[5]) {
    return absl::UnauthenticatedError(
        absl::StrCat(method, ": the fabric credential was made for another request (its body's SHA-256 differs)"));
  }
  verified.nonce = std::string(parts[4]);
  verified.time = absl::FromUnixMillis(unix_ms);
  return verified;
}

std::string MakePeerReplyProof(absl::string_view secret, absl::string_view fabric_id, absl::string_view method,
                               absl::string_view request_nonce, absl::string_view response) {
  return absl::StrCat(kVersion, ":", Mac(secret, ReplyText(fabric_id, method, request_nonce, response)));
}

absl::Status VerifyPeerReplyProof(absl::string_view secret, absl::string_view fabric_id, absl::string_view method,
                                  absl::string_view request_nonce, absl::string_view response,
                                  absl::string_view proof) {
  if (proof.empty()) {
    return absl::UnauthenticatedError(absl::StrCat(method, ": the answer carries no fabric proof (",
                                                   kPeerReplyMetadataKey, "): its server does not hold the secret"));
  }
  const std::string expected = MakePeerReplyProof(secret, fabric_id, method, request_nonce, response);
  if (proof.size() != expected.size() || CRYPTO_memcmp(expected.data(), proof.data(), expected.size()) != 0) {
    return absl::UnauthenticatedError(absl::StrCat(
        method,
        ": the answer's fabric proof does not verify (its server does not hold this fabric's secret, or the "
        "answer was made for another call)"));
  }
  return absl::OkStatus();
}

std::string AddPeerNonce(grpc::ClientContext& context) {
  std::string nonce = NewPeerNonce();
  context.AddMetadata(kPeerNonceMetadataKey, nonce);
  return nonce;
}

std::string PeerReplyProof(const grpc::ClientContext& context) {
  const auto& trailing = context.GetServerTrailingMetadata();
  auto it = trailing.find(kPeerReplyMetadataKey);
  if (it == trailing.end()) return "";
  return std::string(it->second.data(), it->second.size());
}

absl::Status PeerNonceCache::Remember(absl::string_view method, const VerifiedPeerProof& proof, absl::Time now) {
  absl::MutexLock lock(&mutex_);
  if (now >= next_sweep_ || expiry_.size() >= capacity_) {
    for (auto entry = expiry_.begin(); entry != expiry_.end();) {
      if (entry->second < now) {
        expiry_.erase(entry++);
      } else {
        ++entry;
      }
    }
    next_sweep_ = now + absl::Seconds(1);
  }
  // Kept until the proof leaves the window (its time plus the skew), after which the time check refuses it anyway.
  const absl::Time until = proof.time + kPeerAuthMaxSkew;
  auto it = expiry_.find(proof.nonce);
  if (it != expiry_.end() && it->second >= now) {
    return absl::UnauthenticatedError(
        absl::StrCat(method, ": the fabric credential was used already (a replayed proof; its nonce is spent)"));
  }
  if (it == expiry_.end() && expiry_.size() >= capacity_) {
    return absl::ResourceExhaustedError(absl::StrCat(method, ": ", capacity_, " fabric credentials seen in the last ",
                                                     absl::FormatDuration(kPeerAuthMaxSkew * 2), "; try again"));
  }
  expiry_[proof.nonce] = until;
  return absl::OkStatus();
}

std::string PeerAudience(absl::string_view address) {
  const size_t colon = address.rfind(':');
  return colon == absl::string_view::npos ? "" : std::string(address.substr(colon + 1));
}

std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface> MakePeerProofInterceptorFactory(
    std::string secret, std::string fabric_id, PeerProofClaim claim, std::string audience) {
  return std::make_unique<ProofInterceptorFactory>(std::move(secret), std::move(fabric_id), claim, std::move(audience));
}

}  // namespace epfabric::common
