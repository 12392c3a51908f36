// `dsa fit-pattern`: fits the synthetic pattern model (attention_worker/pattern_model.h) to the
// index-score statistics of the real model's trained lightning indexer (SmolLM2-135M,
// docs/model.md) on held-out text, so that the throughput runs' selections behave like a real
// model's.
//
// The statistics are those SPIN section 2 describes and SPIN's block pruning depends on, measured
// on the exact top-K of each decode-like row (rows t = n - rows .. n - 1, each over slots [0, t])
// of every indexer layer, from z_t[i] = sum_h w_t,h ReLU(q_t,h . k_i) (DESIGN.md 3.1, without the
// fp8 key scale):
//   block coverage     distinct 64-slot blocks holding a top-K slot / visible blocks (how much a
//                      block-sparse scan must read to keep the top-K: score concentration)
//   recency share      top-K slots within the newest kPrefixBlockSlots (512) slots
//   sink share         top-K slots in the first block
//   segment share      top-K slots in the most-selected older 512-slot segment (topic segments)
//   step overlap       |top-K(t) n top-K(t - 1)| / K (how often the selection shifts)
//   layer overlap      |top-K of layer l n of layer l - 1| / K, at the same row (layer correlation)
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention_worker/pattern_model.h"
#include "nlohmann/json.hpp"

