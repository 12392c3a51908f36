// `dsa health` (health_command.h).
#include "tools/dsa/commands/health_command.h"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/health_check.h"
#include "server/server.h"
#include "tools/dsa/commands/dial_flags.h"

namespace dsa::commands {
namespace {

// Why a check that waited for the server timed out, when the connection itself kept failing: the
// last connection error (a call that does not wait for the connection reports it), and what a
// connection that ends during the handshake usually means. "" when that is not the case.
std::string WhyNotConnected(grpc::Channel& channel, const std::string& service,
                            const grpc::Status& call, const dsa::ClientSecurity& security) {
  if (call.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED ||
      channel.GetState(/*try_to_connect=*/false) != GRPC_CHANNEL_TRANSIENT_FAILURE) {
    return "";
  }
  const dsa::HealthCheckResult now =
      dsa::CheckHealth(channel, service, std::chrono::seconds(1), /*wait_for_ready=*/false);
  if (now.call.ok() || now.call.error_code() != grpc::StatusCode::UNAVAILABLE) return "";
  const std::string& error = now.call.error_message();
  std::string hint;
  if (absl::StrContains(error, "Connection refused")) {
    hint = " (nothing listens at that port)";
  } else if (security.tls() && absl::StrContains(error, "andshake")) {
    hint = " (is the port plaintext, or its certificate not signed by --tls-ca for this name?)";
  } else if (!security.tls() &&
             (absl::StrContains(error, "Socket closed") || absl::StrContains(error, "reset"))) {
    hint =
        " (dialed in plaintext: a TLS port ends such a connection in its handshake; pass "
        "--tls-ca)";
  }
  return absl::StrCat("; the connection kept failing: ", error, hint);
}

// `dsa health`: prints the status ("SERVING", "NOT_SERVING", "UNKNOWN", or why the call failed)
// and returns 0 only for SERVING.
int RunHealth(const std::string& target, const std::string& service, int64_t timeout_ms,
              const dsa::ClientSecurity& security) {
  if (service.size() >= 128) {
    std::fprintf(stderr, "dsa health: --service must be under 128 bytes\n");
    return 2;
  }
  auto channel = dsa::NewChannel(target, security);
  const dsa::HealthCheckResult result = dsa::CheckHealth(
      *channel, service, std::chrono::milliseconds(timeout_ms), /*wait_for_ready=*/true);
  if (!result.call.ok()) {
    std::printf("%s \"%s\": check failed: %s (%d)%s\n", target.c_str(), service.c_str(),
                result.call.error_message().c_str(), static_cast<int>(result.call.error_code()),
                WhyNotConnected(*channel, service, result.call, security).c_str());
    return 1;
  }
  const char* names[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};
  const bool known = result.serving >= 0 && result.serving <= 3;
  std::printf("%s \"%s\": %s\n", target.c_str(), service.c_str(),
              known ? names[result.serving] : "unreadable answer");
  return result.serving == 1 ? 0 : 1;
}

// `dsa health`'s flags.
struct HealthFlags {
  std::string target, service = dsa::kReadinessService;
  int64_t timeout_ms = 2000;
  DialFlags dial;
};

}  // namespace

Subcommand AddHealthCommand(CLI::App& app) {
  auto flags = std::make_shared<HealthFlags>();
  CLI::App* health_cmd = app.add_subcommand(
      "health",
      "grpc.health.v1 Check of one service name of a server: exit 0 when SERVING, else 1 (for "
      "probes and helm test)");
  health_cmd->add_option("--target", flags->target, "host:port of the server")
      ->required()
      ->check(dsa::HostPortValidator(1, /*allow_empty=*/false));
  health_cmd
      ->add_option("--service", flags->service,
                   "Health service name: readiness, liveness, or \"\" (the server as a whole)")
      ->capture_default_str();
  health_cmd
      ->add_option("--timeout-ms", flags->timeout_ms,
                   "Deadline of the check, waiting for the server to listen until then")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  AddDialFlags(health_cmd, flags->dial);
  return {health_cmd, [flags] {
            const std::optional<dsa::ClientSecurity> security =
                DialSecurity(flags->dial, "dsa health");
            if (!security.has_value()) return 2;
            return RunHealth(flags->target, flags->service, flags->timeout_ms, *security);
          }};
}

}  // namespace dsa::commands
