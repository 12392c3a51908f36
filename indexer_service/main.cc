// `dsa-indexer`: the indexer worker binary. Serves dsa.indexer.v1.IndexerService over one
// dsa::Indexer (CPU backend), with grpc.health.v1 ("liveness", "readiness"), server reflection,
// Prometheus /metrics (DESIGN.md section 6) and graceful shutdown on SIGTERM or SIGINT (readiness
// NOT_SERVING for --drain-delay-ms, then Shutdown: new calls refused, in-flight ones cancelled
// after --shutdown-grace-ms).
#include <pthread.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <thread>

#include "CLI/CLI.hpp"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "indexer_service/grpc_service.h"
#include "indexer_service/indexer.h"
#include "indexer_service/metrics.h"
#include "nlohmann/json.hpp"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"

namespace {

constexpr char kLiveness[] = "liveness";
constexpr char kReadiness[] = "readiness";

// One structured log line on stderr: {"ts": unix seconds, "level", "msg", fields...}.
void Log(const char* level, const char* msg, nlohmann::json fields = nlohmann::json::object()) {
  fields["ts"] =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  fields["level"] = level;
  fields["msg"] = msg;
  // Invalid UTF-8 (a flag value, a library's message) is replaced, never thrown on.
  const std::string line = fields.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

// "host:port" with the port replaced by `port` (the bound one when the flag asked for port 0).
std::string WithPort(const std::string& address, int port) {
  const size_t colon = address.rfind(':');
  const std::string host = colon == std::string::npos ? address : address.substr(0, colon);
  return host + ":" + std::to_string(port);
}

}  // namespace

int main(int argc, char** argv) {  // NOLINT(bugprone-exception-escape): CLI11 parse errors
                                   // are caught by CLI11_PARSE; others end the process.
  CLI::App app{
      "dsa-indexer: the DSA lightning-indexer worker (paged index-key cache, SPIN, top-K) over "
      "gRPC"};
  std::string listen = "127.0.0.1:0";
  dsa::IndexerOptions options;
  options.capacity_blocks = 4096;
  int64_t shutdown_grace_ms = 5000;
  int64_t drain_delay_ms = 0;
  std::string metrics_listen = "127.0.0.1:0";
  app.add_option("--listen", listen,
                 "host:port to serve on; port 0 picks a free one (the bound address is printed)")
      ->capture_default_str();
  app.add_option("--capacity-blocks", options.capacity_blocks,
                 "Index-key cache size in 64-slot blocks, shared by all sequences and layers")
      ->capture_default_str();
  app.add_option("--num-heads", options.num_heads, "Indexer query heads H")->capture_default_str();
  app.add_option("--audit-fraction", options.audit_fraction,
                 "Fraction of pruned selects re-scored densely to export dsa_indexer_miss_rate")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--audit-seed", options.audit_seed, "Seed of the audit draws")
      ->capture_default_str();
  app.add_option("--head-dim", options.head_dim, "Index-key and query dimension D")
      ->capture_default_str();
  app.add_option("--shutdown-grace-ms", shutdown_grace_ms,
                 "On SIGTERM: how long in-flight calls may run before they are cancelled")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--drain-delay-ms", drain_delay_ms,
                 "On SIGTERM: how long readiness reports NOT_SERVING while calls are still taken, "
                 "so load balancers stop routing here before the server stops")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option(
         "--metrics-listen", metrics_listen,
         "host:port of the Prometheus /metrics endpoint; port 0 picks a free one (printed); "
         "empty = no endpoint")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  auto indexer = dsa::Indexer::Create(options);
  if (!indexer.ok()) {
    Log("error", "cannot create the indexer", {{"status", indexer.status().ToString()}});
    return 2;
  }

  // SIGTERM and SIGINT are taken by sigwait below: block them before gRPC starts its threads, so
  // every thread inherits the mask and none is interrupted.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  auto registry = std::make_shared<prometheus::Registry>();
  dsa::IndexerMetrics metrics(*registry);
  metrics.SetCacheUsage((*indexer)->Usage());
  std::unique_ptr<prometheus::Exposer> exposer;
  if (!metrics_listen.empty()) {
    try {  // prometheus-cpp reports a bind failure by throwing
      exposer = std::make_unique<prometheus::Exposer>(metrics_listen, 1);
    } catch (const std::exception& e) {
      Log("error", "cannot serve metrics", {{"address", metrics_listen}, {"error", e.what()}});
      return 1;
    }
    exposer->RegisterCollectable(registry);
  }
  dsa::IndexerServiceImpl service(indexer->get(), &metrics);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(dsa::kMaxReceiveMessageBytes);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    Log("error", "cannot listen", {{"address", listen}});
    return 1;
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  if (health == nullptr) {
    Log("error", "no health check service");
    return 1;
  }
  health->SetServingStatus(kLiveness, true);
  health->SetServingStatus(kReadiness, true);
  std::printf("dsa-indexer: listening on %s (capacity %lld blocks, H=%d, D=%d)\n",
              WithPort(listen, port).c_str(), static_cast<long long>(options.capacity_blocks),
              options.num_heads, options.head_dim);
  if (exposer != nullptr && !exposer->GetListeningPorts().empty()) {
    std::printf("dsa-indexer: metrics on http://%s/metrics\n",
                WithPort(metrics_listen, exposer->GetListeningPorts().front()).c_str());
  }
  std::fflush(stdout);
  Log("info", "serving",
      {{"address", WithPort(listen, port)},
       {"capacity_blocks", options.capacity_blocks},
       {"num_heads", options.num_heads},
       {"head_dim", options.head_dim}});

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  Log("info", "draining",
      {{"signal", signal_number == SIGTERM ? "SIGTERM" : "SIGINT"},
       {"drain_delay_ms", drain_delay_ms},
       {"shutdown_grace_ms", shutdown_grace_ms}});
  health->SetServingStatus(kReadiness, false);
  std::this_thread::sleep_for(std::chrono::milliseconds(drain_delay_ms));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(shutdown_grace_ms));
  server->Wait();
  Log("info", "stopped");
  std::fflush(stdout);
  std::fflush(stderr);
  // Exit now: stopping the /metrics server (civetweb) takes over a second, which would push the
  // exit past a short grace period, and nothing is left to release that the process exit does not.
  std::_Exit(0);
}
