// `dsa fit-pattern`: the synthetic pattern model fitted to the trained indexer's index-score
// statistics on held-out text (tools/dsa/pattern_fit.h).
#pragma once

#include "CLI/CLI.hpp"
#include "tools/dsa/commands/subcommand.h"

namespace dsa::commands {

/// Adds `fit-pattern` to `app`. Its run fits, prints the study's tables and writes --json and
/// --markdown; the exit status is 0, 1 when an output could not be written, 2 for a usage error
/// or a failed study.
Subcommand AddFitPatternCommand(CLI::App& app);

}  // namespace dsa::commands
