#include "tools/dsa/pattern_fit.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attention_worker/llama_model.h"
#include "common/npy.h"
#include "common/status_macros.h"
#include "indexer_service/block_pool.h"
#include "indexer_service/topk.h"
#include "tools/dsa/eval.h"

namespace dsa {
namespace {

using Clock = std::chrono::steady_clock;

// The exact top-K of one row at position t over keys [>= t + 1, D] (IndexScores, then
// SelectTopK's rules: higher score first, ties to the lower slot), sorted by slot.
absl::StatusOr<std::vector<int32_t>> RowTopK(std::span<const float> keys, int64_t t,
                                             std::span<const float> query,
                                             std::span<const float> weights, int num_heads,
                                             int head_dim, int top_k, std::vector<float>& scores) {
  const int64_t blocks = (t + kBlockSize) / kBlockSize;
  scores.assign(static_cast<size_t>(blocks * kBlockSize), -std::numeric_limits<float>::infinity());
  DSA_RETURN_IF_ERROR(IndexScores(num_heads, head_dim, query, weights,
                                  keys.first(static_cast<size_t>(t + 1) * head_dim),
                                  std::span<float>(scores).first(static_cast<size_t>(t + 1))));
  std::vector<int32_t> logical(static_cast<size_t>(blocks));
  for (int64_t j = 0; j < blocks; ++j) logical[j] = static_cast<int32_t>(j);
  std::vector<int32_t> top(static_cast<size_t>(top_k));
  SelectTopK(scores, logical, t, top);
  std::sort(top.begin(), top.end());
  return top;
}

double Overlap(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  std::vector<int32_t> both;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(both));
  return static_cast<double>(both.size()) / static_cast<double>(a.size());
}

class PatternSource final : public IndexScoreSource {
 public:
  explicit PatternSource(std::shared_ptr<const PatternModel> model) : model_(std::move(model)) {}
  int num_layers() const override { return model_->num_layers(); }
  int num_heads() const override { return model_->num_heads(); }
  int head_dim() const override { return model_->head_dim(); }
  absl::Status Keys(int layer, int64_t n, std::span<float> out) const override {
    return model_->IndexKeys(layer, 0, n, out);
  }
  absl::Status Query(int layer, int64_t t, std::span<float> query,
                     std::span<float> head_weights) const override {
    return model_->IndexerQuery(layer, t, query, head_weights);
  }

 private:
  std::shared_ptr<const PatternModel> model_;
};

// The real model's inputs, computed once: keys [L][n, D], the last rows' queries [L][rows, H, D]
// and head weights [L][rows, H].
class RealSource final : public IndexScoreSource {
 public:
  int num_layers() const override { return static_cast<int>(keys_.size()); }
  int num_heads() const override { return num_heads_; }
  int head_dim() const override { return head_dim_; }
  absl::Status Keys(int layer, int64_t n, std::span<float> out) const override {
    if (layer < 0 || layer >= num_layers() || n > n_ ||
        out.size() != static_cast<size_t>(n) * head_dim_) {
      return absl::InvalidArgumentError(
          absl::StrCat("real-model keys: layer ", layer, ", ", n, " slots out of range"));
    }
    std::copy_n(keys_[layer].begin(), out.size(), out.begin());
    return absl::OkStatus();
  }
  absl::Status Query(int layer, int64_t t, std::span<float> query,
                     std::span<float> head_weights) const override {
    const int64_t row = t - (n_ - rows_);
    if (layer < 0 || layer >= num_layers() || row < 0 || row >= rows_ ||
        query.size() != static_cast<size_t>(num_heads_) * head_dim_ ||
        head_weights.size() != static_cast<size_t>(num_heads_)) {
      return absl::InvalidArgumentError(
          absl::StrCat("real-model query: layer ", layer, ", position ", t, " not kept"));
    }
    std::copy_n(queries_[layer].begin() + row * static_cast<int64_t>(query.size()), query.size(),
                query.begin());
    std::copy_n(weights_[layer].begin() + row * num_heads_, num_heads_, head_weights.begin());
    return absl::OkStatus();
  }

