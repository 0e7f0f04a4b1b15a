#include "security/group_secrets.h"

#include <openssl/crypto.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "epfabric/common/peer_auth.h"

namespace epfabric::daemon::security {
namespace {

bool ConstantTimeEqual(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace

std::string TokenDigest(const std::string& token) { return common::Sha256Hex(token); }

bool TokenMatchesDigest(const std::string& token, const std::string& digest) {
  return !token.empty() && ConstantTimeEqual(TokenDigest(token), digest);
}

std::string DataKey(const std::string& token) { return common::HmacSha256Hex(token, "epfabric data v1"); }

std::string DeletionKey(const std::string& token) { return common::HmacSha256Hex(token, "epfabric retire v1"); }

std::string RetireProof(const std::string& deletion_key, const std::string& name, const std::string& nonce) {
  return common::HmacSha256Hex(deletion_key, absl::StrCat("epfd-retire|", name, "|", nonce));
}

bool RetireProofMatches(const std::string& deletion_key, const std::string& name, const std::string& nonce,
                        const std::string& proof) {
  if (deletion_key.empty() || nonce.size() != 32) return false;
  for (char c : nonce) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return ConstantTimeEqual(RetireProof(deletion_key, name, nonce), proof);
}

}  // namespace epfabric::daemon::security
