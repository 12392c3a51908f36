// The checks of a Generate request (coordinator.proto's contract, then the served model's limits)
// that the coordinator's engine (engine.h) makes before admission.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "coordinator/generate.h"
#include "coordinator/served_model.h"

namespace dsa {

/// Most stop_token_ids a request may carry.
inline constexpr int kMaxStopTokenIds = 256;

/// INVALID_ARGUMENT with a precise message when `request` breaks the contract of
/// coordinator.proto (as its plain form, generate.h) whatever the model: request_id 1..128 bytes; a
/// context (context_length >= 1, or context_tokens with >= 1 token, each id >= 0); prefix ids only
/// with context_length, at most ceil(context / 512); max_new_tokens >= 1; draft_length
/// 0..kMaxDraftLength; overrides in range (rho, gamma in [0, 1), top_k in [1, kMaxTopK],
/// acceptance_rate in [0, 1]); sampling in range (temperature 0 or in (0, 100], top_p in [0, 1],
/// not NaN); at most kMaxStopTokenIds stop ids, each >= 0; session_id at most 128 bytes; context +
/// max_new_tokens + draft below 2^31 slots. Messages name the field, and for a list the index and
/// the value.
absl::Status ValidateGenerateRequest(const GenerateSpec& request);

/// The checks that need the model (after ValidateGenerateRequest): a real model needs
/// context_tokens (INVALID_ARGUMENT naming the model), every context and stop token id below its
/// vocab_size (INVALID_ARGUMENT naming the index and the value), and context + max_new_tokens at
/// most its max_context (RESOURCE_EXHAUSTED with the numbers; a model limit, DESIGN.md 5's "too
/// long a context"). The pattern model ignores sampling, stop_token_ids and ignore_eos.
absl::Status ValidateGenerateRequestForModel(const GenerateSpec& request, const ServedModel& model);

/// The request's context length in tokens (slots): its context_tokens' count, else its
/// context_length.
int64_t ContextLength(const GenerateSpec& request);

}  // namespace dsa
