// What every dsa server binary shares (issue 3, DESIGN.md section 5): the common flags, JSON logs
// on stderr, grpc.health.v1 with the "liveness" and "readiness" names, server reflection, the
// Prometheus /metrics endpoint and the SIGTERM drain.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "prometheus/registry.h"

namespace dsa {

/// Health service names (grpc.health.v1): liveness is SERVING from start to exit; readiness is
/// SERVING from start until a drain begins.
inline constexpr char kLivenessService[] = "liveness";
inline constexpr char kReadinessService[] = "readiness";

/// Flags every server binary takes.
struct ServerFlags {
  std::string listen = "127.0.0.1:0";          // gRPC address; port 0 = a free one (printed)
  std::string metrics_listen = "127.0.0.1:0";  // /metrics address; empty = none
  int64_t shutdown_grace_ms = 5000;  // in-flight calls may run this long after the drain delay
  int64_t drain_delay_ms = 0;        // readiness NOT_SERVING this long before Shutdown
};

/// Registers --listen, --metrics-listen, --shutdown-grace-ms and --drain-delay-ms on `app`,
/// writing into `flags` (which must outlive the parse).
void AddServerFlags(CLI::App& app, ServerFlags& flags);

/// One structured log line on stderr: {"ts": unix seconds, "level", "msg", fields...}. Invalid
/// UTF-8 in a field is replaced, never thrown on. Thread-safe (one fprintf per line).
void LogJson(const char* level, const char* msg, nlohmann::json fields = nlohmann::json::object());

/// "host:port" with the port replaced by `port`.
std::string AddressWithPort(const std::string& address, int port);

/// Blocks SIGTERM and SIGINT in the calling thread, so that every thread started afterwards
/// inherits the mask and RunServer's sigwait receives them. Call first thing in main, before any
/// gRPC channel, server or thread exists.
void BlockTerminationSignals();

/// What RunServer serves.
struct ServerSpec {
  std::string name;                      // binary name, e.g. "dsa-attention" (logs, banner)
  std::vector<grpc::Service*> services;  // not owned; outlive RunServer
  std::shared_ptr<prometheus::Registry> registry;  // exposed on /metrics; may be null
  int max_receive_message_bytes = 4 << 20;         // grpc::ServerBuilder::SetMaxReceiveMessageSize
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
  /// Called after the gRPC server has stopped (all calls finished or cancelled), before exit:
  /// release clients and threads here. May be empty.
  std::function<void()> on_stopped;
};

/// Builds and starts the gRPC server with health (both names SERVING) and reflection, serves
/// /metrics, prints "<name>: listening on HOST:PORT" and "<name>: metrics on http://.../metrics"
/// on stdout, then waits for SIGTERM or SIGINT (BlockTerminationSignals must have run). On the
/// signal: readiness NOT_SERVING, on_drain, drain_delay_ms of still taking calls, Shutdown with a
/// deadline of shutdown_grace_ms (new calls refused, in-flight calls cancelled at the deadline),
/// on_stopped, then the process exits with 0 through std::_Exit (stopping the /metrics server
/// would take over a second). Returns only on a startup failure, with exit code 1 after logging
/// why (cannot listen, cannot serve metrics).
int RunServer(const ServerFlags& flags, const ServerSpec& spec);

}  // namespace dsa
