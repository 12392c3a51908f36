// How a `dsa` subcommand dials a server (dial_flags.h).
#include "tools/dsa/commands/dial_flags.h"

#include <cstdio>

#include "absl/status/statusor.h"

namespace dsa::commands {

void AddDialFlags(CLI::App* cmd, DialFlags& flags) {
  dsa::AddTlsFlags(*cmd, flags.tls, /*serves=*/false);
  cmd->add_option("--token-file", flags.token_file,
                  "File holding the bearer token to send (authorization: Bearer; needs --tls-ca)")
      ->check(CLI::ExistingFile);
}

std::optional<dsa::ClientSecurity> DialSecurity(const DialFlags& flags, const char* command) {
  std::string token;
  if (!flags.token_file.empty()) {
    absl::StatusOr<std::string> read = dsa::ReadTokenFile(flags.token_file);
    if (!read.ok()) {
      std::fprintf(stderr, "%s: %s\n", command, std::string(read.status().message()).c_str());
      return std::nullopt;
    }
    token = *read;
  }
  absl::StatusOr<dsa::ClientSecurity> security = dsa::ClientSecurityFrom(flags.tls, token);
  if (!security.ok()) {
    std::fprintf(stderr, "%s: %s\n", command, std::string(security.status().message()).c_str());
    return std::nullopt;
  }
  return *security;
}

}  // namespace dsa::commands
