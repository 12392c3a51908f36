// `dsa generate`: a prompt's text streamed from a real model through a coordinator, given or
// brought up locally for the prompt; the tokenizing client is the Python one
// (tools/dsa/generate.h).
#pragma once

#include "CLI/CLI.hpp"
#include "tools/dsa/commands/subcommand.h"

namespace dsa::commands {

/// Adds `generate` to `app`. Its run starts a local cluster unless --coordinator is given, runs
/// dsa_client.generate against it and stops the cluster. The exit status is the Python side's
/// (0: the text came; 1: the request failed), 2 for a usage or startup error.
Subcommand AddGenerateCommand(CLI::App& app);

}  // namespace dsa::commands
