#include "groups/group_checks.h"

#include <sys/random.h>

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "epfabric/kernels/transport/ring.h"

namespace epfabric::daemon::groups {

namespace {

// The normal-mode parts of a low-latency group (num_normal_bytes of every NVL region, num_normal_rdma_bytes of every
// RDMA region): the same rule for a client's request and for a group a peer describes. `prefix` names the message
// ("" or "group.") in the error.
absl::Status CheckNormalParts(const char* prefix, uint64_t normal_bytes, uint64_t normal_rdma_bytes, bool low_latency,
                              uint64_t nvl_bytes, uint64_t rdma_bytes) {
  if (normal_bytes == 0 && normal_rdma_bytes == 0) return absl::OkStatus();
  if (normal_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "num_normal_rdma_bytes: ", normal_rdma_bytes,
                                                   " needs num_normal_bytes > 0 (a group that serves both modes)"));
  }
  if (!low_latency) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "num_normal_bytes: ", normal_bytes,
                                                   " needs low_latency (a normal-mode group's whole region is normal "
                                                   "mode's)"));
  }
  if (normal_bytes % kRegionPartAlignment != 0 || normal_bytes >= nvl_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "num_normal_bytes: ", normal_bytes, " must be a multiple of ", kRegionPartAlignment,
                     " below num_nvl_bytes (", nvl_bytes, "), leaving the rest to low latency"));
  }
  // Across hosts both modes need the RDMA region too: without a split there, their writes would overlap.
  if (rdma_bytes == 0 && normal_rdma_bytes != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "num_normal_rdma_bytes: ", normal_rdma_bytes, " needs num_rdma_bytes > 0"));
  }
  if (rdma_bytes > 0 &&
      (normal_rdma_bytes == 0 || normal_rdma_bytes % kRegionPartAlignment != 0 || normal_rdma_bytes >= rdma_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "num_normal_rdma_bytes: ", normal_rdma_bytes, " must be a positive multiple of ", kRegionPartAlignment,
        " below num_rdma_bytes (", rdma_bytes, ") in a group with an RDMA region that serves both modes"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateCreateGroup(const v1::CreateGroupRequest& request, int world_size) {
  if (!ValidGroupName(request.name())) {
    return absl::InvalidArgumentError(
        absl::StrCat("name: '", Clip(request.name()), "' must be 1-64 characters of [A-Za-z0-9._-]"));
  }
  if (request.ranks().empty()) return absl::InvalidArgumentError("ranks: a group needs at least one rank");
  std::set<int> seen;
  for (int rank : request.ranks()) {
    if (rank < 0 || rank >= world_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("ranks: ", rank, " is outside the fabric (ranks 0..", world_size - 1, ")"));
    }
    if (!seen.insert(rank).second) return absl::InvalidArgumentError(absl::StrCat("ranks: ", rank, " appears twice"));
  }
  if (request.num_nvl_bytes() == 0) return absl::InvalidArgumentError("num_nvl_bytes: must be positive");
  for (auto [field, bytes] :
       {std::pair{"num_nvl_bytes", request.num_nvl_bytes()}, std::pair{"num_rdma_bytes", request.num_rdma_bytes()}}) {
    if (bytes > kMaxRegionBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", bytes, " bytes is over the limit of one region (", kMaxRegionBytes, ")"));
    }
  }
  if (!v1::MemorySharing_IsValid(request.memory_sharing())) {
    return absl::InvalidArgumentError(absl::StrCat("memory_sharing: ", request.memory_sharing(), " is not a value"));
  }
  if (request.transport_channels() > static_cast<uint32_t>(kernels::transport::kMaxChannels)) {
    return absl::InvalidArgumentError(absl::StrCat("transport_channels: ", request.transport_channels(),
                                                   " is over the limit of ", kernels::transport::kMaxChannels));
  }
  if (request.ring_slots() != 0 && !kernels::transport::ValidRingSlots(request.ring_slots())) {
    return absl::InvalidArgumentError(absl::StrCat("ring_slots: ", request.ring_slots(), " is not a power of two in [",
                                                   kernels::transport::kMinRingSlots, ", ",
                                                   kernels::transport::kMaxRingSlots, "]"));
  }
  return CheckNormalParts("", request.num_normal_bytes(), request.num_normal_rdma_bytes(), request.low_latency(),
                          request.num_nvl_bytes(), request.num_rdma_bytes());
}

std::string Clip(const std::string& text, size_t limit) {
  if (text.size() <= limit) return text;
  return absl::StrCat(text.substr(0, limit), "... (", text.size(), " bytes)");
}

absl::Status ValidateGroupInfo(const v1::GroupInfo& info, int world_size) {
  if (!ValidGroupName(info.name())) {
    return absl::InvalidArgumentError(
        absl::StrCat("group.name: '", Clip(info.name()), "' must be 1-64 characters of [A-Za-z0-9._-]"));
  }
  if (info.ranks().empty() || info.ranks_size() > world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("group.ranks: ", info.ranks_size(), " ranks (a group has 1..", world_size, ")"));
  }
  std::vector<bool> seen(static_cast<size_t>(world_size), false);
  for (int rank : info.ranks()) {
    if (rank < 0 || rank >= world_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("group.ranks: ", rank, " is outside the fabric (ranks 0..", world_size - 1, ")"));
    }
    if (seen[static_cast<size_t>(rank)]) {
      return absl::InvalidArgumentError(absl::StrCat("group.ranks: ", rank, " appears twice"));
    }
    seen[static_cast<size_t>(rank)] = true;
  }
  if (info.num_nvl_bytes() == 0 || info.num_nvl_bytes() > kMaxRegionBytes || info.num_rdma_bytes() > kMaxRegionBytes) {
    return absl::InvalidArgumentError(absl::StrCat("group: region sizes ", info.num_nvl_bytes(), " (NVL) and ",
                                                   info.num_rdma_bytes(), " (RDMA) are not in 1..", kMaxRegionBytes));
  }
  if (info.num_rdma_bytes() > 0 &&
      (info.transport_channels() < 1 || info.transport_channels() > kernels::transport::kMaxChannels ||
       !kernels::transport::ValidRingSlots(info.ring_slots()))) {
    return absl::InvalidArgumentError(absl::StrCat("group: ", info.transport_channels(), " transport channels of ",
                                                   info.ring_slots(), " slots (1..", kernels::transport::kMaxChannels,
                                                   " channels, slots a power of two)"));
  }
  return CheckNormalParts("group.", info.num_normal_bytes(), info.num_normal_rdma_bytes(), info.low_latency(),
                          info.num_nvl_bytes(), info.num_rdma_bytes());
}

