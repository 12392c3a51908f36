// How a `dsa` subcommand dials a server: the --tls-* client flags and --token-file, shared by
// `dsa replay`, `dsa generate` and `dsa health`.
#pragma once

#include <optional>
#include <string>

#include "CLI/CLI.hpp"
#include "server/security.h"

namespace dsa::commands {

/// How a subcommand dials a server: the --tls-* client flags and --token-file.
struct DialFlags {
  dsa::TlsFlags tls;
  std::string token_file;
};

/// Adds the --tls-* client flags and --token-file to `cmd`, writing into `flags` (which must
/// outlive the parse).
void AddDialFlags(CLI::App* cmd, DialFlags& flags);

/// The ClientSecurity of `flags`, or the error printed (prefixed with `command`) and null.
std::optional<dsa::ClientSecurity> DialSecurity(const DialFlags& flags, const char* command);

}  // namespace dsa::commands
