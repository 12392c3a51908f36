// `dsa fit-pattern`: fits the synthetic pattern model (attention_worker/pattern_model.h) to the
// index-score statistics of the real model's trained lightning indexer (SmolLM2-135M,
// docs/model.md) on held-out text, so that the throughput runs' selections behave like a real
// model's.
//
// The statistics are those SPIN section 2 describes and SPIN's block pruning depends on, measured
// on the exact top-K of each decode-like row (rows t = n - rows .. n - 1, each over slots [0, t])
// of every indexer layer, from z_t[i] = sum_h w_t,h ReLU(q_t,h . k_i) (DESIGN.md 4.1, without the
// fp8 key scale):
//   block coverage     distinct 64-slot blocks holding a top-K slot / visible blocks (how much a
//                      block-sparse scan must read to keep the top-K: score concentration)
//   recency share      top-K slots within the newest kPrefixBlockTokens (512) slots
//   sink share         top-K slots in the first block
//   segment share      top-K slots in the most-selected older 512-slot segment (topic segments)
//   step overlap       |top-K(t) n top-K(t - 1)| / K (how often the selection shifts)
//   block step overlap top-K(t) slots in a block that held a top-K slot at t - 1, / K (what SPIN's
//                      prev-iter planning can keep)
//   layer overlap      |top-K of layer l n of layer l - 1| / K, at the same row (layer correlation)
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention_worker/llama_model.h"
#include "attention_worker/pattern_model.h"
#include "nlohmann/json.hpp"

