// The one place where absl::Status becomes grpc::Status (canonical codes map
// one to one).
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace dos {

inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

}  // namespace dos
