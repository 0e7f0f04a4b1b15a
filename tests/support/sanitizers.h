// How much slower a sanitizer build runs the timed paths of the integration tests on CI's 2 cores: time bounds are
// multiplied by it (they catch gross regressions there; the regular build is the one that measures).
#pragma once

namespace epfabric::testing {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr double kSanitizerSlowdown = 5;
#else
inline constexpr double kSanitizerSlowdown = 1;
#endif

}  // namespace epfabric::testing