  int64_t n_ = 0;
  int rows_ = 0;
  int num_heads_ = 0;
  int head_dim_ = 0;
  std::vector<std::vector<float>> keys_, queries_, weights_;
};

struct FieldRef {
  const char* name;
  double (*get)(const PatternModelConfig&);
  void (*set)(PatternModelConfig&, double);
};

#define DSA_PATTERN_FIELD(field)                                                              \
  FieldRef {                                                                                  \
#field, [](const PatternModelConfig& c) { return static_cast<double>(c.field); },           \
        [](PatternModelConfig& c, double v) { c.field = static_cast<decltype(c.field)>(v); } \
  }

const std::vector<FieldRef>& Fields() {
  static const std::vector<FieldRef> fields = {
      DSA_PATTERN_FIELD(sink_strength),
      DSA_PATTERN_FIELD(salient_fraction),
      DSA_PATTERN_FIELD(salient_strength),
      DSA_PATTERN_FIELD(topic_strength),
      DSA_PATTERN_FIELD(topic_switch_rate),
      DSA_PATTERN_FIELD(recency_strength),
      DSA_PATTERN_FIELD(recency_window_slots),
      DSA_PATTERN_FIELD(diagonal_strength),
      DSA_PATTERN_FIELD(key_noise),
      DSA_PATTERN_FIELD(query_noise),
      DSA_PATTERN_FIELD(layer_correlation),
      DSA_PATTERN_FIELD(num_topics),
  };
  return fields;
}
#undef DSA_PATTERN_FIELD

const FieldRef* FindField(const std::string& name) {
  for (const FieldRef& f : Fields()) {
    if (name == f.name) return &f;
  }
  return nullptr;
}

}  // namespace

absl::StatusOr<IndexScoreStatistics> MeasureIndexScores(const IndexScoreSource& source,
                                                        const IndexScoreWindow& window) {
  const int64_t n = window.n;
  const int k = window.top_k;
  if (window.rows < 2 || k < 1 || n - window.rows < k) {
    return absl::InvalidArgumentError(
        absl::StrCat("index-score window: need rows >= 2, top_k >= 1 and n - rows >= top_k; got n ",
                     n, ", rows ", window.rows, ", top_k ", k));
  }
  const int num_heads = source.num_heads();
  const int head_dim = source.head_dim();
  const int64_t first = n - window.rows;
  std::vector<float> keys(static_cast<size_t>(n) * head_dim);
  std::vector<float> query(static_cast<size_t>(num_heads) * head_dim);
  std::vector<float> weights(num_heads);
  std::vector<float> scores;
  double coverage = 0, recency = 0, sink = 0, segment = 0, step = 0, layer_overlap = 0;
  int64_t selections = 0, steps = 0, layer_pairs = 0;
  std::vector<std::vector<int32_t>> previous_layer(window.rows);
  for (int layer = 0; layer < source.num_layers(); ++layer) {
    DSA_RETURN_IF_ERROR(source.Keys(layer, n, keys));
    std::vector<int32_t> previous_row;
    for (int r = 0; r < window.rows; ++r) {
      const int64_t t = first + r;
      DSA_RETURN_IF_ERROR(source.Query(layer, t, query, weights));
      DSA_ASSIGN_OR_RETURN(std::vector<int32_t> top,
                           RowTopK(keys, t, query, weights, num_heads, head_dim, k, scores));
      int64_t blocks = 0, last_block = -1, recent = 0, sinks = 0;
      std::map<int64_t, int> older_segments;
      for (int32_t i : top) {
        if (i / kBlockSize != last_block) {
          ++blocks;
          last_block = i / kBlockSize;
        }
        if (t - i < kPrefixBlockSlots) {
          ++recent;
        } else {
          ++older_segments[i / kPrefixBlockSlots];
        }
        if (i < kBlockSize) ++sinks;
      }
      int most = 0;
      for (const auto& [id, count] : older_segments) most = std::max(most, count);
      const int64_t visible_blocks = (t + kBlockSize) / kBlockSize;  // ceil((t + 1) / 64)
      coverage += static_cast<double>(blocks) / static_cast<double>(visible_blocks);
      recency += static_cast<double>(recent) / k;
      sink += static_cast<double>(sinks) / k;
      segment += static_cast<double>(most) / k;
      ++selections;
      if (!previous_row.empty()) {
        step += Overlap(top, previous_row);
        ++steps;
      }
      if (!previous_layer[r].empty()) {
        layer_overlap += Overlap(top, previous_layer[r]);
        ++layer_pairs;
      }
      previous_row = top;
      previous_layer[r] = std::move(top);
    }
  }
  IndexScoreStatistics s;
  const auto mean = [](double sum, int64_t count) {
    return count == 0 ? 0.0 : sum / static_cast<double>(count);
  };
  s.block_coverage = mean(coverage, selections);
  s.recency_share = mean(recency, selections);
  s.sink_share = mean(sink, selections);
  s.segment_share = mean(segment, selections);
  s.step_overlap = mean(step, steps);
  s.layer_overlap = mean(layer_overlap, layer_pairs);
  return s;
}

