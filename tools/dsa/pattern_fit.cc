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
#include "absl/strings/str_join.h"
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

// A PatternModelConfig field the fit may move: its accessors, range and step rule.
struct FieldRef {
  PatternFitParameter parameter;
  bool fitted_by_default = false;
  double (*get)(const PatternModelConfig&);
  void (*set)(PatternModelConfig&, double);
};

#define DSA_PATTERN_FIELD(field, min, max, integer, additive, fitted)                        \
  FieldRef {                                                                                 \
    {#field, min, max, integer, additive}, fitted,                                           \
        [](const PatternModelConfig& c) { return static_cast<double>(c.field); },            \
        [](PatternModelConfig& c, double v) { c.field = static_cast<decltype(c.field)>(v); } \
  }

// The fittable fields, in the order the fit tries them. Strengths, rates and widths move
// multiplicatively; the layer correlation, a fraction of variance in [0, 1], additively.
const std::vector<FieldRef>& Fields() {
  static const std::vector<FieldRef> fields = {
      DSA_PATTERN_FIELD(sink_strength, 0.0, 32.0, false, false, true),
      DSA_PATTERN_FIELD(salient_fraction, 0.0, 0.2, false, false, true),
      DSA_PATTERN_FIELD(salient_strength, 0.0, 32.0, false, false, true),
      DSA_PATTERN_FIELD(topic_strength, 0.0, 32.0, false, false, true),
      DSA_PATTERN_FIELD(topic_switch_rate, 1e-4, 1.0, false, false, true),
      DSA_PATTERN_FIELD(recency_strength, 0.0, 32.0, false, false, true),
      DSA_PATTERN_FIELD(recency_window_slots, 1, 4096, true, false, true),
      DSA_PATTERN_FIELD(key_noise, 0.0, 16.0, false, false, true),
      DSA_PATTERN_FIELD(query_noise, 0.0, 16.0, false, false, true),
      DSA_PATTERN_FIELD(layer_correlation, 0.0, 1.0, false, true, true),
      DSA_PATTERN_FIELD(diagonal_strength, 0.0, 32.0, false, false, false),
      DSA_PATTERN_FIELD(num_topics, 1, 64, true, false, false),
  };
  return fields;
}
#undef DSA_PATTERN_FIELD

const FieldRef* FindField(const std::string& name) {
  for (const FieldRef& f : Fields()) {
    if (name == f.parameter.name) return &f;
  }
  return nullptr;
}

}  // namespace

absl::Status ValidateIndexScoreWindow(const IndexScoreWindow& window) {
  if (window.rows < 2 || window.top_k < 1 || window.n - window.rows < window.top_k) {
    return absl::InvalidArgumentError(
        absl::StrCat("index-score window: need rows >= 2, top_k >= 1 and n - rows >= top_k; got n ",
                     window.n, ", rows ", window.rows, ", top_k ", window.top_k));
  }
  return absl::OkStatus();
}

