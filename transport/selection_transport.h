// The data plane between an attention worker and an indexer worker (DESIGN.md section 3): select
// requests for full layers go out as soon as their inputs exist, and the selections are collected
// when a later layer needs them (MLI's lag depth hides the round trip). One interface, two
// implementations: a gRPC bidirectional stream (here) and NCCL between GPUs (later).
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "dsa/indexer/v1/indexer.pb.h"

namespace dsa {

/// Payload (absl::Status::SetPayload) of a refused request's status from Await: the decimal number
/// of leading groups the indexer applied before refusing it (SelectError.groups_applied).
inline constexpr char kGroupsAppliedPayload[] = "type.dsa/indexer.v1.SelectError.groups_applied";

/// Thread-safe: any thread may Submit and Await.
class SelectionTransport {
 public:
  virtual ~SelectionTransport() = default;

  /// Sends `request` without waiting for its answer; the transport sets request.request_id to a
  /// fresh id (unique per transport) and returns it. UNAVAILABLE when the transport is closed or
  /// its connection ended (the message says why).
  virtual absl::StatusOr<uint64_t> Submit(dsa::indexer::v1::SelectRequest request) = 0;

  /// Blocks until the response to `request_id` arrives, then hands it over (once).
  /// Errors: DEADLINE_EXCEEDED at `deadline` (the response may still arrive and be awaited again);
  /// NOT_FOUND for an id never submitted or already collected; the indexer's own status (e.g.
  /// INVALID_ARGUMENT, NOT_FOUND) when it refused this request (other requests are unaffected);
  /// UNAVAILABLE, or the stream's final status, when the connection ended before the answer.
  virtual absl::StatusOr<dsa::indexer::v1::SelectResponse> Await(uint64_t request_id,
                                                                 absl::Time deadline) = 0;

  /// Gives up on `request_id` (after a DEADLINE_EXCEEDED the caller will not await again): its
  /// answer, now or later, is dropped, so abandoned requests hold no memory. Unknown ids: no-op.
  virtual void Forget(uint64_t request_id) = 0;

  /// Stops sending, lets the indexer finish what it has (up to 5 s, then the stream is
  /// cancelled), and waits for the stream to end. Returns the stream's final status. Idempotent
  /// and safe to call from several threads.
  virtual absl::Status Close() = 0;
};

}  // namespace dsa
