// Tests of the predictor study: the evaluation arithmetic on hand-made traces, and SPIN Table 1's
// qualitative picture (plus sinks, vertical lines, diagonals, recency, topic shifts) on the
// pattern model's dense scores at N = 8192, T = 32, K = 512, 4 layers, H = 64, D = 128.
#include "tools/dsa/predictor_study.h"

#include <algorithm>
#include <iostream>
#include <memory>
#include <vector>

#include "attention_worker/pattern_model.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "indexer_service/topk.h"

namespace dsa {
namespace {

using ::testing::HasSubstr;

// A trace of `layers` x `steps` where step s has N + s + 1 scores filled by `score(l, s, i)`.
template <typename F>
DenseScoreTrace MakeTrace(int layers, int steps, int64_t n, F score) {
  DenseScoreTrace trace;
  trace.context_slots = n;
  trace.num_steps = steps;
  trace.num_layers = layers;
  for (int l = 0; l < layers; ++l) {
    for (int s = 0; s < steps; ++s) {
      std::vector<float> row(n + s + 1);
      for (int64_t i = 0; i < n + s + 1; ++i) row[i] = score(l, s, i);
      trace.scores.push_back(std::move(row));
    }
  }
  return trace;
}

float Hash(int64_t x) {  // a fixed pseudo-random score in [0, 1)
  uint64_t h = static_cast<uint64_t>(x) * 0x9E3779B97F4A7C15ULL;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ULL;
  h ^= h >> 32;
  return static_cast<float>(h >> 40) / 16777216.0f;
}

TEST(PredictorStudyTest, IdenticalLayersGivePerfectPrevLayer) {
  const DenseScoreTrace trace =
      MakeTrace(3, 4, 1000, [](int, int s, int64_t i) { return Hash(i * 7 + s); });
  PredictorStudyConfig config;
  config.top_k = 50;
  const absl::StatusOr<PredictorStudyResult> result = EvaluatePredictors(trace, config);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_NEAR(result->prev_layer.correlation, 1.0, 1e-9);
  EXPECT_NEAR(result->prev_layer.recall, 1.0, 1e-12);
  EXPECT_NEAR(result->prev_layer_best_of.recall, 1.0, 1e-12);
  EXPECT_EQ(result->prev_layer.num_samples, 2 * 4);
  EXPECT_EQ(result->prev_iter.num_samples, 3 * 3);
  EXPECT_EQ(result->random.num_samples, 3 * 4);
  EXPECT_LT(result->prev_iter.recall, 0.3);  // independent per step
}

TEST(PredictorStudyTest, StaticScoresGivePerfectPrevIterAndShiftedScoresPerfectOffset1) {
  // Vertical: the score depends on the slot only.
  const DenseScoreTrace vertical =
      MakeTrace(2, 5, 2000, [](int l, int, int64_t i) { return Hash(i + 1000 * l); });
  PredictorStudyConfig config;
  config.top_k = 100;
  absl::StatusOr<PredictorStudyResult> r = EvaluatePredictors(vertical, config);
  ASSERT_TRUE(r.ok());
  EXPECT_NEAR(r->prev_iter.correlation, 1.0, 1e-9);
  EXPECT_NEAR(r->prev_iter.recall, 1.0, 1e-12);
  EXPECT_LT(r->prev_iter_offset1.recall, 0.3);

  // Diagonal: the score depends on t - i only.
  const DenseScoreTrace diagonal =
      MakeTrace(2, 5, 2000, [](int, int s, int64_t i) { return Hash(2000 + s - i); });
  r = EvaluatePredictors(diagonal, config);
  ASSERT_TRUE(r.ok());
  EXPECT_NEAR(r->prev_iter_offset1.correlation, 1.0, 1e-9);
  EXPECT_NEAR(r->prev_iter_offset1.recall, 1.0, 1e-12);
  EXPECT_LT(r->prev_iter.recall, 0.3);
}

TEST(PredictorStudyTest, RejectsBadInput) {
  const DenseScoreTrace trace = MakeTrace(1, 2, 100, [](int, int, int64_t i) { return Hash(i); });
  PredictorStudyConfig config;
  config.top_k = 0;
  EXPECT_EQ(EvaluatePredictors(trace, config).status().code(), absl::StatusCode::kInvalidArgument);
  config.top_k = 10;
  config.oracle_depth = 0;
  EXPECT_EQ(EvaluatePredictors(trace, config).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EvaluatePredictors(DenseScoreTrace{}, PredictorStudyConfig{}).status().code(),
            absl::StatusCode::kInvalidArgument);

  const absl::StatusOr<PatternModel> model = PatternModel::Create(PatternModelConfig{});
  ASSERT_TRUE(model.ok());
  DenseScoreConfig scores;
  scores.context_slots = 0;
  EXPECT_EQ(ComputeDenseScores(*model, scores).status().code(), absl::StatusCode::kInvalidArgument);
  scores.context_slots = 100;
  scores.num_steps = 0;
  EXPECT_EQ(ComputeDenseScores(*model, scores).status().code(), absl::StatusCode::kInvalidArgument);
}

// The Table-1 configuration, computed once for the suite.
class PredictorStudyTable1Test : public ::testing::Test {
 protected:
  static constexpr int64_t kContext = 8192;
  static constexpr int kSteps = 32;
  static constexpr int kTopK = 512;
  static constexpr int kLayers = 4;