namespace dsa {

/// Where the index scores come from: a model's indexer inputs at consecutive layers.
class IndexScoreSource {
 public:
  virtual ~IndexScoreSource() = default;
  virtual int num_layers() const = 0;
  virtual int num_heads() const = 0;  // H
  virtual int head_dim() const = 0;   // D
  /// The index keys of slots [0, n) at `layer`: fp32 [n, D].
  virtual absl::Status Keys(int layer, int64_t n, std::span<float> out) const = 0;
  /// The indexer query (fp32 [H, D]) and head weights ([H]) of the row at position t.
  virtual absl::Status Query(int layer, int64_t t, std::span<float> query,
                             std::span<float> head_weights) const = 0;
};

/// The statistics of one source (see the file comment); every field a fraction in [0, 1].
struct IndexScoreStatistics {
  double block_coverage = 0;
  double recency_share = 0;
  double sink_share = 0;
  double segment_share = 0;
  double step_overlap = 0;
  double layer_overlap = 0;
};

/// Rows t in [n - rows, n), each over slots [0, t]; the exact top-K of each (ties to the lower
/// slot).
struct IndexScoreWindow {
  int64_t n = 2048;
  int rows = 32;
  int top_k = 512;
};

/// Measures `source` over `window`. Errors: INVALID_ARGUMENT (rows < 2, n - rows < top_k,
/// top_k < 1), and the source's.
absl::StatusOr<IndexScoreStatistics> MeasureIndexScores(const IndexScoreSource& source,
                                                        const IndexScoreWindow& window);

/// The pattern model as a source (its layers, heads and dims).
std::unique_ptr<IndexScoreSource> PatternScoreSource(std::shared_ptr<const PatternModel> model);

/// The real model's indexer inputs over the first `n` tokens of `tokens` (one dense prefill on the
/// CPU), keeping the keys of every layer and the queries of the last `rows` rows.
/// Errors: NOT_FOUND / DATA_LOSS / INVALID_ARGUMENT from the loaders (naming the file),
/// INVALID_ARGUMENT (fewer than n tokens, a model without an indexer), the forward pass's.
absl::StatusOr<std::unique_ptr<IndexScoreSource>> RealModelScoreSource(
    const std::string& model_file, const std::string& indexer_weights,
    const std::vector<int32_t>& tokens, int64_t n, int rows);

/// The distance minimized: the sum over the statistics of (pattern - real)^2.
double StatisticsDistance(const IndexScoreStatistics& a, const IndexScoreStatistics& b);

/// One fitted parameter of PatternModelConfig and the range it may take.
struct PatternFitParameter {
  std::string name;  // the PatternModelConfig field
  double min = 0;
  double max = 0;
  bool integer = false;
};

/// The parameters `dsa fit-pattern` moves: the strengths and rates of the sinks, salient slots,
/// topics, recency and noise, and the layer correlation.
std::vector<PatternFitParameter> DefaultPatternFitParameters();

/// Reads and writes a fitted parameter of `config` by name. INVALID_ARGUMENT for an unknown name.
absl::StatusOr<double> GetPatternParameter(const PatternModelConfig& config,
                                           const std::string& name);
absl::Status SetPatternParameter(PatternModelConfig& config, const std::string& name, double value);

struct PatternFitOptions {
  IndexScoreWindow window;
  /// The pattern model's shape while fitting (the real indexer's H and D, its own layers).
  PatternModelConfig start;
  std::vector<PatternFitParameter> parameters = DefaultPatternFitParameters();
  /// Coordinate descent: each round tries every parameter scaled by (1 +- step) (an additive step
  /// of `step` for parameters bounded by 1) and keeps any improvement; the step halves after a
  /// round without one, down to min_step.
  double initial_step = 0.5;
  double min_step = 0.06;
  int max_rounds = 40;
};

struct PatternFitReport {
  IndexScoreStatistics real;
  IndexScoreStatistics start;   // the pattern model with options.start
  IndexScoreStatistics fitted;  // with `config`
  PatternModelConfig config;
  double start_distance = 0;
  double fitted_distance = 0;
  int evaluations = 0;
  double seconds = 0;
};

/// Fits options.parameters of the pattern model to `real` by coordinate descent on
/// StatisticsDistance. Errors: INVALID_ARGUMENT (an unknown parameter, a start value outside its
/// range, the window's), the pattern model's (an invalid start config).
absl::StatusOr<PatternFitReport> FitPatternModel(const IndexScoreStatistics& real,
                                                 const PatternFitOptions& options,
                                                 void (*progress)(const std::string&));

nlohmann::json IndexScoreStatisticsToJson(const IndexScoreStatistics& s);

/// SPIN's audited quality at one target block sparsity (gamma 0), against the dense top-K.
struct SpinMissRow {
  double target_block_sparsity = 0;
  double mean_miss_rate = 0;
  double p99_miss_rate = 0;
  double realized_block_sparsity = 0;
};

/// `dsa fit-pattern` (the file comment): the real model's statistics over `samples` windows of
/// held-out text, the fit, and SPIN's miss rate on the pattern model before and after it (the
/// check the fit is for: it is not fitted to it), beside the real model's from a `dsa eval --model
/// smollm2` report at the same context when one is given.
struct PatternFitStudyOptions {
  std::string model_file;
  std::string indexer_weights;
  std::string heldout_tokens;
  int samples = 2;  // windows of window.n tokens, spread evenly over the held-out tokens
  /// The pattern model's H and D while fitting (0: the real indexer's). fit.start's are ignored.
  int pattern_heads = 0;
  int pattern_head_dim = 0;
  PatternFitOptions fit;
  std::vector<double> spin_sparsities = {0.2, 0.3, 0.4, 0.5};
  int spin_decode_steps = 64;    // 0 skips the SPIN check
  std::string real_eval_report;  // optional: a dsa eval --model smollm2 JSON
};

struct PatternFitStudy {
  PatternFitStudyOptions options;
  PatternFitReport fit;
  std::vector<SpinMissRow> spin_start, spin_fitted, spin_real;  // spin_real: from the report
  int64_t real_eval_context = 0;
  double seconds = 0;
};

/// Errors: those of the loaders, RealModelScoreSource, MeasureIndexScores, FitPatternModel and
/// RunEval; INVALID_ARGUMENT for samples < 1 or a real-eval report that is not one.
absl::StatusOr<PatternFitStudy> RunPatternFitStudy(const PatternFitStudyOptions& options,
                                                   void (*progress)(const std::string&));
nlohmann::json PatternFitStudyToJson(const PatternFitStudy& study);
std::string PatternFitStudyToMarkdown(const PatternFitStudy& study);

}  // namespace dsa