absl::Status ValidateCommitMembers(const v1::GroupInfo& info,
                                   const google::protobuf::RepeatedPtrField<v1::PrepareGroupResponse>& members) {
  if (members.size() != info.ranks_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("members: ", members.size(), " descriptors for ", info.ranks_size(), " ranks"));
  }
  for (int i = 0; i < members.size(); ++i) {
    const auto& regions = members[i].regions();
    const int expected = info.num_rdma_bytes() > 0 ? 2 : 1;
    if (regions.size() != expected) {
      return absl::InvalidArgumentError(
          absl::StrCat("members[", i, "].regions: ", regions.size(), " regions, the group has ", expected));
    }
    for (const v1::RegionDescriptor& region : regions) {
      const bool nvl = region.kind() == v1::RegionDescriptor::KIND_NVL;
      const bool rdma = region.kind() == v1::RegionDescriptor::KIND_RDMA;
      const uint64_t size = nvl ? info.num_nvl_bytes() : info.num_rdma_bytes();
      // An allocator may round a region up (cuMem granularity), never down.
      if ((!nvl && !rdma) || region.rank() != i || region.size_bytes() < size) {
        return absl::InvalidArgumentError(
            absl::StrCat("members[", i, "]: a ", v1::RegionDescriptor::Kind_Name(region.kind()), " region of rank ",
                         region.rank(), " and ", region.size_bytes(), " bytes does not describe group rank ", i));
      }
    }
    if (info.num_rdma_bytes() > 0 && members[i].transport().region_bytes() < info.num_rdma_bytes()) {
      return absl::InvalidArgumentError(absl::StrCat("members[", i, "].transport: region of ",
                                                     members[i].transport().region_bytes(), " bytes, the group has ",
                                                     info.num_rdma_bytes()));
    }
  }
  return absl::OkStatus();
}

bool ValidGroupName(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-';
  });
}

bool SharingFitsBackend(v1::MemorySharing sharing, v1::Backend backend) {
  if (sharing == v1::MEMORY_SHARING_UNSPECIFIED) return true;
  if (backend == v1::BACKEND_HOST) return sharing == v1::MEMORY_SHARING_POSIX_SHM;
  return sharing == v1::MEMORY_SHARING_CUDA_IPC || sharing == v1::MEMORY_SHARING_POSIX_FD;
}

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  volatile unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff = static_cast<unsigned char>(diff | (a[i] ^ b[i]));
  return diff == 0;
}

std::string RandomHex128() {
  unsigned char bytes[16];
  size_t filled = 0;
  while (filled < sizeof(bytes)) {
    const ssize_t got = getrandom(bytes + filled, sizeof(bytes) - filled, 0);
    if (got > 0) filled += static_cast<size_t>(got);
  }
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

bool LostAMember(const v1::GroupInfo& info, const std::vector<uint64_t>& incarnations, const v1::Membership& view) {
  for (int i = 0; i < info.ranks_size(); ++i) {
    const v1::MemberInfo& member = view.members(info.ranks(i));
    if (member.state() != v1::MEMBER_STATE_UP) return true;
    if (i < static_cast<int>(incarnations.size()) && member.incarnation() != incarnations[i]) return true;
  }
  return false;
}

std::vector<int> LostRanks(const v1::GroupInfo& info, const std::vector<uint64_t>& incarnations,
                           const v1::Membership& view) {
  std::vector<int> lost;
  for (int i = 0; i < info.ranks_size(); ++i) {
    const v1::MemberInfo& member = view.members(info.ranks(i));
    if (member.state() != v1::MEMBER_STATE_UP ||
        (i < static_cast<int>(incarnations.size()) && member.incarnation() != incarnations[i])) {
      lost.push_back(i);
    }
  }
  return lost;
}

bool CanRestore(const v1::GroupInfo& info, const std::vector<uint64_t>& incarnations, const v1::Membership& view) {
  // Without the committed incarnations (a group adopted from Join records) a restart cannot be told from a pause.
  return incarnations.size() == static_cast<size_t>(info.ranks_size()) && !LostAMember(info, incarnations, view);
}

uint64_t MemberRegionBytes(const v1::GroupInfo& info) {
  return info.num_nvl_bytes() + info.num_rdma_bytes() + info.num_normal_bytes() + info.num_normal_rdma_bytes();
}

}  // namespace epfabric::daemon::groups
