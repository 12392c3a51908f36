// `dsa eval` (see eval.h): every configuration decodes the same pattern-model sequence; each
// selection is compared with the dense top-K of the same row, computed once and memoized.
#include "tools/dsa/eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attention_worker/pattern_model.h"
#include "common/status_macros.h"
#include "coordinator/acceptance_model.h"
#include "indexer_service/indexer.h"
#include "indexer_service/topk.h"
#include "tools/dsa/pattern_fit.h"
#include "tools/dsa/predictor_study.h"
#include "tools/dsa/replay.h"

namespace dsa {
namespace {

// The dense top-K of every (layer, position) row, from a cache holding every key once.
class DenseOracle {
 public:
  static absl::StatusOr<std::unique_ptr<DenseOracle>> Create(const PatternModel& model,
                                                             int64_t num_slots, int top_k) {
    const int layers = model.num_layers();
    DSA_ASSIGN_OR_RETURN(IndexKeyCache cache,
                         IndexKeyCache::Create(layers * CeilDiv(num_slots, 64), model.head_dim()));
    DSA_RETURN_IF_ERROR(cache.AddSequence(0, layers));
    std::vector<float> keys(static_cast<size_t>(num_slots) * model.head_dim());
    for (int l = 0; l < layers; ++l) {
      DSA_RETURN_IF_ERROR(model.IndexKeys(l, 0, num_slots, keys));
      DSA_RETURN_IF_ERROR(cache.Append(0, l, keys, num_slots));
    }
    return std::unique_ptr<DenseOracle>(new DenseOracle(model, std::move(cache), top_k));
  }

  // The dense selection of the row at (layer, position), int32 [K].
  absl::StatusOr<const std::vector<int32_t>*> Selection(int layer, int64_t position) {
    auto key = std::make_pair(layer, position);
    auto it = memo_.find(key);
    if (it != memo_.end()) return &it->second;
    DSA_ASSIGN_OR_RETURN(KeyCacheView view, cache_.View(0, layer));
    std::vector<float> query(static_cast<size_t>(model_.num_heads()) * model_.head_dim());
    std::vector<float> weights(model_.num_heads());
    DSA_RETURN_IF_ERROR(model_.IndexerQuery(layer, position, query, weights));
    const int64_t num_blocks = CeilDiv(position + 1, 64);
    std::vector<int32_t> blocks(num_blocks);
    for (int64_t j = 0; j < num_blocks; ++j) blocks[j] = static_cast<int32_t>(j);
    std::vector<float> scores(num_blocks * 64);
    const IndexerRow row{query, weights, position};
    ScoreBlocks(view, blocks, std::span<const IndexerRow>(&row, 1), model_.num_heads(), scores);
    std::vector<int32_t> selection(top_k_);
    SelectTopK(scores, blocks, position, selection);
    return &memo_.emplace(key, std::move(selection)).first->second;
  }

 private:
  DenseOracle(const PatternModel& model, IndexKeyCache cache, int top_k)
      : model_(model), cache_(std::move(cache)), top_k_(top_k) {}
  const PatternModel& model_;
  IndexKeyCache cache_;
  int top_k_;
  std::map<std::pair<int, int64_t>, std::vector<int32_t>> memo_;
};

// Accumulates one configuration's figures.
struct Tally {
  std::vector<double> misses;
  int64_t blocks_scored = 0;
  int64_t blocks_visible = 0;
  int64_t steps = 0;
  int64_t accepted = 0;

  void Finish(EvalRow& row) const {
    row.rows = static_cast<int64_t>(misses.size());
    row.blocks_scored = blocks_scored;
    row.blocks_visible = blocks_visible;
    row.realized_block_sparsity =
        blocks_visible > 0 ? 1.0 - static_cast<double>(blocks_scored) / blocks_visible : 0.0;
    if (!misses.empty()) {
      double sum = 0.0;
      for (double m : misses) sum += m;
      row.mean_miss_rate = sum / misses.size();
      row.p99_miss_rate = NearestRankPercentile(misses, 99);
    }
    row.mean_accepted = steps > 0 ? static_cast<double>(accepted) / steps : 0.0;
  }
};

class Evaluator {
 public:
  Evaluator(const EvalOptions& options, const PatternModel& model, Indexer& indexer,
            DenseOracle& oracle)
      : options_(options),
        model_(model),
        indexer_(indexer),
        oracle_(oracle),
        query_(static_cast<size_t>(model.num_heads()) * model.head_dim()),
        weights_(model.num_heads()) {}

