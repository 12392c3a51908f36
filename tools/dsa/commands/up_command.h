// `dsa up`: a local cluster of the three servers on loopback until SIGINT or SIGTERM.
#pragma once

#include "CLI/CLI.hpp"
#include "tools/dsa/commands/subcommand.h"

namespace dsa::commands {

/// Adds `up` to `app`. Its run starts the cluster, prints the coordinator address, waits for
/// SIGINT/SIGTERM and stops the cluster; a worker that exits is reported (and with --restart
/// started again), the coordinator exiting stops the cluster (exit 1).
Subcommand AddUpCommand(CLI::App& app);

}  // namespace dsa::commands
