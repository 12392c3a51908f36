// `dsa-attention`'s flags (see worker_flags.h).
#include "attention_worker/worker_flags.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "server/server.h"

namespace dsa {

void AddAttentionWorkerFlags(CLI::App& app, AttentionWorkerFlags& flags) {
  flags.app = &app;
  auto* pattern_option =
      app.add_option("--layer-pattern", flags.layer_pattern,
                     "Model layers, one character each: F (full, runs an indexer) or S (shared); "
                     "must start with F")
          ->capture_default_str();
  app.add_option("--retention", flags.retention,
                 "Instead of --layer-pattern: every R-th layer (from 0) is full; needs "
                 "--num-model-layers")
      ->excludes(pattern_option);
  app.add_option("--num-model-layers", flags.num_model_layers,
                 "Model layers (with --retention; with --layer-pattern it must match the pattern)");
  app.add_option("--lag-depth", flags.lag_depth,
                 "MLI lag depth k: a full layer attends the selection made k full layers earlier")
      ->capture_default_str();
  app.add_option("--num-heads", flags.model_config.num_heads,
                 "Indexer query heads H (must equal the indexer workers')")
      ->capture_default_str();
  app.add_option("--head-dim", flags.model_config.head_dim,
                 "Index-key and query dimension D (must equal the indexer workers')")
      ->capture_default_str();
  app.add_option("--kv-dim", flags.options.kv_dim, "Key and value dimension of the KV cache")
      ->capture_default_str();
  app.add_option("--attention-heads", flags.options.attention_heads, "Attention query heads (MQA)")
      ->capture_default_str();
  app.add_option("--kv-capacity-slots", flags.options.engine.kv_capacity_slots,
                 "KV-cache slots over all sequences (one slot = one position of every layer)")
      ->capture_default_str();
  app.add_option("--prefill-threads", flags.options.engine.prefill_threads,
                 "Threads generating index keys and KV rows during a prefill")
      ->capture_default_str();
  flags.select_timeout_ms = absl::ToInt64Milliseconds(flags.options.engine.select_timeout);
  app.add_option("--select-timeout-ms", flags.select_timeout_ms,
                 "How long a decode step waits for one selection before it fails "
                 "(DEADLINE_EXCEEDED); keep it below the coordinator's --rpc-timeout-ms")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  flags.indexer_call_timeout_ms =
      absl::ToInt64Milliseconds(flags.options.engine.indexer_call_timeout);
  app.add_option("--indexer-call-timeout-ms", flags.indexer_call_timeout_ms,
                 "Deadline of each indexer call of a prefill or release (shape, create, append, "
                 "commit, release)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--seed", flags.seed,
                 "Seed of the pattern model, the KV cache and attention queries")
      ->capture_default_str();
  app.add_option("--transport", flags.transport,
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
  app.add_option("--attention-device", flags.attention_device,
                 "Where the KV cache and sparse attention live: cpu (fp32 MQA rows of --kv-dim), "
                 "or cuda (DeepSeek-V3.2's MLA decode shape on a GPU: paged bf16 576-dim latent "
                 "rows, --attention-heads a multiple of 64, default 128)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--attention-cuda-device", flags.attention_cuda_device,
                 "CUDA ordinal of the attention GPU (--attention-device cuda)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--device-selects", flags.options.engine.device_selects,
                 "With --transport inprocess, --attention-device cuda and --indexer-device cuda "
                 "on the same GPU: send each full layer's select in device form (the indexer "
                 "queries generated on the GPU, the selections left there, the layer that attends "
                 "one waiting for it on the GPU); false sends host queries (the indexer refuses "
                 "the device form by itself when it cannot take it: SPIN settings the GPU does not "
                 "run, auditing, a dropped device)")
      ->capture_default_str();
  app.add_option("--layer-standin", flags.layer_standin,
                 "With --attention-device cuda: run the rest of each layer (feed-forward / MoE) as "
                 "the stand-in, a cuBLAS GEMM reading --layer-standin-weight-bytes of weights plus "
                 "--layer-standin-busy-us, on the attention stream (docs/attention_gpu_inputs.md); "
                 "loaded from libdsa_layer_standin.so beside this binary once /metrics runs")
      ->capture_default_str();
  app.add_option("--layer-standin-weight-bytes", flags.standin_weight_bytes,
                 "Weight bytes a layer's stand-in GEMM reads (0: the calibrated 76,009,472, "
                 "DeepSeek-V3.2 on 8 GPUs)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--layer-standin-busy-us", flags.standin_busy_us,
                 "Busy time after the stand-in's GEMM, microseconds (-1: the calibrated 84)")
      ->capture_default_str();
  app.add_option("--layer-standin-max-rows", flags.standin_max_rows,
                 "Most decode rows a layer of the stand-in takes (a step's rows)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  flags.indexer.options.capacity_blocks = 4096;
  AddIndexerFlags(app, flags.indexer, "--indexer-", /*with_shape_flags=*/false);
  app.add_option("--indexer-workers", flags.indexer_workers,
                 "The only indexer workers (host:port, as the coordinator names them) a Prefill "
                 "may name; with --indexer-dns empty too, any address")
      ->delimiter(',')
      ->check(HostPortValidator(1, /*allow_empty=*/false));
  app.add_option("--indexer-dns", flags.indexer_dns,
                 "NAME:PORT of headless Services whose resolved addresses a Prefill may name")
      ->delimiter(',')
      ->check(HostPortValidator(1, /*allow_empty=*/false));
  app.add_option(
         "--model", flags.model_name,
         "The model the worker runs: pattern (the synthetic pattern model: context lengths, "
         "no tokens) or smollm2 (SmolLM2-135M with its trained lightning indexers, "
         "docs/model.md: token ids in, sampled token ids out; the shapes come from "
         "--model-file and --indexer-weights; on the CPU, or on the GPU with "
         "--attention-device cuda)")
      ->check(CLI::IsMember({"pattern", "smollm2"}))
      ->capture_default_str();
  app.add_option("--model-file", flags.model_file,
                 "--model smollm2: the backbone, fp32 safetensors written by "
                 "scripts/model_setup.sh")
      ->capture_default_str();
  app.add_option("--indexer-weights", flags.indexer_weights,
                 "--model smollm2: the lightning indexers' weights (fp16 safetensors, "
                 "python/dsa_model/train_indexer.py)")
      ->capture_default_str();
}

absl::Status CheckAttentionWorkerFlags(const AttentionWorkerFlags& flags) {
  const CLI::App& app = *flags.app;
  auto refuse = [](const std::string& message) { return absl::InvalidArgumentError(message); };
  if (flags.model_name == "pattern") {
    for (const char* name : {"--model-file", "--indexer-weights"}) {
      if (app.count(name) > 0) return refuse(std::string(name) + " needs --model smollm2");
    }
  } else {
    for (const char* name : {"--num-heads", "--head-dim", "--kv-dim", "--attention-heads", "--seed",
                             "--layer-standin"}) {
      if (app.count(name) > 0) {
        return refuse(std::string(name) +
                      " configures the synthetic pattern model; --model smollm2 takes its shapes "
                      "from its files");
      }
    }
  }
  if (flags.standin_busy_us < 0 && flags.standin_busy_us != -1) {
    return refuse("--layer-standin-busy-us must be >= 0, or -1 for the default");
  }
  const bool cuda = flags.attention_device == "cuda";
  if (!cuda || !flags.layer_standin) {
    for (const char* name : {"--layer-standin", "--layer-standin-weight-bytes",
                             "--layer-standin-busy-us", "--layer-standin-max-rows"}) {
      // --layer-standin false is no stand-in on any device.
      const bool is_switch = std::string(name) == "--layer-standin";
      if (app.count(name) > 0 && !(is_switch && !flags.layer_standin) && (!cuda || !is_switch)) {
        return refuse(std::string(name) +
                      (!cuda ? " needs --attention-device cuda" : " needs --layer-standin true"));
      }
    }
  }
  if (cuda && app.count("--kv-dim") > 0) {
    return refuse(
        "--kv-dim is the CPU backend's; the CUDA backend's rows are MLA's 576-dim latent (512 "
        "values)");
  }
  if (flags.attention_device == "cpu" && flags.transport != "nccl" &&
      app.count("--attention-cuda-device") > 0) {
    return refuse("--attention-cuda-device needs --attention-device cuda");
  }
  if (flags.transport != "inprocess") {
    for (const char* name : {"capacity-blocks", "audit-fraction", "audit-seed", "miss-target",
                             "device", "cuda-device", "scan-kernel", "gpu-spin"}) {
      const std::string flag = std::string("--indexer-") + name;
      if (app.count(flag) > 0) {
        return refuse(flag + " configures the co-located indexer: it needs --transport inprocess");
      }
    }
  }
  return absl::OkStatus();
}

void ApplyLlamaDefaults(const LlamaModel& model, AttentionWorkerFlags& flags) {
  const CLI::App& app = *flags.app;
  // Every second layer full unless the flags say otherwise; a --retention without
  // --num-model-layers takes the model's layers.
  if (app.count("--layer-pattern") == 0 && app.count("--retention") == 0) flags.retention = 2;
  if (flags.num_model_layers == 0 && app.count("--layer-pattern") == 0) {
    flags.num_model_layers = model.config().num_layers;
  }
  // SmolLM2-135M's KV is 46 KB a slot (fp32 K and V of 30 layers): the pattern model's default
  // of 4M slots would admit 190 GB. 65,536 slots are 3 GB.
  if (app.count("--kv-capacity-slots") == 0) flags.options.engine.kv_capacity_slots = 65536;
}

absl::StatusOr<MliSchedule> ScheduleFromFlags(const AttentionWorkerFlags& flags) {
  if (flags.app->count("--retention") > 0 || flags.retention > 0) {
    if (flags.num_model_layers <= 0) {
      return absl::InvalidArgumentError("--retention needs --num-model-layers");
    }
    return MliSchedule::FromRetention(flags.num_model_layers, flags.retention, flags.lag_depth);
  }
  return MliSchedule::FromPattern(flags.layer_pattern, flags.lag_depth,
                                  flags.num_model_layers > 0 ? flags.num_model_layers : -1);
}

absl::StatusOr<PatternModel> PatternModelFromFlags(const AttentionWorkerFlags& flags,
                                                   const MliSchedule& schedule) {
  PatternModelConfig config = flags.model_config;
  config.num_layers = static_cast<int>(schedule.full_layers().size());
  config.seed = flags.seed;
  // The pattern model's diagonals (default 4) need as many positional heads; a small H gets fewer.
  config.num_diagonals =
      std::clamp(static_cast<int>(std::lround(config.positional_head_fraction * config.num_heads)),
                 1, config.num_diagonals);
  return PatternModel::Create(config);
}

AttentionEngineOptions EngineOptionsFromFlags(const AttentionWorkerFlags& flags) {
  AttentionEngineOptions options = flags.options.engine;
  options.select_timeout = absl::Milliseconds(flags.select_timeout_ms);
  options.indexer_call_timeout = absl::Milliseconds(flags.indexer_call_timeout_ms);
  return options;
}

AttentionBackendConfig BackendConfigFromFlags(const AttentionWorkerFlags& flags,
                                              const MliSchedule& schedule) {
  AttentionBackendConfig config;
  config.device = flags.attention_device;
  config.num_model_layers = schedule.num_layers();
  config.seed = flags.seed;
  config.kv_dim = flags.options.kv_dim;
  config.fill_threads = flags.options.engine.prefill_threads;
  config.attention_heads = flags.options.attention_heads;
  if (flags.attention_device == "cuda") {
    // The CUDA backend's default is DeepSeek-V3.2's 128 heads, not the CPU backend's 8.
    if (flags.app->count("--attention-heads") == 0) config.attention_heads = 128;
    config.cuda_device = flags.attention_cuda_device;
    config.capacity_slots = flags.options.engine.kv_capacity_slots;
    config.standin.enabled = flags.layer_standin;
    config.standin.weight_bytes = flags.standin_weight_bytes;
    config.standin.busy_us = flags.standin_busy_us;
    config.standin.max_rows = flags.standin_max_rows;
    config.standin.seed = flags.seed;
  }
  return config;
}

LlamaRunnerConfig LlamaRunnerConfigFromFlags(const AttentionWorkerFlags& flags) {
  return {.device = flags.attention_device, .cuda_device = flags.attention_cuda_device};
}

IndexerTransportConfig TransportConfigFromFlags(const AttentionWorkerFlags& flags,
                                                const ClientSecurity& security,
                                                const ModelShape& shape) {
  IndexerTransportConfig config;
  config.transport = flags.transport;
  config.security = security;
  config.indexer_workers = flags.indexer_workers;
  config.indexer_dns = flags.indexer_dns;
  config.cuda_device = flags.attention_cuda_device;
  config.num_heads = shape.num_heads;
  config.head_dim = shape.head_dim;
  return config;
}

}  // namespace dsa
