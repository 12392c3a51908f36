// `dsa replay`: a Mooncake (.jsonl) or Azure (.csv) production trace against a coordinator, given
// or brought up locally for the run.
#pragma once

#include "CLI/CLI.hpp"
#include "tools/dsa/commands/subcommand.h"

namespace dsa::commands {

/// Adds `replay` to `app`. Its run reads and caps the trace, brings up a local cluster if asked,
/// replays and reports; the exit status is 0 only when every request completed (1 when some
/// failed or a signal stopped the run, 2 for a usage, input or startup error).
Subcommand AddReplayCommand(CLI::App& app);

}  // namespace dsa::commands
