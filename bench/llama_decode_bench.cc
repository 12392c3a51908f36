// The real model's decode step and prefill (docs/model.md) through the LlamaRunner seam
// (attention_worker/llama_runner.h), on the CPU and, built with CUDA and given a GPU, on the GPU:
// tokens/s of one decode step of B sequences (B = 1 and 8 by default) at context C (1K and 8K),
// in three arms:
//   dense:  every layer attends all C slots of each row (K >= C);
//   sparse: every layer attends K = 512 slots a row (a fixed selection: the row's own slot and
//           K - 1 other distinct slots from a seeded shuffle, the same every layer and step; not
//           the indexer's top-K: its scoring and top-K are the indexer service's work);
//   dsa:    sparse plus what the model does for the indexer in a DSA step: the indexer inputs of
//           every full layer (every --retention-th, from 0) computed and copied to the host.
// A step is Begin, per layer (IndexerInputs) and RunLayer, then Logits of every row and the host
// argmax; wall clock on the steady clock (the GPU's Logits waits for its stream), median of
// --steps timed steps after --warmup. Each step decodes at position C - 1 of every sequence and
// then truncates the caches back to C - 1 slots, so every step sees the same context. Prefill:
// one sequence's C - 1 tokens in one dense pass with the indexer inputs of the full layers and the
// last row's logits (as LlamaAttentionModel::Extend), median of --prefill-repeats; the other B - 1
// sequences copy its cache. Weights: --model-file / --indexer-weights (SmolLM2-135M), or
// --random-weights (SmolLM2-135M's shapes, seeded values: the same arithmetic, no files).
// Writes --out (JSON) and prints a table. Runs on the CPU anywhere (small --contexts, --steps).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attention_worker/llama_model.h"
#include "attention_worker/llama_runner.h"
#include "bench/percentile.h"
#include "nlohmann/json.hpp"
#ifdef DSA_WITH_CUDA
#include "attention_worker/cuda/llama_cuda_runner.h"
#endif

namespace {

using Clock = std::chrono::steady_clock;
using dsa::bench::Percentile;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// SmolLM2-135M's shapes with seeded values (uniform, scaled like trained weights' magnitudes).
std::shared_ptr<const dsa::LlamaModel> RandomSmolLM2(uint64_t seed) {
  const dsa::LlamaConfig c = dsa::SmolLM2Config();
  dsa::LightningIndexerConfig ic;
  ic.num_layers = c.num_layers;
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  const auto fill = [&](int64_t n, float scale, float mean = 0.0f) {
    std::vector<float> out(n);
    for (float& x : out) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const float u = static_cast<float>(state >> 40) / static_cast<float>(1 << 24);  // [0, 1)
      x = mean + scale * (2.0f * u - 1.0f);
    }
    return out;
  };
  const int64_t d = c.d_model;
  const float s = 1.7f / std::sqrt(static_cast<float>(d));  // uniform: stddev s / sqrt(3)
  std::vector<dsa::LlamaModel::Layer> layers(c.num_layers);
  std::vector<dsa::LlamaModel::IndexerLayer> indexers(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    layers[l].attn_norm = fill(d, 0.1f, 1.0f);
    layers[l].wqkv = fill((c.q_dim() + 2 * c.kv_dim()) * d, 2 * s);
    layers[l].wo = fill(d * c.q_dim(), s);
    layers[l].ffn_norm = fill(d, 0.1f, 1.0f);
    layers[l].wgate_up = fill(2 * c.ffn_dim * d, s);
    layers[l].wdown = fill(d * c.ffn_dim, 1.7f / std::sqrt(static_cast<float>(c.ffn_dim)));
    indexers[l].wproj = fill((ic.query_rank + ic.head_dim + ic.num_heads) * d, s);
    indexers[l].wqb = fill(ic.num_heads * ic.head_dim * ic.query_rank, 0.15f);
    indexers[l].k_norm_weight = fill(ic.head_dim, 0.1f, 1.0f);
    indexers[l].k_norm_bias = fill(ic.head_dim, 0.1f);
  }
  auto model = dsa::LlamaModel::FromWeights(c, fill(c.vocab_size * d, 0.1f), fill(d, 0.1f, 1.0f),
                                            std::move(layers), ic, std::move(indexers));
  if (!model.ok()) {
    std::fprintf(stderr, "random model: %s\n", model.status().ToString().c_str());
    std::exit(1);
  }
  return *model;
}

