// `dsa fit-pattern` (fit_pattern_command.h).
#include "tools/dsa/commands/fit_pattern_command.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "tools/dsa/cluster.h"
#include "tools/dsa/commands/output.h"
#include "tools/dsa/pattern_fit.h"

namespace dsa::commands {
namespace {

// `dsa fit-pattern`'s flags.
struct FitPatternFlags {
  dsa::PatternFitStudyOptions fit;
  std::string json, markdown;
  std::vector<std::string> parameters;
  std::string start = "defaults";
};

int RunFitPattern(FitPatternFlags& flags) {
  dsa::PatternFitStudyOptions& fit = flags.fit;
  if (!flags.parameters.empty()) {
    fit.fit.parameters.clear();
    for (const std::string& name : flags.parameters) {
      const std::vector<dsa::PatternFitParameter> known = dsa::FittablePatternParameters();
      const auto it =
          std::find_if(known.begin(), known.end(),
                       [&](const dsa::PatternFitParameter& p) { return p.name == name; });
      if (it == known.end()) {
        std::fprintf(stderr, "dsa fit-pattern: --parameters: no fittable field %s\n", name.c_str());
        return 2;
      }
      fit.fit.parameters.push_back(*it);
    }
  }
  if (flags.start == "spin-figure") {
    // The shape flags were parsed into fit.fit.start: keep them over the preset's.
    dsa::PatternModelConfig preset = dsa::SpinFigurePatternConfig();
    preset.num_layers = fit.fit.start.num_layers;
    preset.seed = fit.fit.start.seed;
    fit.fit.start = preset;
  }
  fit.model_file = RepoFileOr(fit.model_file, dsa::kDefaultModelFile);
  fit.indexer_weights = RepoFileOr(fit.indexer_weights, dsa::kDefaultIndexerWeights);
  fit.heldout_tokens = RepoFileOr(fit.heldout_tokens, dsa::kDefaultHeldoutTokens);
  std::ofstream json_out, markdown_out;
  if (!OpenOutput(flags.json, json_out) || !OpenOutput(flags.markdown, markdown_out)) return 1;
  auto study = dsa::RunPatternFitStudy(fit, &PrintProgress);
  if (!study.ok()) {
    std::fprintf(stderr, "dsa fit-pattern: %s\n", study.status().ToString().c_str());
    return 2;
  }
  const std::string markdown = dsa::PatternFitStudyToMarkdown(*study);
  std::cout << markdown;
  return WriteOutput(flags.json, json_out, dsa::PatternFitStudyToJson(*study).dump(2) + "\n") &&
                 WriteOutput(flags.markdown, markdown_out, markdown)
             ? 0
             : 1;
}

}  // namespace

Subcommand AddFitPatternCommand(CLI::App& app) {
  auto flags = std::make_shared<FitPatternFlags>();
  dsa::PatternFitStudyOptions& fit = flags->fit;
  CLI::App* fit_cmd = app.add_subcommand(
      "fit-pattern",
      "Fit the synthetic pattern model to the index-score statistics of SmolLM2-135M's trained "
      "indexer on held-out text, and compare SPIN's miss rate before and after");
  fit_cmd->add_option("--model-file", fit.model_file,
                      std::string("The backbone (default ") + dsa::kDefaultModelFile + ")");
  fit_cmd->add_option(
      "--indexer-weights", fit.indexer_weights,
      std::string("The indexer weights (default ") + dsa::kDefaultIndexerWeights + ")");
  fit_cmd->add_option(
      "--heldout-tokens", fit.heldout_tokens,
      std::string(".npy of held-out token ids (default ") + dsa::kDefaultHeldoutTokens + ")");
  fit_cmd->add_option("--context", fit.fit.window.n, "Tokens of each window (n)")
      ->capture_default_str();
  fit_cmd->add_option("--rows", fit.fit.window.rows, "Query rows at the end of each window")
      ->capture_default_str();
  fit_cmd->add_option("--top-k", fit.fit.window.top_k, "Selection size K")->capture_default_str();
  fit_cmd->add_option("--samples", fit.samples, "Windows of held-out text")->capture_default_str();
  fit_cmd->add_option("--layers", fit.fit.start.num_layers, "Layers of the pattern model")
      ->capture_default_str();
  fit_cmd->add_option("--heads", fit.pattern_heads,
                      "Indexer heads H of the pattern model (default: the real indexer's)");
  fit_cmd->add_option("--head-dim", fit.pattern_head_dim,
                      "Index-key dimension D of the pattern model (default: the real indexer's)");
  fit_cmd->add_option("--seed", fit.fit.start.seed, "Seed of the pattern model")
      ->capture_default_str();
  fit_cmd
      ->add_option("--parameters", flags->parameters,
                   "PatternModelConfig fields to fit (default: sink_strength, salient_fraction, "
                   "salient_strength, topic_strength, topic_switch_rate, recency_strength, "
                   "recency_window_slots, key_noise, query_noise, layer_correlation)")
      ->delimiter(',');
  fit_cmd
      ->add_option("--start", flags->start,
                   "Where the fit starts: defaults (PatternModelConfig's, themselves fitted) or "
                   "spin-figure (SpinFigurePatternConfig(), the defaults before the fit)")
      ->check(CLI::IsMember({"defaults", "spin-figure"}))
      ->capture_default_str();
  fit_cmd
      ->add_option("--spin-steps", fit.spin_decode_steps,
                   "Decode positions of the SPIN check on the pattern model (0 skips it)")
      ->capture_default_str();
  fit_cmd->add_option("--real-eval", fit.real_eval_report,
                      "A dsa eval --model smollm2 JSON report: its fixed-rho SPIN cells beside the "
                      "pattern model's");
  fit_cmd->add_option("--json", flags->json, "Write the study as JSON to this file");
  fit_cmd->add_option("--markdown", flags->markdown, "Write the study's tables to this file");
  return {fit_cmd, [flags] { return RunFitPattern(*flags); }};
}

}  // namespace dsa::commands
