// Checks and secrets shared by the coordinator's registry, this daemon's groups and the leases: request validation,
// group names, constant-time token comparison, random tokens and lease ids, and when a group counts as degraded.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "epfabric/v1/control.pb.h"
#include "epfabric/v1/peer.pb.h"

namespace epfabric::daemon::groups {

// Largest region a CreateGroup may ask for, whatever the daemons' limits (catches unit mistakes).
inline constexpr uint64_t kMaxRegionBytes = 1ull << 40;
// A low-latency group's normal-mode part (num_normal_bytes) ends on this boundary, where the low-latency part starts.
inline constexpr uint64_t kRegionPartAlignment = 4096;

// Checks a CreateGroup request on its own (name, ranks, sizes, sharing). Errors name the field and value.
absl::Status ValidateCreateGroup(const v1::CreateGroupRequest& request, int world_size);

// 1-64 characters of [A-Za-z0-9._-] (the name is part of shared memory names).
bool ValidGroupName(const std::string& name);

// A GroupInfo that arrived from another daemon (Prepare, a Join's group records): a valid name, 1..world_size
// distinct ranks inside the fabric, region sizes in range. Errors name the field.
absl::Status ValidateGroupInfo(const v1::GroupInfo& info, int world_size);

// The descriptors a Commit carries for `info`: one set per group rank, each with an NVL region of the group's size
// (and an RDMA region when it has one), described for that rank.
absl::Status ValidateCommitMembers(const v1::GroupInfo& info,
                                   const google::protobuf::RepeatedPtrField<v1::PrepareGroupResponse>& members);

// At most `limit` bytes of `text` for an error message, with its length when cut (a 10 KB name must not turn an
// INVALID_ARGUMENT into a metadata-size error).
std::string Clip(const std::string& text, size_t limit = 80);

// What one daemon holds at most (RESOURCE_EXHAUSTED beyond): groups, and bytes of regions in all (0: no limit).
struct GroupLimits {
  size_t max_groups = 256;
  uint64_t max_total_region_bytes = 0;
};

// What one client identity (a tenant label, else host and uid) may hold across the fabric, counted by the
// coordinator (0: no limit): groups, and bytes of regions on any one member (the sum over its groups on that member).
struct ClientQuotas {
  size_t max_groups = 0;
  uint64_t max_region_bytes = 0;
};

// Bytes of regions one member holds for a group described by `info` (every region kind together).
uint64_t MemberRegionBytes(const v1::GroupInfo& info);

// Whether `sharing` (UNSPECIFIED: the backend's default) can be used on `backend`.
bool SharingFitsBackend(v1::MemorySharing sharing, v1::Backend backend);

// True when a and b are equal, in time that depends only on their lengths.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

// 128 random bits from the kernel's CSPRNG, hex encoded: group tokens and lease ids.
std::string RandomHex128();

// A group with a member that is not UP in `view`, or not the incarnation that committed (`incarnations`, by group
// rank; empty when unknown), has lost memory: it is degraded.
bool LostAMember(const v1::GroupInfo& info, const std::vector<uint64_t>& incarnations, const v1::Membership& view);
// The group ranks whose member is not UP, or is not the incarnation that committed.
std::vector<int> LostRanks(const v1::GroupInfo& info, const std::vector<uint64_t>& incarnations,
                           const v1::Membership& view);
// Whether a DEGRADED group may be READY again: every member is UP with the incarnation that committed it (a paused
// member came back; a restarted one did not). Never for groups whose committed incarnations are unknown.
bool CanRestore(const v1::GroupInfo& info, const std::vector<uint64_t>& incarnations, const v1::Membership& view);

}  // namespace epfabric::daemon::groups
