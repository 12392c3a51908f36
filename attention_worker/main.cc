// `dsa-attention`: the attention worker binary. Serves dsa.attention.v1.AttentionService (the
// pattern model's layers, the MLI schedule, the KV cache, selections from the indexer workers over
// one gRPC stream each, or from an indexer in this process with --transport inprocess) with
// grpc.health.v1 ("liveness", "readiness"), server reflection, Prometheus /metrics (DESIGN.md
// section 6) and graceful shutdown on SIGTERM or SIGINT.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/time/time.h"
#include "attention_worker/llama_attention_model.h"
#include "attention_worker/metrics.h"
#include "attention_worker/pattern_model.h"
#include "attention_worker/service.h"
#include "common/mli_schedule.h"
#include "indexer_service/grpc_service.h"
#include "indexer_service/indexer_flags.h"
#include "indexer_service/metrics.h"
#include "prometheus/registry.h"
#include "server/server.h"
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

int main(int argc, char** argv) {  // NOLINT(bugprone-exception-escape): CLI11 parse errors
                                   // are caught by CLI11_PARSE; others end the process.
  CLI::App app{
      "dsa-attention: the DSA attention worker (pattern model, KV cache, MLI schedule, sparse "
      "attention over the indexer workers' selections) over gRPC"};
  dsa::ServerFlags server_flags = dsa::DefaultServerFlags(dsa::ServerComponent::kAttention);
  dsa::AddServerFlags(app, server_flags);
  std::string layer_pattern = "FSFSFSFS";
  int retention = 0;
  int num_model_layers = 0;
  int lag_depth = 1;
  dsa::PatternModelConfig model_config;
  dsa::AttentionWorkerOptions options;
  uint64_t seed = 0;
  auto* pattern_option =
      app.add_option("--layer-pattern", layer_pattern,
                     "Model layers, one character each: F (full, runs an indexer) or S (shared); "
                     "must start with F")
          ->capture_default_str();
  auto* retention_option =
      app.add_option("--retention", retention,
                     "Instead of --layer-pattern: every R-th layer (from 0) is full; needs "
                     "--num-model-layers")
          ->excludes(pattern_option);
  app.add_option("--num-model-layers", num_model_layers,
                 "Model layers (with --retention; with --layer-pattern it must match the pattern)");
  app.add_option("--lag-depth", lag_depth,
                 "MLI lag depth k: a full layer attends the selection made k full layers earlier")
      ->capture_default_str();
  app.add_option("--num-heads", model_config.num_heads,
                 "Indexer query heads H (must equal the indexer workers')")
      ->capture_default_str();
  app.add_option("--head-dim", model_config.head_dim,
                 "Index-key and query dimension D (must equal the indexer workers')")
      ->capture_default_str();
  app.add_option("--kv-dim", options.kv_dim, "Key and value dimension of the KV cache")
      ->capture_default_str();
  app.add_option("--attention-heads", options.attention_heads, "Attention query heads (MQA)")
      ->capture_default_str();
  app.add_option("--kv-capacity-slots", options.engine.kv_capacity_slots,
                 "KV-cache slots over all sequences (one slot = one position of every layer)")
      ->capture_default_str();
  app.add_option("--prefill-threads", options.engine.prefill_threads,
                 "Threads generating index keys and KV rows during a prefill")
      ->capture_default_str();
  int64_t select_timeout_ms = absl::ToInt64Milliseconds(options.engine.select_timeout);
  app.add_option("--select-timeout-ms", select_timeout_ms,
                 "How long a decode step waits for one selection before it fails "
                 "(DEADLINE_EXCEEDED); keep it below the coordinator's --rpc-timeout-ms")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  int64_t indexer_call_timeout_ms = absl::ToInt64Milliseconds(options.engine.indexer_call_timeout);
  app.add_option("--indexer-call-timeout-ms", indexer_call_timeout_ms,
                 "Deadline of each indexer call of a prefill or release (shape, create, append, "
                 "commit, release)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--seed", seed, "Seed of the pattern model, the KV cache and attention queries")
      ->capture_default_str();
  std::string transport = "grpc";
  app.add_option("--transport", transport,
                 "How indexer inputs and selections travel: grpc (a SelectStream to each indexer "
                 "worker a Prefill names) or inprocess (an indexer in this process, co-located: "
                 "its selects run beside attention on their own thread, MLI's deferred stream; "
                 "it is also served as dsa.indexer.v1 at this worker's address, which is the "
                 "indexer address the coordinator must name, with --colocated), or nccl (the "
                 "control plane over gRPC, selections over an NCCL communicator per indexer "
                 "worker, bootstrapped over gRPC; this worker's GPU is --attention-cuda-device, "
                 "the indexer's another GPU)")
      ->check(CLI::IsMember({"grpc", "inprocess", "nccl"}))
      ->capture_default_str();
  std::string attention_device = "cpu";
  app.add_option("--attention-device", attention_device,
                 "Where the KV cache and sparse attention live: cpu (fp32 MQA rows of --kv-dim), "
                 "or cuda (DeepSeek-V3.2's MLA decode shape on a GPU: paged bf16 576-dim latent "
                 "rows, --attention-heads a multiple of 64, default 128)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  int attention_cuda_device = 0;
  app.add_option("--attention-cuda-device", attention_cuda_device,
                 "CUDA ordinal of the attention GPU (--attention-device cuda)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--device-selects", options.engine.device_selects,
                 "With --transport inprocess, --attention-device cuda and --indexer-device cuda "
                 "on the same GPU: send each full layer's select in device form (the indexer "
                 "queries generated on the GPU, the selections left there, the layer that attends "
                 "one waiting for it on the GPU); false sends host queries (the indexer refuses "
                 "the device form by itself when it cannot take it: SPIN settings the GPU does not "
                 "run, auditing, a dropped device)")
      ->capture_default_str();
  bool layer_standin = false;
  app.add_option("--layer-standin", layer_standin,
                 "With --attention-device cuda: run the rest of each layer (feed-forward / MoE) as "
                 "the stand-in, a cuBLAS GEMM reading --layer-standin-weight-bytes of weights plus "
                 "--layer-standin-busy-us, on the attention stream (docs/attention_gpu_inputs.md); "
                 "loaded from libdsa_layer_standin.so beside this binary once /metrics runs")
      ->capture_default_str();
  int64_t standin_weight_bytes = 0;
  app.add_option("--layer-standin-weight-bytes", standin_weight_bytes,
                 "Weight bytes a layer's stand-in GEMM reads (0: the calibrated 76,009,472, "
                 "DeepSeek-V3.2 on 8 GPUs)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  double standin_busy_us = -1;
  app.add_option("--layer-standin-busy-us", standin_busy_us,
                 "Busy time after the stand-in's GEMM, microseconds (-1: the calibrated 84)")
      ->capture_default_str();
  int standin_max_rows = 256;
  app.add_option("--layer-standin-max-rows", standin_max_rows,
                 "Most decode rows a layer of the stand-in takes (a step's rows)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  dsa::IndexerFlags indexer_flags;
  indexer_flags.options.capacity_blocks = 4096;
  dsa::AddIndexerFlags(app, indexer_flags, "--indexer-", /*with_shape_flags=*/false);
  std::vector<std::string> indexer_workers;
  std::vector<std::string> indexer_dns;
  app.add_option("--indexer-workers", indexer_workers,
                 "The only indexer workers (host:port, as the coordinator names them) a Prefill "
                 "may name; with --indexer-dns empty too, any address")
      ->delimiter(',')
      ->check(dsa::HostPortValidator(1, /*allow_empty=*/false));
  app.add_option("--indexer-dns", indexer_dns,
                 "NAME:PORT of headless Services whose resolved addresses a Prefill may name")
      ->delimiter(',')
      ->check(dsa::HostPortValidator(1, /*allow_empty=*/false));
  std::string model_name = "pattern";
  app.add_option(
         "--model", model_name,
         "The model the worker runs: pattern (the synthetic pattern model: context lengths, "
         "no tokens) or smollm2 (SmolLM2-135M with its trained lightning indexers, "
         "docs/model.md: token ids in, sampled token ids out; the shapes come from "
         "--model-file and --indexer-weights; on the CPU, or on the GPU with "
         "--attention-device cuda)")
      ->check(CLI::IsMember({"pattern", "smollm2"}))
      ->capture_default_str();
  std::string model_file = "build/models/smollm2-135m/model.safetensors";
  app.add_option("--model-file", model_file,
                 "--model smollm2: the backbone, fp32 safetensors written by "
                 "scripts/model_setup.sh")
      ->capture_default_str();
  std::string indexer_weights = "data/models/smollm2_indexer.safetensors";
  app.add_option("--indexer-weights", indexer_weights,
                 "--model smollm2: the lightning indexers' weights (fp16 safetensors, "
                 "python/dsa_model/train_indexer.py)")
      ->capture_default_str();
  dsa::AddFlagSources(app, "dsa-attention");
  CLI11_PARSE(app, argc, argv);
  const bool real_model = model_name != "pattern";
  if (!real_model) {
    for (const char* name : {"--model-file", "--indexer-weights"}) {
      if (app.count(name) > 0) {
        dsa::LogJson("error", "bad config",
                     {{"status", std::string(name) + " needs --model smollm2"}});
        return 2;
      }
    }
  } else {
    for (const char* name : {"--num-heads", "--head-dim", "--kv-dim", "--attention-heads", "--seed",
                             "--layer-standin"}) {
      if (app.count(name) > 0) {
        dsa::LogJson("error", "bad config",
                     {{"status", std::string(name) +
                                     " configures the synthetic pattern model; --model smollm2 "
                                     "takes its shapes from its files"}});
        return 2;
      }
    }
  }
  // The real model's files, read before the schedule: its layers come from their metadata.
  std::shared_ptr<const dsa::LlamaModel> loaded_model;
  if (real_model) {
    auto loaded = dsa::LlamaModel::Load(model_file, indexer_weights);
    if (!loaded.ok()) {
      dsa::LogJson("error", "cannot load the model", {{"status", loaded.status().ToString()}});
      return 2;
    }
    loaded_model = *std::move(loaded);
    // Every second layer full unless the flags say otherwise; a --retention without
    // --num-model-layers takes the model's layers.
    if (app.count("--layer-pattern") == 0 && retention_option->count() == 0) retention = 2;
    if (num_model_layers == 0 && app.count("--layer-pattern") == 0) {
      num_model_layers = loaded_model->config().num_layers;
    }
    // SmolLM2-135M's KV is 46 KB a slot (fp32 K and V of 30 layers): the pattern model's default
    // of 4M slots would admit 190 GB. 65,536 slots are 3 GB.
    if (app.count("--kv-capacity-slots") == 0) options.engine.kv_capacity_slots = 65536;
  }
  absl::StatusOr<dsa::ClientSecurity> indexer_security = dsa::ClientSecurityFrom(server_flags.tls);
  if (!indexer_security.ok()) {
    std::fprintf(stderr, "%s\n", std::string(indexer_security.status().message()).c_str());
    return 2;
  }
  options.engine.select_timeout = absl::Milliseconds(select_timeout_ms);
  options.engine.indexer_call_timeout = absl::Milliseconds(indexer_call_timeout_ms);
  dsa::BlockTerminationSignals();
  if (standin_busy_us < 0 && standin_busy_us != -1) {
    dsa::LogJson("error", "bad config",
                 {{"status", "--layer-standin-busy-us must be >= 0, or -1 for the default"}});
    return 2;
  }
  if (attention_device != "cuda" || !layer_standin) {
    for (const char* name : {"--layer-standin", "--layer-standin-weight-bytes",
                             "--layer-standin-busy-us", "--layer-standin-max-rows"}) {
      // --layer-standin false is no stand-in on any device.
      const bool is_switch = std::string(name) == "--layer-standin";
      if (app.count(name) > 0 && !(is_switch && !layer_standin) &&
          (attention_device != "cuda" || !is_switch)) {
        dsa::LogJson("error", "bad config",
                     {{"status", std::string(name) + (attention_device != "cuda"
                                                          ? " needs --attention-device cuda"
                                                          : " needs --layer-standin true")}});
        return 2;
      }
    }
  }
  if (attention_device == "cuda") {
    for (const char* name : {"--kv-dim"}) {
      if (app.count(name) > 0) {
        dsa::LogJson("error", "bad config",
                     {{"status", std::string(name) +
                                     " is the CPU backend's; the CUDA backend's rows are MLA's "
                                     "576-dim latent (512 values)"}});
        return 2;
      }
    }
  }
  if (attention_device == "cpu" && transport != "nccl") {
    for (const char* name : {"--attention-cuda-device"}) {
      if (app.count(name) > 0) {
        dsa::LogJson("error", "bad config",
                     {{"status", std::string(name) + " needs --attention-device cuda"}});
        return 2;
      }
    }
  }
  if (transport != "inprocess") {
    for (const std::string& name :
         {"capacity-blocks", "audit-fraction", "audit-seed", "miss-target", "device", "cuda-device",
          "scan-kernel", "gpu-spin"}) {
      if (app.count("--indexer-" + name) > 0) {
        dsa::LogJson("error", "bad config",
                     {{"status", "--indexer-" + name +
                                     " configures the co-located indexer: it needs --transport "
                                     "inprocess"}});
        return 2;
      }
    }
  }

  absl::StatusOr<dsa::MliSchedule> schedule =
      retention_option->count() > 0 || retention > 0
          ? (num_model_layers > 0
                 ? dsa::MliSchedule::FromRetention(num_model_layers, retention, lag_depth)
                 : absl::InvalidArgumentError("--retention needs --num-model-layers"))
          : dsa::MliSchedule::FromPattern(layer_pattern, lag_depth,
                                          num_model_layers > 0 ? num_model_layers : -1);
  if (!schedule.ok()) {
    dsa::LogJson("error", "bad model config", {{"status", schedule.status().ToString()}});
    return 2;
  }
  model_config.num_layers = static_cast<int>(schedule->full_layers().size());
  model_config.seed = seed;
  // The pattern model's diagonals (default 4) need as many positional heads; a small H gets fewer.
  model_config.num_diagonals = std::clamp(
      static_cast<int>(std::lround(model_config.positional_head_fraction * model_config.num_heads)),
      1, model_config.num_diagonals);
  options.seed = seed;
  auto model = dsa::PatternModel::Create(model_config);
  if (!model.ok()) {
    dsa::LogJson("error", "bad model config", {{"status", model.status().ToString()}});
    return 2;
  }
  std::unique_ptr<dsa::LlamaAttentionModel> llama;
  if (real_model) {
    // --attention-device cuda: the forward pass on the GPU (cuda/llama_cuda_runner.h).
    std::shared_ptr<dsa::LlamaRunner> runner;
    if (attention_device == "cuda") {
#ifdef DSA_WITH_CUDA
      auto on_gpu = dsa::cuda::CreateCudaLlamaRunner(loaded_model, {attention_cuda_device});
      if (!on_gpu.ok()) {
        dsa::LogJson("error", "cannot use the attention GPU",
                     {{"status", on_gpu.status().ToString()}});
        return 2;
      }
      runner = *std::move(on_gpu);
#else
      dsa::LogJson("error",
                   "--attention-device cuda: this dsa-attention was built without CUDA (configure "
                   "with -DDSA_ENABLE_CUDA=ON where nvcc is installed)");
      return 2;
#endif
    } else {
      runner = dsa::MakeCpuLlamaRunner(loaded_model);
    }
    auto created = dsa::LlamaAttentionModel::Create(std::move(runner), schedule->full_layers(),
                                                    dsa::kSmolLM2ModelName);
    if (!created.ok()) {
      dsa::LogJson("error", "bad model config", {{"status", created.status().ToString()}});
      return 2;
    }
    llama = *std::move(created);
    model_config.num_heads = llama->shape().num_heads;
    model_config.head_dim = llama->shape().head_dim;
  }
  auto registry = std::make_shared<prometheus::Registry>();
  dsa::AttentionMetrics metrics(*registry, schedule->num_layers());
  const std::string pattern = schedule->Pattern();

  // The co-located indexer (--transport inprocess) and what serves it to the coordinator.
  std::unique_ptr<dsa::Indexer> indexer;
  std::unique_ptr<dsa::IndexerMetrics> indexer_metrics;
  std::unique_ptr<dsa::IndexerServiceImpl> indexer_service;
  std::mutex own_address_mutex;
  std::string own_address;  // set once serving
  dsa::IndexerClientFactory indexer_clients = dsa::GrpcIndexerClient::Factory(*indexer_security);
  if (transport == "inprocess") {
    indexer_flags.options.num_heads = model_config.num_heads;
    indexer_flags.options.head_dim = model_config.head_dim;
    auto created = dsa::CreateIndexerFromFlags(indexer_flags);
    if (!created.ok()) {
      dsa::LogJson("error", "cannot create the co-located indexer",
                   {{"status", created.status().ToString()}});
      return 2;
    }
    indexer = std::move(*created);
    indexer_metrics = std::make_unique<dsa::IndexerMetrics>(*registry);
    indexer_metrics->SetCacheUsage(indexer->Usage());
    indexer_metrics->SetMissTarget(indexer_flags.options.miss_target);
    indexer_service =
        std::make_unique<dsa::IndexerServiceImpl>(indexer.get(), indexer_metrics.get());
    indexer_clients = dsa::InProcessIndexerClient::Factory(
        indexer.get(), indexer_metrics.get(), [&](const std::string& address) {
          std::lock_guard<std::mutex> lock(own_address_mutex);
          if (address == own_address) return true;
          // Listening on all interfaces: the coordinator names this worker by a host of its own
          // (DNS, 127.0.0.1); the port is what identifies it.
          const size_t colon = own_address.rfind(':');
          const std::string host = own_address.substr(0, colon);
          const bool wildcard = host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::";
          return wildcard && colon != std::string::npos &&
                 address.size() > own_address.size() - colon &&
                 address.compare(address.size() - (own_address.size() - colon), std::string::npos,
                                 own_address, colon) == 0;
        });
  }
  if (transport == "nccl") {
#ifdef DSA_WITH_NCCL
    int gpus = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess || attention_cuda_device >= gpus) {
      dsa::LogJson("error", "bad config",
                   {{"status", "--transport nccl needs a GPU: CUDA device " +
                                   std::to_string(attention_cuda_device) + " is not present (" +
                                   std::to_string(gpus) + " visible)"}});
      return 2;
    }
    dsa::NcclConnectOptions nccl_options;
    nccl_options.link.cuda_device = attention_cuda_device;
    nccl_options.num_heads = model_config.num_heads;
    nccl_options.head_dim = model_config.head_dim;
    nccl_options.attention_worker = "dsa-attention pid " + std::to_string(getpid());
    // Under the select timeout (20 s): a first select that bootstraps fails before its deadline.
    nccl_options.connect_timeout = absl::Seconds(15);
    indexer_clients = dsa::NcclIndexerClientFactory(nccl_options, *indexer_security);
#else
    dsa::LogJson("error",
                 "--transport nccl: this dsa-attention was built without NCCL (configure with "
                 "-DDSA_ENABLE_CUDA=ON where nvcc and NCCL are installed)");
    return 2;
#endif
  }
  if (transport != "inprocess") {  // the in-process factory serves only this worker's indexer
    if (indexer_workers.empty() && indexer_dns.empty()) {
      dsa::LogJson("warn",
                   "no --indexer-workers or --indexer-dns: a Prefill may name any address to dial");
    }
    indexer_clients =
        dsa::OnlyIndexerWorkers(std::move(indexer_clients), indexer_workers, indexer_dns);
  }
  absl::StatusOr<std::unique_ptr<dsa::AttentionEngine>> engine;
  std::function<std::string()> before_serving;  // ServerSpec::before_serving
#ifdef DSA_WITH_CUDA
  std::unique_ptr<dsa::cuda::LoadedLayerStandin> standin_owner;
  std::atomic<const dsa::cuda::LoadedLayerStandin*> standin_slot{nullptr};
#endif
  if (attention_device == "cuda" && llama == nullptr) {
#ifdef DSA_WITH_CUDA
    dsa::cuda::CudaAttentionBackendOptions backend_options;
    backend_options.device = attention_cuda_device;
    backend_options.num_model_layers = schedule->num_layers();
    backend_options.num_heads = app.count("--attention-heads") > 0 ? options.attention_heads : 128;
    backend_options.seed = seed;
    backend_options.capacity_slots = options.engine.kv_capacity_slots;
    if (layer_standin) {
      // The stand-in comes in once /metrics runs, before the gRPC server starts (before_serving
      // below), so every layer finds it.
      backend_options.rest_of_layer = [&standin_slot, standin_max_rows](void* stream,
                                                                        int rows) -> cudaError_t {
        const dsa::cuda::LoadedLayerStandin* standin = standin_slot.load(std::memory_order_acquire);
        if (standin == nullptr) return cudaErrorNotReady;
        // A step of more rows than the stand-in was sized for reads the same weights once.
        return standin->Run(stream, std::min(rows, standin_max_rows));
      };
      before_serving = [&, attention_cuda_device]() -> std::string {
        DsaLayerStandinConfig config{};
        config.device = attention_cuda_device;
        config.weight_bytes_per_layer = standin_weight_bytes;
        config.busy_micros = standin_busy_us;
        config.max_rows = standin_max_rows;
        config.seed = seed;
        auto loaded = dsa::cuda::LoadedLayerStandin::Load(
            dsa::cuda::ExecutableDirectory() + dsa::cuda::kLayerStandinModuleName, config);
        if (!loaded.ok()) return loaded.status().ToString();
        standin_owner = *std::move(loaded);
        standin_slot.store(standin_owner.get(), std::memory_order_release);
        return "";
      };
    }
    auto backend = dsa::cuda::CreateCudaAttentionBackend(backend_options);
    if (!backend.ok()) {
      dsa::LogJson("error", "cannot use the attention GPU",
                   {{"status", backend.status().ToString()}});
      return 2;
    }
    engine = dsa::AttentionEngine::Create(*schedule, std::move(*model), std::move(*backend),
                                          std::move(indexer_clients), options.engine, &metrics);
#else
    dsa::LogJson("error",
                 "--attention-device cuda: this dsa-attention was built without CUDA (configure "
                 "with -DDSA_ENABLE_CUDA=ON where nvcc is installed)");
    return 2;
#endif
  } else if (llama != nullptr) {
    engine = dsa::AttentionEngine::Create(*schedule, std::move(llama), std::move(indexer_clients),
                                          options.engine, &metrics);
  } else {
    engine = dsa::MakeCpuAttentionEngine(*schedule, std::move(*model), options,
                                         std::move(indexer_clients), &metrics);
  }
  if (!engine.ok()) {
    dsa::LogJson("error", "bad model config", {{"status", engine.status().ToString()}});
    return 2;
  }
  auto service = std::make_unique<dsa::AttentionServiceImpl>(std::move(*engine));
  if (indexer_service != nullptr) service->ShareOwnersWith(&indexer_service->owners());

  dsa::ServerSpec spec;
  spec.name = "dsa-attention";
  spec.component = dsa::ServerComponent::kAttention;
  spec.services = {service.get()};
  if (indexer_service != nullptr) spec.services.push_back(indexer_service.get());
  spec.registry = registry;
  spec.max_receive_message_bytes = dsa::kMaxReceiveMessageBytes;
  spec.banner_fields = {
      {"layer_pattern", pattern},
      {"lag_depth", lag_depth},
      {"num_heads", model_config.num_heads},
      {"head_dim", model_config.head_dim},
      {"model", service->engine().model().shape().name},
      {"kv_dim", loaded_model != nullptr      ? loaded_model->config().kv_dim()
                 : attention_device == "cuda" ? 576
                                              : options.kv_dim},
      {"attention_heads", loaded_model != nullptr
                              ? loaded_model->config().num_heads
                              : service->engine().model().output_values_per_row() /
                                    (attention_device == "cuda" ? 512 : options.kv_dim)},
      {"kv_capacity_slots", options.engine.kv_capacity_slots},
      {"transport", transport},
      {"device_selects", options.engine.device_selects},
      {"layer_standin", layer_standin},
      {"attention_device", service->engine().model().Description()},
      {"indexer_workers", indexer_workers},
      {"indexer_dns", indexer_dns},
      {"dials_with_tls", indexer_security->tls()}};
  if (indexer != nullptr) {
    spec.banner_fields["indexer_capacity_blocks"] = indexer_flags.options.capacity_blocks;
    spec.banner_fields["indexer_device"] = indexer->DeviceDescription();
  }
  spec.on_serving = [&](const std::string& address) {
    std::lock_guard<std::mutex> lock(own_address_mutex);
    own_address = address;
  };
  spec.on_stopped = [&service] { service->CloseTransports(); };
  spec.before_serving = before_serving;
  return dsa::RunServer(server_flags, spec);
}