  absl::Status Prefill() {
    SequenceOptions seq;
    seq.num_layers = options_.num_layers;
    seq.top_k = options_.top_k;
    seq.spin.enabled = false;
    DSA_RETURN_IF_ERROR(indexer_.CreateSequence(kPrefillSequence, seq));
    std::vector<float> keys(static_cast<size_t>(options_.context_slots) * model_.head_dim());
    for (int l = 0; l < options_.num_layers; ++l) {
      DSA_RETURN_IF_ERROR(model_.IndexKeys(l, 0, options_.context_slots, keys));
      DSA_RETURN_IF_ERROR(
          indexer_.AppendIndexKeys(kPrefillSequence, l, keys, options_.context_slots));
    }
    return absl::OkStatus();
  }

  // Plain decode: one row per step at positions N .. N + T - 1.
  absl::Status RunDecode(const SpinConfig& spin, Tally& tally) {
    const uint64_t seq = next_sequence_++;
    DSA_RETURN_IF_ERROR(StartSequence(seq, spin));
    for (int s = 0; s < options_.decode_steps; ++s) {
      const int64_t t = options_.context_slots + s;
      DSA_RETURN_IF_ERROR(AppendKeys(seq, t, 1));
      for (int l = 0; l < options_.num_layers; ++l) {
        DSA_RETURN_IF_ERROR(SelectAndCompare(seq, l, t, 1, tally));
      }
    }
    return indexer_.Release(seq);
  }

  // Speculative decode: d + 1 verifier rows per step until position N + T is reached.
  absl::Status RunSpeculative(const SpinConfig& spin, const AcceptanceModel& acceptance,
                              Tally& tally) {
    const uint64_t seq = next_sequence_++;
    DSA_RETURN_IF_ERROR(StartSequence(seq, spin));
    const int rows = acceptance.draft_length() + 1;
    int64_t t = options_.context_slots;
    for (uint64_t step = 0; t < options_.context_slots + options_.decode_steps; ++step) {
      DSA_RETURN_IF_ERROR(AppendKeys(seq, t, rows));
      for (int l = 0; l < options_.num_layers; ++l) {
        DSA_RETURN_IF_ERROR(SelectAndCompare(seq, l, t, rows, tally));
      }
      const int accepted = acceptance.Accepted(step);
      DSA_RETURN_IF_ERROR(indexer_.Commit(seq, accepted));
      ++tally.steps;
      tally.accepted += accepted;
      t += accepted + 1;
    }
    return indexer_.Release(seq);
  }

 private:
  static constexpr uint64_t kPrefillSequence = 0;

  absl::Status StartSequence(uint64_t seq, const SpinConfig& spin) {
    SequenceOptions options;
    options.num_layers = options_.num_layers;
    options.top_k = options_.top_k;
    options.spin = spin;
    return indexer_.CreateSequenceFromPrefix(seq, options, kPrefillSequence,
                                             options_.context_slots);
  }

  absl::Status AppendKeys(uint64_t seq, int64_t first_slot, int count) {
    std::vector<float> keys(static_cast<size_t>(count) * model_.head_dim());
    for (int l = 0; l < options_.num_layers; ++l) {
      DSA_RETURN_IF_ERROR(model_.IndexKeys(l, first_slot, count, keys));
      DSA_RETURN_IF_ERROR(indexer_.AppendIndexKeys(seq, l, keys, count));
    }
    return absl::OkStatus();
  }

