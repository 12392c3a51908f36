// `dsa`: the project's command-line tool. Subcommands: `eval` (SPIN quality against all-keep),
// `up` (a local cluster of the three servers), `replay` (a production trace against a
// coordinator), `generate` (a prompt's streamed text from a real model) and `health`.
#include <signal.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_join.h"
#include "common/npy.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "server/health_check.h"
#include "server/server.h"
#include "server/version.h"
#include "tools/dsa/cluster.h"
#include "tools/dsa/eval.h"
#include "tools/dsa/generate.h"
#include "tools/dsa/model_eval.h"
#include "tools/dsa/pattern_fit.h"
#include "tools/dsa/replay.h"
#include "tools/dsa/trace.h"

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

// The temporary ReplaceOutput writes beside `path`.
std::string PartialPath(const std::string& path) { return path + ".partial"; }

// Whether ReplaceOutput can write beside `path` (its temporary is created and removed), so a bad
// path fails before minutes of work without truncating what `path` holds; empty path = none.
bool CanReplaceOutput(const std::string& path) {
  if (path.empty()) return true;
  std::ofstream probe(PartialPath(path), std::ios::trunc);
  const int error = errno;
  if (!probe) {
    std::fprintf(stderr, "dsa: cannot write %s: %s\n", PartialPath(path).c_str(),
                 std::strerror(error));
    return false;
  }
  probe.close();
  std::remove(PartialPath(path).c_str());
  return true;
}

// Replaces `path` with `text` through a temporary beside it, so that a reader never sees half a
// file and a run killed mid-write leaves the previous whole one; empty path = none. On failure
// the temporary is removed and `path` kept.
bool ReplaceOutput(const std::string& path, const std::string& text) {
  if (path.empty()) return true;
  const std::string temporary = PartialPath(path);
  std::ofstream out(temporary, std::ios::trunc);
  out << text;
  out.close();
  const bool written = static_cast<bool>(out);
  if (!written || std::rename(temporary.c_str(), path.c_str()) != 0) {
    std::fprintf(stderr, "dsa: writing %s failed%s%s\n", path.c_str(), written ? ": " : "",
                 written ? std::strerror(errno) : "");
    std::remove(temporary.c_str());
    return false;
  }
  return true;
}

// A file named by a flag, or the repository's default (FindRepoFile) when the flag is empty.
std::string RepoFileOr(const std::string& given, const char* fallback) {
  return dsa::FindRepoFile(given.empty() ? fallback : given);
}

// The cluster flags shared by `dsa up` and `dsa replay --local`; optional ones are passed on to
// the binaries only when given.
struct ClusterFlags {
  int64_t startup_timeout_ms = 60000;
  int64_t stop_timeout_ms = 15000;
  int64_t capacity_blocks = 0;
  double audit_fraction = 0;
  int num_heads = 0, head_dim = 0, top_k = 0;
  std::string layer_pattern;
  int64_t kv_capacity_slots = 0;
  double target_block_sparsity = 0, acceptance_rate = 0;
  uint64_t seed = 0;
  CLI::Option *capacity_blocks_opt = nullptr, *audit_fraction_opt = nullptr,
              *num_heads_opt = nullptr, *head_dim_opt = nullptr, *top_k_opt = nullptr,
              *layer_pattern_opt = nullptr, *kv_capacity_slots_opt = nullptr,
              *target_block_sparsity_opt = nullptr, *acceptance_rate_opt = nullptr,
              *seed_opt = nullptr;
};

