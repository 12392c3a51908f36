// W3C Trace Context (https://www.w3.org/TR/trace-context/) for the `traceparent` gRPC metadata
// that links one request's calls across the coordinator and the workers (docs/reliability.md,
// "Traceability"). Only the traceparent header is carried; tracestate is not.
#pragma once

#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace dsa {

/// The gRPC metadata key (lower case, as gRPC requires).
inline constexpr char kTraceparentKey[] = "traceparent";

/// One span's place in a trace: version 00, a 16-byte trace id and an 8-byte parent (span) id as
/// lower-case hex, and the flags byte (01 = sampled).
struct TraceContext {
  std::string trace_id;   // 32 hex digits, not all zero
  std::string parent_id;  // 16 hex digits, not all zero
  int flags = 1;

  /// "00-<trace_id>-<parent_id>-<flags as 2 hex digits>".
  std::string ToTraceparent() const;
  /// The same trace with a new random span id: what this process sends to the next hop.
  TraceContext Child() const;
};

/// Parses a traceparent header value. nullopt unless it is version 00 with 32 and 16 lower-case
/// hex digits, neither all zero, and 2 hex flag digits (the W3C rules; other versions and
/// malformed values start a new trace instead, as the specification asks).
std::optional<TraceContext> ParseTraceparent(absl::string_view value);

/// A new trace: random trace and span ids, sampled.
TraceContext NewTraceContext();

/// The trace context of the calls this thread makes (ScopedTraceContext), or nullopt. Clients that
/// send calls on behalf of a request (GrpcIndexerClient) add it as `traceparent` metadata.
std::optional<TraceContext> CurrentTraceContext();

/// Sets CurrentTraceContext on this thread for its lifetime (restoring the previous one after):
/// a handler sets it from its call's metadata, and every call the thread makes meanwhile carries
/// the trace.
class ScopedTraceContext {
 public:
  explicit ScopedTraceContext(std::optional<TraceContext> context);
  ~ScopedTraceContext();
  ScopedTraceContext(const ScopedTraceContext&) = delete;
  ScopedTraceContext& operator=(const ScopedTraceContext&) = delete;

 private:
  std::optional<TraceContext> previous_;
};

}  // namespace dsa
