// One `dsa` subcommand as main.cc sees it: the CLI11 subcommand its Add...Command registered, and
// what runs it once the command line chose it.
#pragma once

#include <functional>

#include "CLI/CLI.hpp"

namespace dsa::commands {

/// A subcommand registered on the `dsa` app. The flags it parses into are owned by `run`, so they
/// live as long as it does.
struct Subcommand {
  /// The subcommand, owned by the app it was added to; true once the parse chose it.
  CLI::App* app = nullptr;
  /// Runs the subcommand after a successful parse that chose `app`; returns the exit status.
  std::function<int()> run;
};

}  // namespace dsa::commands
