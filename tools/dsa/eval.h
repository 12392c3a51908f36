// `dsa eval`: the quality evaluation of SPIN against all-keep on the pattern model (SPIN paper
// sections 4.5-4.6 protocol: miss rate of the pruned top-K against the dense top-K, realized block
// sparsity), including the speculative-decoding ablation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attention_worker/pattern_model.h"
#include "indexer_service/spin.h"
#include "nlohmann/json.hpp"

namespace dsa {

/// What to evaluate. Sizes are in slots (tokens visible to the indexer).
struct EvalOptions {
  int64_t context_slots = 32768;  // prefill length N (a multiple of 64: prefill blocks are shared)
  int decode_steps = 128;         // decode positions after the prefill (per configuration)
  int num_layers = 4;             // full layers of the pattern model
  /// The pattern model's other parameters; num_layers, num_heads, head_dim and seed come from the
  /// fields here.
  PatternModelConfig pattern;
  int num_heads = 64;  // H
  int head_dim = 128;  // D
  int top_k = 2048;    // K
  uint64_t seed = 1;   // pattern model, exploration and acceptance seed
  std::vector<double> target_sparsities = {0.2, 0.3, 0.4, 0.5};
  std::vector<double> exploration_fractions = {0.0, 0.05};
  int draft_length = 3;          // d of the speculative ablation (0 skips it)
  double acceptance_rate = 0.7;  // per-token acceptance probability of the seeded model
  double spec_exploration_fraction =
      0.0;  // gamma in the speculative ablation (the paper's MTP study has none)
  bool predictor_study = true;  // also run the Table-1 predictor comparison
  // SPIN ablation options (paper 4.6), applied to every SPIN configuration.
  std::string pooling = "max";                // "max" | "top4" | "mean"
  std::string reduction = "a1";               // "a1" | "a0" | "a2"
  std::string exploration_policy = "random";  // "random" | "staleness" | "age"
};

/// One configuration's results. Miss rate per row = 1 - |pruned top-K n dense top-K| / |dense
/// top-K|.
struct EvalRow {
  std::string name;  // e.g. "spin rho=0.40 gamma=0.05"
  std::string kind;  // "all-keep", "spin", "spec-all-keep", "spec-union-prefix-valid", "spec-row0"
  double target_sparsity = 0.0;
  double exploration_fraction = 0.0;
  int64_t rows = 0;  // selections compared (layers x decode rows)
  double mean_miss_rate = 0.0;
  double p99_miss_rate = 0.0;
  double realized_block_sparsity = 0.0;  // 1 - sum(blocks scored) / sum(blocks visible)
  int64_t blocks_scored = 0;             // total over all steps and layers
  int64_t blocks_visible = 0;
  double mean_accepted = 0.0;  // speculative rows only: mean accepted draft tokens per step
  double seconds = 0.0;        // wall time of this configuration
};

struct EvalReport {
  EvalOptions options;
  std::vector<EvalRow> rows;
  std::string predictor_table;  // markdown, empty when not run
  nlohmann::json predictor_json;
};

/// INVALID_ARGUMENT naming the first option out of range (see RunEval); OK otherwise.
absl::Status ValidateEvalOptions(const EvalOptions& options);

/// Runs every configuration. Errors: INVALID_ARGUMENT for options out of range (sizes < 1, a
/// context not a multiple of 64, sparsities or fractions outside [0, 1), d outside [0, 4], an
/// unknown pooling, reduction or exploration policy name).
/// `progress` (may be null) receives one line per finished configuration.
absl::StatusOr<EvalReport> RunEval(const EvalOptions& options,
                                   void (*progress)(const std::string&));

/// The report as JSON (options, rows, predictor study) and as a markdown table.
nlohmann::json EvalReportToJson(const EvalReport& report);
std::string EvalReportToMarkdown(const EvalReport& report);

}  // namespace dsa
