// Early-return helpers for absl::Status / absl::StatusOr on the host (Abseil 2022 does not ship
// them).
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define DSA_CONCAT_INNER_(a, b) a##b
#define DSA_CONCAT_(a, b) DSA_CONCAT_INNER_(a, b)

/// Evaluates `expr` (an absl::Status) and returns it from the calling function if it is not OK.
#define DSA_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::absl::Status dsa_status_ = (expr);       \
    if (!dsa_status_.ok()) return dsa_status_; \
  } while (false)

// NOLINTBEGIN(bugprone-macro-parentheses): `lhs` may be a declaration, which cannot be
// parenthesized.
#define DSA_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(*tmp)

/// Evaluates `expr` (an absl::StatusOr<T>); on error returns its status, else moves the value into
/// `lhs` (which may be a declaration such as `auto x`).
#define DSA_ASSIGN_OR_RETURN(lhs, expr) \
  DSA_ASSIGN_OR_RETURN_IMPL_(DSA_CONCAT_(dsa_statusor_, __LINE__), lhs, expr)
// NOLINTEND(bugprone-macro-parentheses)
