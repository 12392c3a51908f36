// The predictor study of SPIN section 2 (Table 1): dense index scores of a pattern model through
// the real quantized cache, and how well random, prev-layer and prev-iter predictors foresee them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attention_worker/pattern_model.h"

namespace dsa {

/// The decode run whose dense index scores the study takes.
struct DenseScoreConfig {
  /// N >= 1: prefill slots [0, N) appended before the first decode step.
  int64_t context_slots = 8192;
  /// T >= 1: decode steps; step s has query position t = N + s and sees slots [0, N + s]
  /// (its own key is appended first, DESIGN.md 4.1).
  int num_steps = 32;
};

/// Dense index scores of every layer and decode step.
struct DenseScoreTrace {
  int64_t context_slots = 0;
  int num_steps = 0;
  int num_layers = 0;
  /// scores[layer * num_steps + step]: fp32 [N + step + 1], z_t[i] for slots 0..t, t = N + step.
  std::vector<std::vector<float>> scores;

  const std::vector<float>& At(int layer, int step) const {
    return scores[static_cast<size_t>(layer) * num_steps + step];
  }
};

/// Runs the model's decode through the real indexer path: per layer, appends the model's index keys
/// to a dsa::IndexKeyCache (fp8 e4m3 + fp32 scale per slot), then at every step appends slot t's
/// key and scores all blocks with dsa::ScoreBlocks for the model's query at position t.
/// Memory: num_layers * T * (N + T) * 4 bytes for the trace.
/// Errors: INVALID_ARGUMENT (N < 1, T < 1), RESOURCE_EXHAUSTED (cache), and the model's errors.
absl::StatusOr<DenseScoreTrace> ComputeDenseScores(const PatternModel& model,
                                                   const DenseScoreConfig& config);

/// How well one predictor foresees the dense scores, averaged over (layer, step) samples.
struct PredictorMetrics {
  /// Pearson correlation of predicted and actual scores over the slots visible to both.
  double correlation = 0.0;
  /// |topK(pred) ∩ topK(actual)| / |topK(actual)|, both top-Ks (dsa::SelectTopK) taken over the
  /// slots visible to both.
  double recall = 0.0;
  /// (layer, step) pairs averaged; 0 when the predictor is undefined for the trace.
  int64_t num_samples = 0;
};

/// The study's settings.
struct PredictorStudyConfig {
  /// K >= 1 of the top-K compared.
  int top_k = 512;
  /// Seed of the random predictor's uniform scores (Philox4x32, keyed per layer and step).
  uint64_t random_seed = 1;
  /// Layers the prev-layer best-of oracle looks back (SPIN Table 1 uses 5); >= 1.
  int oracle_depth = 5;
};

/// SPIN Table 1 for one trace. Predictors (SPIN section 2):
/// - random: seeded uniform scores; all (layer, step).
/// - prev_layer: layer l-1 at the same step; layers >= 1.
/// - prev_layer_best_of: best of layers l-1..l-oracle_depth at the same step (the oracle; best
///   correlation and best recall each taken separately); layers >= 1.
/// - prev_iter: the same layer at step s-1, same slot; steps >= 1, slots [0, t-1].
/// - prev_iter_offset1: step s-1's score of slot i-1 predicts slot i; steps >= 1, slots [1, t].
struct PredictorStudyResult {
  int64_t context_slots = 0;
  int num_steps = 0;
  int num_layers = 0;
  int top_k = 0;
  int oracle_depth = 0;
  PredictorMetrics random;
  PredictorMetrics prev_layer;
  PredictorMetrics prev_layer_best_of;
  PredictorMetrics prev_iter;
  PredictorMetrics prev_iter_offset1;
};

/// Evaluates the five predictors of SPIN Table 1 on `trace`. Errors: INVALID_ARGUMENT (top_k < 1,
/// oracle_depth < 1, an empty trace).
absl::StatusOr<PredictorStudyResult> EvaluatePredictors(const DenseScoreTrace& trace,
                                                        const PredictorStudyConfig& config);

/// ComputeDenseScores then EvaluatePredictors. Errors: theirs.
absl::StatusOr<PredictorStudyResult> RunPredictorStudy(const PatternModel& model,
                                                       const DenseScoreConfig& scores,
                                                       const PredictorStudyConfig& config);

/// The result as a markdown table in SPIN Table 1's form: one row per predictor with its Pearson
/// correlation and top-K recall (3 decimals), preceded by a line giving N, T, K and the layers.
std::string FormatPredictorStudyMarkdown(const PredictorStudyResult& result);

}  // namespace dsa
