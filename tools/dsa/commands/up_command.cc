// `dsa up` (up_command.h).
#include "tools/dsa/commands/up_command.h"

#include <signal.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "tools/dsa/cluster.h"
#include "tools/dsa/commands/cluster_flags.h"

namespace dsa::commands {
namespace {

// `dsa up`: starts the cluster, prints the coordinator address, waits for SIGINT/SIGTERM, stops
// the cluster. A worker that exits is reported and the cluster goes on (the coordinator moves its
// requests); with `restart`, it is started again at its address after `restart_delay_ms`. So is
// the coordinator, at its address and under its --name (its requests in flight end with it; the
// workers free what it held at its new instance's first check); without `restart` the coordinator
// exiting stops the cluster (exit 1).
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
      if (process.name == "dsa-coordinator" && !restart) {
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

// `dsa up`'s flags.
struct UpFlags {
  dsa::LocalClusterOptions options;
  ClusterFlags cluster;
  bool restart = false;
  int64_t restart_delay_ms = 1000;
};

}  // namespace

Subcommand AddUpCommand(CLI::App& app) {
  auto flags = std::make_shared<UpFlags>();
  CLI::App* up_cmd = app.add_subcommand(
      "up",
      "Start dsa-indexer(s), dsa-attention(s) and dsa-coordinator on loopback; stop on SIGINT. A "
      "worker that exits is reported and the cluster goes on (--restart starts it, or the "
      "coordinator, again)");
  AddClusterFlags(up_cmd, flags->options, flags->cluster);
  up_cmd->add_flag("--restart", flags->restart,
                   "Start a process that exits again, at its address: a worker (the coordinator "
                   "moves its requests meanwhile and takes the new process in) or the coordinator "
                   "(same --name: the workers free what the dead one held at once)");
  up_cmd
      ->add_option("--restart-delay-ms", flags->restart_delay_ms,
                   "How long after a process exits --restart starts it again")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();

  return {up_cmd, [flags] {
            ResolveClusterFlags(flags->cluster, flags->options);
            return RunUp(flags->options, flags->restart, flags->restart_delay_ms);
          }};
}

}  // namespace dsa::commands
