// SPIN Table 1 on the pattern model: dense scores through the real cache, scoring and top-K, then
// Pearson correlation and top-K recall of the random, prev-layer and prev-iter predictors.
#include "tools/dsa/predictor_study.h"

#include <algorithm>
#include <cmath>
#include <span>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/philox.h"
#include "common/status_macros.h"
#include "indexer_service/index_key_cache.h"
#include "indexer_service/scoring.h"
#include "indexer_service/topk.h"

namespace dsa {
namespace {

constexpr uint64_t kSequenceId = 1;
constexpr int64_t kPrefillChunkSlots = 2048;

// Correlation and recall of one (layer, step) sample; both spans cover the same slots.
struct Sample {
  double correlation = 0.0;
  double recall = 0.0;
};

double Pearson(std::span<const float> a, std::span<const float> b) {
  const size_t n = a.size();
  if (n < 2) return 0.0;
  double mean_a = 0.0, mean_b = 0.0;
  for (size_t i = 0; i < n; ++i) {
    mean_a += a[i];
    mean_b += b[i];
  }
  mean_a /= static_cast<double>(n);
  mean_b /= static_cast<double>(n);
  double cov = 0.0, var_a = 0.0, var_b = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double da = a[i] - mean_a, db = b[i] - mean_b;
    cov += da * db;
    var_a += da * da;
    var_b += db * db;
  }
  if (var_a <= 0.0 || var_b <= 0.0) return 0.0;
  return cov / std::sqrt(var_a * var_b);
}

double TopKRecall(std::span<const float> predicted, std::span<const float> actual, int top_k) {
  const int64_t n = static_cast<int64_t>(actual.size());
  std::vector<int32_t> actual_top(top_k), predicted_top(top_k);
  SelectTopK(actual, {}, n - 1, actual_top);
  SelectTopK(predicted, {}, n - 1, predicted_top);
  std::vector<uint8_t> in_predicted(n, 0);
  for (int32_t slot : predicted_top) {
    if (slot >= 0) in_predicted[slot] = 1;
  }
  int64_t hits = 0, total = 0;
  for (int32_t slot : actual_top) {
    if (slot < 0) continue;
    ++total;
    hits += in_predicted[slot];
  }
  return total == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(total);
}

Sample Compare(std::span<const float> predicted, std::span<const float> actual, int top_k) {
  return Sample{Pearson(predicted, actual), TopKRecall(predicted, actual, top_k)};
}

// Means of the samples in order (deterministic), skipping the undefined ones.
PredictorMetrics Average(const std::vector<Sample>& samples, const std::vector<uint8_t>& defined) {
  PredictorMetrics m;
  for (size_t i = 0; i < samples.size(); ++i) {
    if (!defined[i]) continue;
    m.correlation += samples[i].correlation;
    m.recall += samples[i].recall;
    ++m.num_samples;
  }
  if (m.num_samples > 0) {
    m.correlation /= static_cast<double>(m.num_samples);
    m.recall /= static_cast<double>(m.num_samples);
  }
  return m;
}

}  // namespace

