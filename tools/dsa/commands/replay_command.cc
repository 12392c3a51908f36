// `dsa replay` (replay_command.h).
#include "tools/dsa/commands/replay_command.h"

#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/npy.h"
#include "nlohmann/json.hpp"
#include "tools/dsa/cluster.h"
#include "tools/dsa/commands/cluster_flags.h"
#include "tools/dsa/commands/dial_flags.h"
#include "tools/dsa/commands/output.h"
#include "tools/dsa/replay.h"
#include "tools/dsa/trace.h"

namespace dsa::commands {
namespace {

// `dsa replay`: reads and caps the trace, brings up a local cluster if asked, replays, reports.
// Exit code 0 only when every request completed.
int RunReplayCommand(const std::string& trace_path, dsa::ReplayOptions replay, bool local,
                     const dsa::LocalClusterOptions& cluster_options, const std::string& json_path,
                     const std::string& markdown_path, const std::string& token_file) {
  const sigset_t signals = BlockStopSignals();
  static std::atomic<bool> stop{false};
  std::thread([signals] {
    int signal_number = 0;
    sigwait(&signals, &signal_number);
    stop = true;
  }).detach();
  replay.stop = &stop;

  std::ofstream json_out, markdown_out;
  if (!OpenOutput(json_path, json_out) || !OpenOutput(markdown_path, markdown_out)) return 2;
  auto trace = dsa::ReadTraceFile(trace_path);
  if (!trace.ok()) {
    std::fprintf(stderr, "dsa replay: %s\n", trace.status().ToString().c_str());
    return 2;
  }
  const size_t trace_size = trace->size();
  const std::vector<dsa::TraceRequest> requests = dsa::ApplyCaps(*std::move(trace), replay.caps);
  std::fprintf(stderr, "dsa replay: %zu of %zu requests from %s\n", requests.size(), trace_size,
               trace_path.c_str());
  // A real model: the contexts are real text from the token file.
  std::optional<dsa::ContextTokenSource> token_source;
  if (cluster_options.model == dsa::kSmolLM2Model) {
    // The report names the file as given (or the default, relative to the repository).
    replay.token_file = token_file.empty() ? dsa::kDefaultHeldoutTokens : token_file;
    const std::string corpus_path = dsa::FindRepoFile(replay.token_file);
    absl::StatusOr<std::vector<int32_t>> corpus = dsa::ReadTokensNpy(corpus_path);
    absl::StatusOr<dsa::ContextTokenSource> source =
        corpus.ok() ? dsa::ContextTokenSource::Create(*std::move(corpus))
                    : absl::StatusOr<dsa::ContextTokenSource>(corpus.status());
    if (!source.ok()) {
      std::fprintf(stderr, "dsa replay: --token-corpus: %s%s\n", source.status().ToString().c_str(),
                   token_file.empty() ? " (bash scripts/model_setup.sh writes it)" : "");
      return 2;
    }
    token_source = *std::move(source);
    replay.tokens = &*token_source;
    std::fprintf(stderr, "dsa replay: contexts of real text from %s (%lld tokens)\n",
                 corpus_path.c_str(), static_cast<long long>(token_source->size()));
  } else if (!token_file.empty()) {
    std::fprintf(stderr, "dsa replay: --token-corpus needs --model smollm2\n");
    return 2;
  }

  std::unique_ptr<dsa::LocalCluster> cluster;
  if (local) {
    const auto started = std::chrono::steady_clock::now();
    auto up = dsa::LocalCluster::Start(cluster_options);
    if (!up.ok()) {
      std::fprintf(stderr, "dsa replay: %s\n", up.status().ToString().c_str());
      return 2;
    }
    cluster = *std::move(up);
    std::fprintf(stderr, "dsa replay: local cluster ready in %.1f s; logs in %s\n",
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(),
                 cluster->log_dir().c_str());
    PrintCluster(*cluster);
    replay.coordinator = cluster->coordinator_address();
  }
  replay.progress = stderr;
  auto report = dsa::RunReplay(requests, replay);
  int exit_code = 0;
  if (cluster != nullptr) {
    if (absl::Status stopped = cluster->Stop(); !stopped.ok()) {
      std::fprintf(stderr, "dsa replay: %s\n", stopped.ToString().c_str());
      exit_code = 1;
    }
  }
  if (!report.ok()) {
    std::fprintf(stderr, "dsa replay: %s\n", report.status().ToString().c_str());
    return 2;
  }
  const std::string markdown = dsa::ReplayReportToMarkdown(*report);
  std::cout << markdown;
  nlohmann::json json = dsa::ReplayReportToJson(*report);
  json["trace"] = trace_path;
  const bool colocated = local && cluster_options.transport == "inprocess";
  json["settings"]["indexers"] = !local      ? 0
                                 : colocated ? cluster_options.num_attention_workers
                                             : cluster_options.num_indexers;
  json["settings"]["attention_workers"] = local ? cluster_options.num_attention_workers : 0;
  const std::string indexer_device =
      local ? cluster_options.indexer_device.value_or("cpu") : "not known (remote cluster)";
  json["settings"]["indexer_device"] = indexer_device;
  const std::string transport = local ? cluster_options.transport : "not known (remote cluster)";
  json["settings"]["transport"] = transport;
  const std::string attention_device =
      local ? cluster_options.attention_device.value_or("cpu") : "not known (remote cluster)";
  json["settings"]["attention_device"] = attention_device;
  json["settings"]["model"] = cluster_options.model;
  const std::string heading =
      "## `dsa replay` of " + std::filesystem::path(trace_path).filename().string() +
      (local ? " (local cluster, model: " + cluster_options.model +
                   ", attention device: " + attention_device +
                   ", indexer device: " + indexer_device + ", transport: " + transport +
                   (colocated ? ", each indexer co-located in its attention worker" : "") + ")"
             : "") +
      "\n\n";
  if (!WriteOutput(json_path, json_out, json.dump(2) + "\n") ||
      !WriteOutput(markdown_path, markdown_out, heading + markdown)) {
    return 2;
  }
  if (report->stopped) {
    std::fprintf(stderr,
                 "dsa replay: stopped by a signal; %lld of %lld requests completed (the report "
                 "counts the rest as failed)\n",
                 static_cast<long long>(report->completed),
                 static_cast<long long>(report->requests));
    return 1;
  }
  if (report->failed > 0) {
    std::fprintf(stderr, "dsa replay: %lld of %lld requests failed; first: %s\n",
                 static_cast<long long>(report->failed), static_cast<long long>(report->requests),
                 report->first_error.c_str());
    return 1;
  }
  return exit_code;
}

// `dsa replay`'s flags.
struct ReplayFlags {
  dsa::ReplayOptions replay;
  dsa::LocalClusterOptions cluster;
  ClusterFlags cluster_flags;
  std::string trace_path, json, markdown, token_file;
  bool local = false;
  DialFlags dial;
  // The flags that configure the --local cluster only (AddClusterFlags' but --model, which also
  // picks the replay's request kind against a running coordinator).
  std::vector<const CLI::Option*> local_only;
};

}  // namespace

Subcommand AddReplayCommand(CLI::App& app) {
  auto flags = std::make_shared<ReplayFlags>();
  dsa::ReplayOptions& replay = flags->replay;
  CLI::App* replay_cmd = app.add_subcommand(
      "replay", "Replay a Mooncake (.jsonl) or Azure (.csv) trace against a coordinator");
  replay_cmd->add_option("--trace", flags->trace_path, "Trace file (.jsonl Mooncake, .csv Azure)")
      ->required();
  CLI::Option* coordinator_opt =
      replay_cmd->add_option("--coordinator", replay.coordinator, "Coordinator host:port");
  CLI::Option* local_opt = replay_cmd->add_flag(
      "--local", flags->local,
      "Bring up a local cluster for the run (see the cluster flags) and stop it");
  coordinator_opt->excludes(local_opt);
  replay_cmd
      ->add_option("--time-scale", replay.time_scale,
                   "Arrival times x this; 0 = as fast as --max-in-flight allows")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  replay_cmd->add_option("--limit", replay.caps.limit, "Only the first N requests (0 = all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  replay_cmd
      ->add_option("--max-context", replay.caps.max_context,
                   "Cap on context tokens (prefix ids cut to match; 0 = none)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  replay_cmd->add_option("--max-output", replay.caps.max_output, "Cap on output tokens (0 = none)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  replay_cmd->add_option("--draft-length", replay.draft_length, "Speculative draft length d (0..4)")
      ->check(CLI::Range(0, 4))
      ->capture_default_str();
  replay_cmd
      ->add_option("--max-in-flight", replay.max_in_flight,
                   "Concurrent Generate streams; later requests wait client-side")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  replay_cmd->add_option("--sample-ms", replay.sample_ms, "GetLoad sampling period (cache use)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  replay_cmd
      ->add_option("--request-timeout-ms", replay.request_timeout_ms,
                   "Deadline of each Generate stream")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  replay_cmd->add_option("--token-corpus", flags->token_file,
                         std::string("--model smollm2: .npy of token ids (uint16, int32 or int64) "
                                     "whose 512-token slices fill the contexts, one per trace "
                                     "hash id (default ") +
                             dsa::kDefaultHeldoutTokens + ")");
  replay_cmd
      ->add_option("--temperature", replay.sampling.temperature,
                   "--model smollm2: sampling temperature, 0 = greedy")
      ->check(CLI::Range(0.0, 100.0))
      ->capture_default_str();
  replay_cmd
      ->add_option("--top-p", replay.sampling.top_p,
                   "--model smollm2: nucleus sampling's top-p with --temperature > 0 (0 = 1)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  replay_cmd
      ->add_option("--sampling-seed", replay.sampling.seed,
                   "--model smollm2 with --temperature > 0: request i samples with seed + i")
      ->capture_default_str();
  replay_cmd->add_flag("--ignore-eos", replay.sampling.ignore_eos,
                       "--model smollm2: generate to the output length past the end-of-sequence "
                       "token (default: a request may end there)");
  replay_cmd
      ->add_option("--sample-outputs", replay.sample_outputs,
                   "--model smollm2: keep the generated token ids of the first N requests in "
                   "the report")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  replay_cmd->add_option("--json", flags->json, "Write the report as JSON to this file");
  replay_cmd->add_option("--markdown", flags->markdown,
                         "Write the report as a markdown table to this file");
  const size_t before_cluster_flags = replay_cmd->get_options().size();
  AddClusterFlags(replay_cmd, flags->cluster, flags->cluster_flags);
  const std::vector<CLI::Option*> all = replay_cmd->get_options();
  for (size_t i = before_cluster_flags; i < all.size(); ++i) {
    if (all[i]->get_name() != "--model") flags->local_only.push_back(all[i]);
  }
  AddDialFlags(replay_cmd, flags->dial);
  return {replay_cmd, [flags] {
            dsa::ReplayOptions& replay = flags->replay;
            if (!flags->local && replay.coordinator.empty()) {
              std::fprintf(stderr, "dsa replay: give --coordinator ADDR or --local\n");
              return 2;
            }
            if (!flags->local) {
              // Against a running coordinator these would change nothing: say so instead of
              // replaying as if they had.
              std::string given;
              for (const CLI::Option* option : flags->local_only) {
                if (option->count() > 0) given += (given.empty() ? "" : ", ") + option->get_name();
              }
              if (!given.empty()) {
                std::fprintf(stderr,
                             "dsa replay: %s configure the cluster of --local; with --coordinator "
                             "the running cluster's own settings apply: drop them or use --local\n",
                             given.c_str());
                return 2;
              }
            }
            ResolveClusterFlags(flags->cluster_flags, flags->cluster);
            const std::optional<dsa::ClientSecurity> security =
                DialSecurity(flags->dial, "dsa replay");
            if (!security.has_value()) return 2;
            replay.security = *security;
            return RunReplayCommand(flags->trace_path, replay, flags->local, flags->cluster,
                                    flags->json, flags->markdown, flags->token_file);
          }};
}

}  // namespace dsa::commands
