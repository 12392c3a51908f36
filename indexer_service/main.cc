// `dsa-indexer`: the indexer worker binary. Serves dsa.indexer.v1.IndexerService over one
// dsa::Indexer (scoring on the CPU, or with --device cuda on a GPU), with grpc.health.v1
// ("liveness", "readiness"), server reflection, Prometheus /metrics (DESIGN.md section 6) and
// graceful shutdown on SIGTERM or SIGINT (readiness NOT_SERVING for --drain-delay-ms, then
// Shutdown: new calls refused, in-flight ones cancelled after --shutdown-grace-ms).
#include <cstdint>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "indexer_service/grpc_service.h"
#include "indexer_service/indexer.h"
#include "indexer_service/metrics.h"
#include "prometheus/registry.h"
#include "server/server.h"
#ifdef DSA_WITH_CUDA
#include "indexer_service/cuda/cuda_scoring_device.h"
#endif

int main(int argc, char** argv) {  // NOLINT(bugprone-exception-escape): CLI11 parse errors
                                   // are caught by CLI11_PARSE; others end the process.
  CLI::App app{
      "dsa-indexer: the DSA lightning-indexer worker (paged index-key cache, SPIN, top-K) over "
      "gRPC"};
  dsa::ServerFlags server_flags;
  dsa::AddServerFlags(app, server_flags);
  dsa::IndexerOptions options;
  options.capacity_blocks = 4096;
  app.add_option("--capacity-blocks", options.capacity_blocks,
                 "Index-key cache size in 64-slot blocks, shared by all sequences and layers")
      ->capture_default_str();
  app.add_option("--num-heads", options.num_heads, "Indexer query heads H")->capture_default_str();
  app.add_option("--head-dim", options.head_dim, "Index-key and query dimension D")
      ->capture_default_str();
  app.add_option("--audit-fraction", options.audit_fraction,
                 "Fraction of pruned selects re-scored densely to export dsa_indexer_miss_rate")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--audit-seed", options.audit_seed, "Seed of the audit draws")
      ->capture_default_str();
  std::string device = "cpu";
  app.add_option("--device", device,
                 "Where scan and top-K run: cpu, or cuda (a GPU mirrors the index-key cache; the "
                 "host copy stays, so a GPU failure falls back to the CPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  int cuda_device = 0;
  app.add_option("--cuda-device", cuda_device, "CUDA ordinal of the GPU (--device cuda)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  std::string scan_kernel = "auto";
  app.add_option("--scan-kernel", scan_kernel,
                 "GPU scan: auto (tensor cores where H is 16/32/64 and D 64/128), tensor-cores "
                 "(bf16 queries) or cuda-cores (fp32 queries)")
      ->check(CLI::IsMember({"auto", "tensor-cores", "cuda-cores"}))
      ->capture_default_str();
  bool gpu_spin = true;
  app.add_option("--gpu-spin", gpu_spin,
                 "--device cuda: run SPIN on the GPU too (V and D resident there) where the "
                 "sequence's settings allow; false plans on the CPU")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  dsa::BlockTerminationSignals();
  if (device == "cpu") {
    for (const char* gpu_flag : {"--cuda-device", "--scan-kernel", "--gpu-spin"}) {
      if (app.count(gpu_flag) > 0) {
        dsa::LogJson("error", "a GPU flag without --device cuda", {{"flag", gpu_flag}});
        return 2;
      }
    }
  }

  std::unique_ptr<dsa::ScoringDevice> scoring_device;
  if (device == "cuda") {
#ifdef DSA_WITH_CUDA
    dsa::cuda::CudaScoringOptions cuda_options;
    cuda_options.device = cuda_device;
    cuda_options.spin = gpu_spin;
    if (auto s = dsa::cuda::ParseScanKernel(scan_kernel, &cuda_options.scan_kernel); !s.ok()) {
      dsa::LogJson("error", "bad --scan-kernel", {{"status", s.ToString()}});
      return 2;
    }
    auto created = dsa::cuda::CreateCudaScoringDevice(cuda_options);
    if (!created.ok()) {
      dsa::LogJson("error", "cannot use the GPU", {{"status", created.status().ToString()}});
      return 2;
    }
    scoring_device = std::move(*created);
#else
    dsa::LogJson("error",
                 "--device cuda: this dsa-indexer was built without CUDA "
                 "(configure with -DDSA_ENABLE_CUDA=ON where nvcc is installed)");
    return 2;
#endif
  }
  auto indexer =
      dsa::Indexer::Create(options, std::move(scoring_device), [](const absl::Status& status) {
        dsa::LogJson("error", "the GPU failed; scoring on the CPU from now on",
                     {{"status", status.ToString()}});
      });
  if (!indexer.ok()) {
    dsa::LogJson("error", "cannot create the indexer", {{"status", indexer.status().ToString()}});
    return 2;
  }
  auto registry = std::make_shared<prometheus::Registry>();
  dsa::IndexerMetrics metrics(*registry);
  metrics.SetCacheUsage((*indexer)->Usage());
  dsa::IndexerServiceImpl service(indexer->get(), &metrics);

  dsa::ServerSpec spec;
  spec.name = "dsa-indexer";
  spec.services = {&service};
  spec.registry = registry;
  spec.max_receive_message_bytes = dsa::kMaxReceiveMessageBytes;
  spec.banner_fields = {{"capacity_blocks", options.capacity_blocks},
                        {"num_heads", options.num_heads},
                        {"head_dim", options.head_dim},
                        {"audit_fraction", options.audit_fraction},
                        {"device", (*indexer)->DeviceDescription()}};
  return dsa::RunServer(server_flags, spec);
}
