// `dsa health`: a grpc.health.v1 Check of one service name of a server, for probes and helm test.
#pragma once

#include "CLI/CLI.hpp"
#include "tools/dsa/commands/subcommand.h"

namespace dsa::commands {

/// Adds `health` to `app`. Its run prints the status ("SERVING", "NOT_SERVING", "UNKNOWN", or why
/// the call failed) and returns 0 only for SERVING, 2 for a usage error.
Subcommand AddHealthCommand(CLI::App& app);

}  // namespace dsa::commands
