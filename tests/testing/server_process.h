// Helpers for tests that run the server binaries as real processes on loopback: start one and
// read the addresses it prints, wait for its exit, and probe grpc.health.v1, reflection and
// /metrics without generated stubs.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"

namespace dsa::testing {

/// A started server process and the addresses it printed.
struct Process {
  pid_t pid = -1;
  std::string address;          // gRPC, host:port ("" if none was printed)
  std::string metrics_address;  // /metrics, host:port ("" if none was printed)
  std::string health_address;   // --health-listen's, host:port (read only when flags have it)
};

/// Spawns `binary` with `flags` (after --listen 127.0.0.1:0 and --metrics-listen 127.0.0.1:0 where
/// `flags` has no such flag), stdout piped; reads the first two stdout lines
/// ("NAME: listening on HOST:PORT", "NAME: metrics on http://HOST:PORT/metrics"), and a third
/// ("NAME: health on HOST:PORT") when `flags` has --health-listen.
Process StartServer(const std::string& binary, const std::vector<std::string>& flags);

/// Waits up to `timeout` for the process to exit; its exit code (128 + signal if killed by one),
/// or -1 on timeout (then it is killed).
int WaitExit(pid_t pid, std::chrono::milliseconds timeout);

/// Calls `done` every `poll` of real time for up to `timeout` (for a state of real processes that
/// nothing announces); whether it became true.
bool WaitFor(const std::function<bool()>& done, std::chrono::milliseconds timeout,
             std::chrono::milliseconds poll);

/// grpc.health.v1.Health/Check of `service`: 1 SERVING, 2 NOT_SERVING, 0 UNKNOWN, -1 call failed.
int HealthStatus(const std::shared_ptr<grpc::Channel>& channel, const std::string& service);

/// grpc.health.v1.Health/Watch of `service`: reads the statuses the server sends (the current
/// one, then each change) until one is `until` or `timeout` passes; the last status read (1
/// SERVING, 2 NOT_SERVING, 0 UNKNOWN, 3 SERVICE_UNKNOWN), -1 when none was. Waits for the change
/// itself rather than polling Check.
int WatchHealthUntil(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                     int until, std::chrono::milliseconds timeout);

/// The raw bytes of a grpc.reflection.v1alpha list_services answer (holds the service names).
std::string ReflectionListServices(const std::shared_ptr<grpc::Channel>& channel);

/// GET http://address/metrics over a plain socket; the whole response, headers included.
std::string HttpGetMetrics(const std::string& address);

}  // namespace dsa::testing
