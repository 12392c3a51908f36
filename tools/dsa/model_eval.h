// `dsa eval --model smollm2`: the quality of DSA's selections on the real model (SmolLM2-135M
// with its trained lightning indexers, docs/model.md), measured as the papers measure it: the
// perplexity of held-out continuations decoded through the attention engine under each arm
// (dense; DSA all-keep; SPIN at target block sparsities with and without exploration, SPIN paper
// section 4.5; MLI lag depths and IndexCache retention, MLI paper section 4), passkey retrieval in
// an essay haystack, and each arm's realized block sparsity and audited miss rate against the
// dense top-K of the indexer scores (SPIN paper's miss rate), and the attention mass the selected
// slots hold. Every sparse arm runs the served path: AttentionEngine over LlamaAttentionModel (the
// CPU runner, or the GPU runner), with an in-process Indexer; the dense reference runs the
// runner's passes without selections.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace dsa {

/// One configuration of the sparse attention under evaluation.
struct ModelEvalArm {
  std::string name;
  /// Every slot attended: one full layer whose K covers the context (the reference).
  bool dense = false;
  int retention_stride = 1;          // every r-th layer full (IndexCache retention 1/r), >= 1
  int lag_depth = 0;                 // MLI lag depth k, >= 0 (0: each full layer attends its own)
  bool spin = false;                 // SPIN block pruning (false: all-keep, every block scored)
  double target_block_sparsity = 0;  // rho in [0, 1) (SPIN)
  double exploration_fraction = 0;   // gamma in [0, 1) (SPIN)
  /// Speculative steps: d n-gram draft tokens (coordinator/ngram_drafter.h over the sequence's
  /// own tokens) verified as rows 1..d, accepted while they equal the held-out text; 0: one row a
  /// step. In [0, 4].
  int draft_length = 0;
  /// The SPIN paper's ablation (section 4.6): verifier rows share row 0's mask and only row 0
  /// updates the EMAs (false: the union of the rows' masks, EMAs replayed for rows 0..a).
  bool row0_policies = false;
  /// Adaptive sparsity (indexer_service/sparsity_controller.h): each sequence's rho moves from
  /// target_block_sparsity to hold its audited miss rate near this, in (0, 1); 0: rho fixed.
  double miss_target = 0;
};

/// Dense; all-keep; SPIN rho 0.2/0.3/0.4/0.5 with gamma 0 and 0.05; adaptive sparsity with miss
/// targets 0.05 and 0.2 from rho 0.4 (gamma 0.05); MLI k = 1, 2; retention 1/2,
/// 1/4; SPIN rho 0.4 with MLI k = 1 at retention 1/2 (the served default's schedule); and d = 3
/// speculative steps: all-keep, SPIN rho 0.4 with the union mask and prefix-valid replay, and with
/// row-0 sharing and row-0 update.
std::vector<ModelEvalArm> DefaultModelEvalArms();
/// The --quick arms: dense, all-keep, SPIN rho 0.4 with gamma 0.05, MLI k = 1 at retention 1/2,
/// and d = 3 speculative steps with SPIN rho 0.4 (union mask, prefix-valid replay).
std::vector<ModelEvalArm> QuickModelEvalArms();

struct ModelEvalOptions {
  std::string model_file;       // fp32 safetensors (scripts/model_setup.sh)
  std::string indexer_weights;  // fp16 safetensors (data/models/smollm2_indexer.safetensors)
  std::string heldout_tokens;   // .npy of held-out token ids (never seen in training)
  std::string needles_file;     // needles.json (python/dsa_model/needles.py); empty: no needles
  /// Context lengths of the perplexity windows, tokens, each >= 64 (context + continuation must
  /// fit the model's 8,192 positions: 8,064 is the 8K window).
  std::vector<int64_t> contexts = {1024, 2048, 4096, 8064};
  int samples = 4;                   // windows per context, spread evenly over the held-out tokens
  int continuation = 128;            // tokens scored after each window's context, >= 2
  bool greedy_continuations = true;  // also score the dense model's own greedy continuations
  /// Passkey lengths evaluated (cases of other lengths in the file are skipped); empty: all.
  std::vector<int64_t> needle_lengths;
  int top_k = 512;  // K of the sparse arms
  std::vector<ModelEvalArm> arms = DefaultModelEvalArms();
  uint64_t seed = 0;  // SPIN exploration seed
  /// Where the model runs: "cpu", "cuda" (cuda/llama_cuda_runner.h on GPU cuda_device; needs a
  /// build with CUDA) or "auto" (the GPU when this build has CUDA and one is present).
  std::string device = "auto";
  int cuda_device = 0;
};

