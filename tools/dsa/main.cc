// `dsa`: the project's command-line tool. Subcommands: `eval` (SPIN quality against all-keep),
// `fit-pattern` (the pattern model fitted to the trained indexer), `up` (a local cluster of the
// three servers), `replay` (a production trace against a coordinator), `generate` (a prompt's
// streamed text from a real model) and `health`; each lives in tools/dsa/commands/.
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "server/version.h"
#include "tools/dsa/commands/eval_command.h"
#include "tools/dsa/commands/fit_pattern_command.h"
#include "tools/dsa/commands/generate_command.h"
#include "tools/dsa/commands/health_command.h"
#include "tools/dsa/commands/replay_command.h"
#include "tools/dsa/commands/subcommand.h"
#include "tools/dsa/commands/up_command.h"

int main(int argc, char** argv) {  // NOLINT(bugprone-exception-escape): CLI11 parse errors
                                   // are caught by CLI11_PARSE; others end the process.
  CLI::App app{"dsa: tools for the DSA lightning-indexer service"};
  app.require_subcommand(1);
  // In the order --help lists them.
  const std::vector<dsa::commands::Subcommand> subcommands = {
      dsa::commands::AddEvalCommand(app),     dsa::commands::AddFitPatternCommand(app),
      dsa::commands::AddUpCommand(app),       dsa::commands::AddReplayCommand(app),
      dsa::commands::AddGenerateCommand(app), dsa::commands::AddHealthCommand(app)};
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

  for (const dsa::commands::Subcommand& subcommand : subcommands) {
    if (*subcommand.app) return subcommand.run();
  }
  return 0;
}
