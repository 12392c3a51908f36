// `dsa eval` (eval_command.h).
#include "tools/dsa/commands/eval_command.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_join.h"
#include "tools/dsa/cluster.h"
#include "tools/dsa/commands/output.h"
#include "tools/dsa/eval.h"
#include "tools/dsa/model_eval.h"

namespace dsa::commands {
namespace {

// `dsa eval`'s flags, of both models.
struct EvalFlags {
  dsa::EvalOptions eval;
  std::string json_path, markdown_path;
  bool no_predictor_study = false;
  std::string model = dsa::kPatternModel;
  dsa::ModelEvalOptions model_eval;
  bool quick = false;
  std::string needles_path;
  std::vector<std::string> arm_filters;
  bool no_greedy = false;
};

// `dsa eval --model smollm2`.
int RunModelEvalCommand(EvalFlags& flags, const CLI::App* eval_cmd) {
  dsa::ModelEvalOptions& model_eval = flags.model_eval;
  for (const char* name :
       {"--context", "--steps", "--layers", "--heads", "--head-dim", "--sparsities",
        "--exploration", "--draft-length", "--acceptance-rate", "--pooling", "--reduction",
        "--exploration-policy", "--no-predictor-study"}) {
    if (eval_cmd->count(name) > 0) {
      std::fprintf(stderr,
                   "dsa eval: %s is the pattern model's; --model smollm2 takes "
                   "--contexts, --samples, --continuation, --needle-lengths\n",
                   name);
      return 2;
    }
  }
  if (flags.quick) {
    if (eval_cmd->count("--contexts") == 0) model_eval.contexts = {1024};
    if (eval_cmd->count("--samples") == 0) model_eval.samples = 2;
    if (eval_cmd->count("--continuation") == 0) model_eval.continuation = 32;
    if (eval_cmd->count("--needle-lengths") == 0) model_eval.needle_lengths = {1024};
    model_eval.arms = dsa::QuickModelEvalArms();
  }
  if (!flags.arm_filters.empty()) {
    std::vector<dsa::ModelEvalArm> kept;
    for (const dsa::ModelEvalArm& arm : model_eval.arms) {
      for (const std::string& text : flags.arm_filters) {
        if (arm.name.find(text) != std::string::npos) {
          kept.push_back(arm);
          break;
        }
      }
    }
    model_eval.arms = std::move(kept);
  }
  if (eval_cmd->count("--top-k") > 0) model_eval.top_k = flags.eval.top_k;
  model_eval.seed = flags.eval.seed;
  model_eval.greedy_continuations = !flags.no_greedy;
  model_eval.model_file = RepoFileOr(model_eval.model_file, dsa::kDefaultModelFile);
  model_eval.indexer_weights = RepoFileOr(model_eval.indexer_weights, dsa::kDefaultIndexerWeights);
  model_eval.heldout_tokens = RepoFileOr(model_eval.heldout_tokens, dsa::kDefaultHeldoutTokens);
  model_eval.needles_file =
      flags.needles_path == "none" ? "" : RepoFileOr(flags.needles_path, dsa::kDefaultNeedles);
  // The default cases exist only where scripts/model_setup.sh found the essays (../shared): a
  // run without them skips the pass keys, saying so; a file given by name must exist.
  if (flags.needles_path.empty() && !std::filesystem::exists(model_eval.needles_file)) {
    std::fprintf(stderr,
                 "dsa eval: no pass-key cases at %s (scripts/model_setup.sh writes them when "
                 "../shared/data/long_docs/PaulGrahamEssays exists): pass keys skipped\n",
                 model_eval.needles_file.c_str());
    model_eval.needles_file.clear();
  }
  if (const absl::Status valid = dsa::ValidateModelEvalOptions(model_eval); !valid.ok()) {
    std::fprintf(stderr, "dsa eval: %s\n", valid.ToString().c_str());
    return 2;
  }
  if (!CanReplaceOutput(flags.json_path) || !CanReplaceOutput(flags.markdown_path)) return 1;
  std::fprintf(stderr,
               "dsa eval --model smollm2: %zu arms, contexts %s, %d windows of %d tokens, K %d\n",
               model_eval.arms.size(), absl::StrJoin(model_eval.contexts, ",").c_str(),
               model_eval.samples, model_eval.continuation, model_eval.top_k);
  // Every finished cell is written at once: a run stopped by a time limit keeps its cells. A
  // failed checkpoint is said once; the exit status is the final write's.
  const auto write = [&](const dsa::ModelEvalReport& report) {
    return ReplaceOutput(flags.json_path, dsa::ModelEvalReportToJson(report).dump(2) + "\n") &&
           ReplaceOutput(flags.markdown_path, dsa::ModelEvalReportToMarkdown(report));
  };
  bool checkpoint_failed = false;
  auto report =
      dsa::RunModelEval(model_eval, &PrintProgress, [&](const dsa::ModelEvalReport& partial) {
        if (!checkpoint_failed) checkpoint_failed = !write(partial);
      });
  if (!report.ok()) {
    std::fprintf(stderr, "dsa eval: %s\n", report.status().ToString().c_str());
    return 2;
  }
  std::cout << dsa::ModelEvalReportToMarkdown(*report);
  return write(*report) ? 0 : 1;
}

// `dsa eval --model pattern`.
int RunPatternEvalCommand(EvalFlags& flags, const CLI::App* eval_cmd) {
  dsa::EvalOptions& eval = flags.eval;
  for (const char* name :
       {"--quick", "--model-file", "--indexer-weights", "--heldout-tokens", "--needles",
        "--contexts", "--samples", "--continuation", "--needle-lengths", "--no-greedy", "--arms",
        "--device", "--cuda-device"}) {
    if (eval_cmd->count(name) > 0) {
      std::fprintf(stderr, "dsa eval: %s needs --model smollm2\n", name);
      return 2;
    }
  }
  eval.predictor_study = !flags.no_predictor_study;
  if (const absl::Status valid = dsa::ValidateEvalOptions(eval); !valid.ok()) {
    std::fprintf(stderr, "dsa eval: %s\n", valid.ToString().c_str());
    return 2;
  }
  std::ofstream json_out, markdown_out;
  if (!OpenOutput(flags.json_path, json_out) || !OpenOutput(flags.markdown_path, markdown_out))
    return 1;
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
  if (!WriteOutput(flags.json_path, json_out, dsa::EvalReportToJson(*report).dump(2) + "\n") ||
      !WriteOutput(flags.markdown_path, markdown_out, markdown)) {
    return 1;
  }
  return 0;
}

}  // namespace

Subcommand AddEvalCommand(CLI::App& app) {
  auto flags = std::make_shared<EvalFlags>();
  dsa::EvalOptions& eval = flags->eval;
  dsa::ModelEvalOptions& model_eval = flags->model_eval;
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
  eval_cmd->add_flag("--no-predictor-study", flags->no_predictor_study,
                     "Skip the SPIN Table-1 predictor comparison");
  // The real model's evaluation (tools/dsa/model_eval.h).
  eval_cmd
      ->add_option("--model", flags->model,
                   "pattern (SPIN's miss rate on the synthetic model) or smollm2 (perplexity, "
                   "passkey retrieval and selection statistics of every arm on SmolLM2-135M)")
      ->check(CLI::IsMember({dsa::kPatternModel, dsa::kSmolLM2Model}))
      ->capture_default_str();
  eval_cmd->add_flag(
      "--quick", flags->quick,
      "--model smollm2: context 1K, 2 windows of 32 tokens, 5 arms (dense, all-keep, "
      "SPIN rho 0.4, MLI k 1 at retention 1/2, d = 3 speculative steps with SPIN), the 1K "
      "passkeys");
  eval_cmd->add_option(
      "--model-file", model_eval.model_file,
      std::string("--model smollm2: the backbone (default ") + dsa::kDefaultModelFile + ")");
  eval_cmd->add_option("--indexer-weights", model_eval.indexer_weights,
                       std::string("--model smollm2: the indexer weights (default ") +
                           dsa::kDefaultIndexerWeights + ")");
  eval_cmd->add_option("--heldout-tokens", model_eval.heldout_tokens,
                       std::string("--model smollm2: .npy of held-out token ids (default ") +
                           dsa::kDefaultHeldoutTokens + ")");
  eval_cmd->add_option("--needles", flags->needles_path,
                       std::string("--model smollm2: passkey cases (default ") +
                           dsa::kDefaultNeedles + "; 'none' skips them)");
  eval_cmd
      ->add_option("--contexts", model_eval.contexts,
                   "--model smollm2: context lengths of the perplexity windows, tokens")
      ->delimiter(',')
      ->capture_default_str();
  eval_cmd->add_option("--samples", model_eval.samples, "--model smollm2: windows per context")
      ->capture_default_str();
  eval_cmd
      ->add_option("--continuation", model_eval.continuation,
                   "--model smollm2: tokens scored after each window's context")
      ->capture_default_str();
  eval_cmd
      ->add_option("--needle-lengths", model_eval.needle_lengths,
                   "--model smollm2: passkey lengths evaluated (default: every length in the file)")
      ->delimiter(',');
  eval_cmd
      ->add_option("--device", model_eval.device,
                   "--model smollm2: where the model runs: auto (the GPU when built with CUDA and "
                   "one is present), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  eval_cmd->add_option("--cuda-device", model_eval.cuda_device, "--model smollm2: the GPU ordinal")
      ->capture_default_str();
  eval_cmd
      ->add_option("--arms", flags->arm_filters,
                   "--model smollm2: only the arms whose names contain one of these texts "
                   "(comma-separated; e.g. dense,all-keep,spec; the names are the report's)")
      ->delimiter(',');
  eval_cmd->add_flag("--no-greedy", flags->no_greedy,
                     "--model smollm2: skip the perplexity of the dense greedy continuations");
  eval_cmd->add_option("--json", flags->json_path, "Write the results as JSON to this file");
  eval_cmd->add_option("--markdown", flags->markdown_path,
                       "Write the results as a markdown table to this file");
  return {eval_cmd, [flags, eval_cmd] {
            return flags->model == dsa::kSmolLM2Model ? RunModelEvalCommand(*flags, eval_cmd)
                                                      : RunPatternEvalCommand(*flags, eval_cmd);
          }};
}

}  // namespace dsa::commands
