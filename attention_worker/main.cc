// `dsa-attention`: the attention worker binary. Serves dsa.attention.v1.AttentionService (the
// pattern model's layers, the MLI schedule, the KV cache, selections from the indexer workers over
// one gRPC stream each, or from an indexer in this process with --transport inprocess) with
// grpc.health.v1 ("liveness", "readiness"), server reflection, Prometheus /metrics (DESIGN.md
// section 6) and graceful shutdown on SIGTERM or SIGINT. Its parts are chosen by name in
// factory.h; its flags are worker_flags.h's.
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "attention_worker/factory.h"
#include "attention_worker/llama_attention_model.h"
#include "attention_worker/metrics.h"
#include "attention_worker/pattern_attention_model.h"
#include "attention_worker/service.h"
#include "attention_worker/worker_flags.h"
#include "contracts/lease.h"
#include "contracts/limits.h"
#include "prometheus/registry.h"
#include "server/flag_file.h"
#include "server/periodic_task.h"
#include "server/server.h"

namespace {

// Logs `msg` with `status`'s message and returns dsa-attention's exit code for a bad start.
int Fail(const char* msg, const absl::Status& status, bool whole_status = true) {
  dsa::LogJson("error", msg,
               {{"status", whole_status ? status.ToString() : std::string(status.message())}});
  return 2;
}

// Fail's log line, for a factory that returns no model.
std::unique_ptr<dsa::AttentionModel> NoModel(const char* msg, const absl::Status& status) {
  Fail(msg, status);
  return nullptr;
}

// The model (--model) where it runs (--attention-device): the real model over its runner, or the
// pattern model over a KV backend (whose stand-in, if any, *before_serving loads). Null after
// logging why not.
std::unique_ptr<dsa::AttentionModel> CreateModel(const dsa::AttentionWorkerFlags& flags,
                                                 const dsa::MliSchedule& schedule,
                                                 std::shared_ptr<const dsa::LlamaModel> llama,
                                                 std::function<std::string()>* before_serving) {
  const char* device_failed =
      flags.attention_device == "cuda" ? "cannot use the attention GPU" : "bad model config";
  if (llama != nullptr) {
    auto runner = dsa::MakeLlamaRunner(dsa::LlamaRunnerConfigFromFlags(flags), std::move(llama));
    if (!runner.ok()) return NoModel(device_failed, runner.status());
    auto model = dsa::LlamaAttentionModel::Create(*std::move(runner), schedule.full_layers(),
                                                  dsa::kSmolLM2ModelName);
    if (!model.ok()) return NoModel("bad model config", model.status());
    return *std::move(model);
  }
  auto pattern = dsa::PatternModelFromFlags(flags, schedule);
  if (!pattern.ok()) return NoModel("bad model config", pattern.status());
  auto backend =
      dsa::MakeAttentionBackend(dsa::BackendConfigFromFlags(flags, schedule), before_serving);
  if (!backend.ok()) return NoModel(device_failed, backend.status());
  auto model = dsa::PatternAttentionModel::Create(*std::move(pattern), *std::move(backend));
  if (!model.ok()) return NoModel("bad model config", model.status());
  return *std::move(model);
}

// The "serving" log line's fields beyond the server's own.
nlohmann::json BannerFields(const dsa::AttentionWorkerFlags& flags,
                            const dsa::AttentionEngine& engine, const dsa::LlamaModel* llama,
                            const dsa::ColocatedIndexer* colocated, bool dials_with_tls) {
  const bool cuda = flags.attention_device == "cuda";
  const dsa::ModelShape& shape = engine.model().shape();
  nlohmann::json fields = {
      {"layer_pattern", engine.schedule().Pattern()},
      {"lag_depth", flags.lag_depth},
      {"num_heads", shape.num_heads},
      {"head_dim", shape.head_dim},
      {"model", shape.name},
      {"kv_dim", llama != nullptr ? llama->config().kv_dim()
                 : cuda           ? 576
                                  : flags.options.kv_dim},
      {"attention_heads", llama != nullptr ? llama->config().num_heads
                                           : engine.model().output_values_per_row() /
                                                 (cuda ? 512 : flags.options.kv_dim)},
      {"kv_capacity_slots", flags.options.engine.kv_capacity_slots},
      {"transport", flags.transport},
      {"device_selects", flags.options.engine.device_selects},
      {"layer_standin", flags.layer_standin},
      {"attention_device", engine.model().Description()},
      {"indexer_workers", flags.indexer_workers},
      {"indexer_dns", flags.indexer_dns},
      {"dials_with_tls", dials_with_tls}};
  if (colocated != nullptr) {
    fields["indexer_capacity_blocks"] = colocated->capacity_blocks();
    fields["indexer_device"] = colocated->indexer().DeviceDescription();
  }
  return fields;
}

}  // namespace

