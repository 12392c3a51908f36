// The data plane between an attention worker and an indexer worker (DESIGN.md section 3): select
// requests for full layers go out as soon as their inputs exist, and the selections are collected
// when a later layer needs them (MLI's lag depth hides the round trip). One interface over plain
// structs (no protos), three implementations: a gRPC bidirectional stream, in-process (the
// indexer co-located in the attention worker's process) and NCCL between GPUs.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "contracts/layer_select.h"

namespace dsa {

/// Thread-safe: any thread may Submit and Await.
class SelectionTransport {
 public:
  virtual ~SelectionTransport() = default;

  /// Sends `request` without waiting for its answer and returns a fresh id (unique per transport).
  /// UNAVAILABLE when the transport is closed or its connection ended (the message says why);
  /// INVALID_ARGUMENT for a device-form request on a transport without device forms (the gRPC
  /// stream, NCCL); in process, an indexer that cannot take it refuses it (AwaitEnqueued).
  virtual absl::StatusOr<uint64_t> Submit(LayerSelectRequest request) = 0;

  /// Blocks until the response to `request_id` arrives, then hands it over (once).
  /// Errors: DEADLINE_EXCEEDED at `deadline` (the response may still arrive and be awaited again);
  /// NOT_FOUND for an id never submitted or already collected; the indexer's own status (e.g.
  /// INVALID_ARGUMENT, NOT_FOUND) when it refused this request, with kGroupsAppliedPayload (other
  /// requests are unaffected); UNAVAILABLE, or the connection's final status, when the connection
  /// ended before the answer.
  virtual absl::StatusOr<LayerSelection> Await(uint64_t request_id, absl::Time deadline) = 0;

  /// The CUDA ordinal whose memory the device form of a request (LayerSelectRequest::device) may
  /// address, or -1 when the transport takes host buffers only (the default; the gRPC stream and
  /// NCCL transports). It turns -1 when the indexer lost its device, and may be asked any time.
  virtual int device_ordinal() const { return -1; }

  /// For a request submitted in device form: blocks until its selections are enqueued on the GPU
  /// (device.selections_ready recorded, so a stream may wait on it from then on) or the request
  /// has failed: OK, or the request's error as Await returns it (the answer stays for Await or
  /// Forget). An indexer that cannot take the device form refuses with UNIMPLEMENTED having
  /// changed nothing: send the layer again with host queries. DEADLINE_EXCEEDED at `deadline`;
  /// NOT_FOUND as Await; UNIMPLEMENTED for a transport without device forms (the default).
  virtual absl::Status AwaitEnqueued(uint64_t request_id, absl::Time deadline) {
    return absl::UnimplementedError("this selection transport carries host buffers only");
  }

  /// Gives up on `request_id` (after a DEADLINE_EXCEEDED the caller will not await again): its
  /// answer, now or later, is dropped, so abandoned requests hold no memory. Unknown ids: no-op.
  virtual void Forget(uint64_t request_id) = 0;

  /// Stops sending, lets the indexer finish what it has (bounded, then the connection is
  /// cancelled), and waits for the connection to end. Returns its final status. Idempotent and
  /// safe to call from several threads.
  virtual absl::Status Close() = 0;

  /// True once the connection has ended (the peer went away, or Close): every later Submit fails
  /// with UNAVAILABLE, so the owner should make a new transport. False for a transport without a
  /// connection of its own (the default: in process).
  virtual bool ended() const { return false; }
};

}  // namespace dsa
