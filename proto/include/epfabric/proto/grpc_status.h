// The one place where absl::Status and grpc::Status meet: services convert at their edge, clients on receipt.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace epfabric {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace epfabric