void AddClusterFlags(CLI::App* cmd, dsa::LocalClusterOptions& options, ClusterFlags& flags) {
  cmd->add_option("--model", options.model,
                  "The model the attention workers run: pattern (the synthetic pattern model) or "
                  "smollm2 (SmolLM2-135M with its lightning indexers, docs/model.md: the indexers "
                  "at H 16, D 64, the coordinator at --top-k 512 unless given)")
      ->check(CLI::IsMember({dsa::kPatternModel, dsa::kSmolLM2Model}))
      ->capture_default_str();
  cmd->add_option("--model-file", options.model_file,
                  std::string("--model smollm2: the backbone (default ") + dsa::kDefaultModelFile +
                      ", written by scripts/model_setup.sh)");
  cmd->add_option("--indexer-weights", options.indexer_weights,
                  std::string("--model smollm2: the lightning indexers' weights (default ") +
                      dsa::kDefaultIndexerWeights + ")");
  cmd->add_option("--indexers", options.num_indexers,
                  "dsa-indexer processes (with --transport inprocess: none, each attention worker "
                  "holds its own)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--transport", options.transport,
                  "How selections reach the attention workers: grpc (a SelectStream to separate "
                  "dsa-indexer processes) or inprocess (each dsa-attention holds its indexer, "
                  "co-located; the coordinator runs with --colocated) or nccl (selections over "
                  "NCCL between each attention GPU and each indexer GPU; needs --indexer-device "
                  "cuda and a GPU for each side: --attention-cuda-devices, --indexer-cuda-devices)")
      ->check(CLI::IsMember({"grpc", "inprocess", "nccl"}))
      ->capture_default_str();
  cmd->add_option("--attention-workers", options.num_attention_workers, "dsa-attention processes")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--bin-dir", options.bin_dir,
                  "Folder of dsa-indexer, dsa-attention and dsa-coordinator (default: the folder "
                  "of this dsa executable)");
  cmd->add_option("--log-dir", options.log_dir,
                  "Folder for each process's stdout and stderr log (default: a new temp folder)");
  cmd->add_option("--startup-timeout-ms", flags.startup_timeout_ms,
                  "Per process: time to print its address and report readiness")
      ->capture_default_str();
  cmd->add_option("--stop-timeout-ms", flags.stop_timeout_ms,
                  "Per group on stop: time after SIGTERM before SIGKILL")
      ->capture_default_str();
  flags.capacity_blocks_opt = cmd->add_option("--capacity-blocks", flags.capacity_blocks,
                                              "dsa-indexer: index-key cache blocks per indexer");
  flags.audit_fraction_opt =
      cmd->add_option("--audit-fraction", flags.audit_fraction,
                      "dsa-indexer: fraction of pruned selects re-scored densely (miss rate)")
          ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--indexer-device", options.indexer_device,
                  "dsa-indexer: where scan and top-K run, cpu or cuda (a GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--indexer-cuda-devices", options.indexer_cuda_devices,
                  "dsa-indexer with --indexer-device cuda: CUDA ordinals, indexer i on entry "
                  "i mod count (e.g. 0,1)")
      ->delimiter(',')
      ->check(CLI::Range(0, 1023));
  cmd->add_option(
         "--attention-device", options.attention_device,
         "dsa-attention: where the KV cache and sparse attention live, cpu or cuda (a GPU, "
         "in DeepSeek-V3.2's MLA decode shape)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--attention-cuda-devices", options.attention_cuda_devices,
                  "dsa-attention with --attention-device cuda: CUDA ordinals, attention worker i "
                  "on entry i mod count")
      ->delimiter(',')
      ->check(CLI::Range(0, 1023));
  flags.num_heads_opt = cmd->add_option("--num-heads", flags.num_heads,
                                        "Indexer query heads H (dsa-indexer and dsa-attention)");
  flags.head_dim_opt = cmd->add_option("--head-dim", flags.head_dim,
                                       "Index-key dimension D (dsa-indexer and dsa-attention)");
  flags.layer_pattern_opt = cmd->add_option("--layer-pattern", flags.layer_pattern,
                                            "dsa-attention: F/S layer pattern, e.g. FSFSFSFS");
  flags.kv_capacity_slots_opt = cmd->add_option("--kv-capacity-slots", flags.kv_capacity_slots,
                                                "dsa-attention: KV slots over its sequences");
  flags.top_k_opt = cmd->add_option("--top-k", flags.top_k, "dsa-coordinator: selection size K");
  flags.target_block_sparsity_opt =
      cmd->add_option("--target-block-sparsity", flags.target_block_sparsity,
                      "dsa-coordinator: SPIN target block sparsity rho");
  flags.acceptance_rate_opt =
      cmd->add_option("--acceptance-rate", flags.acceptance_rate,
                      "dsa-coordinator: acceptance probability of the seeded draft model");
  flags.seed_opt = cmd->add_option("--seed", flags.seed, "dsa-attention and dsa-coordinator: seed");
  cmd->add_option(
      "--indexer-arg", options.indexer_args,
      "Extra flag for every dsa-indexer (repeat; e.g. --indexer-arg=--audit-seed); with "
      "--transport inprocess, for every co-located indexer under its dsa-attention "
      "name (--audit-seed becomes --indexer-audit-seed)");
  cmd->add_option("--attention-arg", options.attention_args,
                  "Extra flag for every dsa-attention (repeat)");
  cmd->add_option("--coordinator-arg", options.coordinator_args,
                  "Extra flag for dsa-coordinator (repeat)");
}

