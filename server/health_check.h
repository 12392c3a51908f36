// A client-side grpc.health.v1.Health/Check without generated health stubs (Debian's gRPC ships
// none): used by `dsa up` to wait for readiness and by the tests that run the binaries.
#pragma once

#include <chrono>
#include <string>

#include "grpcpp/grpcpp.h"

namespace dsa {

/// Calls grpc.health.v1.Health/Check for `service` (e.g. kReadinessService; under 128 bytes, as
/// its length is written in one byte) on `channel` with a
/// deadline of `timeout`; with `wait_for_ready`, a server not yet listening is waited for until the
/// deadline instead of failing at once. Returns the serving status: 1 SERVING, 2 NOT_SERVING,
/// 0 UNKNOWN (the default value); -1 when the call fails or the answer cannot be read.
/// The request is encoded by hand: field 1 (service, a string); the answer's field 1 (status,
/// an enum).
int CheckHealthStatus(grpc::Channel& channel, const std::string& service,
                      std::chrono::milliseconds timeout, bool wait_for_ready);

/// What CheckHealth saw: the call's status, and the serving status when the call succeeded (1
/// SERVING, 2 NOT_SERVING, 0 UNKNOWN; -1 when the call failed or the answer could not be read).
/// A server without the health service answers UNIMPLEMENTED; one that does not know the name,
/// NOT_FOUND.
struct HealthCheckResult {
  grpc::Status call;
  int serving = -1;
};

/// CheckHealthStatus with the call's status kept.
HealthCheckResult CheckHealth(grpc::Channel& channel, const std::string& service,
                              std::chrono::milliseconds timeout, bool wait_for_ready);

}  // namespace dsa
