// The attention engine's private parts shared by its two source files: engine.cc (sequences, KV
// accounting, indexer clients, prefill, commit, release) and engine_step.cc (the decode step).
// Not the engine's API (engine.h is): include it from those two files only.
#pragma once

#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "attention_worker/attention_model.h"
#include "attention_worker/engine.h"
#include "attention_worker/sampler.h"

namespace dsa {

// One sequence: its place on the indexer and its length (its KV lives in the backend).
struct AttentionEngine::Sequence {
  std::mutex mutex;  // guards everything below
  uint64_t id = 0;
  bool live = false;   // false while being created and after release (then NOT_FOUND)
  std::string broken;  // non-empty: why the sequence may differ from the indexer's
  std::string indexer_worker;
  std::vector<uint64_t> prefix_block_ids;
  int64_t length = 0;       // committed slots (t of the next step)
  int pending_rows = 0;     // > 0: a step of that many rows awaits Commit
  int64_t kv_slots = 0;     // slots held in the backend (and counted in kv_used_slots_)
  int top_k = 0;            // K of the indexer sequence
  SamplingParams sampling;  // a real model's draws (set by a successful prefill)
};

namespace engine_internal {

// A real model's token ids: `expected` of them, each in [0, vocab); the synthetic model takes none
// (INVALID_ARGUMENT naming `what` otherwise).
absl::Status ValidateTokens(const ModelShape& shape, std::span<const int32_t> tokens,
                            int64_t expected, absl::string_view what);

// RESOURCE_EXHAUSTED when `slots` pass the real model's context limit.
absl::Status CheckModelContext(const ModelShape& shape, int64_t slots);

// Whether a failed indexer call's status came from the transport (the outcome on the indexer
// unknown) rather than from the indexer refusing the request.
bool IsTransportFailure(absl::StatusCode code);

}  // namespace engine_internal
}  // namespace dsa