std::unique_ptr<IndexScoreSource> PatternScoreSource(std::shared_ptr<const PatternModel> model) {
  return std::make_unique<PatternSource>(std::move(model));
}

absl::StatusOr<std::unique_ptr<IndexScoreSource>> RealModelScoreSource(
    const std::string& model_file, const std::string& indexer_weights,
    const std::vector<int32_t>& tokens, int64_t n, int rows) {
  if (n < 1 || rows < 1 || rows > n || static_cast<int64_t>(tokens.size()) < n) {
    return absl::InvalidArgumentError(absl::StrCat("real-model window: ", n, " tokens with ", rows,
                                                   " query rows from ", tokens.size(), " tokens"));
  }
  DSA_ASSIGN_OR_RETURN(std::shared_ptr<const LlamaModel> model,
                       LlamaModel::Load(model_file, indexer_weights));
  if (!model->has_indexer()) {
    return absl::InvalidArgumentError(absl::StrCat(model_file, " was loaded without an indexer"));
  }
  auto source = std::make_unique<RealSource>();
  const LightningIndexerConfig& ic = model->indexer_config();
  source->n_ = n;
  source->rows_ = rows;
  source->num_heads_ = ic.num_heads;
  source->head_dim_ = ic.head_dim;
  LlamaKvCache kv(*model);
  std::vector<LlamaRow> pass_rows(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) pass_rows[t] = {&kv, t, tokens[t]};
  DSA_ASSIGN_OR_RETURN(std::unique_ptr<LlamaForward> pass, LlamaForward::Begin(model, pass_rows));
  const size_t hd = static_cast<size_t>(ic.num_heads) * ic.head_dim;
  std::vector<float> queries(static_cast<size_t>(n) * hd);
  std::vector<float> weights(static_cast<size_t>(n) * ic.num_heads);
  while (!pass->done()) {
    std::vector<float> keys(static_cast<size_t>(n) * ic.head_dim);
    DSA_RETURN_IF_ERROR(pass->IndexerInputs(queries, weights, keys));
    source->keys_.push_back(std::move(keys));
    const int64_t first = n - rows;
    source->queries_.emplace_back(queries.begin() + first * static_cast<int64_t>(hd),
                                  queries.end());
    source->weights_.emplace_back(weights.begin() + first * ic.num_heads, weights.end());
    DSA_RETURN_IF_ERROR(pass->RunLayer());
  }
  return source;
}

double StatisticsDistance(const IndexScoreStatistics& a, const IndexScoreStatistics& b) {
  const auto sq = [](double x) { return x * x; };
  return sq(a.block_coverage - b.block_coverage) + sq(a.recency_share - b.recency_share) +
         sq(a.sink_share - b.sink_share) + sq(a.segment_share - b.segment_share) +
         sq(a.step_overlap - b.step_overlap) + sq(a.layer_overlap - b.layer_overlap);
}

std::vector<PatternFitParameter> DefaultPatternFitParameters() {
  return {
      {"sink_strength", 0.0, 32.0, false},     {"salient_fraction", 0.0, 0.2, false},
      {"salient_strength", 0.0, 32.0, false},  {"topic_strength", 0.0, 32.0, false},
      {"topic_switch_rate", 1e-4, 1.0, false}, {"recency_strength", 0.0, 32.0, false},
      {"recency_window_slots", 1, 4096, true}, {"key_noise", 0.0, 16.0, false},
      {"query_noise", 0.0, 16.0, false},       {"layer_correlation", 0.0, 1.0, false},
  };
}

