// The local cluster's flags and console (cluster_flags.h).
#include "tools/dsa/commands/cluster_flags.h"

#include <chrono>
#include <cstdio>

namespace dsa::commands {

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

}  // namespace dsa::commands
