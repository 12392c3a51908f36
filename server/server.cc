#include "server/server.h"

#include <pthread.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <thread>

#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "prometheus/exposer.h"

namespace dsa {

void AddServerFlags(CLI::App& app, ServerFlags& flags) {
  app.add_option("--listen", flags.listen,
                 "host:port to serve on; port 0 picks a free one (the bound address is printed)")
      ->capture_default_str();
  app.add_option(
         "--metrics-listen", flags.metrics_listen,
         "host:port of the Prometheus /metrics endpoint; port 0 picks a free one (printed); "
         "empty = no endpoint")
      ->capture_default_str();
  app.add_option("--shutdown-grace-ms", flags.shutdown_grace_ms,
                 "On SIGTERM: how long in-flight calls may run before they are cancelled")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--drain-delay-ms", flags.drain_delay_ms,
                 "On SIGTERM: how long readiness reports NOT_SERVING while calls are still taken, "
                 "so load balancers stop routing here before the server stops")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
}

void LogJson(const char* level, const char* msg, nlohmann::json fields) {
  fields["ts"] =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  fields["level"] = level;
  fields["msg"] = msg;
  const std::string line = fields.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

std::string AddressWithPort(const std::string& address, int port) {
  const size_t colon = address.rfind(':');
  const std::string host = colon == std::string::npos ? address : address.substr(0, colon);
  return host + ":" + std::to_string(port);
}

namespace {

sigset_t TerminationSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  return signals;
}

}  // namespace

void BlockTerminationSignals() {
  const sigset_t signals = TerminationSignals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
}

int RunServer(const ServerFlags& flags, const ServerSpec& spec) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  std::unique_ptr<prometheus::Exposer> exposer;
  if (!flags.metrics_listen.empty()) {
    try {  // prometheus-cpp reports a bind failure by throwing
      exposer = std::make_unique<prometheus::Exposer>(flags.metrics_listen, 1);
    } catch (const std::exception& e) {
      LogJson("error", "cannot serve metrics",
              {{"address", flags.metrics_listen}, {"error", e.what()}});
      return 1;
    }
    if (spec.registry != nullptr) {
      exposer->RegisterCollectable(spec.registry);
    }
  }
  if (spec.before_serving) {
    if (const std::string error = spec.before_serving(); !error.empty()) {
      LogJson("error", "cannot start serving", {{"error", error}});
      return 1;
    }
  }
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(flags.listen, grpc::InsecureServerCredentials(), &port);
  for (grpc::Service* service : spec.services) {
    builder.RegisterService(service);
  }
  builder.SetMaxReceiveMessageSize(spec.max_receive_message_bytes);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    LogJson("error", "cannot listen", {{"address", flags.listen}});
    return 1;
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  if (health == nullptr) {
    LogJson("error", "no health check service");
    return 1;
  }
  const std::string address = AddressWithPort(flags.listen, port);
  if (spec.on_serving) spec.on_serving(address);

  health->SetServingStatus(kLivenessService, true);
  health->SetServingStatus(kReadinessService, true);
  std::printf("%s: listening on %s\n", spec.name.c_str(), address.c_str());
  nlohmann::json fields = spec.banner_fields;
  fields["address"] = address;
  if (exposer != nullptr && !exposer->GetListeningPorts().empty()) {
    const std::string metrics_address =
        AddressWithPort(flags.metrics_listen, exposer->GetListeningPorts().front());
    std::printf("%s: metrics on http://%s/metrics\n", spec.name.c_str(), metrics_address.c_str());
    fields["metrics_address"] = metrics_address;
  }
  std::fflush(stdout);
  LogJson("info", "serving", fields);

  const sigset_t signals = TerminationSignals();
  int signal_number = 0;
  sigwait(&signals, &signal_number);
  LogJson("info", "draining",
          {{"signal", signal_number == SIGTERM ? "SIGTERM" : "SIGINT"},
           {"drain_delay_ms", flags.drain_delay_ms},
           {"shutdown_grace_ms", flags.shutdown_grace_ms}});
  health->SetServingStatus(kReadinessService, false);
  if (spec.on_drain) {
    spec.on_drain();
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(flags.drain_delay_ms));
  server->Shutdown(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(flags.shutdown_grace_ms));
  server->Wait();
  if (spec.on_stopped) {
    spec.on_stopped();
  }
  LogJson("info", "stopped");
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(0);
}

}  // namespace dsa
