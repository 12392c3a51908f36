// The attention worker's parts chosen by name (see factory.h).
#include "attention_worker/factory.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attention_worker/cpu_attention_backend.h"
#include "server/log.h"
#include "transport/grpc_indexer_client.h"
#include "transport/in_process_indexer_client.h"
#ifdef DSA_WITH_CUDA
#include "attention_worker/cuda/cuda_attention_backend.h"
#include "attention_worker/cuda/llama_cuda_runner.h"
#include "attention_worker/cuda/standin_loader.h"
#endif
#ifdef DSA_WITH_NCCL
#include <cuda_runtime_api.h>
#include <unistd.h>

#include "transport/nccl_indexer_client.h"
#endif

namespace dsa {
namespace {

#ifdef DSA_WITH_CUDA
// The stand-in, shared by the backend's rest_of_layer and the before_serving that loads it.
struct StandinSlot {
  std::unique_ptr<cuda::LoadedLayerStandin> owner;
  std::atomic<const cuda::LoadedLayerStandin*> loaded{nullptr};
};

absl::StatusOr<std::unique_ptr<AttentionBackend>> MakeCudaAttentionBackend(
    const AttentionBackendConfig& config, std::function<std::string()>* before_serving) {
  cuda::CudaAttentionBackendOptions options;
  options.device = config.cuda_device;
  options.num_model_layers = config.num_model_layers;
  options.num_heads = config.attention_heads;
  options.seed = config.seed;
  options.capacity_slots = config.capacity_slots;
  if (config.standin.enabled) {
    // The stand-in comes in once /metrics runs, before the gRPC server starts (before_serving),
    // so every layer finds it.
    auto slot = std::make_shared<StandinSlot>();
    const int max_rows = config.standin.max_rows;
    options.rest_of_layer = [slot, max_rows](void* stream, int rows) -> cudaError_t {
      const cuda::LoadedLayerStandin* standin = slot->loaded.load(std::memory_order_acquire);
      if (standin == nullptr) return cudaErrorNotReady;
      // A step of more rows than the stand-in was sized for reads the same weights once.
      return standin->Run(stream, std::min(rows, max_rows));
    };
    *before_serving = [slot, device = config.cuda_device,
                       standin = config.standin]() -> std::string {
      DsaLayerStandinConfig standin_config{};
      standin_config.device = device;
      standin_config.weight_bytes_per_layer = standin.weight_bytes;
      standin_config.busy_micros = standin.busy_us;
      standin_config.max_rows = standin.max_rows;
      standin_config.seed = standin.seed;
      auto loaded = cuda::LoadedLayerStandin::Load(
          cuda::ExecutableDirectory() + cuda::kLayerStandinModuleName, standin_config);
      if (!loaded.ok()) return loaded.status().ToString();
      slot->owner = *std::move(loaded);
      slot->loaded.store(slot->owner.get(), std::memory_order_release);
      return "";
    };
  }
  return cuda::CreateCudaAttentionBackend(options);
}
#else
absl::Status BuiltWithoutCuda(const std::string& flag) {
  return absl::FailedPreconditionError(
      absl::StrCat(flag,
                   ": this dsa-attention was built without CUDA (configure with "
                   "-DDSA_ENABLE_CUDA=ON where nvcc is installed)"));
}
#endif

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionBackend>> MakeAttentionBackend(
    const AttentionBackendConfig& config, std::function<std::string()>* before_serving) {
  if (config.device == "cpu") {
    CpuAttentionBackendOptions options;
    options.num_model_layers = config.num_model_layers;
    options.kv_dim = config.kv_dim;
    options.attention_heads = config.attention_heads;
    options.seed = config.seed;
    options.fill_threads = config.fill_threads;
    return CpuAttentionBackend::Create(options);
  }
  if (config.device == "cuda") {
#ifdef DSA_WITH_CUDA
    return MakeCudaAttentionBackend(config, before_serving);
#else
    (void)before_serving;
    return BuiltWithoutCuda("--attention-device cuda");
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown attention device \"", config.device, "\" (cpu or cuda)"));
}

absl::StatusOr<std::shared_ptr<LlamaRunner>> MakeLlamaRunner(
    const LlamaRunnerConfig& config, std::shared_ptr<const LlamaModel> model) {
  if (config.device == "cpu") return MakeCpuLlamaRunner(std::move(model));
  if (config.device == "cuda") {
#ifdef DSA_WITH_CUDA
    return cuda::CreateCudaLlamaRunner(std::move(model), {config.cuda_device});
#else
    return BuiltWithoutCuda("--attention-device cuda");
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown attention device \"", config.device, "\" (cpu or cuda)"));
}

