#include "server/server.h"

#include <pthread.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "prometheus/exposer.h"
#include "prometheus/gauge.h"
#include "server/flag_file.h"
#include "server/parse_errors.h"
#include "server/process_metrics.h"
#include "server/request_log.h"

namespace dsa {

ServerFlags DefaultServerFlags(ServerComponent component) {
  ServerFlags flags;
  int port = kIndexerPort;
  int metrics_port = kIndexerMetricsPort;
  if (component == ServerComponent::kCoordinator) {
    port = kCoordinatorPort;
    metrics_port = kCoordinatorMetricsPort;
  } else if (component == ServerComponent::kAttention) {
    port = kAttentionPort;
    metrics_port = kAttentionMetricsPort;
  }
  flags.listen = absl::StrCat("0.0.0.0:", port);
  flags.metrics_listen = absl::StrCat("0.0.0.0:", metrics_port);
  return flags;
}

CLI::Validator HostPortValidator(int min_port, bool allow_empty) {
  return CLI::Validator(
      [min_port, allow_empty](const std::string& address) -> std::string {
        if (address.empty() && allow_empty) return "";
        absl::StatusOr<HostPort> parsed = ParseHostPort(address, min_port);
        return parsed.ok() ? "" : std::string(parsed.status().message());
      },
      "HOST:PORT");
}

namespace {

// Why a server may fail to bind: gRPC's builder reports no cause.
constexpr char kCannotListen[] =
    "the port is in use (by another server: reuse-port is off), or the host is not this "
    "machine's";

// --metrics-listen: "none", made "" (so that DSA_METRICS_LISTEN, which CLI11 ignores when empty,
// can turn the endpoint off), or host:port without brackets: prometheus-cpp's civetweb here has no
// IPv6.
constexpr char kNoMetricsEndpoint[] = "none";

CLI::Validator MetricsAddressValidator() {
  const CLI::Validator host_port = HostPortValidator(0, /*allow_empty=*/true);
  return CLI::Validator(
      [host_port](std::string& address) -> std::string {
        if (address == kNoMetricsEndpoint) {
          address.clear();
          return "";
        }
        if (!address.empty() && address.front() == '[') {
          return absl::StrCat(address,
                              ": the /metrics endpoint takes IPv4 addresses or names only");
        }
        return host_port(address);
      },
      "HOST:PORT|none");
}

}  // namespace

void AddServerFlags(CLI::App& app, ServerFlags& flags) {
  app.add_option("--listen", flags.listen,
                 "host:port to serve on; port 0 picks a free one (the bound address is printed)")
      ->check(HostPortValidator(0, /*allow_empty=*/false))
      ->capture_default_str();
  app.add_option(
         "--metrics-listen", flags.metrics_listen,
         "host:port (IPv4 or a name) of the Prometheus /metrics endpoint; port 0 picks a free one "
         "(printed); empty or \"none\" = no endpoint")
      ->transform(MetricsAddressValidator())
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
  app.add_option("--log-level", flags.log_level, "Lowest level of the JSON log lines on stderr")
      ->check(CLI::IsMember({"debug", "info", "warn", "error"}))
      ->each([](const std::string& level) { SetLogLevel(level); })
      ->capture_default_str();
  app.add_option("--health-listen", flags.health_listen,
                 "host:port of a second, plaintext port serving only grpc.health.v1 (for "
                 "kubelet's gRPC probes, which speak no TLS); empty = none")
      ->check(HostPortValidator(0, /*allow_empty=*/true));
  AddTlsFlags(app, flags.tls, /*serves=*/true);
}

void AddFlagSources(CLI::App& app, const std::string& binary) {
  const char* config_from_env = std::getenv("DSA_CONFIG");
  const bool env_config = config_from_env != nullptr && config_from_env[0] != '\0';
  app.set_config("--config", env_config ? config_from_env : "",
                 "A TOML file of flags (name = value, one a line, '-' or '_' in names; lists as "
                 "[\"a\", \"b\"]); the command line overrides it (env: DSA_CONFIG)",
                 /*config_required=*/env_config);
  app.allow_config_extras(false);  // a misspelt key in the file is an error, not ignored
  app.config_formatter(std::make_shared<TomlFlagFile>(&app));
  app.set_version_flag("--version", absl::StrCat(binary, " ", BuildVersion()));
  for (CLI::Option* option : app.get_options()) {
    const std::vector<std::string>& names = option->get_lnames();
    if (names.empty() || names.front() == "help" || names.front() == "version" ||
        names.front() == "config") {
      continue;
    }
    std::string env = "DSA_" + names.front();
    for (char& c : env) c = c == '-' ? '_' : static_cast<char>(std::toupper(c));
    option->envname(env);
    if (option->get_items_expected_max() > 1) option->delimiter(',');
  }
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

const char* ComponentName(ServerComponent component) {
  switch (component) {
    case ServerComponent::kCoordinator:
      return "coordinator";
    case ServerComponent::kIndexer:
      return "indexer";
    case ServerComponent::kAttention:
      return "attention";
  }
  return "unknown";
}

// "readiness" and "" of the health service: SERVING while the engine says it is ready and no
// drain has begun. Thread-safe; outlives RunServer's callers through shared ownership.
class Readiness {
 public:
  Readiness(std::vector<grpc::HealthCheckServiceInterface*> health, bool ready)
      : health_(std::move(health)), ready_(ready) {
    absl::MutexLock lock(&mu_);
    ApplyLocked();
  }
  void SetReady(bool ready) {
    absl::MutexLock lock(&mu_);
    if (ready == ready_) return;
    ready_ = ready;
    LogJson(ready ? "info" : "warn", ready ? "ready" : "not ready");
    ApplyLocked();
  }
  void StartDrain() {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    ApplyLocked();
  }

 private:
  void ApplyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const bool serving = ready_ && !draining_;
    // The unnamed service first: a client that reads readiness's new status then finds the same
    // on "" (the two cannot change at once, and the other order let a drain show readiness
    // NOT_SERVING beside "" still SERVING).
    for (grpc::HealthCheckServiceInterface* health : health_) {
      health->SetServingStatus("", serving);
      health->SetServingStatus(kReadinessService, serving);
    }
  }

  const std::vector<grpc::HealthCheckServiceInterface*> health_;
  absl::Mutex mu_;
  bool ready_ ABSL_GUARDED_BY(mu_);
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

void BlockTerminationSignals() {
  const sigset_t signals = TerminationSignals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
}

void ListenExclusively(grpc::ServerBuilder& builder, const std::string& address,
                       const std::shared_ptr<grpc::ServerCredentials>& credentials, int* port) {
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(address, credentials, port);
}

int RunServer(const ServerFlags& flags, const ServerSpec& spec) {
  grpc::EnableDefaultHealthCheckService(true);
  // The plaintext health port: a server of its own with the same statuses. It serves
  // grpc.health.v1 and no dsa service; gRPC's reflection plugin registers itself on every server
  // of a process that links it (a static initializer), so reflection answers there too.
  std::unique_ptr<grpc::Server> health_server;
  int health_port = 0;
  if (!flags.health_listen.empty()) {
    grpc::ServerBuilder health_builder;
    ListenExclusively(health_builder, flags.health_listen, grpc::InsecureServerCredentials(),
                      &health_port);
    health_server = health_builder.BuildAndStart();
    if (health_server == nullptr || health_port == 0) {
      LogJson("error", "cannot listen",
              {{"address", flags.health_listen}, {"reason", kCannotListen}});
      return 1;
    }
    health_server->GetHealthCheckService()->SetServingStatus("", false);  // until Readiness
  }
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  std::unique_ptr<prometheus::Exposer> exposer;
  if (!flags.metrics_listen.empty()) {
    try {  // prometheus-cpp reports a bind failure by throwing
      exposer = std::make_unique<prometheus::Exposer>(flags.metrics_listen, 1);
    } catch (const std::exception& e) {
      // prometheus-cpp's civetweb says "null context when constructing CivetServer" for any
      // failure to bind: name the likely causes as --listen's failure does.
      LogJson("error", "cannot listen",
              {{"address", flags.metrics_listen},
               {"flag", "--metrics-listen"},
               {"reason", kCannotListen},
               {"error", e.what()}});
      return 1;
    }
    if (spec.registry != nullptr) {
      exposer->RegisterCollectable(spec.registry);
    }
  }
  // The exposer holds collectables weakly: this one lives as long as RunServer (until exit).
  const auto process_metrics = std::make_shared<ProcessMetrics>();
  if (exposer != nullptr) exposer->RegisterCollectable(process_metrics);
  if (spec.registry != nullptr) {
    prometheus::BuildGauge()
        .Name("dsa_build_info")
        .Help("1, labelled with the server's component and the version it was built from")
        .Register(*spec.registry)
        .Add({{"component", ComponentName(spec.component)}, {"version", BuildVersion()}})
        .Set(1);
  }
  if (spec.before_serving) {
    if (const std::string error = spec.before_serving(); !error.empty()) {
      LogJson("error", "cannot start serving", {{"error", error}});
      return 1;
    }
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      ServerCredentialsFrom(flags.tls);
  if (!credentials.ok()) {
    LogJson("error", "cannot set up TLS", {{"status", credentials.status().ToString()}});
    return 1;
  }
  if (spec.auth != nullptr) {
    if (flags.tls.cert_file.empty()) {
      LogJson("error", "bearer tokens need TLS",
              {{"status",
                "--auth-tokens-file needs --tls-cert and --tls-key: tokens would cross "
                "the network in plaintext (and gRPC checks them only on a TLS port)"}});
      return 1;
    }
    (*credentials)->SetAuthMetadataProcessor(spec.auth);
  }
  grpc::ServerBuilder builder;
  int port = 0;
  ListenExclusively(builder, flags.listen, *credentials, &port);
  for (grpc::Service* service : spec.services) {
    builder.RegisterService(service);
  }
  builder.SetMaxReceiveMessageSize(spec.max_receive_message_bytes);
  {
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> more;
    more.push_back(NewRequestLogInterceptorFactory());
    AddServerInterceptors(builder, std::move(more));
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    LogJson("error", "cannot listen", {{"address", flags.listen}, {"reason", kCannotListen}});
    return 1;
  }
  std::vector<grpc::HealthCheckServiceInterface*> health;
  for (grpc::Server* each : {server.get(), health_server.get()}) {
    if (each == nullptr) continue;
    health.push_back(each->GetHealthCheckService());
    if (health.back() == nullptr) {
      LogJson("error", "no health check service");
      return 1;
    }
    health.back()->SetServingStatus(kLivenessService, true);
  }
  const std::string address = AddressWithPort(flags.listen, port);
  if (spec.on_serving) spec.on_serving(address);

  auto readiness = std::make_shared<Readiness>(health, !spec.watch_readiness);
  if (spec.watch_readiness) {
    spec.watch_readiness([readiness](bool ready) { readiness->SetReady(ready); });
  }
  std::printf("%s: listening on %s\n", spec.name.c_str(), address.c_str());
  nlohmann::json fields = spec.banner_fields;
  fields["address"] = address;
  fields["tls"] = flags.tls.cert_file.empty()        ? "off"
                  : flags.tls.client_ca_file.empty() ? "tls"
                                                     : "mutual";
  fields["bearer_tokens"] = spec.auth != nullptr;
  if (exposer != nullptr && !exposer->GetListeningPorts().empty()) {
    const std::string metrics_address =
        AddressWithPort(flags.metrics_listen, exposer->GetListeningPorts().front());
    std::printf("%s: metrics on http://%s/metrics\n", spec.name.c_str(), metrics_address.c_str());
    fields["metrics_address"] = metrics_address;
  }
  if (health_server != nullptr) {
    const std::string health_address = AddressWithPort(flags.health_listen, health_port);
    std::printf("%s: health on %s\n", spec.name.c_str(), health_address.c_str());
    fields["health_address"] = health_address;
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
  readiness->StartDrain();
  if (spec.on_drain) {
    spec.on_drain();
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(flags.drain_delay_ms));
  server->Shutdown(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(flags.shutdown_grace_ms));
  server->Wait();
  if (health_server != nullptr) health_server->Shutdown(std::chrono::system_clock::now());
  if (spec.on_stopped) {
    spec.on_stopped();
  }
  LogJson("info", "stopped");
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(0);
}

}  // namespace dsa
