// `dsa`: the project's command-line tool. Subcommands: `eval` (SPIN quality against all-keep).
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <utility>

#include "CLI/CLI.hpp"
#include "tools/dsa/eval.h"

namespace {

void PrintProgress(const std::string& line) {
  std::fprintf(stderr, "  %s\n", line.c_str());
  std::fflush(stderr);
}

// Opens `path` for writing now, so a bad path fails before minutes of work; empty path = none.
bool OpenOutput(const std::string& path, std::ofstream& out) {
  if (path.empty()) return true;
  out.open(path);
  if (!out) {
    std::fprintf(stderr, "dsa: cannot write %s: %s\n", path.c_str(), std::strerror(errno));
    return false;
  }
  return true;
}

bool WriteOutput(const std::string& path, std::ofstream& out, const std::string& text) {
  if (path.empty()) return true;
  out << text;
  out.close();
  if (!out) {
    std::fprintf(stderr, "dsa: writing %s failed: %s\n", path.c_str(), std::strerror(errno));
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {  // NOLINT(bugprone-exception-escape): CLI11 parse errors
                                   // are caught by CLI11_PARSE; others end the process.
  CLI::App app{"dsa: tools for the DSA lightning-indexer service"};
  app.require_subcommand(1);

  dsa::EvalOptions eval;
  std::string json_path, markdown_path;
  CLI::App* eval_cmd = app.add_subcommand(
      "eval",
      "Miss rate and realized block sparsity of SPIN against all-keep on the pattern model");
  eval_cmd->add_option("--context", eval.context_slots, "Prefill length in slots (multiple of 64)")
      ->capture_default_str();
  eval_cmd->add_option("--steps", eval.decode_steps, "Decode positions per configuration")
      ->capture_default_str();
  eval_cmd->add_option("--layers", eval.num_layers, "Full layers of the pattern model")
      ->capture_default_str();
  eval_cmd->add_option("--heads", eval.num_heads, "Indexer query heads H")->capture_default_str();
  eval_cmd->add_option("--head-dim", eval.head_dim, "Index-key dimension D")->capture_default_str();
  eval_cmd->add_option("--top-k", eval.top_k, "Selection size K")->capture_default_str();
  eval_cmd->add_option("--seed", eval.seed, "Seed of the model, exploration and acceptance")
      ->capture_default_str();
  eval_cmd->add_option("--sparsities", eval.target_sparsities, "Target block sparsities rho")
      ->capture_default_str();
  eval_cmd->add_option("--exploration", eval.exploration_fractions, "Exploration fractions gamma")
      ->capture_default_str();
  eval_cmd
      ->add_option("--draft-length", eval.draft_length,
                   "Draft length d of the speculative ablation (0 skips it)")
      ->capture_default_str();
  eval_cmd
      ->add_option("--acceptance-rate", eval.acceptance_rate,
                   "Per-token acceptance probability of the seeded acceptance model")
      ->capture_default_str();
  eval_cmd->add_option("--pooling", eval.pooling, "SPIN block pooling (ablation): max, top4, mean")
      ->capture_default_str();
  eval_cmd->add_option("--reduction", eval.reduction, "SPIN slot-to-block reduction: a1, a0, a2")
      ->capture_default_str();
  eval_cmd
      ->add_option("--exploration-policy", eval.exploration_policy,
                   "SPIN exploration policy: random, staleness, age")
      ->capture_default_str();
  bool no_predictor_study = false;
  eval_cmd->add_flag("--no-predictor-study", no_predictor_study,
                     "Skip the SPIN Table-1 predictor comparison");
  eval_cmd->add_option("--json", json_path, "Write the results as JSON to this file");
  eval_cmd->add_option("--markdown", markdown_path,
                       "Write the results as a markdown table to this file");

  // CLI11 says only "A subcommand is required" for a misspelt one: name it.
  const std::string first = argc > 1 ? argv[1] : "";
  const auto named_first = [&first](const CLI::App* sub) { return sub->check_name(first); };
  if (!first.empty() && first[0] != '-' &&
      std::as_const(app).get_subcommands(named_first).empty()) {
    std::fprintf(stderr, "dsa: unknown subcommand '%s' (available: eval); see dsa --help\n",
                 argv[1]);
    return 106;
  }
  CLI11_PARSE(app, argc, argv);

  if (*eval_cmd) {
    eval.predictor_study = !no_predictor_study;
    if (const absl::Status valid = dsa::ValidateEvalOptions(eval); !valid.ok()) {
      std::fprintf(stderr, "dsa eval: %s\n", valid.ToString().c_str());
      return 2;
    }
    std::ofstream json_out, markdown_out;
    if (!OpenOutput(json_path, json_out) || !OpenOutput(markdown_path, markdown_out)) return 1;
    std::fprintf(stderr,
                 "dsa eval: %lld-slot prefill, %d decode positions, %d layers, H=%d D=%d K=%d\n",
                 static_cast<long long>(eval.context_slots), eval.decode_steps, eval.num_layers,
                 eval.num_heads, eval.head_dim, eval.top_k);
    auto report = dsa::RunEval(eval, &PrintProgress);
    if (!report.ok()) {
      std::fprintf(stderr, "dsa eval: %s\n", report.status().ToString().c_str());
      return 2;
    }
    const std::string markdown = dsa::EvalReportToMarkdown(*report);
    std::cout << markdown;
    if (!WriteOutput(json_path, json_out, dsa::EvalReportToJson(*report).dump(2) + "\n") ||
        !WriteOutput(markdown_path, markdown_out, markdown)) {
      return 1;
    }
  }
  return 0;
}
