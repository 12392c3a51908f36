// The one conversion between absl::Status (every engine's API) and grpc::Status (the service
// adapters and the gRPC clients). Abseil's codes are gRPC's codes, so the mapping is 1:1.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "contracts/limits.h"
#include "grpcpp/support/status.h"

namespace dsa {

/// absl::Status -> grpc::Status with the same code and message; a message over
/// kMaxStatusMessageBytes is cut there and says how many bytes were cut.
inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const absl::string_view message = status.message();
  if (message.size() <= kMaxStatusMessageBytes) {
    return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(message));
  }
  constexpr size_t kKept = kMaxStatusMessageBytes - 64;  // room for the note
  return grpc::Status(
      static_cast<grpc::StatusCode>(status.code()),
      absl::StrCat(message.substr(0, kKept), "... (", message.size() - kKept, " more bytes cut)"));
}

/// grpc::Status -> absl::Status with the same code; the message prefixed "<context>: " when
/// `context` is not empty (e.g. "indexer worker host:port: Commit").
inline absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view context = {}) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      context.empty() ? status.error_message()
                                      : absl::StrCat(context, ": ", status.error_message()));
}

}  // namespace dsa