absl::StatusOr<IndexScoreStatistics> MeasureIndexScores(const IndexScoreSource& source,
                                                        const IndexScoreWindow& window) {
  DSA_RETURN_IF_ERROR(ValidateIndexScoreWindow(window));
  const int64_t n = window.n;
  const int k = window.top_k;
  const int num_heads = source.num_heads();
  const int head_dim = source.head_dim();
  const int64_t first = n - window.rows;
  std::vector<float> keys(static_cast<size_t>(n) * head_dim);
  std::vector<float> query(static_cast<size_t>(num_heads) * head_dim);
  std::vector<float> weights(num_heads);
  std::vector<float> scores;
  double coverage = 0, recency = 0, sink = 0, segment = 0, step = 0, block_step = 0,
         layer_overlap = 0;
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
        if (t - i < kPrefixBlockTokens) {
          ++recent;
        } else {
          ++older_segments[i / kPrefixBlockTokens];
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
        // Both are sorted by slot, so their blocks come sorted too.
        std::vector<int32_t> previous_blocks;
        for (int32_t i : previous_row) {
          if (previous_blocks.empty() || previous_blocks.back() != i / kBlockSize) {
            previous_blocks.push_back(i / kBlockSize);
          }
        }
        int64_t hits = 0;
        for (int32_t i : top) {
          hits += std::binary_search(previous_blocks.begin(), previous_blocks.end(), i / kBlockSize)
                      ? 1
                      : 0;
        }
        block_step += static_cast<double>(hits) / k;
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
  s.block_step_overlap = mean(block_step, steps);
  s.layer_overlap = mean(layer_overlap, layer_pairs);
  return s;
}

std::unique_ptr<IndexScoreSource> PatternScoreSource(std::shared_ptr<const PatternModel> model) {
  return std::make_unique<PatternSource>(std::move(model));
}

absl::StatusOr<std::unique_ptr<IndexScoreSource>> RealModelScoreSource(
    const std::shared_ptr<const LlamaModel>& model, const std::vector<int32_t>& tokens, int64_t n,
    int rows) {
  if (n < 1 || rows < 1 || rows > n || static_cast<int64_t>(tokens.size()) < n) {
    return absl::InvalidArgumentError(absl::StrCat("real-model window: ", n, " tokens with ", rows,
                                                   " query rows from ", tokens.size(), " tokens"));
  }
  if (n > model->config().context_length) {
    return absl::InvalidArgumentError(absl::StrCat("real-model window: ", n,
                                                   " tokens exceed the model's context of ",
                                                   model->config().context_length));
  }
  if (!model->has_indexer()) {
    return absl::InvalidArgumentError("the model was loaded without an indexer");
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
         sq(a.step_overlap - b.step_overlap) + sq(a.block_step_overlap - b.block_step_overlap) +
         sq(a.layer_overlap - b.layer_overlap);
}

std::vector<PatternFitParameter> FittablePatternParameters() {
  std::vector<PatternFitParameter> parameters;
  for (const FieldRef& f : Fields()) parameters.push_back(f.parameter);
  return parameters;
}

std::vector<PatternFitParameter> DefaultPatternFitParameters() {
  std::vector<PatternFitParameter> parameters;
  for (const FieldRef& f : Fields()) {
    if (f.fitted_by_default) parameters.push_back(f.parameter);
  }
  return parameters;
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

absl::Status CheckFitParameters(const PatternFitOptions& options) {
  DSA_RETURN_IF_ERROR(ValidateIndexScoreWindow(options.window));
  for (const PatternFitParameter& p : options.parameters) {
    DSA_ASSIGN_OR_RETURN(const double value, GetPatternParameter(options.start, p.name));
    if (!(value >= p.min && value <= p.max)) {
      return absl::InvalidArgumentError(absl::StrCat("parameter ", p.name, " starts at ", value,
                                                     ", outside [", p.min, ", ", p.max, "]"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<PatternFitReport> FitPatternModel(const IndexScoreStatistics& real,
                                                 const PatternFitOptions& options,
                                                 void (*progress)(const std::string&)) {
  const auto start_time = Clock::now();
  PatternFitReport report;
  report.real = real;
  DSA_RETURN_IF_ERROR(CheckFitParameters(options));
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
      // Additive parameters move by step / 2 of their range; the others multiplicatively (a zero
      // strength moves to step itself, so it can come back).
      for (const double direction : {1.0, -1.0}) {
        double next = p.additive
                          ? value + direction * step * 0.5 * (p.max - p.min)
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

nlohmann::json PatternModelConfigToJson(const PatternModelConfig& config) {
  nlohmann::json out = nlohmann::json::object();
  for (const FieldRef& f : Fields()) out[f.parameter.name] = f.get(config);
  return out;
}

nlohmann::json IndexScoreStatisticsToJson(const IndexScoreStatistics& s) {
  return {{"block_coverage", s.block_coverage}, {"recency_share", s.recency_share},
          {"sink_share", s.sink_share},         {"segment_share", s.segment_share},
          {"step_overlap", s.step_overlap},     {"block_step_overlap", s.block_step_overlap},
          {"layer_overlap", s.layer_overlap}};
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
    mean.block_step_overlap += s.block_step_overlap / static_cast<double>(all.size());
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
// eval --model smollm2` report at context `n` with K = `top_k`.
absl::Status ReadRealSpinMisses(const std::string& path, int64_t n, int top_k,
                                PatternFitStudy& study) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  const nlohmann::json report = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  const auto malformed = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not a dsa eval --model smollm2 JSON report: ", why));
  };
  if (report.is_discarded()) return malformed("not JSON");
  // value() and get() throw on a field of the wrong type: any such field makes it malformed.
  try {
    if (!report.is_object() || !report.contains("options") || !report["options"].is_object() ||
        !report.contains("perplexity") || !report["perplexity"].is_array()) {
      return malformed("no options object or perplexity array");
    }
    const nlohmann::json& options = report["options"];
    const int report_k = options.value("top_k", 0);
    if (report_k != top_k) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, " was run with K = ", report_k, ", this fit with K = ", top_k));
    }
    std::map<std::string, double> fixed_rho;
    for (const nlohmann::json& arm : options.value("arms", nlohmann::json::array())) {
      if (arm.value("spin", false) && arm.value("exploration_fraction", 1.0) == 0.0 &&
          arm.value("lag_depth", 1) == 0 && arm.value("retention_stride", 2) == 1 &&
          arm.value("draft_length", 1) == 0 && arm.value("miss_target", 1.0) == 0.0) {
        fixed_rho[arm.value("name", "")] = arm.value("target_block_sparsity", 0.0);
      }
    }
    std::vector<int64_t> contexts;
    for (const nlohmann::json& cell : report["perplexity"]) {
      const auto arm = fixed_rho.find(cell.value("arm", ""));
      if (arm == fixed_rho.end()) continue;
      const int64_t context = cell.value("context", int64_t{0});
      contexts.push_back(context);
      if (context != n) continue;
      study.spin_real.push_back({arm->second, cell.value("mean_miss_rate", 0.0),
                                 cell.value("p99_miss_rate", 0.0),
                                 cell.value("realized_block_sparsity", 0.0)});
    }
    if (study.spin_real.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, " has no fixed-rho SPIN cell (gamma 0) at context ", n, "; its cells' contexts: ",
          contexts.empty() ? std::string("none") : absl::StrJoin(contexts, ", ")));
    }
    study.real_eval_partial = !report.value("complete", true);
  } catch (const nlohmann::json::exception& e) {
    return malformed(e.what());
  }
  std::sort(study.spin_real.begin(), study.spin_real.end(),
            [](const SpinMissRow& a, const SpinMissRow& b) {
              return a.target_block_sparsity < b.target_block_sparsity;
            });
  study.real_eval_context = n;
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
  // Everything a run could be refused for is checked before the model loads (seconds) and the
  // prefills run (seconds each).
  if (options.samples < 1) {
    return absl::InvalidArgumentError(absl::StrCat("samples must be >= 1, got ", options.samples));
  }
  DSA_RETURN_IF_ERROR(ValidateIndexScoreWindow(options.fit.window));
  if (options.spin_decode_steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("SPIN check steps must be >= 0, got ", options.spin_decode_steps));
  }
  PatternFitStudy study;
  study.options = options;
  PatternModelConfig& shape = study.options.fit.start;
  const auto check_shape = [&]() -> absl::Status {
    if (absl::Status valid = ValidatePatternModelConfig(shape); !valid.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("pattern model with ", shape.num_layers, " layers, H = ", shape.num_heads,
                       ", D = ", shape.head_dim, ": ", valid.message()));
    }
    return CheckFitParameters(study.options.fit);
  };
  if (options.pattern_heads != 0) shape.num_heads = options.pattern_heads;
  if (options.pattern_head_dim != 0) shape.head_dim = options.pattern_head_dim;
  DSA_RETURN_IF_ERROR(check_shape());
  if (!options.real_eval_report.empty()) {
    DSA_RETURN_IF_ERROR(ReadRealSpinMisses(options.real_eval_report, options.fit.window.n,
                                           options.fit.window.top_k, study));
  }
  DSA_ASSIGN_OR_RETURN(std::vector<int32_t> tokens, ReadTokensNpy(options.heldout_tokens));
  const int64_t n = options.fit.window.n;
  if (static_cast<int64_t>(tokens.size()) < n) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.heldout_tokens, " holds ", tokens.size(), " tokens, fewer than ", n));
  }
  DSA_ASSIGN_OR_RETURN(std::shared_ptr<const LlamaModel> model,
                       LlamaModel::Load(options.model_file, options.indexer_weights));
  if (n > model->config().context_length) {
    return absl::InvalidArgumentError(
        absl::StrCat("context ", n, " exceeds the model's ", model->config().context_length));
  }
  if (!model->has_indexer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.model_file, " was loaded without an indexer"));
  }
  // The statistics are rank-based, so the pattern model may have any shape; by default the real
  // indexer's.
  if (options.pattern_heads == 0) shape.num_heads = model->indexer_config().num_heads;
  if (options.pattern_head_dim == 0) shape.head_dim = model->indexer_config().head_dim;
  DSA_RETURN_IF_ERROR(check_shape());
  std::vector<IndexScoreStatistics> measured;
  for (int i = 0; i < options.samples; ++i) {
    const size_t offset = (tokens.size() - static_cast<size_t>(n)) * static_cast<size_t>(i) /
                          static_cast<size_t>(options.samples);
    const std::vector<int32_t> window(tokens.begin() + static_cast<int64_t>(offset),
                                      tokens.begin() + static_cast<int64_t>(offset) + n);
    DSA_ASSIGN_OR_RETURN(std::unique_ptr<IndexScoreSource> source,
                         RealModelScoreSource(model, window, n, options.fit.window.rows));
    DSA_ASSIGN_OR_RETURN(IndexScoreStatistics s, MeasureIndexScores(*source, options.fit.window));
    measured.push_back(s);
    if (progress != nullptr) {
      progress(absl::StrFormat("real model, window %d at token %d: %s", i + 1, offset,
                               IndexScoreStatisticsToJson(s).dump()));
    }
  }
  const IndexScoreStatistics real = Average(measured);
  DSA_ASSIGN_OR_RETURN(study.fit, FitPatternModel(real, study.options.fit, progress));
  if (options.spin_decode_steps > 0) {
    DSA_ASSIGN_OR_RETURN(study.spin_start, PatternSpinMisses(shape, study.options));
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
          {"fitted_config", PatternModelConfigToJson(study.fit.config)},
          {"spin_start", SpinRowsToJson(study.spin_start)},
          {"spin_fitted", SpinRowsToJson(study.spin_fitted)},
          {"spin_real", SpinRowsToJson(study.spin_real)},
          {"real_eval_context", study.real_eval_context},
          {"real_eval_partial", study.real_eval_partial},
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
  row("block step overlap", &IndexScoreStatistics::block_step_overlap);
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
                                           study.real_eval_context, " from ", o.real_eval_report,
                                           study.real_eval_partial ? " (a partial report)" : "")));
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
