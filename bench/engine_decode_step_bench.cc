// The decode step through the product's own paths on one GPU: the real
// AttentionEngine with the CUDA attention backend (DeepSeek-V3.2's MLA decode shape) over an
// Indexer with the CUDA scoring device on the same GPU, the pattern model as the model, every layer
// full (r = 1) at lag depth 1. Each arm differs only in how selections travel:
//   inprocess: InProcessIndexerClient's transport (the co-located MLI deployment: Submit returns at
//              once, the indexer thread selects while the engine attends; awaited at sigma^-1)
//   grpc:      GrpcIndexerClient's SelectStream to an IndexerServiceImpl over the same Indexer on a
//              loopback gRPC server in this process
//   serial:    the in-process transport behind a decorator whose Submit waits for the answer (the
//              indexer's time exposed: "serial" in the issue)
//   device:    the in-process transport with device-form requests (the co-located device-resident
//              path: the indexer queries generated on the GPU, the selections left there, the
//              attention stream waiting on their event at the layer that attends them)
//   ceiling:   a transport that answers at once with a fixed valid selection (no indexer work)
// With --remote-indexer ADDR (the indexer worker on its own GPU, a dsa-indexer process
// started by bench/run_two_gpu.sh) the engine's indexer is that process instead, control plane and
// data plane, and the arms are:
//   remote:        the attention worker's own client (--remote-transport nccl: NCCL data plane
//                  bootstrapped over gRPC, as dsa-attention --transport nccl; grpc: SelectStream),
//                  MLI k = 1 (Submit returns at once, awaited at the layer that attends it)
//   remote_serial: the same transport behind the serial decorator
//   ceiling
// each with SPIN off (all-keep) and SPIN rho 0.4, each with and without the layer stand-in
// (layer_standin.h, enqueued on the backend's stream after every layer's attention: no host wait
// between layers in any arm). Step time: engine->DecodeStep wall time on the steady clock, median
// over the timed steps after warm-up. docs/decode_step.md ("Through the engine") says how; results
// in docs/results/engine_decode_step_h200.md. With no GPU it says so and exits 0; --device cpu runs
// the same arms with the CPU backend and a CPU indexer (no stand-in), to check the bench itself
// (with --remote-indexer and --remote-transport grpc too). Each set's decode window (wall clock,
// Unix seconds) is in the JSON, so that a GPU-busy sampler's figures can be cut to it.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "attention_worker/attention_backend.h"
#include "attention_worker/cpu_attention_backend.h"
#include "attention_worker/cuda/cuda_attention_backend.h"
#include "attention_worker/cuda/layer_standin.h"
#include "attention_worker/engine.h"
#include "attention_worker/pattern_model.h"
#include "bench/engine_decode_step_arms.h"
#include "bench/percentile.h"
#include "common/mli_schedule.h"
#include "grpcpp/grpcpp.h"
#include "indexer_service/grpc_service.h"
#include "indexer_service/indexer.h"
#include "indexer_service/indexer_flags.h"
#include "nlohmann/json.hpp"
#include "transport/grpc_indexer_client.h"
#include "transport/in_process_indexer_client.h"
#include "transport/indexer_client.h"
#include "transport/nccl_bootstrap.h"
#include "transport/nccl_indexer_client.h"
#include "transport/selection_transport.h"

namespace {

using dsa::bench::ArmClient;
using dsa::bench::ArmTransport;
using dsa::bench::CeilingTransport;
using dsa::bench::Cell;
using dsa::bench::CellJson;
using dsa::bench::Clock;
using dsa::bench::kArms;
using dsa::bench::kCeiling;
using dsa::bench::kDevice;
using dsa::bench::kInProcess;
using dsa::bench::kNumArms;
using dsa::bench::kRemote;
using dsa::bench::kRemoteSerial;
using dsa::bench::kSerial;
using dsa::bench::ParseShapes;
using dsa::bench::Percentile;
using dsa::bench::SecondsSince;
using dsa::bench::SerialTransport;
using dsa::bench::Shape;
using dsa::bench::StepParts;
using dsa::bench::TimedBackend;
using dsa::bench::UnixSeconds;

}  // namespace

