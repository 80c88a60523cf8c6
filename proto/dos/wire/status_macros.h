// Status propagation macros for absl::Status / absl::StatusOr<T>.
//
// Debian 12's abseil (20220623) predates absl's own status macros, so the
// project defines them once, here. Project code does not throw: every
// fallible function returns absl::Status or absl::StatusOr<T>.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define DOS_STATUS_CONCAT_INNER_(a, b) a##b
#define DOS_STATUS_CONCAT_(a, b) DOS_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status) and returns it from the calling function
// if it is not OK.
#define DOS_RETURN_IF_ERROR(expr)                  \
  do {                                             \
    ::absl::Status dos_status_ = (expr);           \
    if (!dos_status_.ok()) return dos_status_;     \
  } while (0)

// `DOS_ASSIGN_OR_RETURN(auto x, MakeX());` evaluates an absl::StatusOr<T>,
// returns its status on error and otherwise moves the value into `lhs`.
#define DOS_ASSIGN_OR_RETURN(lhs, expr) \
  DOS_ASSIGN_OR_RETURN_IMPL_(DOS_STATUS_CONCAT_(dos_statusor_, __LINE__), lhs, expr)
#define DOS_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()
