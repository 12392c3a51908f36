// `dsa-indexer`: the indexer worker binary. Serves dsa.indexer.v1.IndexerService over one
// dsa::Indexer (scoring on the CPU, or with --device cuda on a GPU), with grpc.health.v1
// ("liveness", "readiness"), server reflection, Prometheus /metrics (DESIGN.md section 6) and
// graceful shutdown on SIGTERM or SIGINT (readiness NOT_SERVING for --drain-delay-ms, then
// Shutdown: new calls refused, in-flight ones cancelled after --shutdown-grace-ms).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "indexer_service/grpc_service.h"
#include "indexer_service/indexer.h"
#include "indexer_service/indexer_flags.h"
#include "indexer_service/metrics.h"
#include "prometheus/registry.h"
#include "server/flag_file.h"
#include "server/periodic_task.h"
#include "server/server.h"
#ifdef DSA_WITH_NCCL
#include "transport/nccl_server.h"
#endif

int main(int argc, char** argv) {  // NOLINT(bugprone-exception-escape): CLI11 parse errors
                                   // are caught by ParseServerFlags; others end the process.
  CLI::App app{
      "dsa-indexer: the DSA lightning-indexer worker (paged index-key cache, SPIN, top-K) over "
      "gRPC"};
  dsa::ServerFlags server_flags = dsa::DefaultServerFlags(dsa::ServerComponent::kIndexer);
  dsa::AddServerFlags(app, server_flags);
  dsa::IndexerFlags flags;
  flags.options.capacity_blocks = 4096;
  dsa::AddIndexerFlags(app, flags, "--", /*with_shape_flags=*/true);
  std::vector<std::string> operator_identities;
  app.add_option("--operator-identities", operator_identities,
                 "Caller identities (client certificates' common names, mutual TLS) that may "
                 "act on any sequence, not only those they created: the coordinator's")
      ->delimiter(',')
      ->check(CLI::Validator(
          [](const std::string& name) {
            return name.empty() ? std::string("an empty identity (anonymous callers share \"\")")
                                : std::string();
          },
          "NAME"));
  dsa::AddFlagSources(app, "dsa-indexer");
  if (const int exit_code = dsa::ParseServerFlags(app, argc, argv); exit_code >= 0) {
    return exit_code;
  }
  dsa::BlockTerminationSignals();
  const dsa::IndexerOptions& options = flags.options;
  auto indexer = dsa::CreateIndexerFromFlags(flags);
  if (!indexer.ok()) {
    dsa::LogJson("error", "cannot create the indexer", {{"status", indexer.status().ToString()}});
    return 2;
  }
  auto registry = std::make_shared<prometheus::Registry>();
  dsa::IndexerMetrics metrics(*registry);
  metrics.SetCacheUsage((*indexer)->Usage());
  metrics.SetMissTarget(options.miss_target);
  dsa::IndexerServiceImpl service(indexer->get(), &metrics, operator_identities);
#ifdef DSA_WITH_NCCL
  // OpenDataPlane: NCCL data planes need the GPU (transport/README.md).
  std::unique_ptr<dsa::NcclDataPlanes> data_planes;
  if (flags.device == "cuda") {
    dsa::NcclDataPlaneOptions plane_options;
    plane_options.link.cuda_device = flags.cuda_device;
    data_planes = std::make_unique<dsa::NcclDataPlanes>(**indexer, &metrics, plane_options);
    service.SetDataPlaneOpener(data_planes->Opener());
  } else {
    service.SetDataPlaneOpener([](const dsa::indexer::v1::OpenDataPlaneRequest&,
                                  const dsa::DataPlaneCaller&,
                                  dsa::indexer::v1::OpenDataPlaneResponse*) {
      return absl::FailedPreconditionError(
          "OpenDataPlane: this dsa-indexer was started without --device cuda");
    });
  }
#endif

  dsa::ServerSpec spec;
  spec.name = "dsa-indexer";
  spec.component = dsa::ServerComponent::kIndexer;
  spec.services = {&service};
  spec.registry = registry;
  spec.max_receive_message_bytes = dsa::kMaxReceiveMessageBytes;
  spec.banner_fields = {{"capacity_blocks", options.capacity_blocks},
                        {"num_heads", options.num_heads},
                        {"head_dim", options.head_dim},
                        {"audit_fraction", options.audit_fraction},
                        {"device", (*indexer)->DeviceDescription()}};
  const dsa::PeriodicTask lease_sweep(dsa::kLeaseSweepPeriod,
                                      [&service] { service.ReleaseExpiredLeases(); });
  return dsa::RunServer(server_flags, spec);
}
