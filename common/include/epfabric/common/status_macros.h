// Status propagation macros (the pattern of Abseil's internal status_macros.h, which Debian's Abseil does not ship).
//
//   EPF_RETURN_IF_ERROR(DoThing());               // returns the status from the enclosing function if not OK
//   EPF_ASSIGN_OR_RETURN(auto fd, OpenThing());   // declares/assigns the value, or returns the error
//
// Header-only and dependency-free apart from absl::Status, so every library (kernels included) may use it.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace epfabric::internal {
// absl::Status and absl::StatusOr<T> both reduce to an absl::Status for the early return.
inline const absl::Status& ToStatus(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& ToStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}
}  // namespace epfabric::internal

#define EPF_STATUS_CONCAT_INNER_(a, b) a##b
#define EPF_STATUS_CONCAT_(a, b) EPF_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status or absl::StatusOr) once; returns its status if it is not OK.
#define EPF_RETURN_IF_ERROR(expr)                                                     \
  do {                                                                                \
    if (auto epf_status_ = (expr); !::epfabric::internal::ToStatus(epf_status_).ok()) \
      return ::epfabric::internal::ToStatus(epf_status_);                             \
  } while (false)

// Evaluates `rexpr` (an absl::StatusOr<T>); returns its status if not OK, else moves the value into `lhs`, which may
// be a declaration (`auto x`, `const Foo& y` is not allowed: the value is moved) or an existing lvalue.
#define EPF_ASSIGN_OR_RETURN(lhs, rexpr) \
  EPF_ASSIGN_OR_RETURN_IMPL_(EPF_STATUS_CONCAT_(epf_status_or_, __LINE__), lhs, rexpr)

#define EPF_ASSIGN_OR_RETURN_IMPL_(status_or, lhs, rexpr)    \
  auto status_or = (rexpr);                                  \
  if (!status_or.ok()) return std::move(status_or).status(); \
  lhs = std::move(status_or).value()
