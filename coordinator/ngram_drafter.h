// Draft tokens for a real model's speculative steps by n-gram prompt lookup over the sequence's
// own tokens (no draft model): the coordinator proposes, the attention worker's model verifies.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace dsa {

/// The n-gram lengths prompt lookup tries (vLLM's prompt_lookup_min / prompt_lookup_max).
struct NgramDraftOptions {
  int min_ngram = 2;  // >= 1
  int max_ngram = 4;  // >= min_ngram, <= kMaxNgram
};

/// The longest n-gram NgramDraftOptions may ask for.
inline constexpr int kMaxNgram = 64;

/// INVALID_ARGUMENT naming the field when `options` is out of range (1 <= min_ngram <=
/// max_ngram <= kMaxNgram).
absl::Status ValidateNgramDraftOptions(const NgramDraftOptions& options);

/// Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ngram speculator,
/// vllm/v1/spec_decode/ngram_proposer.py): for n from max_ngram down to min_ngram, look for an
/// earlier occurrence of the last n tokens of `tokens` (the sequence so far: context and generated
/// tokens); the first n that has one wins, its earliest occurrence is used (as vLLM does), and the
/// up to `max_draft` tokens that followed that occurrence are the draft. No match, `max_draft` <=
/// 0, or fewer than min_ngram + 1 tokens: an empty draft (the step is a plain one-row step).
/// The occurrence may overlap the suffix but not be it, so a draft has at least one token.
/// O(|tokens| x max_ngram) time in the worst case, no allocation but the result. Thread-safe
/// (pure).
std::vector<int32_t> ProposeNgramDraft(absl::Span<const int32_t> tokens, int max_draft,
                                       const NgramDraftOptions& options = {});

}  // namespace dsa
