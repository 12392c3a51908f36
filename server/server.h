// What every dsa server binary shares (DESIGN.md section 5): the common flags, JSON logs
// on stderr, grpc.health.v1 with the "liveness" and "readiness" names, server reflection, the
// Prometheus /metrics endpoint and the SIGTERM drain.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "common/host_port.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "prometheus/registry.h"
#include "server/log.h"
#include "server/security.h"
#include "server/version.h"

namespace dsa {

/// Health service names (grpc.health.v1): liveness is SERVING from start to exit; readiness is
/// SERVING while the server can do its job (ServerSpec::watch_readiness) until a drain begins; the
/// unnamed service "" always equals readiness.
inline constexpr char kLivenessService[] = "liveness";
inline constexpr char kReadinessService[] = "readiness";

/// Which server a binary is: names its default ports (docs/deploy.md, "Flags every server
/// takes") and its `component` label of dsa_build_info.
enum class ServerComponent { kCoordinator, kIndexer, kAttention };

/// Default gRPC and /metrics ports, one pair a component (so the three can share one host).
inline constexpr int kCoordinatorPort = 50051;
inline constexpr int kIndexerPort = 50052;
inline constexpr int kAttentionPort = 50053;
inline constexpr int kCoordinatorMetricsPort = 9401;
inline constexpr int kIndexerMetricsPort = 9402;
inline constexpr int kAttentionMetricsPort = 9403;

/// Flags every server binary takes.
struct ServerFlags {
  std::string listen;                // gRPC host:port; port 0 = a free one (printed)
  std::string metrics_listen;        // /metrics host:port; empty (or "none" on the flag) = none
  int64_t shutdown_grace_ms = 5000;  // in-flight calls may run this long after the drain delay
  int64_t drain_delay_ms = 0;        // readiness NOT_SERVING this long before Shutdown
  std::string log_level = "info";    // debug | info | warn | error (SetLogLevel)
  TlsFlags tls;                      // --tls-*: TLS / mutual TLS of the gRPC port and dialing
  std::string health_listen;         // plaintext grpc.health.v1-only host:port; "" = none
};

/// `component`'s defaults: listen on every interface at its fixed ports
/// (0.0.0.0:kCoordinatorPort and 0.0.0.0:kCoordinatorMetricsPort for the coordinator, ...).
ServerFlags DefaultServerFlags(ServerComponent component);

/// Registers --listen, --metrics-listen, --shutdown-grace-ms, --drain-delay-ms, --log-level,
/// --health-listen and the --tls-* flags (AddTlsFlags) on `app`, writing into `flags` (which must
/// outlive the parse). The addresses are checked by HostPortValidator (metrics and health may be
/// empty); --log-level takes effect as it is parsed.
void AddServerFlags(CLI::App& app, ServerFlags& flags);

/// ParseHostPort as a CLI11 validator (its error message is the status's); with `allow_empty`,
/// "" passes too.
CLI::Validator HostPortValidator(int min_port, bool allow_empty);

/// Call after every option of `app` is added, before parsing: every option `--some-name` also
/// reads the environment variable DSA_SOME_NAME (a list option splits it at commas); `--config
/// FILE` (or DSA_CONFIG) reads options from a TOML file (`some-name = value`, lists as
/// `["a", "b"]`); `--version` prints "<binary> <BuildVersion()>" and exits 0. Precedence: the
/// command line, then the config file, then the environment, then the default. A DSA_CONFIG or
/// --config file that does not exist, or a key in it that is no flag, fails the parse, naming it.
void AddFlagSources(CLI::App& app, const std::string& binary);

/// "host:port" with the port replaced by `port`.
std::string AddressWithPort(const std::string& address, int port);

/// Blocks SIGTERM and SIGINT in the calling thread, so that every thread started afterwards
/// inherits the mask and RunServer's sigwait receives them. Call first thing in main, before any
/// gRPC channel, server or thread exists.
void BlockTerminationSignals();

/// What RunServer serves.
struct ServerSpec {
  std::string name;  // binary name, e.g. "dsa-attention" (logs, banner)
  ServerComponent component = ServerComponent::kIndexer;  // dsa_build_info's component label
  std::vector<grpc::Service*> services;                   // not owned; outlive RunServer
  std::shared_ptr<prometheus::Registry> registry;         // exposed on /metrics; may be null
  int max_receive_message_bytes = 4 << 20;  // grpc::ServerBuilder::SetMaxReceiveMessageSize
  nlohmann::json banner_fields = nlohmann::json::object();  // added to the "serving" log line
  /// Called once when a drain begins (readiness already NOT_SERVING), before the drain delay:
  /// stop admitting work here. May be empty.
  std::function<void()> on_drain;
  /// Called once with the bound gRPC address (host:port) after the server started, before
  /// readiness turns SERVING. May be empty.
  std::function<void(const std::string& address)> on_serving;
  /// Called once /metrics serves, before the gRPC server starts (so no call can come before it
  /// ends): for what may only be loaded once /metrics' threads exist (dsa-attention's cuBLAS
  /// stand-in). A non-empty return is an error: logged, and RunServer returns 1. May be empty.
  std::function<std::string()> before_serving;
  /// Readiness beyond the drain, for a server that depends on others (the coordinator on its
  /// workers). When set, it is called once before serving with a function that the engine may
  /// call from any thread, at any time until exit, with whether it can do its job; "readiness"
  /// and "" are SERVING while the last value given is true and no drain has begun, and start
  /// NOT_SERVING. When empty, both are SERVING from start until the drain.
  std::function<void(std::function<void(bool ready)> set_ready)> watch_readiness;
  /// Bearer tokens every call on the gRPC port must carry (the coordinator's
  /// --auth-tokens-file); null = none. Needs flags.tls's certificate: RunServer refuses to
  /// start with tokens on a plaintext port.
  std::shared_ptr<grpc::AuthMetadataProcessor> auth;
  /// Called after the gRPC server has stopped (all calls finished or cancelled), before exit:
  /// release clients and threads here. May be empty.
  std::function<void()> on_stopped;
};

/// Adds a listening port at `address` to `builder` with SO_REUSEPORT off (`*port` is set by
/// BuildAndStart: the bound port, 0 when it could not bind). gRPC turns SO_REUSEPORT on by
/// default, so a second server started on a port in use would share it silently and half of the
/// new connections would reach the wrong server; with it off, that server fails to start.
void ListenExclusively(grpc::ServerBuilder& builder, const std::string& address,
                       const std::shared_ptr<grpc::ServerCredentials>& credentials, int* port);

/// Builds and starts the gRPC server (TLS or mutual TLS as flags.tls says; with spec.auth's
/// tokens) with health ("liveness"; "readiness" and "" as
/// watch_readiness says) and reflection, serves /metrics (spec.registry, dsa_build_info and
/// ProcessMetrics), prints "<name>: listening on HOST:PORT" and "<name>: metrics on
/// http://.../metrics" on stdout, then waits for SIGTERM or SIGINT (BlockTerminationSignals must
/// have run). On the signal: readiness NOT_SERVING, on_drain, drain_delay_ms of still taking calls,
/// Shutdown with a deadline of shutdown_grace_ms (new calls refused, in-flight calls cancelled at
/// the deadline), on_stopped, then the process exits with 0 through std::_Exit (stopping the
/// /metrics server would take over a second). Returns only on a startup failure, with exit code 1
/// after logging why (cannot listen, cannot serve metrics, unreadable TLS files, tokens without
/// TLS). With flags.health_listen, a second, plaintext server there serves grpc.health.v1 with
/// the same statuses, and no dsa service (kubelet's gRPC probes speak no TLS; gRPC's reflection
/// registers itself there too and lists only health).
int RunServer(const ServerFlags& flags, const ServerSpec& spec);

}  // namespace dsa