  absl::Status SelectAndCompare(uint64_t seq, int layer, int64_t t, int num_rows, Tally& tally) {
    const size_t q_size = query_.size();
    std::vector<float> queries(q_size * num_rows), weights(weights_.size() * num_rows);
    std::vector<IndexerRow> rows(num_rows);
    for (int r = 0; r < num_rows; ++r) {
      std::span<float> q(queries.data() + r * q_size, q_size);
      std::span<float> w(weights.data() + r * weights_.size(), weights_.size());
      DSA_RETURN_IF_ERROR(model_.IndexerQuery(layer, t + r, q, w));
      rows[r] = IndexerRow{q, w, t + r};
    }
    DSA_ASSIGN_OR_RETURN(SelectResult result, indexer_.Select(seq, layer, rows));
    tally.blocks_scored += result.blocks_scored;
    tally.blocks_visible += result.blocks_visible;
    for (int r = 0; r < num_rows; ++r) {
      DSA_ASSIGN_OR_RETURN(const std::vector<int32_t>* dense, oracle_.Selection(layer, t + r));
      tally.misses.push_back(SelectionMissRate(
          std::span<const int32_t>(result.selections.data() + r * result.top_k, result.top_k),
          *dense));
    }
    return absl::OkStatus();
  }

  const EvalOptions& options_;
  const PatternModel& model_;
  Indexer& indexer_;
  DenseOracle& oracle_;
  std::vector<float> query_;
  std::vector<float> weights_;
  uint64_t next_sequence_ = 1;
};

}  // namespace

absl::Status ValidateEvalOptions(const EvalOptions& o) {
  if (o.context_slots < 64 || o.context_slots % 64 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("context must be a positive multiple of 64 slots, got ", o.context_slots));
  }
  if (o.decode_steps < 1) return absl::InvalidArgumentError("decode steps must be >= 1");
  if (o.num_layers < 1) return absl::InvalidArgumentError("layers must be >= 1");
  if (o.top_k < 1) return absl::InvalidArgumentError("top_k must be >= 1");
  for (double rho : o.target_sparsities) {
    if (!(rho >= 0.0 && rho < 1.0)) {
      return absl::InvalidArgumentError(absl::StrCat("target sparsity ", rho, " outside [0, 1)"));
    }
  }
  for (double gamma : o.exploration_fractions) {
    if (!(gamma >= 0.0 && gamma < 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("exploration fraction ", gamma, " outside [0, 1)"));
    }
  }
  if (o.draft_length < 0 || o.draft_length > 4) {
    return absl::InvalidArgumentError("draft length must be in [0, 4]");
  }
  SpinConfig spin;
  DSA_RETURN_IF_ERROR(ParseBlockPooling(o.pooling, &spin.pooling));
  DSA_RETURN_IF_ERROR(ParseBlockReduction(o.reduction, &spin.reduction));
  DSA_RETURN_IF_ERROR(ParseExplorationPolicy(o.exploration_policy, &spin.exploration));
  return absl::OkStatus();
}

