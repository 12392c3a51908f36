// Token sampling from a real model's logits: greedy, or seeded temperature and top-p (nucleus)
// sampling whose draw is a pure function of (seed, position), so a request gives the same tokens
// wherever and whenever its rows run (a migrated request, verifier rows, a replay).
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"

namespace dsa {

/// How a request's tokens are drawn.
struct SamplingParams {
  /// 0 = greedy (the highest logit; ties to the lowest id); otherwise in (0, 100]: logits are
  /// divided by it before the softmax.
  float temperature = 0.0f;
  /// Nucleus: the smallest set of most likely tokens whose probability reaches top_p, in (0, 1]
  /// (1 = every token). Ignored when greedy.
  float top_p = 1.0f;
  /// Seed of the draws: position p's uniform is Philox4x32-10 of (seed, p).
  uint64_t seed = 0;
};

/// INVALID_ARGUMENT naming the bad field (temperature outside {0} or (0, 100], top_p outside
/// (0, 1], a NaN).
absl::Status ValidateSamplingParams(const SamplingParams& params);

/// The token for position `position` from `logits` (fp32 [vocab]; NaN logits are never chosen,
/// and an all-NaN row gives token 0): greedy, or the inverse CDF of the top-p truncated softmax
/// of logits / temperature at the uniform u(seed, position) (Holtzman et al. 2020, nucleus
/// sampling). With speculative verification a draft token is accepted when it equals this token,
/// which for a deterministic draft (n-gram lookup) is exactly rejection sampling's acceptance.
/// `params` must be valid.
int32_t SampleToken(std::span<const float> logits, const SamplingParams& params, int64_t position);

}  // namespace dsa
