// One structured log line per RPC (docs/reliability.md, "Traceability"): every dsa server logs each
// call it served with its method, status, duration, peer and the trace id of its `traceparent`
// metadata (common/trace_context.h), so that one request's calls can be followed across the
// coordinator and the workers by their common trace id.
#pragma once

#include <memory>

#include "grpcpp/support/server_interceptor.h"

namespace dsa {

/// The interceptor factory (thread-safe). Each call ends with a LogJson line "rpc" with fields
/// method, code (grpc::StatusCode name), duration_ms, peer, trace_id (when the call carried a
/// valid traceparent) and message (when not OK), at level "debug" for OK and the statuses a
/// client causes (CANCELLED, INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION,
/// OUT_OF_RANGE, RESOURCE_EXHAUSTED, UNAUTHENTICATED, PERMISSION_DENIED), "warn" for the others (a
/// server's failure: UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, ...). Health checks are not logged.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
NewRequestLogInterceptorFactory();

}  // namespace dsa