absl::StatusOr<EvalReport> RunEval(const EvalOptions& options,
                                   void (*progress)(const std::string&)) {
  DSA_RETURN_IF_ERROR(ValidateEvalOptions(options));
  PatternModelConfig model_config = options.pattern;
  model_config.num_layers = options.num_layers;
  model_config.num_heads = options.num_heads;
  model_config.head_dim = options.head_dim;
  model_config.seed = options.seed;
  DSA_ASSIGN_OR_RETURN(PatternModel model, PatternModel::Create(model_config));

  const int rows_per_step = options.draft_length + 1;
  const int64_t max_slots = options.context_slots + options.decode_steps + rows_per_step;
  DSA_ASSIGN_OR_RETURN(auto oracle, DenseOracle::Create(model, max_slots, options.top_k));

  IndexerOptions indexer_options;
  indexer_options.num_heads = options.num_heads;
  indexer_options.head_dim = options.head_dim;
  // The shared prefill plus one decoding sequence at a time (each holds its decode blocks and a
  // copy-on-write tail), with slack.
  indexer_options.capacity_blocks =
      options.num_layers *
      (CeilDiv(max_slots, 64) + CeilDiv(options.decode_steps + rows_per_step, 64) + 4);
  DSA_ASSIGN_OR_RETURN(auto indexer, Indexer::Create(indexer_options));
  Evaluator evaluator(options, model, *indexer, *oracle);
  DSA_RETURN_IF_ERROR(evaluator.Prefill());

  EvalReport report;
  report.options = options;
  auto run = [&](EvalRow row, auto&& body) -> absl::Status {
    Tally tally;
    const auto start = std::chrono::steady_clock::now();
    DSA_RETURN_IF_ERROR(body(tally));
    row.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    tally.Finish(row);
    if (progress != nullptr) {
      progress(absl::StrFormat("%-44s miss mean %.4f p99 %.4f  realized sparsity %.3f  (%.1f s)",
                               row.name, row.mean_miss_rate, row.p99_miss_rate,
                               row.realized_block_sparsity, row.seconds));
    }
    report.rows.push_back(std::move(row));
    return absl::OkStatus();
  };

  SpinConfig base;
  base.seed = options.seed;
  DSA_RETURN_IF_ERROR(ParseBlockPooling(options.pooling, &base.pooling));
  DSA_RETURN_IF_ERROR(ParseBlockReduction(options.reduction, &base.reduction));
  DSA_RETURN_IF_ERROR(ParseExplorationPolicy(options.exploration_policy, &base.exploration));
  {
    SpinConfig all_keep = base;
    all_keep.enabled = false;
    EvalRow row{.name = "all-keep", .kind = "all-keep"};
    DSA_RETURN_IF_ERROR(run(row, [&](Tally& t) { return evaluator.RunDecode(all_keep, t); }));
  }
  for (double gamma : options.exploration_fractions) {
    for (double rho : options.target_sparsities) {
      SpinConfig spin = base;
      spin.target_block_sparsity = rho;
      spin.exploration_fraction = gamma;
      EvalRow row{.name = absl::StrFormat("spin rho=%.2f gamma=%.2f", rho, gamma),
                  .kind = "spin",
                  .target_sparsity = rho,
                  .exploration_fraction = gamma};
      DSA_RETURN_IF_ERROR(run(row, [&](Tally& t) { return evaluator.RunDecode(spin, t); }));
    }
  }
  if (options.draft_length > 0) {
    DSA_ASSIGN_OR_RETURN(
        AcceptanceModel acceptance,
        AcceptanceModel::Create(options.acceptance_rate, options.draft_length, options.seed));
    struct Policy {
      const char* kind;
      const char* label;
      SpecMaskPolicy mask;
      SpecUpdatePolicy update;
    };
    const Policy policies[] = {{"spec-union-prefix-valid", "union + prefix-valid",
                                SpecMaskPolicy::kRowLocalUnion, SpecUpdatePolicy::kPrefixValid},
                               {"spec-row0", "row-0 sharing + row-0 update",
                                SpecMaskPolicy::kRow0Sharing, SpecUpdatePolicy::kRow0}};
    {
      SpinConfig all_keep = base;
      all_keep.enabled = false;
      EvalRow row{.name = absl::StrFormat("spec d=%d all-keep", options.draft_length),
                  .kind = "spec-all-keep"};
      DSA_RETURN_IF_ERROR(
          run(row, [&](Tally& t) { return evaluator.RunSpeculative(all_keep, acceptance, t); }));
    }
    for (const Policy& policy : policies) {
      for (double rho : options.target_sparsities) {
        SpinConfig spin = base;
        spin.target_block_sparsity = rho;
        spin.exploration_fraction = options.spec_exploration_fraction;
        spin.spec_mask = policy.mask;
        spin.spec_update = policy.update;
        EvalRow row{.name = absl::StrFormat("spec d=%d %s rho=%.2f", options.draft_length,
                                            policy.label, rho),
                    .kind = policy.kind,
                    .target_sparsity = rho,
                    .exploration_fraction = options.spec_exploration_fraction};
        DSA_RETURN_IF_ERROR(
            run(row, [&](Tally& t) { return evaluator.RunSpeculative(spin, acceptance, t); }));
      }
    }
  }
  if (options.predictor_study) {
    const auto start = std::chrono::steady_clock::now();
    DenseScoreConfig dense;
    dense.context_slots = options.context_slots;
    dense.num_steps = std::min(options.decode_steps, 64);
    PredictorStudyConfig study;
    study.top_k = options.top_k;
    study.random_seed = options.seed;
    DSA_ASSIGN_OR_RETURN(PredictorStudyResult result, RunPredictorStudy(model, dense, study));
    report.predictor_table = FormatPredictorStudyMarkdown(result);
    auto metrics = [](const PredictorMetrics& m) {
      return nlohmann::json{
          {"pearson", m.correlation}, {"recall", m.recall}, {"samples", m.num_samples}};
    };
    report.predictor_json = {{"context_slots", result.context_slots},
                             {"steps", result.num_steps},
                             {"layers", result.num_layers},
                             {"top_k", result.top_k},
                             {"random", metrics(result.random)},
                             {"prev_layer", metrics(result.prev_layer)},
                             {"prev_layer_best_of", metrics(result.prev_layer_best_of)},
                             {"prev_iter", metrics(result.prev_iter)},
                             {"prev_iter_offset1", metrics(result.prev_iter_offset1)}};
    if (progress != nullptr) {
      progress(absl::StrFormat(
          "predictor study: prev-iter recall %.3f, random recall %.3f (%.1f s)",
          result.prev_iter.recall, result.random.recall,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()));
    }
  }
  return report;
}

