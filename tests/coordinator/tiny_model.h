// A tiny deterministic "real model" for the coordinator's test doubles of the attention worker
// (fake_workers.h, fake_attention.h): its next token is a pure function of the tokens before it,
// so the tests can predict every id the coordinator streams, and build contexts whose n-gram
// drafts it confirms or refutes.
#pragma once

#include <cstdint>

#include "absl/types/span.h"
#include "dsa/attention/v1/attention.pb.h"

namespace dsa::testing {

/// The tiny model's vocabulary (token ids 0..63) and end-of-sequence token.
inline constexpr int32_t kTinyVocab = 64;
inline constexpr int32_t kTinyEos = 63;

/// The token after `tokens` (not empty): (last + step) mod vocab_size, step 1 when greedy
/// (temperature 0) and 1 + seed mod 3 otherwise, so a sampled request differs from a greedy one
/// but repeats exactly for a seed.
inline int32_t TinyModelNext(absl::Span<const int32_t> tokens, int32_t vocab_size,
                             const dsa::attention::v1::SamplingParams& sampling) {
  const int64_t step =
      sampling.temperature() > 0.0f ? 1 + static_cast<int64_t>(sampling.seed() % 3) : 1;
  return static_cast<int32_t>((tokens.back() + step) % vocab_size);
}

}  // namespace dsa::testing
