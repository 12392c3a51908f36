// The attention worker's parts chosen by name (dsa-attention's --attention-device and
// --transport): where the KV cache and attention run (cpu, cuda), where the real model's forward
// pass runs (cpu, cuda), and how indexer inputs and selections travel (grpc, inprocess, nccl).
// The only place that knows whether this build has CUDA and NCCL: what it lacks is refused here.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attention_worker/attention_backend.h"
#include "attention_worker/llama_model.h"
#include "attention_worker/llama_runner.h"
#include "indexer_service/grpc_service.h"
#include "indexer_service/indexer.h"
#include "indexer_service/indexer_flags.h"
#include "indexer_service/metrics.h"
#include "prometheus/registry.h"
#include "server/security.h"
#include "transport/indexer_client.h"

namespace dsa {

/// The layer stand-in of the CUDA backend (--layer-standin, docs/attention_gpu_inputs.md): the
/// rest of each layer (feed-forward / MoE) as a cuBLAS GEMM plus a busy spin, on the attention
/// stream after the layer's attention.
struct LayerStandinConfig {
  bool enabled = false;
  int64_t weight_bytes = 0;  // weights a layer's GEMM reads, bytes (0: the calibrated 76,009,472)
  double busy_us = -1;       // busy time after the GEMM, microseconds (-1: the calibrated 84)
  int max_rows = 256;        // most decode rows a layer takes (a step's rows), >= 1
  uint64_t seed = 0;         // of the stand-in's weights
};

/// What MakeAttentionBackend builds.
struct AttentionBackendConfig {
  std::string device = "cpu";  // cpu | cuda
  int num_model_layers = 1;    // layers whose KV the backend holds, >= 1
  uint64_t seed = 0;           // of the KV rows and attention queries
  /// cpu: Dk = Dv of the fp32 MQA rows (>= 1) and the threads that fill them (>= 1).
  int kv_dim = 32;
  int fill_threads = 2;
  /// Attention query heads: cpu MQA heads (>= 1); cuda a multiple of 64.
  int attention_heads = 8;
  /// cuda: the GPU, the pools' slots over all sequences, and the optional stand-in.
  int cuda_device = 0;
  int64_t capacity_slots = int64_t{1} << 20;
  LayerStandinConfig standin;
};

/// The synthetic model's KV backend: device "cpu" is CpuAttentionBackend (fp32 MQA rows of
/// kv_dim); "cuda" is the CUDA backend (cuda/cuda_attention_backend.h: DeepSeek-V3.2's paged bf16
/// 576-dim latent rows) on cuda_device. With the stand-in enabled, *before_serving is set to the
/// function that loads it (libdsa_layer_standin.so beside the binary), to run once /metrics
/// serves (ServerSpec::before_serving); until then a layer fails (cudaErrorNotReady). Otherwise
/// *before_serving is left as it is. The stand-in's state lives as long as the backend and
/// *before_serving both do. Errors: INVALID_ARGUMENT (unknown device; the backend's field
/// checks), FAILED_PRECONDITION (cuda in a build without CUDA), the CUDA backend's (no such GPU,
/// RESOURCE_EXHAUSTED for the pools).
absl::StatusOr<std::unique_ptr<AttentionBackend>> MakeAttentionBackend(
    const AttentionBackendConfig& config, std::function<std::string()>* before_serving);

/// What MakeLlamaRunner builds.
struct LlamaRunnerConfig {
  std::string device = "cpu";  // cpu | cuda
  int cuda_device = 0;         // cuda: the GPU
};

/// The real model's forward pass (llama_runner.h) over `model`: on the CPU (MakeCpuLlamaRunner),
/// or with device "cuda" on GPU cuda_device (cuda/llama_cuda_runner.h, the weights uploaded).
/// Errors: INVALID_ARGUMENT (unknown device), FAILED_PRECONDITION (cuda in a build without CUDA),
/// CreateCudaLlamaRunner's.
absl::StatusOr<std::shared_ptr<LlamaRunner>> MakeLlamaRunner(
    const LlamaRunnerConfig& config, std::shared_ptr<const LlamaModel> model);

/// The indexer co-located in the attention worker's process (--transport inprocess): the indexer,
/// its metrics, the dsa.indexer.v1 service that serves it at the worker's own address, and the
/// in-process clients that reach it. Thread-safe.
class ColocatedIndexer {
 public:
  /// The indexer of `flags` with the model's H and D; its metrics in `registry`.
  /// CreateIndexerFromFlags's errors.
  static absl::StatusOr<std::unique_ptr<ColocatedIndexer>> Create(IndexerFlags flags, int num_heads,
                                                                  int head_dim,
                                                                  prometheus::Registry& registry);

  /// InProcessIndexerClient::Factory over this indexer: it serves kInProcessIndexerAddress and
  /// the worker's own address (SetOwnAddress; with the worker listening on every interface, any
  /// host with its port). The factory refers to this object, which must outlive it.
  IndexerClientFactory Clients();
  /// Records the address the worker serves at (ServerSpec::on_serving).
  void SetOwnAddress(const std::string& address);
  /// The service to register beside the attention service (dsa.indexer.v1 at the same port).
  IndexerServiceImpl& service() { return *service_; }
  const Indexer& indexer() const { return *indexer_; }
  int64_t capacity_blocks() const { return capacity_blocks_; }

 private:
  ColocatedIndexer() = default;
  // Whether the engine's `address` is this worker's own (see Clients).
  bool IsOwnAddress(const std::string& address);

  std::unique_ptr<Indexer> indexer_;
  std::unique_ptr<IndexerMetrics> metrics_;
  std::unique_ptr<IndexerServiceImpl> service_;
  int64_t capacity_blocks_ = 0;
  std::mutex own_address_mutex_;  // guards own_address_
  std::string own_address_;       // set once serving
};

/// What MakeIndexerClients builds.
struct IndexerTransportConfig {
  std::string transport = "grpc";  // grpc | inprocess | nccl
  ClientSecurity security;         // grpc, nccl: how the indexer workers are dialed
  /// grpc, nccl: the only indexer workers (host:port) and headless Services (NAME:PORT) a Prefill
  /// may name (OnlyIndexerWorkers); both empty: any address (logged as a warning).
  std::vector<std::string> indexer_workers;
  std::vector<std::string> indexer_dns;
  /// nccl: this worker's GPU, and the model's indexer H and D (the data plane's shapes).
  int cuda_device = 0;
  int num_heads = 0;
  int head_dim = 0;
  ColocatedIndexer* colocated = nullptr;  // inprocess: the indexer (not owned)
};

/// The engine's indexer clients: "grpc" (a SelectStream to each indexer worker a Prefill names),
/// "inprocess" (config.colocated's clients) or "nccl" (the control plane over gRPC, selections
/// over an NCCL communicator per indexer worker, bootstrapped over gRPC; connect timeout 15 s,
/// under the select timeout). Errors: INVALID_ARGUMENT (unknown transport, inprocess without an
/// indexer), FAILED_PRECONDITION (nccl in a build without NCCL, or without the GPU cuda_device).
absl::StatusOr<IndexerClientFactory> MakeIndexerClients(const IndexerTransportConfig& config);

}  // namespace dsa