absl::StatusOr<double> GetPatternParameter(const PatternModelConfig& config,
                                           const std::string& name) {
  const FieldRef* field = FindField(name);
  if (field == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("no fittable PatternModelConfig field ", name));
  }
  return field->get(config);
}

absl::Status SetPatternParameter(PatternModelConfig& config, const std::string& name,
                                 double value) {
  const FieldRef* field = FindField(name);
  if (field == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("no fittable PatternModelConfig field ", name));
  }
  field->set(config, value);
  return absl::OkStatus();
}

absl::StatusOr<PatternFitReport> FitPatternModel(const IndexScoreStatistics& real,
                                                 const PatternFitOptions& options,
                                                 void (*progress)(const std::string&)) {
  const auto start_time = Clock::now();
  PatternFitReport report;
  report.real = real;
  for (const PatternFitParameter& p : options.parameters) {
    DSA_ASSIGN_OR_RETURN(const double value, GetPatternParameter(options.start, p.name));
    if (!(value >= p.min && value <= p.max)) {
      return absl::InvalidArgumentError(absl::StrCat("parameter ", p.name, " starts at ", value,
                                                     ", outside [", p.min, ", ", p.max, "]"));
    }
  }
  const auto measure = [&](const PatternModelConfig& config) -> absl::StatusOr<double> {
    DSA_ASSIGN_OR_RETURN(PatternModel model, PatternModel::Create(config));
    auto source = PatternScoreSource(std::make_shared<const PatternModel>(std::move(model)));
    DSA_ASSIGN_OR_RETURN(IndexScoreStatistics s, MeasureIndexScores(*source, options.window));
    ++report.evaluations;
    report.fitted = s;
    return StatisticsDistance(s, real);
  };
  PatternModelConfig best = options.start;
  DSA_ASSIGN_OR_RETURN(double best_distance, measure(best));
  report.start = report.fitted;
  report.start_distance = best_distance;
  IndexScoreStatistics best_statistics = report.fitted;
  double step = options.initial_step;
  for (int round = 0; round < options.max_rounds && step >= options.min_step; ++round) {
    bool improved = false;
    for (const PatternFitParameter& p : options.parameters) {
      const double value = *GetPatternParameter(best, p.name);
      // Parameters bounded by 1 move additively; strengths, rates and widths multiplicatively
      // (a zero strength moves to step itself, so it can come back).
      const bool additive = p.max <= 1.0;
      for (const double direction : {1.0, -1.0}) {
        double next = additive
                          ? value + direction * step * 0.5
                          : (value == 0 && direction > 0 ? step : value * (1.0 + direction * step));
        next = std::clamp(next, p.min, p.max);
        if (p.integer) next = std::round(next);
        if (next == value) continue;
        PatternModelConfig trial = best;
        DSA_RETURN_IF_ERROR(SetPatternParameter(trial, p.name, next));
        auto distance = measure(trial);
        if (!distance.ok()) {
          // A value the model refuses (e.g. a switch rate below its floor) is not a fit failure.
          if (distance.status().code() == absl::StatusCode::kInvalidArgument) continue;
          return distance.status();
        }
        if (*distance < best_distance) {
          best = trial;
          best_distance = *distance;
          best_statistics = report.fitted;
          improved = true;
          break;
        }
      }
    }
    if (progress != nullptr) {
      progress(absl::StrFormat("round %d, step %.3f: distance %.6f (%d evaluations)", round + 1,
                               step, best_distance, report.evaluations));
    }
    if (!improved) step *= 0.5;
  }
  report.config = best;
  report.fitted = best_statistics;
  report.fitted_distance = best_distance;
  report.seconds = std::chrono::duration<double>(Clock::now() - start_time).count();
  return report;
}

nlohmann::json IndexScoreStatisticsToJson(const IndexScoreStatistics& s) {
  return {{"block_coverage", s.block_coverage}, {"recency_share", s.recency_share},
          {"sink_share", s.sink_share},         {"segment_share", s.segment_share},
          {"step_overlap", s.step_overlap},     {"layer_overlap", s.layer_overlap}};
}

