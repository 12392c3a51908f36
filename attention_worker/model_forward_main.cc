// dsa-model-forward: the real model's forward pass (docs/model.md) over a token file, dense or
// sparse with the MLI schedule (DESIGN.md 4.3), writing logits, selections, indexer inputs and
// timings, for python/dsa_model/tests/check_forward.py and the speed figures.
//
// Sparse: at every full layer f each row's indexer inputs are computed, its index scores over
// slots 0..t (fp32 keys, IndexScores) and their top-K (SelectTopK, DESIGN.md 4.1); layer l attends
// the selection of sigma(l). With --decode-from P, rows [0, P) run as one pass (a prefill) and
// every later row as a pass of its own (decode steps); otherwise the whole prompt is one pass.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "attention_worker/llama_model.h"
#include "common/mli_schedule.h"
#include "common/npy.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "indexer_service/topk.h"

namespace dsa {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

template <typename T>
std::span<const std::byte> Bytes(const std::vector<T>& values) {
  return std::as_bytes(std::span<const T>(values));
}

struct Options {
  std::string model, indexer, tokens, mode = "dense";
  int64_t offset = 0, num_tokens = 0, decode_from = 0;
  int top_k = 64, lag_depth = 1, retention = 2;
  int64_t parallel_min_work = LlamaForwardOptions().parallel_min_work;
  std::string retention_pattern, indexer_layers;
  std::string out_logits, out_selections, out_indexer, report;
};

absl::Status Run(const Options& options) {
  const bool sparse = options.mode == "sparse";
  if (sparse && options.indexer.empty()) {
    return absl::InvalidArgumentError("--mode sparse needs --indexer");
  }
  const Clock::time_point load_start = Clock::now();
  DSA_ASSIGN_OR_RETURN(std::shared_ptr<const LlamaModel> model,
                       LlamaModel::Load(options.model, options.indexer));
  const double load_seconds = SecondsSince(load_start);
  const LlamaConfig& config = model->config();
  DSA_ASSIGN_OR_RETURN(std::vector<int32_t> all_tokens, ReadTokensNpy(options.tokens));
  const int64_t available = static_cast<int64_t>(all_tokens.size()) - options.offset;
  const int64_t n = options.num_tokens > 0 ? options.num_tokens : available;
  if (options.offset < 0 || n < 1 || n > available) {
    return absl::InvalidArgumentError(absl::StrCat(options.tokens, " holds ", all_tokens.size(),
                                                   " tokens: cannot take ", n, " from offset ",
                                                   options.offset));
  }
  const std::vector<int32_t> tokens(all_tokens.begin() + options.offset,
                                    all_tokens.begin() + options.offset + n);
  absl::StatusOr<MliSchedule> schedule =
      options.retention_pattern.empty()
          ? MliSchedule::FromRetention(config.num_layers, options.retention, options.lag_depth)
          : MliSchedule::FromPattern(options.retention_pattern, options.lag_depth,
                                     config.num_layers);
  if (!schedule.ok()) return schedule.status();
  const std::vector<int>& full_layers = schedule->full_layers();
  const auto num_full = static_cast<int64_t>(full_layers.size());
  std::vector<int> full_index(config.num_layers, -1);
  for (int64_t i = 0; i < num_full; ++i) full_index[full_layers[i]] = static_cast<int>(i);

  // Layers whose indexer inputs are written (--out-indexer).
  std::vector<int> dump_layers;
  if (!options.out_indexer.empty()) {
    if (!model->has_indexer()) return absl::InvalidArgumentError("--out-indexer needs --indexer");
    if (options.indexer_layers.empty()) {
      dump_layers = {full_layers.front(), full_layers[num_full / 2], full_layers.back()};
    } else {
      for (absl::string_view text : absl::StrSplit(options.indexer_layers, ',')) {
        int layer = 0;
        if (!absl::SimpleAtoi(text, &layer) || layer < 0 || layer >= config.num_layers) {
          return absl::InvalidArgumentError(absl::StrCat("--indexer-layers: bad layer ", text));
        }
        dump_layers.push_back(layer);
      }
    }
    std::sort(dump_layers.begin(), dump_layers.end());
    dump_layers.erase(std::unique(dump_layers.begin(), dump_layers.end()), dump_layers.end());
  }
  const LightningIndexerConfig& ic = model->indexer_config();
  const int64_t h = ic.num_heads, dk = ic.head_dim, k = options.top_k;
  std::vector<std::vector<float>> dump_q(dump_layers.size()), dump_w(dump_layers.size()),
      dump_k(dump_layers.size());

  // Sparse state: per full layer, the index keys of every slot [n, D] and the selections [n, K].
  std::vector<std::vector<float>> index_keys(sparse ? num_full : 0);
  std::vector<int32_t> selections(sparse ? num_full * n * k : 0, -1);

  std::vector<float> logits;
  if (!options.out_logits.empty()) logits.resize(n * config.vocab_size);
  LlamaKvCache cache(*model);
  const int64_t prefill_rows = options.decode_from > 0 ? std::min(options.decode_from, n) : n;
  double prefill_seconds = 0, prefill_logits_seconds = 0, indexer_seconds = 0;
  std::vector<double> decode_seconds;

  for (int64_t begin = 0; begin < n;) {
    const int64_t end = begin == 0 ? prefill_rows : begin + 1;
    const int64_t rows = end - begin;
    std::vector<LlamaRow> pass_rows;
    for (int64_t t = begin; t < end; ++t) pass_rows.push_back({&cache, t, tokens[t]});
    const Clock::time_point pass_start = Clock::now();
    double pass_indexer_seconds = 0;
    DSA_ASSIGN_OR_RETURN(std::unique_ptr<LlamaForward> pass,
                         LlamaForward::Begin(model, std::move(pass_rows),
                                             {.parallel_min_work = options.parallel_min_work}));
    std::vector<float> q(rows * h * dk), w(rows * h), keys(rows * dk);
    std::vector<std::span<const int32_t>> row_selections;
    for (int layer = 0; layer < config.num_layers; ++layer) {
      const int f = full_index[layer];
      const auto dump = std::find(dump_layers.begin(), dump_layers.end(), layer);
      if ((sparse && f >= 0) || dump != dump_layers.end()) {
        const Clock::time_point indexer_start = Clock::now();
        DSA_RETURN_IF_ERROR(pass->IndexerInputs(q, w, keys));
        if (dump != dump_layers.end()) {
          const size_t i = dump - dump_layers.begin();
          dump_q[i].insert(dump_q[i].end(), q.begin(), q.end());
          dump_w[i].insert(dump_w[i].end(), w.begin(), w.end());
          dump_k[i].insert(dump_k[i].end(), keys.begin(), keys.end());
        }
        if (sparse && f >= 0) {
          std::vector<float>& stored = index_keys[f];
          stored.insert(stored.end(), keys.begin(), keys.end());
#pragma omp parallel
          {
            std::vector<float> scores;
#pragma omp for schedule(dynamic, 8)
            for (int64_t r = 0; r < rows; ++r) {
              const int64_t t = begin + r;
              scores.resize(t + 1);
              const absl::Status scored =
                  IndexScores(static_cast<int>(h), static_cast<int>(dk),
                              std::span<const float>(&q[r * h * dk], h * dk),
                              std::span<const float>(&w[r * h], h),
                              std::span<const float>(stored.data(), (t + 1) * dk), scores);
              if (scored.ok()) {
                SelectTopK(scores, {}, t, std::span<int32_t>(&selections[(f * n + t) * k], k));
              }
            }
          }
        }
        pass_indexer_seconds += SecondsSince(indexer_start);
      }
      row_selections.clear();
      if (sparse) {
        const int attended = full_index[schedule->AttendedLayer(layer)];
        for (int64_t t = begin; t < end; ++t) {
          row_selections.emplace_back(&selections[(attended * n + t) * k], k);
        }
      }
      DSA_RETURN_IF_ERROR(pass->RunLayer(row_selections));
    }
    const double layers_seconds = SecondsSince(pass_start);
    const Clock::time_point logits_start = Clock::now();
    if (!logits.empty()) {
      std::vector<int32_t> row_indices(rows);
      for (int64_t r = 0; r < rows; ++r) row_indices[r] = static_cast<int32_t>(r);
      DSA_RETURN_IF_ERROR(pass->Logits(
          row_indices,
          std::span<float>(&logits[begin * config.vocab_size], rows * config.vocab_size)));
    } else {
      std::vector<float> last(config.vocab_size);
      const int32_t last_row = static_cast<int32_t>(rows - 1);
      DSA_RETURN_IF_ERROR(pass->Logits(std::span<const int32_t>(&last_row, 1), last));
    }
    const double logits_seconds = SecondsSince(logits_start);
    if (begin == 0) {
      prefill_seconds = layers_seconds;
      prefill_logits_seconds = logits_seconds;
    } else {
      decode_seconds.push_back(layers_seconds + logits_seconds);
    }
    indexer_seconds += pass_indexer_seconds;
    begin = end;
  }

  if (!options.out_logits.empty()) {
    DSA_RETURN_IF_ERROR(WriteNpy(options.out_logits, "<f4", {n, config.vocab_size}, logits.data(),
                                 logits.size() * sizeof(float)));
  }
  if (!options.out_selections.empty()) {
    if (!sparse) return absl::InvalidArgumentError("--out-selections needs --mode sparse");
    DSA_RETURN_IF_ERROR(WriteNpy(options.out_selections, "<i4", {num_full, n, k}, selections.data(),
                                 selections.size() * sizeof(int32_t)));
  }
  if (!options.out_indexer.empty()) {
    std::vector<SafetensorsTensorToWrite> tensors;
    for (size_t i = 0; i < dump_layers.size(); ++i) {
      const std::string prefix = absl::StrCat("layer.", dump_layers[i], ".");
      tensors.push_back({prefix + "q", "F32", {n, h, dk}, Bytes(dump_q[i])});
      tensors.push_back({prefix + "w", "F32", {n, h}, Bytes(dump_w[i])});
      tensors.push_back({prefix + "k", "F32", {n, dk}, Bytes(dump_k[i])});
    }
    DSA_RETURN_IF_ERROR(WriteSafetensors(options.out_indexer,
                                         {{"layers", absl::StrJoin(dump_layers, ",")},
                                          {"mode", options.mode},
                                          {"offset", absl::StrCat(options.offset)}},
                                         tensors));
  }
  // Timings: the prefill pass (layers only, then the logits it wrote) and the decode steps
  // (layers + one row's logits, or all rows' when --out-logits).
  double decode_mean = 0;
  for (const double s : decode_seconds) decode_mean += s;
  if (!decode_seconds.empty()) decode_mean /= static_cast<double>(decode_seconds.size());
  const std::string report = absl::StrFormat(
      "{\"mode\": \"%s\", \"tokens\": %d, \"prefill_rows\": %d, \"threads\": %d, "
      "\"full_layers\": [%s], \"lag_depth\": %d, \"top_k\": %d, \"load_seconds\": %.3f, "
      "\"prefill_seconds\": %.4f, \"prefill_tokens_per_second\": %.2f, "
      "\"prefill_logits_seconds\": %.4f, \"indexer_seconds\": %.4f, \"decode_steps\": %d, "
      "\"decode_step_mean_ms\": %.3f, \"decode_context_first\": %d, \"decode_context_last\": %d, "
      "\"parallel_min_work\": %d}\n",
      options.mode, n, prefill_rows, omp_get_max_threads(), absl::StrJoin(full_layers, ", "),
      options.lag_depth, options.top_k, load_seconds, prefill_seconds,
      static_cast<double>(prefill_rows) / prefill_seconds, prefill_logits_seconds, indexer_seconds,
      decode_seconds.size(), decode_mean * 1e3, prefill_rows + 1, n, options.parallel_min_work);
  std::fputs(report.c_str(), stdout);
  if (!options.report.empty()) {
    std::ofstream out(options.report);
    out << report;
    if (!out) return absl::PermissionDeniedError(absl::StrCat(options.report, ": cannot write"));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace dsa

int main(int argc, char** argv) {  // NOLINT(bugprone-exception-escape): CLI11 parse errors
  dsa::Options options;
  CLI::App app{
      "dsa-model-forward: the real model's forward pass (docs/model.md), dense or sparse "
      "(MLI), over a .npy token file"};
  app.add_option("--model", options.model, "model.safetensors (fp32, dsa-llama/1)")->required();
  app.add_option("--indexer", options.indexer,
                 "the lightning indexers (fp16 safetensors, dsa-indexer/1); needed by sparse");
  app.add_option("--tokens", options.tokens, ".npy of int32, uint16 or int64 token ids (flattened)")
      ->required();
  app.add_option("--offset", options.offset, "first token taken from the file");
  app.add_option("--num-tokens", options.num_tokens, "tokens taken (0: the rest of the file)");
  app.add_option("--mode", options.mode, "dense (causal) or sparse (top-K selections, MLI)")
      ->check(CLI::IsMember({"dense", "sparse"}));
  app.add_option("--top-k", options.top_k, "K of the sparse selections")
      ->check(CLI::PositiveNumber);
  app.add_option("--lag-depth", options.lag_depth, "MLI lag depth k")
      ->check(CLI::NonNegativeNumber);
  auto* retention =
      app.add_option("--retention", options.retention, "every r-th layer is full (retention 1/r)")
          ->check(CLI::PositiveNumber);
  app.add_option("--retention-pattern", options.retention_pattern,
                 "full/shared pattern, one F or S per layer")
      ->excludes(retention);
  app.add_option("--decode-from", options.decode_from,
                 "rows [0, P) as one pass, then one row per pass (0: one pass)");
  app.add_option("--out-logits", options.out_logits, ".npy fp32 [n, vocab]");
  app.add_option("--out-selections", options.out_selections, ".npy int32 [full layers, n, K]");
  app.add_option("--out-indexer", options.out_indexer,
                 "safetensors of layer.L.{q,w,k} fp32 [n,H,D], [n,H], [n,D]");
  app.add_option("--indexer-layers", options.indexer_layers,
                 "layers written to --out-indexer (comma list; default first, middle and last "
                 "full layer)");
  app.add_option("--report", options.report, "timings as JSON");
  app.add_option("--parallel-min-work", options.parallel_min_work,
                 "LlamaForwardOptions::parallel_min_work (multiply-adds below which a GEMM runs "
                 "on one thread)")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  const absl::Status status = dsa::Run(options);
  if (!status.ok()) {
    std::fprintf(stderr, "dsa-model-forward: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
