// What a member certificate lets its holder act as: the ranks it may claim in which fabric, read from its subject
// common name (docs/security.md, "Credentials").
//  - "epfabric-member:<fabric_id>:<rank>": exactly that rank;
//  - "epfabric-member:<lws>:pod:<pod>" (a LeaderWorkerSet pod; cert-manager's csi-driver writes the pod's name):
//    <pod> is the leader "<lws>-<group>" or a worker "<lws>-<group>-<worker>" (decimal, no leading zeros, worker
//    >= 1), its fabric is "<lws>-<group>" (the leader's name, so no two LWS groups share one) and its ranks are
//    [worker x ranks_per_pod, (worker + 1) x ranks_per_pod) (the leader is worker 0).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace epfabric::daemon::security {

inline constexpr int kMaxFabricRanks = 4096;  // --world_size's bound

struct MemberScope {
  int first_rank = -1;
  int end_rank = -1;  // one past the last rank
  std::string pod;    // the pod a pod certificate names; empty for a rank certificate
  bool Covers(int rank) const { return rank >= first_rank && rank < end_rank; }
  // "rank 3", or "pod moe-0-2 (ranks 4-5)".
  std::string Describe() const;
};

// The scope of a member CN in fabric `fabric_id`, whose pods hold `ranks_per_pod` ranks each (0: pod certificates
// are not accepted). UNAUTHENTICATED says why a CN does not fit: not a member CN, another fabric, a pod name that is
// not one of this fabric's LeaderWorkerSet pods, a pod CN without --ranks_per_pod.
absl::StatusOr<MemberScope> MemberScopeOf(absl::string_view cn, absl::string_view fabric_id, int ranks_per_pod);

// Whether `cn` has the form of a member CN at all (either kind, any fabric).
bool IsMemberCommonName(absl::string_view cn);

// The subject common name of the first certificate in the PEM file at `path` (INVALID_ARGUMENT when it cannot be
// read or has not exactly one CN).
absl::StatusOr<std::string> CertificateCommonName(const std::string& path);

}  // namespace epfabric::daemon::security