absl::StatusOr<std::unique_ptr<ColocatedIndexer>> ColocatedIndexer::Create(
    IndexerFlags flags, int num_heads, int head_dim, prometheus::Registry& registry) {
  flags.options.num_heads = num_heads;
  flags.options.head_dim = head_dim;
  auto created = CreateIndexerFromFlags(flags);
  if (!created.ok()) return created.status();
  std::unique_ptr<ColocatedIndexer> colocated(new ColocatedIndexer());
  colocated->indexer_ = *std::move(created);
  colocated->metrics_ = std::make_unique<IndexerMetrics>(registry);
  colocated->metrics_->SetCacheUsage(colocated->indexer_->Usage());
  colocated->metrics_->SetMissTarget(flags.options.miss_target);
  colocated->service_ =
      std::make_unique<IndexerServiceImpl>(colocated->indexer_.get(), colocated->metrics_.get());
  colocated->capacity_blocks_ = flags.options.capacity_blocks;
  return colocated;
}

IndexerClientFactory ColocatedIndexer::Clients() {
  return InProcessIndexerClient::Factory(
      indexer_.get(), metrics_.get(),
      [this](const std::string& address) { return IsOwnAddress(address); });
}

void ColocatedIndexer::SetOwnAddress(const std::string& address) {
  std::lock_guard<std::mutex> lock(own_address_mutex_);
  own_address_ = address;
}

bool ColocatedIndexer::IsOwnAddress(const std::string& address) {
  std::lock_guard<std::mutex> lock(own_address_mutex_);
  if (address == own_address_) return true;
  // Listening on all interfaces: the coordinator names this worker by a host of its own (DNS,
  // 127.0.0.1); the port is what identifies it.
  const size_t colon = own_address_.rfind(':');
  const std::string host = own_address_.substr(0, colon);
  const bool wildcard = host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::";
  return wildcard && colon != std::string::npos && address.size() > own_address_.size() - colon &&
         address.compare(address.size() - (own_address_.size() - colon), std::string::npos,
                         own_address_, colon) == 0;
}

absl::StatusOr<IndexerClientFactory> MakeIndexerClients(const IndexerTransportConfig& config) {
  IndexerClientFactory clients;
  if (config.transport == "inprocess") {
    // The in-process factory serves only this worker's indexer.
    if (config.colocated == nullptr) {
      return absl::InvalidArgumentError("--transport inprocess needs the co-located indexer");
    }
    return config.colocated->Clients();
  }
  if (config.transport == "grpc") {
    clients = GrpcIndexerClient::Factory(config.security);
  } else if (config.transport == "nccl") {
#ifdef DSA_WITH_NCCL
    int gpus = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess || config.cuda_device >= gpus) {
      return absl::FailedPreconditionError(
          absl::StrCat("--transport nccl needs a GPU: CUDA device ", config.cuda_device,
                       " is not present (", gpus, " visible)"));
    }
    NcclConnectOptions options;
    options.link.cuda_device = config.cuda_device;
    options.num_heads = config.num_heads;
    options.head_dim = config.head_dim;
    options.attention_worker = absl::StrCat("dsa-attention pid ", getpid());
    // Under the select timeout (20 s): a first select that bootstraps fails before its deadline.
    options.connect_timeout = absl::Seconds(15);
    clients = NcclIndexerClientFactory(options, config.security);
#else
    return absl::FailedPreconditionError(
        "--transport nccl: this dsa-attention was built without NCCL (configure with "
        "-DDSA_ENABLE_CUDA=ON where nvcc and NCCL are installed)");
#endif
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown transport \"", config.transport, "\" (grpc, inprocess or nccl)"));
  }
  if (config.indexer_workers.empty() && config.indexer_dns.empty()) {
    LogJson("warn",
            "no --indexer-workers or --indexer-dns: a Prefill may name any address to dial");
  }
  return OnlyIndexerWorkers(std::move(clients), config.indexer_workers, config.indexer_dns);
}

}  // namespace dsa