absl::StatusOr<DenseScoreTrace> ComputeDenseScores(const PatternModel& model,
                                                   const DenseScoreConfig& config) {
  if (config.context_slots < 1) {
    return absl::InvalidArgumentError("DenseScoreConfig.context_slots must be >= 1");
  }
  if (config.num_steps < 1) {
    return absl::InvalidArgumentError("DenseScoreConfig.num_steps must be >= 1");
  }
  const int num_layers = model.num_layers();
  const int num_heads = model.num_heads();
  const int head_dim = model.head_dim();
  const int64_t total_slots = config.context_slots + config.num_steps;
  const int64_t blocks_per_layer = (total_slots + kBlockSize - 1) / kBlockSize;
  DSA_ASSIGN_OR_RETURN(IndexKeyCache cache,
                       IndexKeyCache::Create(blocks_per_layer * num_layers, head_dim));
  DSA_RETURN_IF_ERROR(cache.AddSequence(kSequenceId, num_layers));

  DenseScoreTrace trace;
  trace.context_slots = config.context_slots;
  trace.num_steps = config.num_steps;
  trace.num_layers = num_layers;
  trace.scores.resize(static_cast<size_t>(num_layers) * config.num_steps);

  std::vector<float> keys(static_cast<size_t>(kPrefillChunkSlots) * head_dim);
  std::vector<float> query(static_cast<size_t>(num_heads) * head_dim), weights(num_heads);
  std::vector<int32_t> blocks;
  std::vector<float> scores;
  for (int layer = 0; layer < num_layers; ++layer) {
    // Prefill: slots [0, N) in chunks, keys generated on all cores.
    for (int64_t first = 0; first < config.context_slots; first += kPrefillChunkSlots) {
      const int64_t count = std::min(kPrefillChunkSlots, config.context_slots - first);
      constexpr int64_t kSlotsPerTask = 64;
      const int64_t num_tasks = (count + kSlotsPerTask - 1) / kSlotsPerTask;
      bool ok = true;
#pragma omp parallel for schedule(dynamic) reduction(&& : ok)
      for (int64_t task = 0; task < num_tasks; ++task) {
        const int64_t begin = task * kSlotsPerTask;
        const int64_t n = std::min(kSlotsPerTask, count - begin);
        ok = ok && model
                       .IndexKeys(layer, first + begin, n,
                                  std::span<float>(keys).subspan(begin * head_dim, n * head_dim))
                       .ok();
      }
      if (!ok) return absl::InternalError("ComputeDenseScores: IndexKeys failed");
      DSA_RETURN_IF_ERROR(cache.Append(
          kSequenceId, layer, std::span<const float>(keys).first(count * head_dim), count));
    }
    // Decode: append slot t's own key, then score every block for the query at t.
    for (int step = 0; step < config.num_steps; ++step) {
      const int64_t position = config.context_slots + step;
      std::span<float> own_key = std::span<float>(keys).first(head_dim);
      DSA_RETURN_IF_ERROR(model.IndexKeys(layer, position, 1, own_key));
      DSA_RETURN_IF_ERROR(cache.Append(kSequenceId, layer, own_key, 1));
      DSA_RETURN_IF_ERROR(model.IndexerQuery(layer, position, query, weights));
      DSA_ASSIGN_OR_RETURN(KeyCacheView view, cache.View(kSequenceId, layer));
      const int64_t num_blocks = (view.num_slots + kBlockSize - 1) / kBlockSize;
      blocks.resize(num_blocks);
      for (int64_t j = 0; j < num_blocks; ++j) blocks[j] = static_cast<int32_t>(j);
      scores.resize(num_blocks * kBlockSize);
      const IndexerRow row{query, weights, position};
      ScoreBlocks(view, blocks, std::span<const IndexerRow>(&row, 1), num_heads, scores);
      trace.scores[static_cast<size_t>(layer) * config.num_steps + step].assign(
          scores.begin(), scores.begin() + position + 1);
    }
  }
  return trace;
}