namespace {

IndexScoreStatistics Average(const std::vector<IndexScoreStatistics>& all) {
  IndexScoreStatistics mean;
  for (const IndexScoreStatistics& s : all) {
    mean.block_coverage += s.block_coverage / static_cast<double>(all.size());
    mean.recency_share += s.recency_share / static_cast<double>(all.size());
    mean.sink_share += s.sink_share / static_cast<double>(all.size());
    mean.segment_share += s.segment_share / static_cast<double>(all.size());
    mean.step_overlap += s.step_overlap / static_cast<double>(all.size());
    mean.layer_overlap += s.layer_overlap / static_cast<double>(all.size());
  }
  return mean;
}

absl::StatusOr<std::vector<SpinMissRow>> PatternSpinMisses(const PatternModelConfig& config,
                                                           const PatternFitStudyOptions& o) {
  EvalOptions eval;
  eval.pattern = config;
  eval.context_slots = o.fit.window.n / 64 * 64;
  eval.decode_steps = o.spin_decode_steps;
  eval.num_layers = config.num_layers;
  eval.num_heads = config.num_heads;
  eval.head_dim = config.head_dim;
  eval.top_k = o.fit.window.top_k;
  eval.seed = config.seed;
  eval.target_sparsities = o.spin_sparsities;
  eval.exploration_fractions = {0.0};
  eval.draft_length = 0;
  eval.predictor_study = false;
  DSA_ASSIGN_OR_RETURN(EvalReport report, RunEval(eval, nullptr));
  std::vector<SpinMissRow> rows;
  for (const EvalRow& r : report.rows) {
    if (r.kind != "spin") continue;
    rows.push_back(
        {r.target_sparsity, r.mean_miss_rate, r.p99_miss_rate, r.realized_block_sparsity});
  }
  return rows;
}

// The fixed-rho SPIN cells (gamma 0, no lag, retention 1, no drafts, no miss target) of a `dsa
// eval --model smollm2` report, at its context nearest to `n`.
absl::Status ReadRealSpinMisses(const std::string& path, int64_t n, PatternFitStudy& study) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  const nlohmann::json report = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (report.is_discarded() || !report.contains("perplexity") || !report.contains("options")) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not a dsa eval --model smollm2 JSON report"));
  }
  std::map<std::string, double> fixed_rho;
  for (const nlohmann::json& arm : report["options"].value("arms", nlohmann::json::array())) {
    if (arm.value("spin", false) && arm.value("exploration_fraction", 1.0) == 0.0 &&
        arm.value("lag_depth", 1) == 0 && arm.value("retention_stride", 2) == 1 &&
        arm.value("draft_length", 1) == 0 && arm.value("miss_target", 1.0) == 0.0) {
      fixed_rho[arm.value("name", "")] = arm.value("target_block_sparsity", 0.0);
    }
  }
  int64_t best = -1;
  for (const nlohmann::json& cell : report["perplexity"]) {
    const int64_t context = cell.value("context", int64_t{0});
    if (fixed_rho.count(cell.value("arm", "")) != 0 &&
        (best < 0 || std::llabs(context - n) < std::llabs(best - n))) {
      best = context;
    }
  }
  for (const nlohmann::json& cell : report["perplexity"]) {
    const auto arm = fixed_rho.find(cell.value("arm", ""));
    if (arm == fixed_rho.end() || cell.value("context", int64_t{0}) != best) continue;
    study.spin_real.push_back({arm->second, cell.value("mean_miss_rate", 0.0),
                               cell.value("p99_miss_rate", 0.0),
                               cell.value("realized_block_sparsity", 0.0)});
  }
  std::sort(study.spin_real.begin(), study.spin_real.end(),
            [](const SpinMissRow& a, const SpinMissRow& b) {
              return a.target_block_sparsity < b.target_block_sparsity;
            });
  study.real_eval_context = best;
  return absl::OkStatus();
}

nlohmann::json SpinRowsToJson(const std::vector<SpinMissRow>& rows) {
  nlohmann::json out = nlohmann::json::array();
  for (const SpinMissRow& r : rows) {
    out.push_back({{"target_block_sparsity", r.target_block_sparsity},
                   {"mean_miss_rate", r.mean_miss_rate},
                   {"p99_miss_rate", r.p99_miss_rate},
                   {"realized_block_sparsity", r.realized_block_sparsity}});
  }
  return out;
}

}  // namespace