// Copies the given optional flags into `options`.
void ResolveClusterFlags(const ClusterFlags& flags, dsa::LocalClusterOptions& options) {
  options.startup_timeout = std::chrono::milliseconds(flags.startup_timeout_ms);
  options.stop_timeout = std::chrono::milliseconds(flags.stop_timeout_ms);
  const auto given = [](const CLI::Option* option) { return option->count() > 0; };
  if (given(flags.capacity_blocks_opt)) options.capacity_blocks = flags.capacity_blocks;
  if (given(flags.audit_fraction_opt)) options.audit_fraction = flags.audit_fraction;
  if (given(flags.num_heads_opt)) options.num_heads = flags.num_heads;
  if (given(flags.head_dim_opt)) options.head_dim = flags.head_dim;
  if (given(flags.layer_pattern_opt)) options.layer_pattern = flags.layer_pattern;
  if (given(flags.kv_capacity_slots_opt)) options.kv_capacity_slots = flags.kv_capacity_slots;
  if (given(flags.top_k_opt)) options.top_k = flags.top_k;
  if (given(flags.target_block_sparsity_opt)) {
    options.target_block_sparsity = flags.target_block_sparsity;
  }
  if (given(flags.acceptance_rate_opt)) options.acceptance_rate = flags.acceptance_rate;
  if (given(flags.seed_opt)) options.seed = flags.seed;
}

// Blocks SIGINT and SIGTERM in this thread (and the threads it starts later), so that they are
// taken with sigwait and the cluster is stopped in order rather than orphaned.
sigset_t BlockStopSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

void PrintCluster(const dsa::LocalCluster& cluster) {
  for (const dsa::ClusterProcess& process : cluster.processes()) {
    std::fprintf(stderr, "  %-18s pid %d  grpc %s  metrics %s  log %s\n", process.name.c_str(),
                 static_cast<int>(process.pid), process.address.c_str(),
                 process.metrics_address.c_str(), process.log_path.c_str());
  }
}