absl::StatusOr<PredictorStudyResult> EvaluatePredictors(const DenseScoreTrace& trace,
                                                        const PredictorStudyConfig& config) {
  if (config.top_k < 1)
    return absl::InvalidArgumentError("PredictorStudyConfig.top_k must be >= 1");
  if (config.oracle_depth < 1) {
    return absl::InvalidArgumentError("PredictorStudyConfig.oracle_depth must be >= 1");
  }
  if (trace.num_layers < 1 || trace.num_steps < 1 ||
      trace.scores.size() != static_cast<size_t>(trace.num_layers) * trace.num_steps) {
    return absl::InvalidArgumentError("EvaluatePredictors: empty or malformed trace");
  }
  const int num_samples = trace.num_layers * trace.num_steps;
  const int k = config.top_k;
  std::vector<Sample> random(num_samples), prev_layer(num_samples), best_of(num_samples),
      prev_iter(num_samples), offset1(num_samples);
  std::vector<uint8_t> has_prev_layer(num_samples, 0), has_prev_iter(num_samples, 0),
      all(num_samples, 1);
  const PhiloxKey random_key{
      {static_cast<uint32_t>(config.random_seed), static_cast<uint32_t>(config.random_seed >> 32)}};

#pragma omp parallel for schedule(dynamic)
  for (int sample = 0; sample < num_samples; ++sample) {
    const int layer = sample / trace.num_steps, step = sample % trace.num_steps;
    const std::vector<float>& actual = trace.At(layer, step);
    const std::span<const float> actual_all(actual);
    const int64_t n = static_cast<int64_t>(actual.size());

    // Random: uniform scores keyed by (layer, step, slot).
    std::vector<float> uniform(n);
    for (int64_t i = 0; i < n; i += 4) {
      const PhiloxCounter r =
          Philox4x32(PhiloxCounter{{static_cast<uint32_t>(i / 4), static_cast<uint32_t>(i >> 34),
                                    static_cast<uint32_t>(layer), static_cast<uint32_t>(step)}},
                     random_key);
      for (int64_t j = i; j < std::min(n, i + 4); ++j) uniform[j] = UniformFloat(r.c[j - i]);
    }
    random[sample] = Compare(uniform, actual_all, k);

    if (layer >= 1) {
      has_prev_layer[sample] = 1;
      prev_layer[sample] = Compare(trace.At(layer - 1, step), actual_all, k);
      Sample best{-2.0, -1.0};
      for (int back = 1; back <= config.oracle_depth && layer - back >= 0; ++back) {
        const Sample s =
            back == 1 ? prev_layer[sample] : Compare(trace.At(layer - back, step), actual_all, k);
        best.correlation = std::max(best.correlation, s.correlation);
        best.recall = std::max(best.recall, s.recall);
      }
      best_of[sample] = best;
    }
    if (step >= 1) {
      has_prev_iter[sample] = 1;
      const std::span<const float> previous(trace.At(layer, step - 1));  // slots [0, n - 1)
      prev_iter[sample] = Compare(previous, actual_all.first(n - 1), k);
      // Offset 1: previous[i - 1] predicts slot i, for i in [1, n).
      offset1[sample] = Compare(previous, actual_all.subspan(1), k);
    }
  }

  PredictorStudyResult result;
  result.context_slots = trace.context_slots;
  result.num_steps = trace.num_steps;
  result.num_layers = trace.num_layers;
  result.top_k = k;
  result.oracle_depth = config.oracle_depth;
  result.random = Average(random, all);
  result.prev_layer = Average(prev_layer, has_prev_layer);
  result.prev_layer_best_of = Average(best_of, has_prev_layer);
  result.prev_iter = Average(prev_iter, has_prev_iter);
  result.prev_iter_offset1 = Average(offset1, has_prev_iter);
  return result;
}

absl::StatusOr<PredictorStudyResult> RunPredictorStudy(const PatternModel& model,
                                                       const DenseScoreConfig& scores,
                                                       const PredictorStudyConfig& config) {
  DSA_ASSIGN_OR_RETURN(DenseScoreTrace trace, ComputeDenseScores(model, scores));
  return EvaluatePredictors(trace, config);
}

std::string FormatPredictorStudyMarkdown(const PredictorStudyResult& r) {
  std::string out = absl::StrFormat(
      "Pattern model, N = %d context slots, T = %d decode steps, K = %d, %d layers\n\n"
      "| predictor | Pearson correlation | top-K recall | samples |\n"
      "|---|---:|---:|---:|\n",
      r.context_slots, r.num_steps, r.top_k, r.num_layers);
  auto row = [&out](const std::string& name, const PredictorMetrics& m) {
    if (m.num_samples == 0) {
      absl::StrAppend(&out, "| ", name, " | n/a | n/a | 0 |\n");
    } else {
      absl::StrAppend(&out, absl::StrFormat("| %s | %.3f | %.3f | %d |\n", name, m.correlation,
                                            m.recall, m.num_samples));
    }
  };
  row("Random", r.random);
  row("Prev-layer", r.prev_layer);
  row(absl::StrCat("Prev-layer (best-of-", r.oracle_depth, " oracle)"), r.prev_layer_best_of);
  row("Prev-iter", r.prev_iter);
  row("Prev-iter (offset 1)", r.prev_iter_offset1);
  return out;
}

}  // namespace dsa
