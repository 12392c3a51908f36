// A seeded model of speculative-decoding acceptance: how many of a draft's d tokens the target
// model accepts at each verification step (coordinator side of DESIGN.md 4.2, "Speculative
// decoding").
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"

namespace dsa {

/// Each draft token is accepted with probability `acceptance_rate`, independently, and acceptance
/// stops at the first rejected token, so P(a = j) = p^j (1 - p) for j < d and P(a = d) = p^d; the
/// mean is sum_{j=1..d} p^j. Draws are a pure function of (seed, step): Philox4x32-10 word j of
/// counter (step lo, step hi, 0, 0) decides token j (d <= 4). Thread-safe (const).
class AcceptanceModel {
 public:
  /// INVALID_ARGUMENT when acceptance_rate is outside [0, 1] or draft_length outside [0, 4].
  static absl::StatusOr<AcceptanceModel> Create(double acceptance_rate, int draft_length,
                                                uint64_t seed);

  /// The number of accepted draft tokens a in [0, draft_length] at verification step `step`.
  int Accepted(uint64_t step) const;
  /// The expected number of accepted tokens per step, sum_{j=1..d} p^j.
  double ExpectedAccepted() const;

  int draft_length() const { return draft_length_; }
  double acceptance_rate() const { return acceptance_rate_; }

 private:
  AcceptanceModel(double rate, int draft_length, uint64_t seed)
      : acceptance_rate_(rate), draft_length_(draft_length), seed_(seed) {}
  double acceptance_rate_;
  int draft_length_;
  uint64_t seed_;
};

}  // namespace dsa