absl::StatusOr<PatternFitStudy> RunPatternFitStudy(const PatternFitStudyOptions& options,
                                                   void (*progress)(const std::string&)) {
  const auto start = Clock::now();
  if (options.samples < 1) {
    return absl::InvalidArgumentError(absl::StrCat("samples must be >= 1, got ", options.samples));
  }
  PatternFitStudy study;
  study.options = options;
  if (options.pattern_heads != 0) study.options.fit.start.num_heads = options.pattern_heads;
  if (options.pattern_head_dim != 0) study.options.fit.start.head_dim = options.pattern_head_dim;
  if (!options.real_eval_report.empty()) {
    DSA_RETURN_IF_ERROR(ReadRealSpinMisses(options.real_eval_report, options.fit.window.n, study));
  }
  DSA_ASSIGN_OR_RETURN(std::vector<int32_t> tokens, ReadTokensNpy(options.heldout_tokens));
  const int64_t n = options.fit.window.n;
  if (static_cast<int64_t>(tokens.size()) < n) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.heldout_tokens, " holds ", tokens.size(), " tokens, fewer than ", n));
  }
  std::vector<IndexScoreStatistics> measured;
  for (int i = 0; i < options.samples; ++i) {
    const size_t offset = (tokens.size() - static_cast<size_t>(n)) * static_cast<size_t>(i) /
                          static_cast<size_t>(options.samples);
    const std::vector<int32_t> window(tokens.begin() + static_cast<int64_t>(offset),
                                      tokens.begin() + static_cast<int64_t>(offset) + n);
    DSA_ASSIGN_OR_RETURN(std::unique_ptr<IndexScoreSource> source,
                         RealModelScoreSource(options.model_file, options.indexer_weights, window,
                                              n, options.fit.window.rows));
    DSA_ASSIGN_OR_RETURN(IndexScoreStatistics s, MeasureIndexScores(*source, options.fit.window));
    measured.push_back(s);
    // The statistics are rank-based, so the pattern model may have any shape; by default the
    // real indexer's.
    if (options.pattern_heads == 0) study.options.fit.start.num_heads = source->num_heads();
    if (options.pattern_head_dim == 0) study.options.fit.start.head_dim = source->head_dim();
    if (progress != nullptr) {
      progress(absl::StrFormat("real model, window %d at token %d: %s", i + 1, offset,
                               IndexScoreStatisticsToJson(s).dump()));
    }
  }
  const IndexScoreStatistics real = Average(measured);
  DSA_ASSIGN_OR_RETURN(study.fit, FitPatternModel(real, study.options.fit, progress));
  if (options.spin_decode_steps > 0) {
    DSA_ASSIGN_OR_RETURN(study.spin_start,
                         PatternSpinMisses(study.options.fit.start, study.options));
    DSA_ASSIGN_OR_RETURN(study.spin_fitted, PatternSpinMisses(study.fit.config, study.options));
  }
  study.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return study;
}

nlohmann::json PatternFitStudyToJson(const PatternFitStudy& study) {
  const PatternFitStudyOptions& o = study.options;
  nlohmann::json parameters = nlohmann::json::array();
  for (const PatternFitParameter& p : o.fit.parameters) {
    parameters.push_back({{"name", p.name},
                          {"start", *GetPatternParameter(o.fit.start, p.name)},
                          {"fitted", *GetPatternParameter(study.fit.config, p.name)},
                          {"min", p.min},
                          {"max", p.max}});
  }
  return {{"options",
           {{"model_file", o.model_file},
            {"indexer_weights", o.indexer_weights},
            {"heldout_tokens", o.heldout_tokens},
            {"samples", o.samples},
            {"n", o.fit.window.n},
            {"rows", o.fit.window.rows},
            {"top_k", o.fit.window.top_k},
            {"pattern_layers", o.fit.start.num_layers},
            {"num_heads", o.fit.start.num_heads},
            {"head_dim", o.fit.start.head_dim},
            {"seed", o.fit.start.seed},
            {"real_eval_report", o.real_eval_report}}},
          {"real", IndexScoreStatisticsToJson(study.fit.real)},
          {"start", IndexScoreStatisticsToJson(study.fit.start)},
          {"fitted", IndexScoreStatisticsToJson(study.fit.fitted)},
          {"start_distance", study.fit.start_distance},
          {"fitted_distance", study.fit.fitted_distance},
          {"evaluations", study.fit.evaluations},
          {"parameters", parameters},
          {"spin_start", SpinRowsToJson(study.spin_start)},
          {"spin_fitted", SpinRowsToJson(study.spin_fitted)},
          {"spin_real", SpinRowsToJson(study.spin_real)},
          {"real_eval_context", study.real_eval_context},
          {"seconds", study.seconds}};
}

