// `dsa generate` (generate_command.h).
#include "tools/dsa/commands/generate_command.h"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tools/dsa/cluster.h"
#include "tools/dsa/commands/cluster_flags.h"
#include "tools/dsa/commands/dial_flags.h"
#include "tools/dsa/generate.h"

namespace dsa::commands {
namespace {

// `dsa generate`'s own flags; each is passed on to dsa_client.generate.
struct GenerateFlags {
  std::string coordinator;
  std::string prompt;
  std::string tokenizer;
  bool chat = false;
  std::string system_prompt;
  int64_t max_new_tokens = 64;
  int draft_length = 2;
  double temperature = 0, top_p = 0;
  std::optional<uint64_t> sampling_seed;  // unset: the coordinator picks one per request
  std::vector<int> stop_token_ids;
  bool ignore_eos = false;
  bool json = false;
  std::string python, client_dir;
  CLI::Option* system_opt = nullptr;
};

void AddGenerateFlags(CLI::App* cmd, GenerateFlags& flags) {
  cmd->add_option("prompt", flags.prompt, "The prompt (plain text; with --chat the user's turn)")
      ->required();
  cmd->add_option("--coordinator", flags.coordinator,
                  "Coordinator host:port; without it a local cluster is started for the prompt "
                  "(the cluster flags below) and stopped after it");
  cmd->add_option(
      "--tokenizer", flags.tokenizer,
      std::string("The model's tokenizer.json (default ") + dsa::kDefaultTokenizerFile + ")");
  cmd->add_flag("--chat", flags.chat,
                "Wrap the prompt in the model's ChatML template (system, user, then the "
                "assistant's turn; the special tokens inserted by id)");
  flags.system_opt =
      cmd->add_option("--system", flags.system_prompt,
                      "--chat: the system prompt (default: the model's own, SmolLM2's)");
  cmd->add_option("--max-new-tokens", flags.max_new_tokens, "Tokens to generate at most")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--draft-length", flags.draft_length,
                  "Speculative draft length d (0..4): the coordinator's n-gram drafts, kept where "
                  "the model's own tokens confirm them")
      ->check(CLI::Range(0, 4))
      ->capture_default_str();
  cmd->add_option("--temperature", flags.temperature, "Sampling temperature, 0 = greedy")
      ->check(CLI::Range(0.0, 100.0))
      ->capture_default_str();
  cmd->add_option("--top-p", flags.top_p, "Nucleus sampling's top-p (0 = 1)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  cmd->add_option("--sampling-seed", flags.sampling_seed,
                  "Seed of the sampled draws (default: the coordinator picks one)");
  cmd->add_option("--stop-token-id", flags.stop_token_ids,
                  "End after this token id (repeat for several)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--ignore-eos", flags.ignore_eos,
                "Do not end at the model's end-of-sequence token");
  cmd->add_flag("--json", flags.json,
                "Print one JSON line (prompt and generated ids, text, finish reason, timings) "
                "instead of streaming the text");
  cmd->add_option("--python", flags.python,
                  "Python with grpcio, protobuf and tokenizers (default: $DSA_PYTHON, else the "
                  "repository's .venv-model/bin/python from scripts/model_setup.sh)");
  cmd->add_option("--client-dir", flags.client_dir,
                  "Folder of the dsa_client package (default: the repository's clients/python)");
}

// `dsa generate`: starts a local cluster unless --coordinator is given, runs dsa_client.generate
// against it, stops the cluster. The exit code is the Python side's (0: the text came; 1: the
// request failed), 2 for a usage or startup error.
int RunGenerateCommand(const GenerateFlags& flags, const dsa::LocalClusterOptions& cluster_options,
                       const DialFlags& dial) {
  dsa::PythonGenerateOptions python;
  python.python = flags.python;
  python.client_dir = flags.client_dir;
  std::vector<std::string>& args = python.args;
  args = {"--tokenizer",
          dsa::FindRepoFile(flags.tokenizer.empty() ? dsa::kDefaultTokenizerFile : flags.tokenizer),
          "--max-new-tokens",
          std::to_string(flags.max_new_tokens),
          "--draft-length",
          std::to_string(flags.draft_length)};
  if (flags.chat) args.emplace_back("--chat");
  if (flags.system_opt->count() > 0) args.insert(args.end(), {"--system", flags.system_prompt});
  if (flags.temperature > 0) {
    std::ostringstream temperature, top_p;
    temperature << flags.temperature;
    top_p << flags.top_p;
    args.insert(args.end(), {"--temperature", temperature.str(), "--top-p", top_p.str()});
    if (flags.sampling_seed.has_value()) {
      args.insert(args.end(), {"--seed", std::to_string(*flags.sampling_seed)});
    }
  }
  for (int id : flags.stop_token_ids) {
    args.insert(args.end(), {"--stop-token-id", std::to_string(id)});
  }
  if (flags.ignore_eos) args.emplace_back("--ignore-eos");
  if (flags.json) args.emplace_back("--json");
  if (!dial.tls.ca_file.empty()) args.insert(args.end(), {"--ca-cert", dial.tls.ca_file});
  if (!dial.tls.cert_file.empty()) args.insert(args.end(), {"--client-cert", dial.tls.cert_file});
  if (!dial.tls.key_file.empty()) args.insert(args.end(), {"--client-key", dial.tls.key_file});
  if (!dial.tls.server_name.empty()) {
    args.insert(args.end(), {"--tls-server-name", dial.tls.server_name});
  }
  if (!dial.token_file.empty()) args.insert(args.end(), {"--token-file", dial.token_file});
  args.insert(args.end(), {"--", flags.prompt});

  // Ctrl-C reaches the Python side (same process group); this process waits for it and then
  // stops its cluster.
  BlockStopSignals();
  std::unique_ptr<dsa::LocalCluster> cluster;
  std::string coordinator = flags.coordinator;
  if (coordinator.empty()) {
    std::fprintf(stderr, "dsa generate: starting a local cluster (--model %s)\n",
                 cluster_options.model.c_str());
    const auto started = std::chrono::steady_clock::now();
    auto up = dsa::LocalCluster::Start(cluster_options);
    if (!up.ok()) {
      std::fprintf(stderr, "dsa generate: %s\n", up.status().ToString().c_str());
      return 2;
    }
    cluster = *std::move(up);
    std::fprintf(stderr, "dsa generate: local cluster ready in %.1f s; logs in %s\n",
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(),
                 cluster->log_dir().c_str());
    coordinator = cluster->coordinator_address();
  }
  absl::StatusOr<int> exit_code = dsa::RunPythonGenerate(coordinator, python);
  if (cluster != nullptr) {
    if (absl::Status stopped = cluster->Stop(); !stopped.ok()) {
      std::fprintf(stderr, "dsa generate: %s\n", stopped.ToString().c_str());
    }
  }
  if (!exit_code.ok()) {
    std::fprintf(stderr, "dsa generate: %s\n", exit_code.status().ToString().c_str());
    return 2;
  }
  return *exit_code;
}

// Everything `dsa generate` parses: its own flags, the cluster's and how it dials.
struct GenerateCommandFlags {
  GenerateFlags generate;
  dsa::LocalClusterOptions cluster;
  ClusterFlags cluster_flags;
  DialFlags dial;
};

}  // namespace

Subcommand AddGenerateCommand(CLI::App& app) {
  auto flags = std::make_shared<GenerateCommandFlags>();
  flags->cluster.model = dsa::kSmolLM2Model;
  CLI::App* generate_cmd = app.add_subcommand(
      "generate",
      "Stream a prompt's generated text from a real model (tokenized in Python by "
      "dsa_client.generate with the model's tokenizer.json); starts a local cluster unless "
      "--coordinator is given");
  AddGenerateFlags(generate_cmd, flags->generate);
  AddClusterFlags(generate_cmd, flags->cluster, flags->cluster_flags);
  AddDialFlags(generate_cmd, flags->dial);
  return {generate_cmd, [flags] {
            if (flags->cluster.model != dsa::kSmolLM2Model) {
              std::fprintf(stderr,
                           "dsa generate: the pattern model draws no tokens: --model smollm2\n");
              return 2;
            }
            ResolveClusterFlags(flags->cluster_flags, flags->cluster);
            return RunGenerateCommand(flags->generate, flags->cluster, flags->dial);
          }};
}

}  // namespace dsa::commands
