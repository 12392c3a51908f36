// `dsa-attention`'s flags: their values, the combinations they refuse, and the options of the
// factories (factory.h) and the engine they turn into.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention_worker/factory.h"
#include "attention_worker/llama_model.h"
#include "attention_worker/pattern_model.h"
#include "attention_worker/service.h"
#include "common/mli_schedule.h"
#include "indexer_service/indexer_flags.h"

namespace dsa {

/// Values of dsa-attention's own flags (the server's are ServerFlags), defaults as --help shows
/// them. `app` is the app they were added to (to tell flags given from defaults).
struct AttentionWorkerFlags {
  std::string layer_pattern = "FSFSFSFS";
  int retention = 0;         // every R-th layer full (0: --layer-pattern)
  int num_model_layers = 0;  // 0: the pattern's, or the real model's
  int lag_depth = 1;
  PatternModelConfig model_config;  // the synthetic model's H, D (and the derived fields)
  AttentionWorkerOptions options;   // the CPU backend's shapes and the engine's options
  uint64_t seed = 0;
  int64_t select_timeout_ms = 0;         // set from options.engine's default when added
  int64_t indexer_call_timeout_ms = 0;   // likewise
  std::string transport = "grpc";        // grpc | inprocess | nccl
  std::string attention_device = "cpu";  // cpu | cuda
  int attention_cuda_device = 0;
  bool layer_standin = false;
  int64_t standin_weight_bytes = 0;  // 0: the calibrated default
  double standin_busy_us = -1;       // -1: the calibrated default
  int standin_max_rows = 256;
  IndexerFlags indexer;  // the co-located indexer's (--indexer-*)
  std::vector<std::string> indexer_workers;
  std::vector<std::string> indexer_dns;
  std::string model_name = "pattern";  // pattern | smollm2
  std::string model_file = "build/models/smollm2-135m/model.safetensors";
  std::string indexer_weights = "data/models/smollm2_indexer.safetensors";
  CLI::App* app = nullptr;
};

/// Registers the flags on `app` (the co-located indexer's with the "--indexer-" prefix, without
/// shape flags). `flags` must outlive the parse.
void AddAttentionWorkerFlags(CLI::App& app, AttentionWorkerFlags& flags);

/// After the parse: the flag combinations dsa-attention refuses (a pattern-model flag with
/// --model smollm2 and the reverse, a stand-in or GPU flag without its device, a co-located
/// indexer's flag without --transport inprocess, a negative --layer-standin-busy-us other than
/// -1). INVALID_ARGUMENT whose message names the flag (dsa-attention logs it as it is).
absl::Status CheckAttentionWorkerFlags(const AttentionWorkerFlags& flags);

/// --model smollm2's defaults where the flags did not say: every second layer full, the model's
/// layers, 65,536 KV slots (its KV is 46 KB a slot: the pattern model's 4M slots would be 190 GB).
void ApplyLlamaDefaults(const LlamaModel& model, AttentionWorkerFlags& flags);

/// The MLI schedule of --layer-pattern or --retention, --num-model-layers and --lag-depth.
/// INVALID_ARGUMENT: MliSchedule's, and --retention without --num-model-layers.
absl::StatusOr<MliSchedule> ScheduleFromFlags(const AttentionWorkerFlags& flags);

/// The synthetic pattern model of --num-heads, --head-dim and --seed over `schedule`'s full
/// layers (at most one positional diagonal a positional head). PatternModel::Create's errors.
absl::StatusOr<PatternModel> PatternModelFromFlags(const AttentionWorkerFlags& flags,
                                                   const MliSchedule& schedule);

/// The engine's options: capacity, threads, device selects and the two timeouts.
AttentionEngineOptions EngineOptionsFromFlags(const AttentionWorkerFlags& flags);

/// The factories' options (factory.h) the flags describe, for `schedule`.
AttentionBackendConfig BackendConfigFromFlags(const AttentionWorkerFlags& flags,
                                              const MliSchedule& schedule);
LlamaRunnerConfig LlamaRunnerConfigFromFlags(const AttentionWorkerFlags& flags);
/// `security` dials the indexer workers; `shape` is the model's (the indexers' H and D).
IndexerTransportConfig TransportConfigFromFlags(const AttentionWorkerFlags& flags,
                                                const ClientSecurity& security,
                                                const ModelShape& shape);

}  // namespace dsa
