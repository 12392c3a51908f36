// `dsa eval`: SPIN's quality against all-keep, on the synthetic pattern model (tools/dsa/eval.h)
// or on SmolLM2-135M with its trained indexers (tools/dsa/model_eval.h).
#pragma once

#include "CLI/CLI.hpp"
#include "tools/dsa/commands/subcommand.h"

namespace dsa::commands {

/// Adds `eval` to `app`. Its run refuses the other model's flags, evaluates, prints the markdown
/// report and writes --json and --markdown; the exit status is 0, 1 when an output could not be
/// written, 2 for a usage error or a failed evaluation.
Subcommand AddEvalCommand(CLI::App& app);

}  // namespace dsa::commands