nlohmann::json EvalReportToJson(const EvalReport& report) {
  const EvalOptions& o = report.options;
  nlohmann::json j;
  j["options"] = {{"context_slots", o.context_slots},
                  {"decode_steps", o.decode_steps},
                  {"num_layers", o.num_layers},
                  {"num_heads", o.num_heads},
                  {"head_dim", o.head_dim},
                  {"top_k", o.top_k},
                  {"seed", o.seed},
                  {"target_sparsities", o.target_sparsities},
                  {"exploration_fractions", o.exploration_fractions},
                  {"draft_length", o.draft_length},
                  {"acceptance_rate", o.acceptance_rate},
                  {"spec_exploration_fraction", o.spec_exploration_fraction},
                  {"pooling", o.pooling},
                  {"reduction", o.reduction},
                  {"exploration_policy", o.exploration_policy},
                  {"pattern", PatternModelConfigToJson(o.pattern)}};
  j["rows"] = nlohmann::json::array();
  for (const EvalRow& r : report.rows) {
    j["rows"].push_back({{"name", r.name},
                         {"kind", r.kind},
                         {"target_sparsity", r.target_sparsity},
                         {"exploration_fraction", r.exploration_fraction},
                         {"rows", r.rows},
                         {"mean_miss_rate", r.mean_miss_rate},
                         {"p99_miss_rate", r.p99_miss_rate},
                         {"realized_block_sparsity", r.realized_block_sparsity},
                         {"blocks_scored", r.blocks_scored},
                         {"blocks_visible", r.blocks_visible},
                         {"mean_accepted", r.mean_accepted},
                         {"seconds", r.seconds}});
  }
  if (!report.predictor_json.is_null()) j["predictor_study"] = report.predictor_json;
  return j;
}

std::string EvalReportToMarkdown(const EvalReport& report) {
  const EvalOptions& o = report.options;
  std::string md = absl::StrFormat(
      "Pattern model: %d full layers, H = %d, D = %d, prefill %d slots, %d decode positions, "
      "K = %d, seed %d; SPIN pooling %s, reduction %s, exploration %s; speculative ablation "
      "d = %d, acceptance rate %.2f.\n\n",
      o.num_layers, o.num_heads, o.head_dim, o.context_slots, o.decode_steps, o.top_k, o.seed,
      o.pooling, o.reduction, o.exploration_policy, o.draft_length, o.acceptance_rate);
  md +=
      "| configuration | rows | mean miss | p99 miss | realized block sparsity | blocks scored | "
      "blocks visible | mean accepted | seconds |\n";
  md += "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const EvalRow& r : report.rows) {
    md += absl::StrFormat(
        "| %s | %d | %.4f | %.4f | %.3f | %d | %d | %s | %.1f |\n", r.name, r.rows,
        r.mean_miss_rate, r.p99_miss_rate, r.realized_block_sparsity, r.blocks_scored,
        r.blocks_visible,
        r.kind.rfind("spec", 0) == 0 ? absl::StrFormat("%.2f", r.mean_accepted) : std::string("-"),
        r.seconds);
  }
  if (!report.predictor_table.empty()) {
    md +=
        "\nPredictor study (SPIN Table 1 protocol) on the same model:\n\n" + report.predictor_table;
  }
  return md;
}

}  // namespace dsa