std::string PatternFitStudyToMarkdown(const PatternFitStudy& study) {
  const PatternFitStudyOptions& o = study.options;
  const PatternFitReport& f = study.fit;
  std::string md = absl::StrFormat(
      "Real model: %d windows of %d held-out tokens, rows %d..%d, K = %d, every indexer layer. "
      "Pattern model: %d layers, H = %d, D = %d, seed %d. %d evaluations, %.0f s.\n\n",
      o.samples, o.fit.window.n, o.fit.window.n - o.fit.window.rows, o.fit.window.n - 1,
      o.fit.window.top_k, o.fit.start.num_layers, o.fit.start.num_heads, o.fit.start.head_dim,
      o.fit.start.seed, f.evaluations, study.seconds);
  absl::StrAppend(&md,
                  "| statistic | real model | pattern model (start) | pattern model (fitted) |\n"
                  "|---|---|---|---|\n");
  const auto row = [&](const char* name, double IndexScoreStatistics::*field) {
    absl::StrAppend(&md, absl::StrFormat("| %s | %.3f | %.3f | %.3f |\n", name, f.real.*field,
                                         f.start.*field, f.fitted.*field));
  };
  row("block coverage", &IndexScoreStatistics::block_coverage);
  row("recency share (newest 512)", &IndexScoreStatistics::recency_share);
  row("sink share (first block)", &IndexScoreStatistics::sink_share);
  row("segment share (top older 512)", &IndexScoreStatistics::segment_share);
  row("step overlap", &IndexScoreStatistics::step_overlap);
  row("layer overlap", &IndexScoreStatistics::layer_overlap);
  absl::StrAppend(&md, absl::StrFormat("| distance (sum of squares) | 0 | %.4f | %.4f |\n\n",
                                       f.start_distance, f.fitted_distance));
  absl::StrAppend(&md, "| parameter | start | fitted |\n|---|---|---|\n");
  for (const PatternFitParameter& p : o.fit.parameters) {
    absl::StrAppend(&md, absl::StrFormat("| %s | %.4g | %.4g |\n", p.name,
                                         *GetPatternParameter(o.fit.start, p.name),
                                         *GetPatternParameter(f.config, p.name)));
  }
  if (!study.spin_fitted.empty()) {
    absl::StrAppend(
        &md,
        absl::StrFormat("\nSPIN (gamma 0) against the dense top-K, context %d, %d decode positions "
                        "(mean miss / p99 miss / realized block sparsity)%s:\n\n",
                        o.fit.window.n / 64 * 64, o.spin_decode_steps,
                        study.spin_real.empty()
                            ? std::string()
                            : absl::StrCat("; the real model's at context ",
                                           study.real_eval_context, " from ", o.real_eval_report)));
    absl::StrAppend(&md,
                    "| rho | real model | pattern model (start) | pattern model (fitted) |\n"
                    "|---|---|---|---|\n");
    const auto cell = [](const std::vector<SpinMissRow>& rows, double rho) {
      for (const SpinMissRow& r : rows) {
        if (std::abs(r.target_block_sparsity - rho) < 1e-9) {
          return absl::StrFormat("%.3f / %.3f / %.3f", r.mean_miss_rate, r.p99_miss_rate,
                                 r.realized_block_sparsity);
        }
      }
      return std::string("-");
    };
    for (const SpinMissRow& r : study.spin_fitted) {
      absl::StrAppend(&md, absl::StrFormat("| %.1f | %s | %s | %s |\n", r.target_block_sparsity,
                                           cell(study.spin_real, r.target_block_sparsity),
                                           cell(study.spin_start, r.target_block_sparsity),
                                           cell(study.spin_fitted, r.target_block_sparsity)));
    }
  }
  return md;
}

}  // namespace dsa
