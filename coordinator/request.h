// One Generate call in flight inside the coordinator's engine (engine.h), as its handler thread,
// its attention worker's decode loop and the watch threads share it.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/trace_context.h"
#include "coordinator/acceptance_model.h"
#include "coordinator/generate.h"
#include "coordinator/scheduler.h"

namespace dsa {

/// Where a request is in its life. kMigrating: off its failed workers, waiting for its handler to
/// place it again.
enum class RequestPhase { kQueued, kPrefilling, kDecoding, kMigrating, kEnded };

/// One Generate call in flight: what its handler, its decode loop and the watch threads share.
struct InFlightRequest {
  std::string id;
  std::string caller;  // TenantIdentity of the Generate call: it scopes the id
  TraceContext trace;  // the router's traceparent, or a new trace; its calls carry a child
  uint64_t ticket = 0;
  GenerateSpec spec;  // as the caller sent it, but for a sampling seed the coordinator picked
  SequenceDemand demand;
  absl::Time arrival;
  // Guarded by EngineCore::mu (engine_core.h).
  RequestPhase phase = RequestPhase::kQueued;
  std::optional<Admission> admission;
  bool cancel_requested = false;
  std::string cancel_reason = "aborted";  // the CANCELLED status's message
  // The Generate call's stream while Generate runs (TryCancel unblocks a Write that a stalled
  // reader holds); null once it returns.
  GenerateStream* stream = nullptr;
  std::optional<absl::Time> stalled_since;        // event queue full since
  std::optional<absl::Time> write_blocked_since;  // a Write in progress since
  std::deque<GenerateEvent> events;
  std::optional<absl::Status> final_status;
  absl::CondVar changed;        // admission, an event, the final status
  int migrations = 0;           // guarded by EngineCore::mu; moves off a failed worker so far
  absl::Status migrate_reason;  // guarded by EngineCore::mu; the failure that made it kMigrating
  // Guarded by EngineCore::mu. Set: the request is kMigrating because its Prefill could not reach
  // its indexer, which is no migration (nothing was lost): it is placed again no earlier than
  // this, by the engine's clock. `unreached_placements` counts those placements (bounded).
  std::optional<absl::Time> place_after;
  int unreached_placements = 0;
  // A real model (ServedModel::real when validated): vocabulary, end-of-sequence token and stop
  // ids for the checks of its tokens. Set before admission, then read-only.
  bool real = false;
  int32_t vocab_size = 0;
  int32_t eos_token_id = -1;  // -1: none, or ignore_eos
  std::vector<int32_t> stop_token_ids;
  // Owned by the handler until the request decodes, then by the decode loop (a migration hands
  // it back through EngineCore::mu). A real model: the sequence's tokens (context, then every
  // generated token); drafts of the step in flight.
  std::vector<int32_t> tokens;
  std::vector<int32_t> drafts;
  int64_t generated = 0;
  int64_t generated_when_placed = 0;  // `generated` at the current placement's prefill
  uint64_t verification_steps = 0;
  std::optional<AcceptanceModel> acceptance;
  int first_count = 0;
  absl::Time first_token_time;
  absl::Time last_step_time;
};

}  // namespace dsa