  static void SetUpTestSuite() {
    // The patterns at SPIN Figure 1's strength; H = 64, D = 128, seed 0.
    PatternModelConfig config = SpinFigurePatternConfig();
    config.num_layers = kLayers;
    absl::StatusOr<PatternModel> model = PatternModel::Create(config);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = new PatternModel(*std::move(model));
    DenseScoreConfig scores;
    scores.context_slots = kContext;
    scores.num_steps = kSteps;
    absl::StatusOr<DenseScoreTrace> trace = ComputeDenseScores(*model_, scores);
    ASSERT_TRUE(trace.ok()) << trace.status();
    trace_ = new DenseScoreTrace(*std::move(trace));
  }
  static void TearDownTestSuite() {
    delete trace_;
    delete model_;
    trace_ = nullptr;
    model_ = nullptr;
  }

  // The top-K of (layer, step) as a membership mask over slots 0..t.
  static std::vector<uint8_t> TopKMask(int layer, int step) {
    const std::vector<float>& z = trace_->At(layer, step);
    std::vector<int32_t> selection(kTopK);
    SelectTopK(z, {}, static_cast<int64_t>(z.size()) - 1, selection);
    std::vector<uint8_t> mask(z.size(), 0);
    for (int32_t slot : selection) {
      if (slot >= 0) mask[slot] = 1;
    }
    return mask;
  }