int main(int argc, char** argv) {  // NOLINT(bugprone-exception-escape): CLI11 parse errors
                                   // are caught by ParseServerFlags; others end the process.
  CLI::App app{
      "dsa-attention: the DSA attention worker (pattern model, KV cache, MLI schedule, sparse "
      "attention over the indexer workers' selections) over gRPC"};
  dsa::ServerFlags server_flags = dsa::DefaultServerFlags(dsa::ServerComponent::kAttention);
  dsa::AddServerFlags(app, server_flags);
  dsa::AttentionWorkerFlags flags;
  dsa::AddAttentionWorkerFlags(app, flags);
  dsa::AddFlagSources(app, "dsa-attention");
  if (const int exit_code = dsa::ParseServerFlags(app, argc, argv); exit_code >= 0) {
    return exit_code;
  }
  if (absl::Status checked = dsa::CheckAttentionWorkerFlags(flags); !checked.ok()) {
    return Fail("bad config", checked, /*whole_status=*/false);
  }
  // The real model's files, read before the schedule: its layers come from their metadata.
  std::shared_ptr<const dsa::LlamaModel> llama;
  if (flags.model_name != "pattern") {
    auto loaded = dsa::LlamaModel::Load(flags.model_file, flags.indexer_weights);
    if (!loaded.ok()) return Fail("cannot load the model", loaded.status());
    llama = *std::move(loaded);
    dsa::ApplyLlamaDefaults(*llama, flags);
  }
  absl::StatusOr<dsa::ClientSecurity> security = dsa::ClientSecurityFrom(server_flags.tls);
  if (!security.ok()) {
    std::fprintf(stderr, "%s\n", std::string(security.status().message()).c_str());
    return 2;
  }
  dsa::BlockTerminationSignals();
  absl::StatusOr<dsa::MliSchedule> schedule = dsa::ScheduleFromFlags(flags);
  if (!schedule.ok()) return Fail("bad model config", schedule.status());

  std::function<std::string()> before_serving;  // ServerSpec::before_serving
  std::unique_ptr<dsa::AttentionModel> model =
      CreateModel(flags, *schedule, llama, &before_serving);
  if (model == nullptr) return 2;
  auto registry = std::make_shared<prometheus::Registry>();
  dsa::AttentionMetrics metrics(*registry, schedule->num_layers());
  std::unique_ptr<dsa::ColocatedIndexer> colocated;  // --transport inprocess
  if (flags.transport == "inprocess") {
    auto created = dsa::ColocatedIndexer::Create(flags.indexer, model->shape().num_heads,
                                                 model->shape().head_dim, *registry);
    if (!created.ok()) return Fail("cannot create the co-located indexer", created.status());
    colocated = *std::move(created);
  }
  dsa::IndexerTransportConfig transport =
      dsa::TransportConfigFromFlags(flags, *security, model->shape());
  transport.colocated = colocated.get();
  absl::StatusOr<dsa::IndexerClientFactory> indexer_clients = dsa::MakeIndexerClients(transport);
  if (!indexer_clients.ok()) {
    return Fail("bad config", indexer_clients.status(), /*whole_status=*/false);
  }
  auto engine =
      dsa::AttentionEngine::Create(*schedule, std::move(model), *std::move(indexer_clients),
                                   dsa::EngineOptionsFromFlags(flags), &metrics);
  if (!engine.ok()) return Fail("bad model config", engine.status());
  auto service = std::make_unique<dsa::AttentionServiceImpl>(*std::move(engine));

  dsa::ServerSpec spec;
  spec.name = "dsa-attention";
  spec.component = dsa::ServerComponent::kAttention;
  spec.services = {service.get()};
  if (colocated != nullptr) {
    service->ShareIndexerWith(&colocated->service());
    spec.services.push_back(&colocated->service());
    spec.on_serving = [&colocated](const std::string& address) {
      colocated->SetOwnAddress(address);
    };
  }
  spec.registry = registry;
  spec.max_receive_message_bytes = dsa::kMaxReceiveMessageBytes;
  spec.banner_fields =
      BannerFields(flags, service->engine(), llama.get(), colocated.get(), security->tls());
  spec.on_stopped = [&service] { service->CloseTransports(); };
  spec.before_serving = before_serving;
  const dsa::PeriodicTask lease_sweep(dsa::kLeaseSweepPeriod, [&service, &colocated] {
    service->ReleaseExpiredLeases();
    if (colocated != nullptr) colocated->service().ReleaseExpiredLeases();
  });
  return dsa::RunServer(server_flags, spec);
}
