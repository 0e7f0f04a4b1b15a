#include "epfabric/common/peer_auth.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace epfabric::common {
namespace {

constexpr absl::string_view kVersion = "v1";

absl::string_view RoleName(PeerRole role) { return role == PeerRole::kMember ? "member" : "ops"; }

std::string Mac(absl::string_view secret, absl::string_view message) { return HmacSha256Hex(secret, message); }

std::string SignedText(absl::string_view fabric_id, absl::string_view method, absl::string_view role, int rank,
                       int64_t unix_ms, absl::string_view nonce) {
  return absl::StrCat("epfabric-peer-", kVersion, "|", fabric_id, "|", method, "|", role, "|", rank, "|", unix_ms, "|",
                      nonce);
}

class ProofInterceptor final : public grpc::experimental::Interceptor {
 public:
  ProofInterceptor(const std::string* secret, const std::string* fabric_id, PeerProofClaim claim, std::string method)
      : secret_(secret), fabric_id_(fabric_id), claim_(claim), method_(std::move(method)) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace(kPeerAuthMetadataKey,
                                                 MakePeerProof(*secret_, *fabric_id_, method_, claim_, absl::Now()));
    }
    methods->Proceed();
  }

 private:
  const std::string* secret_;
  const std::string* fabric_id_;
  const PeerProofClaim claim_;
  const std::string method_;
};

class ProofInterceptorFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  ProofInterceptorFactory(std::string secret, std::string fabric_id, PeerProofClaim claim)
      : secret_(std::move(secret)), fabric_id_(std::move(fabric_id)), claim_(claim) {}

  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo* info) override {
    return new ProofInterceptor(&secret_, &fabric_id_, claim_, info->method());
  }

 private:
  const std::string secret_;
  const std::string fabric_id_;
  const PeerProofClaim claim_;
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
        absl::StrCat("--", flag, ": '", path, "' has mode 0", absl::StrCat(absl::Hex(st.st_mode & 0777)),
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

std::string MakePeerProof(absl::string_view secret, absl::string_view fabric_id, absl::string_view method,
                          const PeerProofClaim& claim, absl::Time now) {
  unsigned char nonce_bytes[12];
  RAND_bytes(nonce_bytes, sizeof(nonce_bytes));
  const std::string nonce =
      absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(nonce_bytes), sizeof(nonce_bytes)));
  const int64_t unix_ms = absl::ToUnixMillis(now);
  const absl::string_view role = RoleName(claim.role);
  return absl::StrCat(kVersion, ":", role, ":", claim.rank, ":", unix_ms, ":", nonce, ":",
                      Mac(secret, SignedText(fabric_id, method, role, claim.rank, unix_ms, nonce)));
}

absl::StatusOr<PeerProofClaim> VerifyPeerProof(absl::string_view secret, absl::string_view fabric_id,
                                               absl::string_view method, absl::string_view proof, absl::Time now) {
  if (proof.empty()) {
    return absl::UnauthenticatedError(
        absl::StrCat(method, ": no fabric credential (", kPeerAuthMetadataKey, " metadata) on the call"));
  }
  const std::vector<absl::string_view> parts = absl::StrSplit(proof, ':');
  PeerProofClaim claim;
  int64_t unix_ms = 0;
  if (parts.size() != 6 || parts[0] != kVersion || !absl::SimpleAtoi(parts[2], &claim.rank) ||
      !absl::SimpleAtoi(parts[3], &unix_ms) || parts[4].size() != 24 || parts[5].size() != 64) {
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
  const std::string expected = Mac(secret, SignedText(fabric_id, method, parts[1], claim.rank, unix_ms, parts[4]));
  if (CRYPTO_memcmp(expected.data(), parts[5].data(), expected.size()) != 0) {
    return absl::UnauthenticatedError(absl::StrCat(method, ": the fabric credential does not verify for fabric '",
                                                   fabric_id, "' (another fabric id or secret, or a forgery)"));
  }
  const absl::Duration skew = absl::AbsDuration(now - absl::FromUnixMillis(unix_ms));
  if (skew > kPeerAuthMaxSkew) {
    return absl::UnauthenticatedError(absl::StrCat(method, ": the fabric credential is ", absl::FormatDuration(skew),
                                                   " away from this daemon's clock (limit ",
                                                   absl::FormatDuration(kPeerAuthMaxSkew), ")"));
  }
  return claim;
}

std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface> MakePeerProofInterceptorFactory(
    std::string secret, std::string fabric_id, PeerProofClaim claim) {
  return std::make_unique<ProofInterceptorFactory>(std::move(secret), std::move(fabric_id), claim);
}

}  // namespace epfabric::common
