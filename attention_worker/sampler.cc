// Token sampling (see sampler.h).
#include "attention_worker/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/philox.h"

namespace dsa {

namespace {

// The largest temperature accepted: beyond it every distribution is practically uniform.
constexpr float kMaxTemperature = 100.0f;

// Philox stream (counter word 3) of the sampler's draws, apart from SPIN's exploration.
constexpr uint32_t kSamplingStream = 0x53414d50u;  // "SAMP"

double UniformAt(uint64_t seed, int64_t position) {
  const PhiloxKey key{{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)}};
  const auto p = static_cast<uint64_t>(position);
  const PhiloxCounter counter{
      {static_cast<uint32_t>(p), static_cast<uint32_t>(p >> 32), 0u, kSamplingStream}};
  const PhiloxCounter r = Philox4x32(counter, key);
  // 53 random bits in [0, 1).
  const uint64_t bits = (static_cast<uint64_t>(r.c[0]) << 21) ^ (r.c[1] >> 11);
  return static_cast<double>(bits & ((uint64_t{1} << 53) - 1)) / 9007199254740992.0;
}

int32_t Greedy(std::span<const float> logits) {
  int32_t best = 0;
  float best_value = -INFINITY;
  bool found = false;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (std::isnan(logits[i])) continue;
    if (!found || logits[i] > best_value) {
      best = static_cast<int32_t>(i);
      best_value = logits[i];
      found = true;
    }
  }
  return best;
}

}  // namespace

absl::Status ValidateSamplingParams(const SamplingParams& params) {
  if (!(params.temperature == 0.0f ||
        (params.temperature > 0.0f && params.temperature <= kMaxTemperature))) {
    return absl::InvalidArgumentError(absl::StrCat("temperature must be 0 (greedy) or in (0, ",
                                                   kMaxTemperature, "], got ", params.temperature));
  }
  if (!(params.top_p > 0.0f && params.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", params.top_p));
  }
  return absl::OkStatus();
}

int32_t SampleToken(std::span<const float> logits, const SamplingParams& params, int64_t position) {
  if (params.temperature == 0.0f) return Greedy(logits);
  const int32_t best = Greedy(logits);
  const float max_logit = logits.empty() || std::isnan(logits[best]) ? 0.0f : logits[best];
  if (std::isinf(max_logit)) return best;
  // Probabilities in double, ordered by descending probability (ties: lower id first).
  std::vector<double> weights(logits.size(), 0.0);
  double total = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (std::isnan(logits[i])) continue;
    weights[i] = std::exp(static_cast<double>(logits[i] - max_logit) / params.temperature);
    total += weights[i];
  }
  if (!(total > 0)) return best;
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return weights[a] != weights[b] ? weights[a] > weights[b] : a < b;
  });
  // The nucleus: the shortest prefix whose mass reaches top_p (at least one token).
  size_t kept = 0;
  double kept_mass = 0;
  const double target = static_cast<double>(params.top_p) * total;
  while (kept < order.size() && (kept == 0 || kept_mass < target)) {
    kept_mass += weights[order[kept]];
    ++kept;
  }
  const double u = UniformAt(params.seed, position) * kept_mass;
  double cumulative = 0;
  for (size_t i = 0; i < kept; ++i) {
    cumulative += weights[order[i]];
    if (u < cumulative) return order[i];
  }
  return order[kept - 1];
}

}  // namespace dsa
