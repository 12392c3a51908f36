// The local cluster's flags, shared by `dsa up`, `dsa replay --local` and `dsa generate`, and how
// those subcommands hold the stop signals and print the cluster's processes.
#pragma once

#include <signal.h>

#include <cstdint>
#include <string>

#include "CLI/CLI.hpp"
#include "tools/dsa/cluster.h"

namespace dsa::commands {

/// The cluster flags shared by `dsa up` and `dsa replay --local`; optional ones are passed on to
/// the binaries only when given.
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

/// Adds the cluster flags to `cmd`, writing into `options` and `flags` (which must outlive the
/// parse).
void AddClusterFlags(CLI::App* cmd, dsa::LocalClusterOptions& options, ClusterFlags& flags);

/// Copies the given optional flags into `options`.
void ResolveClusterFlags(const ClusterFlags& flags, dsa::LocalClusterOptions& options);

/// Blocks SIGINT and SIGTERM in this thread (and the threads it starts later), so that they are
/// taken with sigwait and the cluster is stopped in order rather than orphaned.
sigset_t BlockStopSignals();

/// Prints each process of `cluster` (name, pid, addresses, log) on stderr.
void PrintCluster(const dsa::LocalCluster& cluster);

}  // namespace dsa::commands
