#include "security/member_identity.h"

#include <openssl/bio.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace epfabric::daemon::security {
namespace {

constexpr absl::string_view kMemberPrefix = "epfabric-member";

// A number as LeaderWorkerSet writes it into pod names: decimal, no sign, no leading zero. Another spelling would
// be another pod's name for the same ranks.
std::optional<int64_t> CanonicalNumber(absl::string_view text) {
  if (text.empty() || text.size() > 9 || (text.size() > 1 && text[0] == '0')) return std::nullopt;
  for (char c : text) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return std::nullopt;
  }
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value)) return std::nullopt;
  return value;
}

absl::Status NotAMember(absl::string_view cn, absl::string_view fabric_id, absl::string_view why) {
  return absl::UnauthenticatedError(absl::StrCat("the certificate's CN '", cn, "' ", why, " (fabric ", fabric_id,
                                                 " takes 'epfabric-member:", fabric_id,
                                                 ":<rank>' or 'epfabric-member:<lws>:pod:<pod>')"));
}

}  // namespace

std::string MemberScope::Describe() const {
  if (pod.empty()) return absl::StrCat("rank ", first_rank);
  if (end_rank - first_rank == 1) return absl::StrCat("pod ", pod, " (rank ", first_rank, ")");
  return absl::StrCat("pod ", pod, " (ranks ", first_rank, "-", end_rank - 1, ")");
}

bool IsMemberCommonName(absl::string_view cn) { return absl::StartsWith(cn, absl::StrCat(kMemberPrefix, ":")); }

absl::StatusOr<MemberScope> MemberScopeOf(absl::string_view cn, absl::string_view fabric_id, int ranks_per_pod) {
  const std::vector<absl::string_view> parts = absl::StrSplit(cn, ':');
  if (parts.empty() || parts[0] != kMemberPrefix) return NotAMember(cn, fabric_id, "is not a member's");
  MemberScope scope;
  if (parts.size() == 3) {
    if (parts[1] != fabric_id) {
      return NotAMember(cn, fabric_id, absl::StrCat("names fabric ", parts[1], ", not ", fabric_id));
    }
    const std::optional<int64_t> rank = CanonicalNumber(parts[2]);
    if (!rank.has_value() || *rank >= kMaxFabricRanks) return NotAMember(cn, fabric_id, "names no rank");
    scope.first_rank = static_cast<int>(*rank);
    scope.end_rank = scope.first_rank + 1;
    return scope;
  }
  if (parts.size() != 4 || parts[2] != "pod" || parts[1].empty()) {
    return NotAMember(cn, fabric_id, "is neither a rank's nor a pod's");
  }
  const absl::string_view lws = parts[1];
  const absl::string_view pod = parts[3];
  // "<lws>-<group>" or "<lws>-<group>-<worker>": the LWS name is the CN's own field, so a pod of an LWS whose name
  // ends in "-<number>" is never read as a worker of a shorter-named one.
  if (!absl::StartsWith(pod, absl::StrCat(lws, "-"))) {
    return NotAMember(cn, fabric_id, absl::StrCat("names pod ", pod, ", which is no pod of LeaderWorkerSet ", lws));
  }
  const std::vector<absl::string_view> indexes = absl::StrSplit(pod.substr(lws.size() + 1), '-');
  const std::optional<int64_t> group = CanonicalNumber(indexes[0]);
  std::optional<int64_t> worker = 0;
  if (indexes.size() == 2) worker = CanonicalNumber(indexes[1]);
  if (!group.has_value() || indexes.size() > 2 || !worker.has_value() || (indexes.size() == 2 && *worker == 0)) {
    return NotAMember(
        cn, fabric_id,
        absl::StrCat("names pod ", pod, ", which is not '", lws, "-<group>' or '", lws, "-<group>-<worker>'"));
  }
  const std::string pod_fabric = absl::StrCat(lws, "-", *group);
  if (pod_fabric != fabric_id) {
    return NotAMember(cn, fabric_id,
                      absl::StrCat("names pod ", pod, " of fabric ", pod_fabric, " (LeaderWorkerSet ", lws, " group ",
                                   *group, "), not ", fabric_id));
  }
  if (ranks_per_pod <= 0) {
    return NotAMember(
        cn, fabric_id,
        absl::StrCat("names pod ", pod, ", and this daemon takes no pod certificates (no --ranks_per_pod)"));
  }
  if ((*worker + 1) * ranks_per_pod > kMaxFabricRanks) {
    return NotAMember(cn, fabric_id,
                      absl::StrCat("names pod ", pod, ", whose ranks would lie beyond ", kMaxFabricRanks - 1));
  }
  scope.first_rank = static_cast<int>(*worker * ranks_per_pod);
  scope.end_rank = scope.first_rank + ranks_per_pod;
  scope.pod = std::string(pod);
  return scope;
}

absl::StatusOr<std::string> CertificateCommonName(const std::string& path) {
  std::unique_ptr<BIO, decltype(&BIO_free)> file(BIO_new_file(path.c_str(), "r"), &BIO_free);
  if (file == nullptr) return absl::InvalidArgumentError(absl::StrCat("cannot read '", path, "'"));
  std::unique_ptr<X509, decltype(&X509_free)> certificate(PEM_read_bio_X509(file.get(), nullptr, nullptr, nullptr),
                                                          &X509_free);
  if (certificate == nullptr) return absl::InvalidArgumentError(absl::StrCat("'", path, "' holds no certificate"));
  const X509_NAME* subject = X509_get_subject_name(certificate.get());
  const int first = X509_NAME_get_index_by_NID(subject, NID_commonName, -1);
  if (first < 0 || X509_NAME_get_index_by_NID(subject, NID_commonName, first) >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the certificate in '", path, "' has ", first < 0 ? "no" : "more than one", " subject CN"));
  }
  const ASN1_STRING* data = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(subject, first));
  unsigned char* utf8 = nullptr;
  const int length = ASN1_STRING_to_UTF8(&utf8, data);
  if (length < 0) return absl::InvalidArgumentError(absl::StrCat("the certificate in '", path, "' has no readable CN"));
  std::string cn(reinterpret_cast<const char*>(utf8), static_cast<size_t>(length));
  OPENSSL_free(utf8);
  return cn;
}

}  // namespace epfabric::daemon::security