/// One model layer's selections under an arm, over every decode row of a context.
struct LayerSelectionStats {
  int model_layer = 0;
  /// Attention-mass recall: per sparse row, the dense softmax mass (over every visible slot,
  /// averaged over the layer's query heads) that falls on the slots the row attended. Measured on
  /// the CPU runner only (0 rows elsewhere).
  int64_t rows = 0;
  double mean_mass_recall = 0;
  double p1_mass_recall = 0;  // the 1st percentile: 99% of rows keep at least this
  /// Audited miss rates of this layer's own selects (full layers of SPIN arms).
  int64_t audited_rows = 0;
  double mean_miss_rate = 0;
  double p99_miss_rate = 0;
};

/// One sequence's selections under a SPIN arm (fixed rho, or moved by adaptive sparsity).
struct SequenceSelectionStats {
  int window = 0;       // the window's index in the context's samples
  bool greedy = false;  // the dense greedy continuation (else the held-out one)
  double realized_block_sparsity = 0;
  int64_t audited_rows = 0;
  double mean_miss_rate = 0;
  double p99_miss_rate = 0;
};

/// The perplexity of one arm at one context length.
struct PerplexityCell {
  std::string arm;
  int64_t context = 0;
  int64_t tokens_scored = 0;           // per kind of continuation: samples x continuation
  double real_perplexity = 0;          // exp(mean NLL) of the held-out continuations
  double greedy_perplexity = 0;        // of the dense model's greedy continuations (0: not run)
  double realized_block_sparsity = 0;  // 1 - blocks scored / blocks visible, over every step
  int64_t audited_rows = 0;            // rows audited against the dense top-K (SPIN arms)
  double mean_miss_rate = 0;
  double p99_miss_rate = 0;
  /// Attention-mass recall over every sparse row and layer (see LayerSelectionStats).
  double mean_mass_recall = 0;
  double p1_mass_recall = 0;
  std::vector<LayerSelectionStats> layers;        // sparse arms: one per model layer
  std::vector<SequenceSelectionStats> sequences;  // SPIN arms: one per scored sequence
  /// Speculative arms: decode steps run, and draft tokens accepted per step.
  int64_t steps = 0;
  double mean_accepted = 0;
  double seconds = 0;
};

/// One passkey case under one arm.
struct NeedleCell {
  std::string arm;
  int64_t length = 0;
  double depth = 0;
  bool found = false;              // the greedy answer's ids equal the key's
  std::vector<int32_t> generated;  // the greedy ids (as many as the answer's)
};

struct ModelEvalReport {
  ModelEvalOptions options;
  std::vector<PerplexityCell> perplexity;
  std::vector<NeedleCell> needles;
  std::string device;  // the runner's Description()
  double seconds = 0;
  /// False in the reports a checkpoint sees: some cells are still to run.
  bool complete = false;
};

/// Sees the report so far after every finished perplexity cell and pass-key group, so that a run
/// cut short (a time limit) leaves what it finished.
using ModelEvalCheckpoint = std::function<void(const ModelEvalReport&)>;

/// INVALID_ARGUMENT naming the first option out of range.
absl::Status ValidateModelEvalOptions(const ModelEvalOptions& options);

/// Runs every arm. Errors: INVALID_ARGUMENT (options; a held-out file too short for a window;
/// malformed needles), FAILED_PRECONDITION (device "cuda" in a build without CUDA, or the GPU
/// runner's own errors), NOT_FOUND / DATA_LOSS / INVALID_ARGUMENT from the model's and tokens'
/// loaders (naming the file), and any engine error (its status). `progress` (may be null) gets one
/// line per finished arm and context; `checkpoint` (may be empty) the report so far.
absl::StatusOr<ModelEvalReport> RunModelEval(const ModelEvalOptions& options,
                                             void (*progress)(const std::string&),
                                             const ModelEvalCheckpoint& checkpoint = {});

/// The report as JSON (options, cells) and as markdown tables (perplexity with each arm's ratio to
/// dense and to all-keep, the needle grid, selection statistics).
nlohmann::json ModelEvalReportToJson(const ModelEvalReport& report);
std::string ModelEvalReportToMarkdown(const ModelEvalReport& report);

}  // namespace dsa