  static PatternModel* model_;
  static DenseScoreTrace* trace_;
};

PatternModel* PredictorStudyTable1Test::model_ = nullptr;
DenseScoreTrace* PredictorStudyTable1Test::trace_ = nullptr;

TEST_F(PredictorStudyTable1Test, PrevIterIsTheBestPredictor) {
  ASSERT_NE(trace_, nullptr);
  PredictorStudyConfig config;
  config.top_k = kTopK;
  const absl::StatusOr<PredictorStudyResult> result = EvaluatePredictors(*trace_, config);
  ASSERT_TRUE(result.ok()) << result.status();
  std::cout << FormatPredictorStudyMarkdown(*result);
  const PredictorStudyResult& r = *result;

  // Random: correlation ~0, recall ~K / N (N + T/2 visible slots on average).
  const double expected_random_recall = static_cast<double>(kTopK) / (kContext + kSteps / 2);
  EXPECT_NEAR(r.random.correlation, 0.0, 0.02);
  EXPECT_NEAR(r.random.recall, expected_random_recall, 0.01);

  // Prev-iter is clearly best in both measures (seen: 0.96 / 0.91 against prev-layer 0.67 / 0.40
  // and offset 1 0.64 / 0.35).
  EXPECT_GT(r.prev_iter.correlation, 0.9);
  EXPECT_GT(r.prev_iter.recall, 0.8);
  EXPECT_GT(r.prev_iter.correlation, r.prev_layer_best_of.correlation + 0.15);
  EXPECT_GT(r.prev_iter.recall, r.prev_layer_best_of.recall + 0.3);
  EXPECT_GT(r.prev_iter.correlation, r.prev_iter_offset1.correlation + 0.15);
  EXPECT_GT(r.prev_iter.recall, r.prev_iter_offset1.recall + 0.3);

  // Prev-layer: better than random, worse than prev-iter (adjacent layers are correlated).
  EXPECT_GT(r.prev_layer.correlation, 0.3);
  EXPECT_GT(r.prev_layer.recall, r.random.recall + 0.15);
  EXPECT_GE(r.prev_layer_best_of.recall, r.prev_layer.recall);
  EXPECT_GE(r.prev_layer_best_of.correlation, r.prev_layer.correlation);

  const std::string table = FormatPredictorStudyMarkdown(r);
  EXPECT_THAT(table, HasSubstr("| Prev-iter |"));
  EXPECT_THAT(table, HasSubstr("| Prev-layer (best-of-5 oracle) |"));
  EXPECT_THAT(table, HasSubstr("K = 512"));
}

// Sinks, recency, vertical lines, diagonals and topic shifts in the top-K masks (one test so the
// suite computes the dense scores once per process).
TEST_F(PredictorStudyTable1Test, ScoresShowThePatternsOfSpinFigure1) {
  ASSERT_NE(trace_, nullptr);
  std::vector<std::vector<std::vector<uint8_t>>> masks(kLayers);
  for (int l = 0; l < kLayers; ++l) {
    for (int s = 0; s < kSteps; ++s) masks[l].push_back(TopKMask(l, s));
  }
  const int rows = kLayers * kSteps;

  // Sinks and recency: slot 0 is selected at (almost) every row, and most of the newest 32 slots.
  int sink_rows = 0;
  double recent_fraction = 0.0;
  for (int l = 0; l < kLayers; ++l) {
    for (int s = 0; s < kSteps; ++s) {
      const std::vector<uint8_t>& mask = masks[l][s];
      sink_rows += mask[0];
      int recent = 0;
      for (size_t i = mask.size() - 32; i < mask.size(); ++i) recent += mask[i];
      recent_fraction += recent / 32.0;
    }
  }
  EXPECT_GE(sink_rows, rows * 95 / 100);
  EXPECT_GT(recent_fraction / rows, 0.75);

  // Vertical lines: salient slots are selected at most steps, most of them at every step.
  for (int l = 0; l < kLayers; ++l) {
    std::vector<int64_t> salient, plain;
    for (int64_t i = 16; i < kContext; ++i) {
      (model_->IsSalientSlot(l, i) ? salient : plain).push_back(i);
    }
    ASSERT_GT(salient.size(), 30u);
    int64_t salient_hits = 0, plain_hits = 0, persistent = 0;
    for (int64_t i : salient) {
      int steps_in = 0;
      for (int s = 0; s < kSteps; ++s) steps_in += masks[l][s][i];
      salient_hits += steps_in;
      persistent += steps_in == kSteps;
    }
    for (int64_t i : plain) {
      for (int s = 0; s < kSteps; ++s) plain_hits += masks[l][s][i];
    }
    const double salient_rate = static_cast<double>(salient_hits) / (salient.size() * kSteps);
    const double plain_rate = static_cast<double>(plain_hits) / (plain.size() * kSteps);
    EXPECT_GT(salient_rate, 0.8) << "layer " << l;
    EXPECT_LT(plain_rate, 0.1) << "layer " << l;
    EXPECT_GT(persistent, static_cast<int64_t>(salient.size()) / 2) << "layer " << l;
  }

  // Diagonals: the band slot t - offset (or a neighbour) is selected at (almost) every row, so the
  // selected slot moves one slot per step.
  for (int d = 1; d < model_->config().num_diagonals; ++d) {
    const int offset = model_->DiagonalOffset(d);
    ASSERT_LT(offset, kContext);
    int on_band = 0;
    for (int l = 0; l < kLayers; ++l) {
      for (int s = 0; s < kSteps; ++s) {
        const int64_t t = kContext + s;
        bool hit = false;
        for (int64_t i = t - offset - 1; i <= t - offset + 1; ++i) hit = hit || masks[l][s][i];
        on_band += hit;
      }
    }
    EXPECT_GE(on_band, rows * 9 / 10) << "diagonal " << d << " offset " << offset;
  }

  // Sudden shifts: where the query's topic switches, the top-K overlap with the previous step
  // drops well below its steady value.
  std::vector<int> switch_steps;
  for (int s = 1; s < kSteps; ++s) {
    if (model_->TopicEpochStart(kContext + s) == kContext + s &&
        model_->QueryTopic(kContext + s) != model_->QueryTopic(kContext + s - 1)) {
      switch_steps.push_back(s);
    }
  }
  ASSERT_FALSE(switch_steps.empty()) << "seed 0 has a topic switch in the first 32 steps";
  double switch_overlap = 0.0, steady_overlap = 0.0;
  int switch_rows = 0, steady_rows = 0;
  for (int l = 0; l < kLayers; ++l) {
    for (int s = 1; s < kSteps; ++s) {
      const std::vector<uint8_t>& before = masks[l][s - 1];
      const std::vector<uint8_t>& after = masks[l][s];
      int common = 0;
      for (size_t i = 0; i < before.size(); ++i) common += before[i] && after[i];
      const double overlap = static_cast<double>(common) / kTopK;
      if (std::find(switch_steps.begin(), switch_steps.end(), s) != switch_steps.end()) {
        switch_overlap += overlap;
        ++switch_rows;
      } else {
        steady_overlap += overlap;
        ++steady_rows;
      }
    }
  }
  switch_overlap /= switch_rows;
  steady_overlap /= steady_rows;
  std::cout << "top-K overlap with the previous step: steady " << steady_overlap
            << ", at topic switches " << switch_overlap << "\n";
  EXPECT_GT(steady_overlap, 0.85);
  EXPECT_LT(switch_overlap, steady_overlap - 0.2);
}

}  // namespace
}  // namespace dsa