// `dsa up`: starts the cluster, prints the coordinator address, waits for SIGINT/SIGTERM, stops
// the cluster. A worker that exits is reported and the cluster goes on (the coordinator moves its
// requests); with `restart`, it is started again at its address after `restart_delay_ms`. The
// coordinator exiting stops the cluster (exit 1).
int RunUp(const dsa::LocalClusterOptions& options, bool restart, int64_t restart_delay_ms) {
  const sigset_t signals = BlockStopSignals();
  auto cluster = dsa::LocalCluster::Start(options);
  if (!cluster.ok()) {
    std::fprintf(stderr, "dsa up: %s\n", cluster.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "dsa up: cluster ready; logs in %s\n", (*cluster)->log_dir().c_str());
  PrintCluster(**cluster);
  std::printf("dsa up: coordinator listening on %s\n", (*cluster)->coordinator_address().c_str());
  std::fflush(stdout);
  int exit_code = 0;
  // Workers that exited, with when they may be started again.
  std::vector<std::pair<size_t, std::chrono::steady_clock::time_point>> to_restart;
  bool stop = false;
  while (!stop) {
    timespec period{0, 200 * 1000 * 1000};
    const int signal_number = sigtimedwait(&signals, nullptr, &period);
    if (signal_number == SIGINT || signal_number == SIGTERM) {
      std::fprintf(stderr, "dsa up: %s, stopping the cluster\n",
                   signal_number == SIGINT ? "SIGINT" : "SIGTERM");
      break;
    }
    for (size_t index : (*cluster)->ReapExited()) {
      const dsa::ClusterProcess& process = (*cluster)->processes()[index];
      if (process.name == "dsa-coordinator") {
        std::fprintf(stderr, "dsa up: dsa-coordinator exited with %d (log %s), stopping\n",
                     process.exit_code, process.log_path.c_str());
        exit_code = 1;
        stop = true;
        break;
      }
      std::fprintf(stderr, "dsa up: %s exited with %d (log %s); the cluster goes on%s\n",
                   process.name.c_str(), process.exit_code, process.log_path.c_str(),
                   restart ? ", restarting it" : "");
      if (restart) {
        to_restart.emplace_back(
            index, std::chrono::steady_clock::now() + std::chrono::milliseconds(restart_delay_ms));
      }
    }
    for (auto it = to_restart.begin(); !stop && it != to_restart.end();) {
      if (std::chrono::steady_clock::now() < it->second) {
        ++it;
        continue;
      }
      const size_t index = it->first;
      it = to_restart.erase(it);
      if (absl::Status restarted = (*cluster)->Restart(index); !restarted.ok()) {
        std::fprintf(stderr, "dsa up: restart failed: %s\n", restarted.ToString().c_str());
        to_restart.emplace_back(
            index, std::chrono::steady_clock::now() + std::chrono::milliseconds(restart_delay_ms));
        break;
      }
      const dsa::ClusterProcess& process = (*cluster)->processes()[index];
      std::fprintf(stderr, "dsa up: %s restarted (pid %d, grpc %s, log %s)\n", process.name.c_str(),
                   static_cast<int>(process.pid), process.address.c_str(),
                   process.log_path.c_str());
    }
  }
  if (absl::Status stopped = (*cluster)->Stop(); !stopped.ok()) {
    // Workers that were killed or died on their own are reported above; their exit codes make
    // the stop unclean.
    std::fprintf(stderr, "dsa up: %s\n", stopped.ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "dsa up: stopped\n");
  return exit_code;
}

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

// `dsa health`: prints the status ("SERVING", "NOT_SERVING", "UNKNOWN", or why the call failed)
// and returns 0 only for SERVING.
int RunHealth(const std::string& target, const std::string& service, int64_t timeout_ms,
              const dsa::ClientSecurity& security) {
  if (service.size() >= 128) {
    std::fprintf(stderr, "dsa health: --service must be under 128 bytes\n");
    return 2;
  }
  auto channel = dsa::NewChannel(target, security);
  const dsa::HealthCheckResult result = dsa::CheckHealth(
      *channel, service, std::chrono::milliseconds(timeout_ms), /*wait_for_ready=*/true);
  if (!result.call.ok()) {
    std::printf("%s \"%s\": check failed: %s (%d)\n", target.c_str(), service.c_str(),
                result.call.error_message().c_str(), static_cast<int>(result.call.error_code()));
    return 1;
  }
  const char* names[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};
  const bool known = result.serving >= 0 && result.serving <= 3;
  std::printf("%s \"%s\": %s\n", target.c_str(), service.c_str(),
              known ? names[result.serving] : "unreadable answer");
  return result.serving == 1 ? 0 : 1;
}

// How a subcommand dials a server: the --tls-* client flags and --token-file.
struct DialFlags {
  dsa::TlsFlags tls;
  std::string token_file;
};

void AddDialFlags(CLI::App* cmd, DialFlags& flags) {
  dsa::AddTlsFlags(*cmd, flags.tls, /*serves=*/false);
  cmd->add_option("--token-file", flags.token_file,
                  "File holding the bearer token to send (authorization: Bearer; needs --tls-ca)")
      ->check(CLI::ExistingFile);
}

// The ClientSecurity of `flags`, or the error printed (prefixed with `command`) and null.
std::optional<dsa::ClientSecurity> DialSecurity(const DialFlags& flags, const char* command) {
  std::string token;
  if (!flags.token_file.empty()) {
    absl::StatusOr<std::string> read = dsa::ReadTokenFile(flags.token_file);
    if (!read.ok()) {
      std::fprintf(stderr, "%s: %s\n", command, std::string(read.status().message()).c_str());
      return std::nullopt;
    }
    token = *read;
  }
  absl::StatusOr<dsa::ClientSecurity> security = dsa::ClientSecurityFrom(flags.tls, token);
  if (!security.ok()) {
    std::fprintf(stderr, "%s: %s\n", command, std::string(security.status().message()).c_str());
    return std::nullopt;
  }
  return *security;
}

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
  // `dsa fit-pattern` (tools/dsa/pattern_fit.h).
  dsa::PatternFitStudyOptions fit;
  std::string fit_json, fit_markdown;
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
  std::vector<std::string> fit_parameters;
  fit_cmd
      ->add_option("--parameters", fit_parameters,
                   "PatternModelConfig fields to fit (default: sink_strength, salient_fraction, "
                   "salient_strength, topic_strength, topic_switch_rate, recency_strength, "
                   "recency_window_slots, key_noise, query_noise, layer_correlation)")
      ->delimiter(',');
  std::string fit_start = "defaults";
  fit_cmd
      ->add_option("--start", fit_start,
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
  fit_cmd->add_option("--json", fit_json, "Write the study as JSON to this file");
  fit_cmd->add_option("--markdown", fit_markdown, "Write the study's tables to this file");

  // The real model's evaluation (tools/dsa/model_eval.h).
  std::string eval_model = dsa::kPatternModel;
  eval_cmd
      ->add_option("--model", eval_model,
                   "pattern (SPIN's miss rate on the synthetic model) or smollm2 (perplexity, "
                   "passkey retrieval and selection statistics of every arm on SmolLM2-135M)")
      ->check(CLI::IsMember({dsa::kPatternModel, dsa::kSmolLM2Model}))
      ->capture_default_str();
  dsa::ModelEvalOptions model_eval;
  bool eval_quick = false;
  eval_cmd->add_flag(
      "--quick", eval_quick,
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
  std::string needles_path;
  eval_cmd->add_option("--needles", needles_path,
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
  std::vector<std::string> arm_filters;
  eval_cmd
      ->add_option("--arms", arm_filters,
                   "--model smollm2: only the arms whose names contain one of these texts "
                   "(comma-separated; e.g. dense,all-keep,spec; the names are the report's)")
      ->delimiter(',');
  bool no_greedy = false;
  eval_cmd->add_flag("--no-greedy", no_greedy,
                     "--model smollm2: skip the perplexity of the dense greedy continuations");
  eval_cmd->add_option("--json", json_path, "Write the results as JSON to this file");
  eval_cmd->add_option("--markdown", markdown_path,
                       "Write the results as a markdown table to this file");

  dsa::LocalClusterOptions up_options;
  ClusterFlags up_flags;
  CLI::App* up_cmd = app.add_subcommand(
      "up",
      "Start dsa-indexer(s), dsa-attention(s) and dsa-coordinator on loopback; stop on SIGINT. A "
      "worker that exits is reported and the cluster goes on (--restart starts it again)");
  AddClusterFlags(up_cmd, up_options, up_flags);
  bool up_restart = false;
  int64_t up_restart_delay_ms = 1000;
  up_cmd->add_flag("--restart", up_restart,
                   "Start a worker that exits again, at its address (the coordinator moves its "
                   "requests meanwhile and takes the new process in)");
  up_cmd
      ->add_option("--restart-delay-ms", up_restart_delay_ms,
                   "How long after a worker exits --restart starts it again")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();

  dsa::ReplayOptions replay;
  dsa::LocalClusterOptions replay_cluster;
  ClusterFlags replay_flags;
  std::string trace_path, replay_json, replay_markdown;
  bool local = false;
  CLI::App* replay_cmd = app.add_subcommand(
      "replay", "Replay a Mooncake (.jsonl) or Azure (.csv) trace against a coordinator");
  replay_cmd->add_option("--trace", trace_path, "Trace file (.jsonl Mooncake, .csv Azure)")
      ->required();
  CLI::Option* coordinator_opt =
      replay_cmd->add_option("--coordinator", replay.coordinator, "Coordinator host:port");
  CLI::Option* local_opt = replay_cmd->add_flag(
      "--local", local, "Bring up a local cluster for the run (see the cluster flags) and stop it");
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
  std::string replay_token_file;
  replay_cmd->add_option("--token-corpus", replay_token_file,
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
  replay_cmd->add_option("--json", replay_json, "Write the report as JSON to this file");
  replay_cmd->add_option("--markdown", replay_markdown,
                         "Write the report as a markdown table to this file");
  AddClusterFlags(replay_cmd, replay_cluster, replay_flags);
  DialFlags replay_dial;
  AddDialFlags(replay_cmd, replay_dial);

  dsa::LocalClusterOptions generate_cluster;
  generate_cluster.model = dsa::kSmolLM2Model;
  ClusterFlags generate_flags;
  GenerateFlags generate;
  CLI::App* generate_cmd = app.add_subcommand(
      "generate",
      "Stream a prompt's generated text from a real model (tokenized in Python by "
      "dsa_client.generate with the model's tokenizer.json); starts a local cluster unless "
      "--coordinator is given");
  AddGenerateFlags(generate_cmd, generate);
  AddClusterFlags(generate_cmd, generate_cluster, generate_flags);
  DialFlags generate_dial;
  AddDialFlags(generate_cmd, generate_dial);

  std::string health_target, health_service = dsa::kReadinessService;
  int64_t health_timeout_ms = 2000;
  CLI::App* health_cmd = app.add_subcommand(
      "health",
      "grpc.health.v1 Check of one service name of a server: exit 0 when SERVING, else 1 (for "
      "probes and helm test)");
  health_cmd->add_option("--target", health_target, "host:port of the server")
      ->required()
      ->check(dsa::HostPortValidator(1, /*allow_empty=*/false));
  health_cmd
      ->add_option("--service", health_service,
                   "Health service name: readiness, liveness, or \"\" (the server as a whole)")
      ->capture_default_str();
  health_cmd
      ->add_option("--timeout-ms", health_timeout_ms,
                   "Deadline of the check, waiting for the server to listen until then")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  DialFlags health_dial;
  AddDialFlags(health_cmd, health_dial);
  app.set_version_flag("--version", std::string("dsa ") + dsa::BuildVersion());

  // CLI11 says only "A subcommand is required" for a misspelt one: name it.
  const std::string first = argc > 1 ? argv[1] : "";
  const auto named_first = [&first](const CLI::App* sub) { return sub->check_name(first); };
  if (!first.empty() && first[0] != '-' &&
      std::as_const(app).get_subcommands(named_first).empty()) {
    std::fprintf(
        stderr,
        "dsa: unknown subcommand '%s' (available: eval, up, replay, generate, health); see dsa "
        "--help\n",
        argv[1]);
    return 106;
  }
  CLI11_PARSE(app, argc, argv);

  if (*health_cmd) {
    const std::optional<dsa::ClientSecurity> security = DialSecurity(health_dial, "dsa health");
    if (!security.has_value()) return 2;
    return RunHealth(health_target, health_service, health_timeout_ms, *security);
  }
  if (*up_cmd) {
    ResolveClusterFlags(up_flags, up_options);
    return RunUp(up_options, up_restart, up_restart_delay_ms);
  }
  if (*replay_cmd) {
    if (!local && replay.coordinator.empty()) {
      std::fprintf(stderr, "dsa replay: give --coordinator ADDR or --local\n");
      return 2;
    }
    ResolveClusterFlags(replay_flags, replay_cluster);
    const std::optional<dsa::ClientSecurity> security = DialSecurity(replay_dial, "dsa replay");
    if (!security.has_value()) return 2;
    replay.security = *security;
    return RunReplayCommand(trace_path, replay, local, replay_cluster, replay_json, replay_markdown,
                            replay_token_file);
  }
  if (*generate_cmd) {
    if (generate_cluster.model != dsa::kSmolLM2Model) {
      std::fprintf(stderr, "dsa generate: the pattern model draws no tokens: --model smollm2\n");
      return 2;
    }
    ResolveClusterFlags(generate_flags, generate_cluster);
    return RunGenerateCommand(generate, generate_cluster, generate_dial);
  }
  if (*fit_cmd) {
    if (!fit_parameters.empty()) {
      fit.fit.parameters.clear();
      for (const std::string& name : fit_parameters) {
        const std::vector<dsa::PatternFitParameter> known = dsa::FittablePatternParameters();
        const auto it =
            std::find_if(known.begin(), known.end(),
                         [&](const dsa::PatternFitParameter& p) { return p.name == name; });
        if (it == known.end()) {
          std::fprintf(stderr, "dsa fit-pattern: --parameters: no fittable field %s\n",
                       name.c_str());
          return 2;
        }
        fit.fit.parameters.push_back(*it);
      }
    }
    if (fit_start == "spin-figure") {
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
    if (!OpenOutput(fit_json, json_out) || !OpenOutput(fit_markdown, markdown_out)) return 1;
    auto study = dsa::RunPatternFitStudy(fit, &PrintProgress);
    if (!study.ok()) {
      std::fprintf(stderr, "dsa fit-pattern: %s\n", study.status().ToString().c_str());
      return 2;
    }
    const std::string markdown = dsa::PatternFitStudyToMarkdown(*study);
    std::cout << markdown;
    return WriteOutput(fit_json, json_out, dsa::PatternFitStudyToJson(*study).dump(2) + "\n") &&
                   WriteOutput(fit_markdown, markdown_out, markdown)
               ? 0
               : 1;
  }
  if (*eval_cmd && eval_model == dsa::kSmolLM2Model) {
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
    if (eval_quick) {
      if (eval_cmd->count("--contexts") == 0) model_eval.contexts = {1024};
      if (eval_cmd->count("--samples") == 0) model_eval.samples = 2;
      if (eval_cmd->count("--continuation") == 0) model_eval.continuation = 32;
      if (eval_cmd->count("--needle-lengths") == 0) model_eval.needle_lengths = {1024};
      model_eval.arms = dsa::QuickModelEvalArms();
    }
    if (!arm_filters.empty()) {
      std::vector<dsa::ModelEvalArm> kept;
      for (const dsa::ModelEvalArm& arm : model_eval.arms) {
        for (const std::string& text : arm_filters) {
          if (arm.name.find(text) != std::string::npos) {
            kept.push_back(arm);
            break;
          }
        }
      }
      model_eval.arms = std::move(kept);
    }
    if (eval_cmd->count("--top-k") > 0) model_eval.top_k = eval.top_k;
    model_eval.seed = eval.seed;
    model_eval.greedy_continuations = !no_greedy;
    model_eval.model_file = RepoFileOr(model_eval.model_file, dsa::kDefaultModelFile);
    model_eval.indexer_weights =
        RepoFileOr(model_eval.indexer_weights, dsa::kDefaultIndexerWeights);
    model_eval.heldout_tokens = RepoFileOr(model_eval.heldout_tokens, dsa::kDefaultHeldoutTokens);
    model_eval.needles_file =
        needles_path == "none" ? "" : RepoFileOr(needles_path, dsa::kDefaultNeedles);
    // The default cases exist only where scripts/model_setup.sh found the essays (../shared): a
    // run without them skips the pass keys, saying so; a file given by name must exist.
    if (needles_path.empty() && !std::filesystem::exists(model_eval.needles_file)) {
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
    if (!CanReplaceOutput(json_path) || !CanReplaceOutput(markdown_path)) return 1;
    std::fprintf(stderr,
                 "dsa eval --model smollm2: %zu arms, contexts %s, %d windows of %d tokens, K %d\n",
                 model_eval.arms.size(), absl::StrJoin(model_eval.contexts, ",").c_str(),
                 model_eval.samples, model_eval.continuation, model_eval.top_k);
    // Every finished cell is written at once: a run stopped by a time limit keeps its cells. A
    // failed checkpoint is said once; the exit status is the final write's.
    const auto write = [&](const dsa::ModelEvalReport& report) {
      return ReplaceOutput(json_path, dsa::ModelEvalReportToJson(report).dump(2) + "\n") &&
             ReplaceOutput(markdown_path, dsa::ModelEvalReportToMarkdown(report));
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
  if (*eval_cmd) {
    for (const char* name :
         {"--quick", "--model-file", "--indexer-weights", "--heldout-tokens", "--needles",
          "--contexts", "--samples", "--continuation", "--needle-lengths", "--no-greedy", "--arms",
          "--device", "--cuda-device"}) {
      if (eval_cmd->count(name) > 0) {
        std::fprintf(stderr, "dsa eval: %s needs --model smollm2\n", name);
        return 2;
      }
    }
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
