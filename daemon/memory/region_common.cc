#include "memory/region_common.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace epfabric::daemon::memory {

absl::Status ValidateRegionSpec(const RegionSpec& spec) {
  if (spec.group.empty() || spec.group.size() > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("RegionSpec.group '", spec.group, "' must have 1 to 64 characters, has ", spec.group.size()));
  }
  for (char c : spec.group) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return absl::InvalidArgumentError(
          absl::StrCat("RegionSpec.group '", spec.group, "' may only contain [A-Za-z0-9._-]"));
    }
  }
  if (spec.rank < 0) return absl::InvalidArgumentError(absl::StrCat("RegionSpec.rank ", spec.rank, " is negative"));
  if (spec.bytes == 0) return absl::InvalidArgumentError("RegionSpec.bytes must be positive, is 0");
  if (spec.kind != v1::RegionDescriptor::KIND_NVL && spec.kind != v1::RegionDescriptor::KIND_RDMA &&
      spec.kind != v1::RegionDescriptor::KIND_COMMANDS && spec.kind != v1::RegionDescriptor::KIND_STATS) {
    return absl::InvalidArgumentError(absl::StrCat("RegionSpec.kind ", static_cast<int>(spec.kind),
                                                   " must be KIND_NVL, KIND_RDMA, KIND_COMMANDS or KIND_STATS"));
  }
  return absl::OkStatus();
}

absl::Status CheckRegionLimit(const RegionSpec& spec, uint64_t max_region_bytes, absl::string_view backend) {
  if (max_region_bytes == 0 || spec.bytes <= max_region_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(DescribeRegion(spec), ": ", spec.bytes,
                                                   " bytes requested, over the ", backend, " limit of ",
                                                   max_region_bytes, " bytes per region"));
}

absl::string_view KindName(v1::RegionDescriptor::Kind kind) {
  switch (kind) {
    case v1::RegionDescriptor::KIND_NVL:
      return "nvl";
    case v1::RegionDescriptor::KIND_RDMA:
      return "rdma";
    case v1::RegionDescriptor::KIND_COMMANDS:
      return "commands";
    case v1::RegionDescriptor::KIND_STATS:
      return "stats";
    default:
      return "unspecified";
  }
}

absl::Status CheckZeroRange(uint64_t offset, uint64_t bytes, uint64_t size) {
  // Written without offset + bytes, which could wrap around.
  if (offset > size || bytes > size - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("Zero: offset ", offset, " + bytes ", bytes, " is outside the region of ", size, " bytes"));
  }
  return absl::OkStatus();
}

std::string DescribeRegion(const RegionSpec& spec) {
  return absl::StrCat("group '", spec.group, "' rank ", spec.rank, " ", KindName(spec.kind), " region");
}

}  // namespace epfabric::daemon::memory