struct Settings {
  std::vector<int64_t> contexts;
  std::vector<int> batches;
  int top_k = 512;
  int retention = 2;
  int steps = 10;
  int warmup = 2;
  int prefill_repeats = 3;
  uint64_t seed = 0;
};

// One arm's timed steps at one (device, context, batch).
struct ArmResult {
  std::string device, arm;
  int64_t context = 0;
  int batch = 0;
  int top_k = 0;  // 0 for dense
  std::vector<double> step_seconds;
};

struct PrefillResult {
  std::string device;
  int64_t tokens = 0;
  std::vector<double> seconds;
};

// A fixed selection of K distinct slots of [0, position] including `position` (all of them when
// K > position), seeded by the sequence.
std::vector<int32_t> FixedSelection(int64_t position, int k, uint64_t seed) {
  std::vector<int32_t> slots(position);
  std::iota(slots.begin(), slots.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(std::min<int64_t>(k - 1, position));
  slots.push_back(static_cast<int32_t>(position));
  return slots;
}

absl::Status CheckOk(const absl::Status& status, const std::string& what) {
  return status.ok() ? status
                     : absl::Status(status.code(), absl::StrCat(what, ": ", status.message()));
}

// Runs the benchmark on one runner: prefill per context, then the decode arms per batch.
absl::Status RunDevice(dsa::LlamaRunner& runner, const std::string& device, const Settings& s,
                       std::vector<ArmResult>* arms, std::vector<PrefillResult>* prefills) {
  const dsa::LlamaModel& model = runner.model();
  const dsa::LlamaConfig& c = model.config();
  const dsa::LightningIndexerConfig& ic = model.indexer_config();
  const int max_batch = *std::max_element(s.batches.begin(), s.batches.end());
  std::mt19937 rng(static_cast<uint32_t>(s.seed));
  std::uniform_int_distribution<int32_t> token(17, std::min(c.vocab_size - 1, 20000));
  for (const int64_t context : s.contexts) {
    if (context < 2 || context > c.context_length) {
      return absl::InvalidArgumentError(
          absl::StrCat("context ", context, " outside [2, ", c.context_length, "]"));
    }
    const int64_t prompt = context - 1;
    std::vector<std::unique_ptr<dsa::LlamaSequenceCache>> caches;
    for (int b = 0; b < max_batch; ++b) {
      auto cache = runner.NewCache();
      if (!cache.ok()) return cache.status();
      caches.push_back(*std::move(cache));
    }
    std::vector<int32_t> tokens(prompt);
    for (int32_t& t : tokens) t = token(rng);
    // Prefill (timed): sequence 0's prompt, as LlamaAttentionModel::Extend runs it.
    PrefillResult prefill{device, prompt, {}};
    for (int repeat = 0; repeat < s.prefill_repeats; ++repeat) {
      if (absl::Status status = caches[0]->Truncate(0); !status.ok()) return status;
      std::vector<dsa::LlamaRunnerRow> rows(prompt);
      for (int64_t i = 0; i < prompt; ++i) rows[i] = {caches[0].get(), i, tokens[i]};
      std::vector<float> queries(prompt * ic.num_heads * ic.head_dim);
      std::vector<float> head_weights(prompt * ic.num_heads), keys(prompt * ic.head_dim);
      std::vector<float> logits(c.vocab_size);
      const Clock::time_point start = Clock::now();
      auto pass = runner.Begin(std::move(rows));
      if (!pass.ok()) return CheckOk(pass.status(), "prefill");
      for (int l = 0; l < c.num_layers; ++l) {
        if (l % s.retention == 0) {
          if (absl::Status st = (*pass)->IndexerInputs(queries, head_weights, keys); !st.ok()) {
            return CheckOk(st, "prefill indexer inputs");
          }
        }
        if (absl::Status st = (*pass)->RunLayer(); !st.ok()) return CheckOk(st, "prefill layer");
      }
      const int32_t last = static_cast<int32_t>(prompt - 1);
      if (absl::Status st = (*pass)->Logits(std::span<const int32_t>(&last, 1), logits); !st.ok()) {
        return CheckOk(st, "prefill logits");
      }
      prefill.seconds.push_back(SecondsSince(start));
    }
    prefills->push_back(prefill);
    std::fprintf(stderr, "%s: prefill of %lld tokens: %.1f ms (median of %d)\n", device.c_str(),
                 static_cast<long long>(prompt), 1e3 * Percentile(prefill.seconds, 0.5),
                 s.prefill_repeats);
    for (int b = 1; b < max_batch; ++b) {
      if (absl::Status st = caches[b]->CopyFrom(*caches[0]); !st.ok()) {
        return CheckOk(st, "copying the prefilled cache");
      }
    }
    // The decode arms.
    for (const int batch : s.batches) {
      std::vector<std::vector<int32_t>> selections(batch);
      for (int b = 0; b < batch; ++b) {
        selections[b] = FixedSelection(prompt, s.top_k, s.seed * 131 + b);
      }
      for (const std::string arm : {"dense", "sparse", "dsa"}) {
        ArmResult result{device, arm, context, batch, arm == "dense" ? 0 : s.top_k, {}};
        std::vector<std::span<const int32_t>> spans;
        if (arm != "dense") {
          for (const auto& selection : selections) spans.emplace_back(selection);
        }
        std::vector<float> queries(batch * ic.num_heads * ic.head_dim);
        std::vector<float> head_weights(batch * ic.num_heads), keys(batch * ic.head_dim);
        std::vector<float> logits(static_cast<size_t>(batch) * c.vocab_size);
        std::vector<int32_t> all(batch);
        std::iota(all.begin(), all.end(), 0);
        std::vector<int32_t> next(batch, token(rng));
        for (int step = -s.warmup; step < s.steps; ++step) {
          std::vector<dsa::LlamaRunnerRow> rows(batch);
          for (int b = 0; b < batch; ++b) rows[b] = {caches[b].get(), prompt, next[b]};
          const Clock::time_point start = Clock::now();
          auto pass = runner.Begin(std::move(rows));
          if (!pass.ok()) return CheckOk(pass.status(), "decode step");
          for (int l = 0; l < c.num_layers; ++l) {
            if (arm == "dsa" && l % s.retention == 0) {
              if (absl::Status st = (*pass)->IndexerInputs(queries, head_weights, keys); !st.ok()) {
                return CheckOk(st, "decode indexer inputs");
              }
            }
            if (absl::Status st = (*pass)->RunLayer(spans); !st.ok()) {
              return CheckOk(st, "decode layer");
            }
          }
          if (absl::Status st = (*pass)->Logits(all, logits); !st.ok()) {
            return CheckOk(st, "decode logits");
          }
          for (int b = 0; b < batch; ++b) {
            const float* row = &logits[static_cast<size_t>(b) * c.vocab_size];
            next[b] = static_cast<int32_t>(std::max_element(row, row + c.vocab_size) - row);
          }
          const double seconds = SecondsSince(start);
          pass->reset();
          if (step >= 0) result.step_seconds.push_back(seconds);
          for (int b = 0; b < batch; ++b) {
            if (absl::Status st = caches[b]->Truncate(prompt); !st.ok()) return st;
          }
        }
        const double median = Percentile(result.step_seconds, 0.5);
        std::fprintf(stderr, "%s: context %lld, batch %d, %s: %.2f ms a step, %.1f tokens/s\n",
                     device.c_str(), static_cast<long long>(context), batch, arm.c_str(),
                     1e3 * median, batch / median);
        arms->push_back(std::move(result));
      }
    }
  }
  return absl::OkStatus();
}

template <typename T>
std::vector<T> ParseList(const std::string& text) {
  std::vector<T> out;
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t end = std::min(text.find(',', begin), text.size());
    if (end > begin) out.push_back(static_cast<T>(std::stoll(text.substr(begin, end - begin))));
    begin = end + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "llama_decode_bench: SmolLM2-135M's decode step and prefill, dense against DSA, "
      "on the CPU and the GPU (bench/llama_decode_bench.cc)"};
  std::string model_file, indexer_weights = "data/models/smollm2_indexer.safetensors";
  bool random_weights = false;
  std::string devices = "auto", contexts = "1024,8192", batches = "1,8", out;
  std::string cpu_contexts;
  Settings s;
  int64_t cpu_parallel_min_work = dsa::LlamaForwardOptions{}.parallel_min_work;
  int cuda_device = 0;
  app.add_option("--model-file", model_file,
                 "The backbone (fp32 safetensors of scripts/model_setup.sh); or --random-weights");
  app.add_option("--indexer-weights", indexer_weights, "The lightning indexers (fp16 safetensors)")
      ->capture_default_str();
  app.add_flag("--random-weights", random_weights,
               "SmolLM2-135M's shapes with seeded random weights (no files)");
  app.add_option("--devices", devices, "cpu, cuda, or both (auto: cpu, and cuda when present)")
      ->capture_default_str();
  app.add_option("--contexts", contexts, "Contexts C (slots a decode row attends)")
      ->capture_default_str();
  app.add_option("--cpu-contexts", cpu_contexts, "The CPU's contexts (default: --contexts)");
  app.add_option("--batches", batches, "Sequences a decode step")->capture_default_str();
  app.add_option("--top-k", s.top_k, "K of the sparse and dsa arms")->capture_default_str();
  app.add_option("--retention", s.retention, "Every R-th layer (from 0) is full (dsa arm)")
      ->capture_default_str();
  app.add_option("--steps", s.steps, "Timed decode steps an arm")->capture_default_str();
  app.add_option("--warmup", s.warmup, "Untimed decode steps before them")->capture_default_str();
  app.add_option("--prefill-repeats", s.prefill_repeats, "Timed prefills a context")
      ->capture_default_str();
  int cpu_prefill_repeats = 1, cpu_steps = 0;
  app.add_option("--cpu-prefill-repeats", cpu_prefill_repeats, "The CPU's timed prefills")
      ->capture_default_str();
  app.add_option("--cpu-steps", cpu_steps, "The CPU's timed decode steps an arm (0: --steps)")
      ->capture_default_str();
  app.add_option("--seed", s.seed, "Tokens, selections, random weights")->capture_default_str();
  app.add_option("--cpu-parallel-min-work", cpu_parallel_min_work,
                 "LlamaForwardOptions::parallel_min_work of the CPU runner")
      ->capture_default_str();
  app.add_option("--cuda-device", cuda_device, "CUDA ordinal")->capture_default_str();
  app.add_option("--out", out, "JSON results file");
  CLI11_PARSE(app, argc, argv);
  s.contexts = ParseList<int64_t>(contexts);
  s.batches = ParseList<int>(batches);
  if (s.contexts.empty() || s.batches.empty() || s.top_k < 1 || s.retention < 1 || s.steps < 1 ||
      s.warmup < 0 || s.prefill_repeats < 1 ||
      *std::min_element(s.batches.begin(), s.batches.end()) < 1) {
    std::fprintf(stderr, "bad settings\n");
    return 2;
  }
  if (model_file.empty() == !random_weights) {
    std::fprintf(stderr, "give --model-file (with --indexer-weights) or --random-weights\n");
    return 2;
  }
  const Clock::time_point load_start = Clock::now();
  std::shared_ptr<const dsa::LlamaModel> model;
  if (random_weights) {
    model = RandomSmolLM2(s.seed);
  } else {
    auto loaded = dsa::LlamaModel::Load(model_file, indexer_weights);
    if (!loaded.ok()) {
      std::fprintf(stderr, "%s\n", loaded.status().ToString().c_str());
      return 2;
    }
    model = *loaded;
  }
  std::fprintf(stderr, "model: %s in %.1f s (%lld MB of fp32 weights)\n",
               random_weights ? "random SmolLM2-135M shapes" : model_file.c_str(),
               SecondsSince(load_start), static_cast<long long>(model->weight_bytes() >> 20));

  bool want_cpu = devices == "auto" || devices.find("cpu") != std::string::npos;
  bool want_cuda = devices == "auto" || devices.find("cuda") != std::string::npos;
  nlohmann::json runners = nlohmann::json::array();
  std::vector<ArmResult> arms;
  std::vector<PrefillResult> prefills;
  // The GPU first (its figures are the point; the CPU's take longer).
#ifdef DSA_WITH_CUDA
  if (want_cuda && dsa::cuda::CudaDeviceCount() == 0) {
    std::fprintf(stderr, "cuda: no CUDA device; skipped\n");
    want_cuda = false;
  }
  if (want_cuda) {
    auto gpu = dsa::cuda::CreateCudaLlamaRunner(model, {cuda_device});
    if (!gpu.ok()) {
      std::fprintf(stderr, "cuda: %s\n", gpu.status().ToString().c_str());
      return 1;
    }
    runners.push_back({{"device", "cuda"}, {"description", (*gpu)->Description()}});
    if (absl::Status st = RunDevice(**gpu, "cuda", s, &arms, &prefills); !st.ok()) {
      std::fprintf(stderr, "cuda: %s\n", st.ToString().c_str());
      return 1;
    }
  }
#else
  if (want_cuda && devices != "auto") {
    std::fprintf(stderr, "cuda: this build has no CUDA\n");
    return 2;
  }
#endif
  if (want_cpu) {
    Settings cpu = s;
    if (!cpu_contexts.empty()) cpu.contexts = ParseList<int64_t>(cpu_contexts);
    cpu.prefill_repeats = std::max(1, cpu_prefill_repeats);
    if (cpu_steps > 0) cpu.steps = cpu_steps;
    dsa::LlamaForwardOptions options;
    options.parallel_min_work = cpu_parallel_min_work;
    std::shared_ptr<dsa::LlamaRunner> runner = dsa::MakeCpuLlamaRunner(model, options);
    runners.push_back({{"device", "cpu"},
                       {"description", absl::StrCat("cpu (", std::thread::hardware_concurrency(),
                                                    " hardware threads)")}});
    if (absl::Status st = RunDevice(*runner, "cpu", cpu, &arms, &prefills); !st.ok()) {
      std::fprintf(stderr, "cpu: %s\n", st.ToString().c_str());
      return 1;
    }
  }

  // The table, and the JSON.
  std::printf("\n%-5s %7s %5s %-6s %6s %10s %12s %10s\n", "dev", "context", "batch", "arm", "K",
              "step ms", "tokens/s", "vs dense");
  nlohmann::json decode = nlohmann::json::array();
  for (const ArmResult& r : arms) {
    const double median = Percentile(r.step_seconds, 0.5);
    double dense = 0;
    for (const ArmResult& other : arms) {
      if (other.device == r.device && other.context == r.context && other.batch == r.batch &&
          other.arm == "dense") {
        dense = Percentile(other.step_seconds, 0.5);
      }
    }
    std::printf("%-5s %7lld %5d %-6s %6d %10.3f %12.1f %9.2fx\n", r.device.c_str(),
                static_cast<long long>(r.context), r.batch, r.arm.c_str(), r.top_k, 1e3 * median,
                r.batch / median, dense / median);
    decode.push_back({{"device", r.device},
                      {"context", r.context},
                      {"batch", r.batch},
                      {"arm", r.arm},
                      {"top_k", r.top_k},
                      {"step_ms_median", 1e3 * median},
                      {"step_ms_p10", 1e3 * Percentile(r.step_seconds, 0.1)},
                      {"step_ms_p90", 1e3 * Percentile(r.step_seconds, 0.9)},
                      {"tokens_per_second", r.batch / median},
                      {"speedup_over_dense", dense / median},
                      {"steps", r.step_seconds.size()}});
  }
  std::printf("\n%-5s %7s %10s %12s\n", "dev", "tokens", "prefill ms", "tokens/s");
  nlohmann::json prefill = nlohmann::json::array();
  for (const PrefillResult& p : prefills) {
    const double median = Percentile(p.seconds, 0.5);
    std::printf("%-5s %7lld %10.1f %12.1f\n", p.device.c_str(), static_cast<long long>(p.tokens),
                1e3 * median, p.tokens / median);
    prefill.push_back({{"device", p.device},
                       {"tokens", p.tokens},
                       {"ms_median", 1e3 * median},
                       {"tokens_per_second", p.tokens / median},
                       {"repeats", p.seconds.size()}});
  }
  if (!out.empty()) {
    nlohmann::json doc = {
        {"benchmark", "llama_decode_bench"},
        {"date", absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(), absl::UTCTimeZone())},
        {"model", random_weights ? "random SmolLM2-135M shapes" : model_file},
        {"indexer", random_weights ? "random" : indexer_weights},
        {"selection", "fixed: the row's own slot and K-1 distinct others, seeded; every layer"},
        {"top_k", s.top_k},
        {"retention", s.retention},
        {"steps", s.steps},
        {"warmup", s.warmup},
        {"runners", runners},
        {"decode", decode},
        {"prefill", prefill}};
    std::ofstream file(out);
    file << doc.dump(2) << "\n";
    if (!file) {
      std::fprintf(stderr, "cannot write %s\n", out.c_str());
      return 1;
    }
    std::fprintf(stderr, "wrote %s\n", out.c_str());
  }
  return 0;
}
