// Checks shared by the host and cuda region allocators.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "memory/region.h"

namespace epfabric::daemon::memory {

// Group name, rank, size and kind of `spec` (not the sharing, which each backend checks).
absl::Status ValidateRegionSpec(const RegionSpec& spec);

// ResourceExhausted naming both sizes when `bytes` is over `max_region_bytes` (0 = no limit).
absl::Status CheckRegionLimit(const RegionSpec& spec, uint64_t max_region_bytes, absl::string_view backend);

// "nvl" or "rdma": the kind as it appears in shm names and messages.
absl::string_view KindName(v1::RegionDescriptor::Kind kind);

// Bounds check for Region::Zero: InvalidArgument unless [offset, offset + bytes) lies inside `size`.
absl::Status CheckZeroRange(uint64_t offset, uint64_t bytes, uint64_t size);

// "group 'g' rank 3 nvl region": how messages name a region.
std::string DescribeRegion(const RegionSpec& spec);

}  // namespace epfabric::daemon::memory