namespace dsa {

/// Where the index scores come from: a model's indexer inputs at consecutive layers. The methods
/// are const and thread-safe.
class IndexScoreSource {
 public:
  virtual ~IndexScoreSource() = default;
  virtual int num_layers() const = 0;
  virtual int num_heads() const = 0;  // H
  virtual int head_dim() const = 0;   // D
  /// The index keys of slots [0, n) at `layer`: fp32 [n, D]. INVALID_ARGUMENT for a layer out of
  /// range, more slots than the source holds, or out.size() != n * D.
  virtual absl::Status Keys(int layer, int64_t n, std::span<float> out) const = 0;
  /// The indexer query (fp32 [H, D]) and head weights (fp32 [H]) of the row at position t.
  /// INVALID_ARGUMENT for a layer or position the source does not hold, or wrong span sizes.
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
  double block_step_overlap = 0;
  double layer_overlap = 0;
};

/// Rows t in [n - rows, n), each over slots [0, t]; the exact top-K of each (ties to the lower
/// slot).
struct IndexScoreWindow {
  int64_t n = 2048;
  int rows = 32;
  int top_k = 512;
};

/// INVALID_ARGUMENT unless rows >= 2, top_k >= 1 and n - rows >= top_k (every row sees K slots).
absl::Status ValidateIndexScoreWindow(const IndexScoreWindow& window);

/// Measures `source` over `window`. Errors: ValidateIndexScoreWindow's, and the source's.
absl::StatusOr<IndexScoreStatistics> MeasureIndexScores(const IndexScoreSource& source,
                                                        const IndexScoreWindow& window);

/// The pattern model as a source (its layers, heads and dims).
std::unique_ptr<IndexScoreSource> PatternScoreSource(std::shared_ptr<const PatternModel> model);

/// The real model's indexer inputs over the first `n` tokens of `tokens` (one dense prefill on the
/// CPU, LlamaForward::IndexerInputs at every layer), keeping the keys of every layer (fp32
/// [n, D] each) and the queries and head weights of the last `rows` rows. Errors:
/// INVALID_ARGUMENT (fewer than n tokens, rows outside [1, n], n above the model's context, a model
/// without an indexer), the forward pass's.
absl::StatusOr<std::unique_ptr<IndexScoreSource>> RealModelScoreSource(
    const std::shared_ptr<const LlamaModel>& model, const std::vector<int32_t>& tokens, int64_t n,
    int rows);

/// The distance minimized: the sum over the seven statistics of (pattern - real)^2.
double StatisticsDistance(const IndexScoreStatistics& a, const IndexScoreStatistics& b);

/// One fitted parameter of PatternModelConfig and the range it may take.
struct PatternFitParameter {
  std::string name;  // the PatternModelConfig field
  double min = 0;
  double max = 0;
  bool integer = false;
  /// Steps of step / 2 of (max - min) instead of a factor (1 +- step).
  bool additive = false;
};

/// Every field `dsa fit-pattern` can move (--parameters), with its range and step rule.
std::vector<PatternFitParameter> FittablePatternParameters();

/// The parameters `dsa fit-pattern` moves by default: the strengths and rates of the sinks, salient
/// slots, topics, recency and noise, and the layer correlation.
std::vector<PatternFitParameter> DefaultPatternFitParameters();

/// Reads and writes a fitted parameter of `config` by name. INVALID_ARGUMENT for an unknown name.
absl::StatusOr<double> GetPatternParameter(const PatternModelConfig& config,
                                           const std::string& name);
absl::Status SetPatternParameter(PatternModelConfig& config, const std::string& name, double value);

/// What FitPatternModel fits, from where, and how far it searches.
struct PatternFitOptions {
  IndexScoreWindow window;
  /// The first config tried; its shape (layers, H, D, seed) is kept throughout.
  PatternModelConfig start;
  std::vector<PatternFitParameter> parameters = DefaultPatternFitParameters();
  /// Coordinate descent: each round tries every parameter scaled by (1 +- step) (additive ones
  /// moved by +- step / 2 of their range) and keeps the first improvement of each; the step halves
  /// after a round without one, down to min_step.
  double initial_step = 0.5;
  double min_step = 0.06;
  int max_rounds = 40;
};

/// FitPatternModel's result: the statistics it fitted to, those of the start and of the fitted
/// config, and the distances between them.
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

/// INVALID_ARGUMENT for the window's errors, an unknown parameter, or a start value outside its
/// parameter's range.
absl::Status CheckFitParameters(const PatternFitOptions& options);

/// Fits options.parameters of the pattern model to `real` by coordinate descent on
/// StatisticsDistance. Errors: INVALID_ARGUMENT (an unknown parameter, a start value outside its
/// range, the window's), the pattern model's (an invalid start config).
absl::StatusOr<PatternFitReport> FitPatternModel(const IndexScoreStatistics& real,
                                                 const PatternFitOptions& options,
                                                 void (*progress)(const std::string&));

/// The pattern model's fittable fields (DefaultPatternFitParameters' and the diagonal strength and
/// topic count) as a JSON object keyed by field name: what a report records of the model it ran.
nlohmann::json PatternModelConfigToJson(const PatternModelConfig& config);

/// The six statistics as a JSON object keyed by their field names.
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
  /// The pattern model's H and D while fitting (0: the real indexer's, which then replace
  /// fit.start's).
  int pattern_heads = 0;
  int pattern_head_dim = 0;
  PatternFitOptions fit;
  std::vector<double> spin_sparsities = {0.2, 0.3, 0.4, 0.5};
  int spin_decode_steps = 64;    // 0 skips the SPIN check
  std::string real_eval_report;  // optional: a dsa eval --model smollm2 JSON
};

/// RunPatternFitStudy's result; options as run (the pattern shape filled in).
struct PatternFitStudy {
  PatternFitStudyOptions options;
  PatternFitReport fit;
  std::vector<SpinMissRow> spin_start, spin_fitted, spin_real;  // spin_real: from the report
  int64_t real_eval_context = 0;                                // the report's context (window.n)
  bool real_eval_partial = false;                               // the report was marked incomplete
  double seconds = 0;
};

/// Every option is checked before the model loads. Errors: INVALID_ARGUMENT (samples < 1, the
/// window's, spin_decode_steps < 0, a pattern shape PatternModelConfig refuses, n above the model's
/// context, a real-eval report that is malformed, has another K, or no fixed-rho SPIN cell at
/// context n), NOT_FOUND (a file), the loaders', FitPatternModel's and RunEval's.
absl::StatusOr<PatternFitStudy> RunPatternFitStudy(const PatternFitStudyOptions& options,
                                                   void (*progress)(const std::string&));
/// The study as JSON (options, statistics, parameters start and fitted, SPIN rows) and as the
/// markdown tables of docs/eval.md.
nlohmann::json PatternFitStudyToJson(const PatternFitStudy& study);
std::string PatternFitStudyToMarkdown(const PatternFitStudy& study);

}  // namespace dsa
