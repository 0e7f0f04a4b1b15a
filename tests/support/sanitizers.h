// How much slower a sanitizer build runs the timed paths of the integration tests on CI's 2 cores: time bounds are
// multiplied by it (they catch gross regressions there; the regular build is the one that measures). GCC defines
// __SANITIZE_ADDRESS__ / __SANITIZE_THREAD__; clang 14 (CI's ASan build) only answers __has_feature.
#pragma once

#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define EPF_TESTS_UNDER_SANITIZER 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define EPF_TESTS_UNDER_SANITIZER 1
#endif

namespace epfabric::testing {

#if defined(EPF_TESTS_UNDER_SANITIZER)
inline constexpr double kSanitizerSlowdown = 5;
#else
inline constexpr double kSanitizerSlowdown = 1;
#endif

}  // namespace epfabric::testing
