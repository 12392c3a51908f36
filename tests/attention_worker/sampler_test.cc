// Tests of token sampling (attention_worker/sampler.h): greedy ties and NaNs, validation, the
// nucleus cut, repeatability per (seed, position), and the draws' frequencies against the
// softmax they sample.
#include "attention_worker/sampler.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace dsa {
namespace {

TEST(Sampler, GreedyTakesTheHighestLogitTiesToTheLowestIdAndSkipsNaN) {
  const SamplingParams greedy;
  EXPECT_EQ(SampleToken(std::vector<float>{0.5f, 2.0f, 2.0f, -1.0f}, greedy, 0), 1);
  EXPECT_EQ(SampleToken(std::vector<float>{NAN, 0.1f, NAN}, greedy, 0), 1);
  EXPECT_EQ(SampleToken(std::vector<float>{NAN, NAN}, greedy, 0), 0);
}

TEST(Sampler, ValidationNamesTheField) {
  EXPECT_TRUE(ValidateSamplingParams({0.0f, 1.0f, 1}).ok());
  EXPECT_TRUE(ValidateSamplingParams({0.7f, 0.9f, 1}).ok());
  for (const SamplingParams& bad : {SamplingParams{-0.1f, 1.0f, 0}, SamplingParams{101.0f, 1.0f, 0},
                                    SamplingParams{NAN, 1.0f, 0}, SamplingParams{1.0f, 0.0f, 0},
                                    SamplingParams{1.0f, 1.5f, 0}, SamplingParams{1.0f, NAN, 0}}) {
    const absl::Status status = ValidateSamplingParams(bad);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_NE(ValidateSamplingParams({1.0f, 1.5f, 0}).message().find("top_p"), std::string::npos);
  EXPECT_NE(ValidateSamplingParams({-1.0f, 1.0f, 0}).message().find("temperature"),
            std::string::npos);
}

TEST(Sampler, ATightNucleusKeepsOnlyTheMostLikelyToken) {
  const std::vector<float> logits = {1.0f, 3.0f, 2.9f, 0.0f};
  for (int64_t position = 0; position < 200; ++position) {
    EXPECT_EQ(SampleToken(logits, {1.0f, 0.01f, 5}, position), 1);
  }
}

TEST(Sampler, DrawsRepeatPerSeedAndPositionAndFollowTheSoftmax) {
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, -1.0f};
  const SamplingParams params{1.0f, 1.0f, 42};
  std::vector<int> counts(logits.size(), 0);
  constexpr int kDraws = 40000;
  int changed_with_seed = 0;
  for (int64_t position = 0; position < kDraws; ++position) {
    const int32_t token = SampleToken(logits, params, position);
    EXPECT_EQ(token, SampleToken(logits, params, position));
    changed_with_seed += token != SampleToken(logits, {1.0f, 1.0f, 43}, position);
    ++counts[token];
  }
  EXPECT_GT(changed_with_seed, kDraws / 4);
  double total = 0;
  for (float logit : logits) total += std::exp(logit);
  for (size_t i = 0; i < logits.size(); ++i) {
    const double expected = std::exp(logits[i]) / total;
    // Four standard deviations of a binomial proportion.
    const double sigma = std::sqrt(expected * (1 - expected) / kDraws);
    EXPECT_NEAR(static_cast<double>(counts[i]) / kDraws, expected, 4 * sigma) << i;
  }
}

TEST(Sampler, TopPRenormalizesOverTheNucleus) {
  // Probabilities ~ 0.64, 0.24, 0.09, 0.03: top_p 0.8 keeps the first two.
  const std::vector<float> logits = {3.0f, 2.0f, 1.0f, 0.0f};
  std::vector<int> counts(logits.size(), 0);
  constexpr int kDraws = 20000;
  for (int64_t position = 0; position < kDraws; ++position) {
    ++counts[SampleToken(logits, {1.0f, 0.8f, 9}, position)];
  }
  EXPECT_EQ(counts[2] + counts[3], 0);
  const double expected = std::exp(3.0) / (std::exp(3.0) + std::exp(2.0));
  EXPECT_NEAR(static_cast<double>(counts[0]) / kDraws, expected,
              4 * std::sqrt(expected * (1 - expected) / kDraws));
}

}  // namespace
}  // namespace dsa