int main(int argc, char** argv) {  // NOLINT(bugprone-exception-escape): CLI11 and json errors end
                                   // the process.
  CLI::App app{"The decode step through the attention engine, its transports and the indexer"};
  std::string device = "cuda";
  int layers = 16;
  std::string shapes_text = "1x65536,1x131072,64x65536";
  int steps = 80;
  int batch_steps = 20;
  int warmup = 5;
  int batch_warmup = 2;
  double rho = 0.4;
  int top_k = 2048;
  int attention_heads = 128;
  int prefill_threads = static_cast<int>(std::max(1U, std::thread::hardware_concurrency()));
  double prefill_budget_s = 60;
  uint64_t seed = 0;
  std::string json_path;
  std::string remote_indexer;
  std::string remote_transport = "nccl";
  app.add_option("--device", device, "cuda (the measurement) or cpu (checks the bench, no GPU)")
      ->check(CLI::IsMember({"cuda", "cpu"}))
      ->capture_default_str();
  app.add_option("--layers", layers, "Model layers, every one full (r = 1), lag depth 1")
      ->capture_default_str();
  app.add_option("--shapes", shapes_text, "Comma-separated BxC: B sequences of C context slots")
      ->capture_default_str();
  app.add_option("--steps", steps, "Timed steps per arm and stand-in setting at B = 1")
      ->capture_default_str();
  app.add_option("--batch-steps", batch_steps, "Timed steps per arm and setting at B > 1")
      ->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps before each block of timed ones")
      ->capture_default_str();
  app.add_option("--batch-warmup", batch_warmup, "Untimed steps before each block at B > 1")
      ->capture_default_str();
  app.add_option("--rho", rho, "SPIN target block sparsity of the SPIN set")->capture_default_str();
  app.add_option("--top-k", top_k, "K")->capture_default_str();
  app.add_option("--attention-heads", attention_heads, "Attention heads (CUDA: multiple of 64)")
      ->capture_default_str();
  app.add_option("--prefill-threads", prefill_threads, "The engine's key-generating threads")
      ->capture_default_str();
  app.add_option("--prefill-budget-s", prefill_budget_s,
                 "A shape whose prefill the measured key rate predicts above this many seconds "
                 "runs with fewer sequences (halved until it fits; reported)")
      ->capture_default_str();
  app.add_option("--seed", seed, "Pattern model and KV seed")->capture_default_str();
  app.add_option("--json", json_path,
                 "Write every figure as JSON here (rewritten after each shape)");
  app.add_option("--remote-indexer", remote_indexer,
                 "host:port of a running dsa-indexer (H 64, D 128, capacity for the shapes): the "
                 "engine's indexer, arms remote, remote_serial and ceiling");
  bool print_index_blocks = false;
  app.add_flag("--print-index-blocks", print_index_blocks,
               "Print the index-key cache blocks the shapes need (a --remote-indexer's "
               "--capacity-blocks at least) and exit");
  app.add_option("--remote-transport", remote_transport,
                 "--remote-indexer's data plane: nccl (this process on GPU 0, the indexer on "
                 "another GPU) or grpc")
      ->check(CLI::IsMember({"nccl", "grpc"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const bool remote = !remote_indexer.empty();
  // The arms of this run, interleaved step by step; the ceiling runs after them.
  const std::vector<int> indexer_arms = remote ? std::vector<int>{kRemote, kRemoteSerial}
                                               : std::vector<int>{kInProcess, 1, kSerial, kDevice};
  const int serial_arm = remote ? kRemoteSerial : kSerial;
  const int mli_arm = remote ? kRemote : kInProcess;
  const int arms_run = static_cast<int>(indexer_arms.size()) + 1;
  auto shapes = ParseShapes(shapes_text);
  if (!shapes.ok() || layers < 1 || steps < 1 || batch_steps < 1 || warmup < 0 ||
      batch_warmup < 0) {
    std::fprintf(stderr, "bad arguments: %s\n",
                 shapes.ok() ? "layers, steps >= 1" : shapes.status().ToString().c_str());
    return 2;
  }
  // Sizes: the largest shape's two sequence sets (keep and SPIN) with their steps.
  const int steps_per_set_1 = 2 * arms_run * (warmup + steps);  // arms x 2 stand-in settings
  const int steps_per_set_b = 2 * arms_run * (batch_warmup + batch_steps);
  int64_t kv_slots = 0;
  int64_t index_blocks = 0;
  for (const Shape& s : *shapes) {
    const int set_steps = s.batch == 1 ? steps_per_set_1 : steps_per_set_b;
    kv_slots = std::max(kv_slots, s.batch * (s.context + set_steps + 64));
    // Keep set: context + its steps; SPIN set: shares the keep set's prefix, plus its own steps.
    index_blocks = std::max<int64_t>(
        index_blocks, int64_t{s.batch} * layers * ((s.context + 2 * set_steps) / 64 + 4));
  }
  if (print_index_blocks) {  // what a --remote-indexer needs, and nothing else
    std::printf("%lld\n", static_cast<long long>(index_blocks));
    return 0;
  }

  const bool on_gpu = device == "cuda";
  if (on_gpu) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      std::printf("bench_engine_decode_step: no CUDA device is present; nothing measured\n");
      return 0;
    }
    cudaSetDevice(0);
  }

  // The indexer (CUDA scoring device on GPU 0, as dsa-attention --transport inprocess builds it;
  // with --remote-indexer a small CPU one that no arm uses: the remote process holds the keys).
  dsa::IndexerFlags indexer_flags;
  indexer_flags.options.capacity_blocks = remote ? 16 : index_blocks;
  indexer_flags.options.num_heads = 64;
  indexer_flags.options.head_dim = 128;
  indexer_flags.device = on_gpu && !remote ? "cuda" : "cpu";
  if (remote) {
    std::printf("remote indexer %s over %s (it needs --capacity-blocks >= %lld)\n",
                remote_indexer.c_str(), remote_transport.c_str(),
                static_cast<long long>(index_blocks));
  }
  auto indexer = dsa::CreateIndexerFromFlags(indexer_flags);
  if (!indexer.ok()) {
    std::fprintf(stderr, "indexer: %s\n", indexer.status().ToString().c_str());
    return 1;
  }
  // The same Indexer served over gRPC on loopback (port 0).
  dsa::IndexerServiceImpl service(indexer->get());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(dsa::kMaxReceiveMessageBytes);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "cannot start the loopback gRPC server\n");
    return 1;
  }
  auto grpc_client = dsa::GrpcIndexerClient::Factory()(absl::StrCat("127.0.0.1:", port));
  auto in_process_client =
      dsa::InProcessIndexerClient::Factory(indexer->get())(dsa::kInProcessIndexerAddress);
  if (!grpc_client.ok() || !in_process_client.ok()) return 1;
  // --remote-indexer: the attention worker's own client of that process.
  std::shared_ptr<dsa::IndexerClient> remote_client;
  if (remote) {
    absl::StatusOr<std::shared_ptr<dsa::IndexerClient>> made;
    if (remote_transport == "nccl") {
      dsa::NcclConnectOptions nccl_options;
      nccl_options.link.cuda_device = 0;
      nccl_options.num_heads = 64;
      nccl_options.head_dim = 128;
      nccl_options.attention_worker = "bench_engine_decode_step";
      made = dsa::NcclIndexerClientFactory(nccl_options)(remote_indexer);
    } else {
      made = dsa::GrpcIndexerClient::Factory()(remote_indexer);
    }
    if (!made.ok()) {
      std::fprintf(stderr, "--remote-indexer: %s\n", made.status().ToString().c_str());
      return 1;
    }
    remote_client = *std::move(made);
  }
  // The control plane every sequence is made and released through.
  dsa::IndexerClient& control = remote ? *remote_client : **in_process_client;
  StepParts parts;
  SerialTransport serial(&(*in_process_client)->Selections());
  SerialTransport remote_serial(remote ? &remote_client->Selections() : nullptr);
  CeilingTransport ceiling(top_k);
  dsa::SelectionTransport* arm_transports[kNumArms] = {
      &(*in_process_client)->Selections(),
      &(*grpc_client)->Selections(),
      &serial,
      &(*in_process_client)->Selections(),
      &ceiling,
      remote ? &remote_client->Selections() : nullptr,
      &remote_serial};
  ArmTransport arm_transport(&parts);
  auto arm_client = std::make_shared<ArmClient>(
      remote ? remote_client : std::shared_ptr<dsa::IndexerClient>(*in_process_client),
      &arm_transport);

  // The attention backend with the stand-in as the rest of each layer (on its stream).
  dsa::cuda::LayerStandin standin;
  __nv_bfloat16* activations = nullptr;
  __nv_bfloat16* standin_out = nullptr;
  cudaStream_t standin_stream = nullptr;
  bool standin_enabled = false;
  cudaError_t standin_error = cudaSuccess;
  std::unique_ptr<dsa::AttentionBackend> inner;
  nlohmann::json standin_json = nullptr;
  int max_batch = 1;
  for (const Shape& s : *shapes) max_batch = std::max(max_batch, s.batch);
  if (on_gpu) {
    dsa::cuda::LayerStandinParams params;  // header defaults: 76.0 MB a layer + 84 us busy
    params.max_rows = std::max(params.max_rows, max_batch);
    cudaError_t error = dsa::cuda::CreateLayerStandin(params, &standin);
    if (error == cudaSuccess) {
      error = cudaMalloc(reinterpret_cast<void**>(&activations),
                         sizeof(__nv_bfloat16) * params.max_rows * params.hidden_dim);
    }
    if (error == cudaSuccess) {
      error =
          cudaMemset(activations, 0, sizeof(__nv_bfloat16) * params.max_rows * params.hidden_dim);
    }
    if (error == cudaSuccess) {
      error = cudaMalloc(reinterpret_cast<void**>(&standin_out),
                         sizeof(__nv_bfloat16) * params.max_rows * standin.weight_rows);
    }
    if (error == cudaSuccess)
      error = cudaStreamCreateWithFlags(&standin_stream, cudaStreamNonBlocking);
    if (error != cudaSuccess) {
      std::fprintf(stderr, "layer stand-in: %s\n", cudaGetErrorString(error));
      return 1;
    }
    // The stand-in alone (its GEMM and the whole layer), at each batch's rows.
    standin_json = nlohmann::json::object();
    for (const Shape& s : *shapes) {
      dsa::cuda::LayerStandinTiming timing;
      error = dsa::cuda::MeasureLayerStandin(&standin, activations, s.batch, standin_out, 50,
                                             standin_stream, &timing);
      if (error != cudaSuccess) {
        std::fprintf(stderr, "layer stand-in timing: %s\n", cudaGetErrorString(error));
        return 1;
      }
      standin_json[absl::StrCat("rows_", s.batch)] = {{"gemm_us", timing.gemm_micros},
                                                      {"layer_us", timing.layer_micros}};
      std::printf("stand-in alone, %d rows: GEMM %.1f us, layer %.1f us (%.0f GB/s)\n", s.batch,
                  timing.gemm_micros, timing.layer_micros, timing.weight_bytes_per_second / 1e9);
    }
    dsa::cuda::CudaAttentionBackendOptions backend_options;
    backend_options.num_model_layers = layers;
    backend_options.num_heads = attention_heads;
    backend_options.seed = seed;
    backend_options.capacity_slots = kv_slots;
    backend_options.rest_of_layer = [&](void* stream, int rows) -> cudaError_t {
      if (!standin_enabled) return cudaSuccess;
      const cudaError_t ran = dsa::cuda::RunLayerStandin(&standin, activations, rows, standin_out,
                                                         static_cast<cudaStream_t>(stream));
      if (ran != cudaSuccess) standin_error = ran;
      return ran;
    };
    auto backend = dsa::cuda::CreateCudaAttentionBackend(backend_options);
    if (!backend.ok()) {
      std::fprintf(stderr, "attention backend: %s\n", backend.status().ToString().c_str());
      return 1;
    }
    inner = std::move(*backend);
  } else {
    dsa::CpuAttentionBackendOptions backend_options;
    backend_options.num_model_layers = layers;
    backend_options.seed = seed;
    auto backend = dsa::CpuAttentionBackend::Create(backend_options);
    if (!backend.ok()) return 1;
    inner = std::move(*backend);
  }
  auto wrapped = std::make_unique<TimedBackend>(std::move(inner), &parts);

  auto schedule = dsa::MliSchedule::FromRetention(layers, 1, 1);
  dsa::PatternModelConfig model_config;
  model_config.num_layers = layers;
  model_config.num_heads = 64;
  model_config.head_dim = 128;
  model_config.seed = seed;
  auto model = dsa::PatternModel::Create(model_config);
  if (!schedule.ok() || !model.ok()) return 1;
  dsa::AttentionEngineOptions engine_options;
  engine_options.kv_capacity_slots = kv_slots;
  engine_options.prefill_threads = prefill_threads;
  engine_options.indexer_call_timeout = absl::Seconds(600);
  auto engine = dsa::AttentionEngine::Create(
      *schedule, std::move(*model), std::move(wrapped),
      [arm_client](const std::string&) -> absl::StatusOr<std::shared_ptr<dsa::IndexerClient>> {
        return std::shared_ptr<dsa::IndexerClient>(arm_client);
      },
      engine_options);
  if (!engine.ok()) {
    std::fprintf(stderr, "engine: %s\n", engine.status().ToString().c_str());
    return 1;
  }

  nlohmann::json out = {
      {"device", on_gpu ? (*engine)->model().Description() : "cpu"},
      {"indexer_device", remote
                             ? absl::StrCat("remote ", remote_indexer, " over ", remote_transport)
                             : (*indexer)->DeviceDescription()},
      {"arms", nlohmann::json::array()},
      {"layers", layers},
      {"retention", 1},
      {"lag_depth", 1},
      {"top_k", top_k},
      {"indexer_heads", 64},
      {"indexer_head_dim", 128},
      {"attention_heads", attention_heads},
      {"rho", rho},
      {"warmup", warmup},
      {"batch_warmup", batch_warmup},
      {"prefill_threads", prefill_threads},
      {"standin_alone", standin_json},
      {"shapes", nlohmann::json::array()},
  };
  auto write_json = [&] {
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  };
  for (int arm : indexer_arms) out["arms"].push_back(kArms[arm]);
  out["arms"].push_back(kArms[kCeiling]);
  std::printf("engine decode step: %d layers (all full, k = 1), K %d, indexer %s, attention %s\n",
              layers, top_k, out["indexer_device"].get<std::string>().c_str(),
              (*engine)->model().Description().c_str());

  double keys_per_second = 0;  // measured by the first prefill
  uint64_t next_id = 1;
  int exit_code = 0;
  for (const Shape& requested : *shapes) {
    Shape shape = requested;
    if (keys_per_second > 0) {
      while (shape.batch > 1 && static_cast<double>(shape.batch) * static_cast<double>(layers) *
                                        static_cast<double>(shape.context) / keys_per_second >
                                    prefill_budget_s) {
        shape.batch /= 2;
      }
    }
    const int timed = shape.batch == 1 ? steps : batch_steps;
    const int untimed = shape.batch == 1 ? warmup : batch_warmup;
    std::printf("\n== %d x %lld (requested %d x %lld), %d timed steps a cell ==\n", shape.batch,
                static_cast<long long>(shape.context), requested.batch,
                static_cast<long long>(requested.context), timed);
    std::fflush(stdout);
    nlohmann::json shape_json = {{"batch", shape.batch},     {"requested_batch", requested.batch},
                                 {"context", shape.context}, {"timed_steps", timed},
                                 {"warmup_steps", untimed},  {"sets", nlohmann::json::object()}};
    std::vector<uint64_t> keep_ids;
    // [set][arm][standin]
    Cell cells[2][kNumArms][2];
    bool failed = false;
    for (int set = 0; set < 2 && !failed; ++set) {  // 0: all-keep, 1: SPIN rho
      std::vector<uint64_t> ids;
      const Clock::time_point prefill_start = Clock::now();
      for (int b = 0; b < shape.batch && !failed; ++b) {
        dsa::PrefillSpec spec;
        spec.sequence_id = next_id++;
        spec.context_length = shape.context;
        spec.indexer_worker = "bench-arms";
        spec.top_k = top_k;
        spec.spin.enabled = set == 1;
        spec.spin.target_block_sparsity = rho;
        if (set == 1) {  // the keep set's index keys, shared (no key generated again)
          spec.prefix_source_id = keep_ids[b];
          spec.prefix_slots = shape.context / 64 * 64;
        }
        auto prefilled = (*engine)->Prefill(spec);
        if (!prefilled.ok()) {
          std::fprintf(stderr, "prefill: %s\n", prefilled.status().ToString().c_str());
          failed = true;
        }
        ids.push_back(spec.sequence_id);
      }
      if (failed) break;
      const double prefill_s = SecondsSince(prefill_start);
      if (set == 0) {
        keys_per_second = static_cast<double>(shape.batch) * layers *
                          static_cast<double>(shape.context) / prefill_s;
      }
      std::printf("%s set: prefill of %d x %lld slots x %d layers in %.2f s%s\n",
                  set == 0 ? "all-keep" : "SPIN", shape.batch,
                  static_cast<long long>(shape.context), layers, prefill_s,
                  set == 0 ? absl::StrCat(" (", keys_per_second / 1e6, " M keys/s)").c_str()
                           : " (keys shared with the all-keep set; KV generated on the device)");
      std::fflush(stdout);
      shape_json["sets"][set == 0 ? "keep" : "spin"]["prefill_s"] = prefill_s;
      std::vector<dsa::StepMember> members;
      members.reserve(ids.size());
      for (uint64_t id : ids) members.push_back({id, 1});

      auto run_step = [&](int arm, Cell* cell) -> bool {
        arm_transport.set_arm(arm_transports[arm], arm == kDevice);
        parts = StepParts{};
        const Clock::time_point start = Clock::now();
        auto result = (*engine)->DecodeStep(members);
        const double seconds = SecondsSince(start);
        if (!result.ok()) {
          std::fprintf(stderr, "%s step: %s\n", kArms[arm], result.status().ToString().c_str());
          return false;
        }
        if (arm == kDevice && on_gpu && result->device_selects == 0) {
          std::fprintf(stderr, "device step: no select went in device form\n");
          return false;
        }
        if (cell != nullptr) {
          cell->step_seconds.push_back(seconds);
          cell->parts.push_back(parts);
          double wait = 0;
          for (double w : result->selection_wait_seconds) wait += w;
          cell->wait_seconds.push_back(wait);
          for (const dsa::SequenceStepResult& s : result->sequences) {
            cell->blocks_scored += s.blocks_scored;
            cell->blocks_visible += s.blocks_visible;
          }
        }
        return true;
      };
      // The indexer arms interleaved step by step (machine drift hits all alike), then the ceiling
      // (it leaves the indexer's sequences behind the engine's, so it comes last).
      const double window_start = UnixSeconds();
      for (int with_standin = 0; with_standin < 2 && !failed; ++with_standin) {
        standin_enabled = on_gpu && with_standin == 1;
        for (int it = 0; it < untimed + timed && !failed; ++it) {
          for (int arm : indexer_arms) {
            if (failed) break;
            failed = !run_step(arm, it < untimed ? nullptr : &cells[set][arm][with_standin]);
          }
        }
      }
      for (int with_standin = 0; with_standin < 2 && !failed; ++with_standin) {
        standin_enabled = on_gpu && with_standin == 1;
        for (int it = 0; it < untimed + timed && !failed; ++it) {
          failed =
              !run_step(kCeiling, it < untimed ? nullptr : &cells[set][kCeiling][with_standin]);
        }
      }
      shape_json["sets"][set == 0 ? "keep" : "spin"]["decode_window_unix"] = {window_start,
                                                                              UnixSeconds()};
      // The keep set stays on the indexer as the SPIN set's prefix donor.
      for (uint64_t id : ids) (void)(*engine)->Release(id, /*keep_indexer_sequence=*/set == 0);
      if (set == 0) keep_ids = ids;
    }
    for (uint64_t id : keep_ids) (void)control.Release(id, absl::InfiniteFuture());
    if (failed) {
      exit_code = 1;
      break;
    }

    // Per-layer table and derived figures.
    std::printf(
        "\n| stand-in | set | arm | layer us | step ms p50 (p10-p90) | submit | await | attention "
        "| drain | rest | hidden vs serial keep | hidden vs serial same set |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int with_standin = 0; with_standin < 2; ++with_standin) {
      const char* standin_name = with_standin == 1 ? "standin" : "bare";
      const double serial_keep = Percentile(cells[0][serial_arm][with_standin].step_seconds, 0.5);
      for (int set = 0; set < 2; ++set) {
        const char* set_name = set == 0 ? "keep" : "spin";
        const double ceiling_step =
            Percentile(cells[set][kCeiling][with_standin].step_seconds, 0.5);
        const double serial_same =
            Percentile(cells[set][serial_arm][with_standin].step_seconds, 0.5);
        for (int arm = 0; arm < kNumArms; ++arm) {
          if (arm != kCeiling &&
              std::find(indexer_arms.begin(), indexer_arms.end(), arm) == indexer_arms.end()) {
            continue;  // not an arm of this run
          }
          const Cell& cell = cells[set][arm][with_standin];
          nlohmann::json j = CellJson(cell, layers);
          const double step = Percentile(cell.step_seconds, 0.5);
          // The ceiling of the same set (the keep set's for serial keep's reference).
          const double hidden_keep =
              (serial_keep - step) /
              (serial_keep - Percentile(cells[0][kCeiling][with_standin].step_seconds, 0.5));
          const double hidden_same = (serial_same - step) / (serial_same - ceiling_step);
          if (arm != kCeiling) {
            j["hidden_vs_serial_keep"] = hidden_keep;
            j["hidden_vs_serial_same_set"] = hidden_same;
          }
          shape_json["sets"][set_name][standin_name][kArms[arm]] = j;
          const double rest = j["rest_us_per_layer"].get<double>();
          std::printf(
              "| %s | %s | %s | %.1f | %.2f (%.2f-%.2f) | %.1f | %.1f | %.1f | %.1f | %.1f | %s | "
              "%s |\n",
              standin_name, set_name, kArms[arm], j["layer_us"].get<double>(),
              j["step_ms_p50"].get<double>(), j["step_ms_p10"].get<double>(),
              j["step_ms_p90"].get<double>(), j["submit_us_per_layer"].get<double>(),
              j["await_us_per_layer"].get<double>(), j["attention_us_per_layer"].get<double>(),
              j["drain_us_per_layer"].get<double>(), rest,
              arm == kCeiling ? "-" : absl::StrFormat("%.3f", hidden_keep).c_str(),
              arm == kCeiling ? "-" : absl::StrFormat("%.3f", hidden_same).c_str());
        }
      }
    }
    const Cell& spin_in = cells[1][mli_arm][0];
    std::printf("SPIN set realized block sparsity (%s, bare): %.3f\n", kArms[mli_arm],
                spin_in.blocks_visible > 0 ? 1.0 - static_cast<double>(spin_in.blocks_scored) /
                                                       static_cast<double>(spin_in.blocks_visible)
                                           : 0.0);
    out["shapes"].push_back(shape_json);
    write_json();
    std::fflush(stdout);
  }

  // The scoring device must have served every select (a GPU failure falls back to the CPU).
  const absl::Status device_status = (*indexer)->DeviceStatus();
  out["indexer_device_after"] = (*indexer)->DeviceDescription();
  if (on_gpu && !remote && !device_status.ok()) {
    std::fprintf(stderr, "the indexer's scoring device was dropped: %s\n",
                 device_status.ToString().c_str());
    exit_code = 1;
  }
  if (standin_error != cudaSuccess) {
    std::fprintf(stderr, "layer stand-in: %s\n", cudaGetErrorString(standin_error));
    exit_code = 1;
  }
  write_json();
  (*engine)->CloseIndexerClients();
  if (remote) (void)remote_client->Close();
  (void)(*grpc_client)->Close();
  (void)(*in_process_client)->Close();
  server->Shutdown();
  engine->reset();
  if (on_gpu) {
    (void)dsa::cuda::DestroyLayerStandin(&standin);
    (void)cudaFree(activations);
    (void)cudaFree(standin_out);
    (void)cudaStreamDestroy(standin_stream);
  }
  return exit_code;
}
