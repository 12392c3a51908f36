// The real model's evaluation report as JSON and as markdown tables (model_eval.h), apart from the
// run that fills it.
#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "tools/dsa/model_eval.h"

namespace dsa {

nlohmann::json ModelEvalReportToJson(const ModelEvalReport& report) {
  const ModelEvalOptions& o = report.options;
  nlohmann::json arms = nlohmann::json::array();
  for (const ModelEvalArm& a : o.arms) {
    arms.push_back({{"name", a.name},
                    {"dense", a.dense},
                    {"retention_stride", a.retention_stride},
                    {"lag_depth", a.lag_depth},
                    {"spin", a.spin},
                    {"target_block_sparsity", a.target_block_sparsity},
                    {"exploration_fraction", a.exploration_fraction},
                    {"draft_length", a.draft_length},
                    {"row0_policies", a.row0_policies},
                    {"miss_target", a.miss_target}});
  }
  nlohmann::json out = {{"options",
                         {{"model_file", o.model_file},
                          {"indexer_weights", o.indexer_weights},
                          {"heldout_tokens", o.heldout_tokens},
                          {"needles_file", o.needles_file},
                          {"contexts", o.contexts},
                          {"samples", o.samples},
                          {"continuation", o.continuation},
                          {"greedy_continuations", o.greedy_continuations},
                          {"top_k", o.top_k},
                          {"seed", o.seed},
                          {"needle_lengths", o.needle_lengths},
                          {"requested_device", o.device},
                          {"cuda_device", o.cuda_device},
                          {"arms", arms}}},
                        {"device", report.device},
                        {"seconds", report.seconds},
                        {"complete", report.complete}};
  nlohmann::json cells = nlohmann::json::array();
  for (const PerplexityCell& c : report.perplexity) {
    nlohmann::json layers = nlohmann::json::array();
    for (const LayerSelectionStats& l : c.layers) {
      layers.push_back({{"model_layer", l.model_layer},
                        {"rows", l.rows},
                        {"mean_mass_recall", l.mean_mass_recall},
                        {"p1_mass_recall", l.p1_mass_recall},
                        {"audited_rows", l.audited_rows},
                        {"mean_miss_rate", l.mean_miss_rate},
                        {"p99_miss_rate", l.p99_miss_rate}});
    }
    nlohmann::json sequences = nlohmann::json::array();
    for (const SequenceSelectionStats& q : c.sequences) {
      sequences.push_back({{"window", q.window},
                           {"greedy", q.greedy},
                           {"realized_block_sparsity", q.realized_block_sparsity},
                           {"audited_rows", q.audited_rows},
                           {"mean_miss_rate", q.mean_miss_rate},
                           {"p99_miss_rate", q.p99_miss_rate}});
    }
    cells.push_back({{"arm", c.arm},
                     {"context", c.context},
                     {"tokens_scored", c.tokens_scored},
                     {"real_perplexity", c.real_perplexity},
                     {"greedy_perplexity", c.greedy_perplexity},
                     {"realized_block_sparsity", c.realized_block_sparsity},
                     {"audited_rows", c.audited_rows},
                     {"mean_miss_rate", c.mean_miss_rate},
                     {"p99_miss_rate", c.p99_miss_rate},
                     {"steps", c.steps},
                     {"mean_accepted", c.mean_accepted},
                     {"mean_mass_recall", c.mean_mass_recall},
                     {"p1_mass_recall", c.p1_mass_recall},
                     {"layers", layers},
                     {"sequences", sequences},
                     {"seconds", c.seconds}});
  }
  out["perplexity"] = cells;
  nlohmann::json needles = nlohmann::json::array();
  for (const NeedleCell& c : report.needles) {
    needles.push_back({{"arm", c.arm},
                       {"length", c.length},
                       {"depth", c.depth},
                       {"found", c.found},
                       {"generated", c.generated}});
  }
  out["needles"] = needles;
  return out;
}

std::string ModelEvalReportToMarkdown(const ModelEvalReport& report) {
  std::string md = absl::StrCat(
      report.complete ? ""
                      : "**Partial report**: the run stopped before its last cell; every cell "
                        "below is whole.\n\n",
      "Device: ", report.device, "; K = ", report.options.top_k, "; ", report.options.samples,
      " windows of ", report.options.continuation, " tokens a context; ",
      absl::StrFormat("%.0f", report.seconds), " s.\n\n");
  // Perplexity, with the ratios the targets are stated in.
  std::map<int64_t, const PerplexityCell*> dense, all_keep;
  for (const PerplexityCell& c : report.perplexity) {
    if (c.arm == "dense") dense[c.context] = &c;
    if (c.arm == "all-keep") all_keep[c.context] = &c;
  }
  absl::StrAppend(
      &md,
      "| context | arm | perplexity (held-out) | / dense | / all-keep | perplexity "
      "(greedy) | mass recall (mean / p1) | realized block sparsity | mean miss | p99 miss | "
      "accepted / step | s |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const PerplexityCell& c : report.perplexity) {
    const auto ratio = [&](const std::map<int64_t, const PerplexityCell*>& base) {
      const auto it = base.find(c.context);
      return it == base.end() || it->second->real_perplexity == 0
                 ? std::string("-")
                 : absl::StrFormat("%.4f", c.real_perplexity / it->second->real_perplexity);
    };
    absl::StrAppend(
        &md,
        absl::StrFormat(
            "| %d | %s | %.3f | %s | %s | %.3f | %s | %.3f | %s | %s | %s | %.0f |\n", c.context,
            c.arm, c.real_perplexity, ratio(dense), ratio(all_keep), c.greedy_perplexity,
            c.mean_mass_recall > 0
                ? absl::StrFormat("%.3f / %.3f", c.mean_mass_recall, c.p1_mass_recall)
                : "-",
            c.realized_block_sparsity,
            c.audited_rows > 0 ? absl::StrFormat("%.3f", c.mean_miss_rate) : "-",
            c.audited_rows > 0 ? absl::StrFormat("%.3f", c.p99_miss_rate) : "-",
            c.mean_accepted > 0 ? absl::StrFormat("%.2f", c.mean_accepted) : "-", c.seconds));
  }
  if (!report.needles.empty()) {
    // One row per arm and length: found / cases, and which depths missed.
    std::map<std::pair<std::string, int64_t>, std::pair<int, int>> grid;
    std::map<std::pair<std::string, int64_t>, std::string> missed;
    std::vector<std::string> order;
    for (const NeedleCell& c : report.needles) {
      const auto key = std::make_pair(c.arm, c.length);
      if (std::find(order.begin(), order.end(), c.arm) == order.end()) order.push_back(c.arm);
      grid[key].first += c.found ? 1 : 0;
      grid[key].second += 1;
      if (!c.found) absl::StrAppend(&missed[key], missed[key].empty() ? "" : ", ", c.depth);
    }
    absl::StrAppend(&md, "\n| arm | length | found | missed at depths |\n|---|---|---|---|\n");
    for (const std::string& arm : order) {
      for (const auto& [key, counts] : grid) {
        if (key.first != arm) continue;
        absl::StrAppend(
            &md, absl::StrFormat("| %s | %d | %d / %d | %s |\n", arm, key.second, counts.first,
                                 counts.second, missed[key].empty() ? "-" : missed[key]));
      }
    }
  }
  return md;
}

}  // namespace dsa
