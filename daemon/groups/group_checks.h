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

// Checks a CreateGroup request on its own (name, ranks, sizes, sharing). Errors name the field and value.
absl::Status ValidateCreateGroup(const v1::CreateGroupRequest& request, int world_size);

// 1-64 characters of [A-Za-z0-9._-] (the name is part of shared memory names).
bool ValidGroupName(const std::string& name);

// Whether `sharing` (UNSPECIFIED: the backend's default) can be used on `backend`.
bool SharingFitsBackend(v1::MemorySharing sharing, v1::Backend backend);

// True when a and b are equal, in time that depends only on their lengths.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

// 128 random bits from the kernel's CSPRNG, hex encoded: group tokens and lease ids.
std::string RandomHex128();

// A group with a member that is not UP in `view`, or not the incarnation that committed (`incarnations`, by group
// rank; empty when unknown), has lost memory: it is degraded.
bool LostAMember(const v1::GroupInfo& info, const std::vector<uint64_t>& incarnations, const v1::Membership& view);

}  // namespace epfabric::daemon::groups
