// Early returns on errors, as Abseil's and gRPC's own code writes them:
//
//   OFFLOAD_RETURN_IF_ERROR(store->Load(chunk));   // returns the Status unless it is OK
//   OFFLOAD_ASSIGN_OR_RETURN(Manifest m, ReadManifest(dir));  // or an lvalue: (m, ...)
//
// Both work in any function that returns absl::Status or absl::StatusOr<T>. The expression is
// evaluated once; a StatusOr's value is moved into the left-hand side.
#ifndef OFFLOAD_BASE_STATUS_MACROS_H_
#define OFFLOAD_BASE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define OFFLOAD_RETURN_IF_ERROR(expr)                                     \
  do {                                                                    \
    if (::absl::Status offload_status_ = (expr); !offload_status_.ok()) { \
      return offload_status_;                                             \
    }                                                                     \
  } while (false)

#define OFFLOAD_ASSIGN_OR_RETURN(lhs, expr)                                                       \
  OFFLOAD_ASSIGN_OR_RETURN_IMPL_(OFFLOAD_STATUS_MACROS_CONCAT_(offload_statusor_, __LINE__), lhs, \
                                 expr)

// Implementation details.
#define OFFLOAD_STATUS_MACROS_CONCAT_INNER_(a, b) a##b
#define OFFLOAD_STATUS_MACROS_CONCAT_(a, b) OFFLOAD_STATUS_MACROS_CONCAT_INNER_(a, b)
#define OFFLOAD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                   \
  if (!statusor.ok()) return std::move(statusor).status();  \
  lhs = std::move(statusor).value()

#endif  // OFFLOAD_BASE_STATUS_MACROS_H_
