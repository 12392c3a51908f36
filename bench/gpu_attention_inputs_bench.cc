// bench_gpu_attention_inputs: the attention side's GPU input generators against the CPU ones, and
// the layer stand-in's GEMM against a device-to-device copy measured in the same run
// (docs/attention_gpu_inputs.md). Usage: bench_gpu_attention_inputs [results.json]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "attention_worker/cuda/layer_standin.h"
#include "attention_worker/cuda/mla_inputs.h"
#include "attention_worker/cuda/pattern_inputs.h"
#include "attention_worker/mla_kv.h"
#include "attention_worker/model_inputs.h"
#include "attention_worker/pattern_model.h"

namespace {

#define CHECK_CUDA(expr)                                                                           \
  do {                                                                                             \
    const cudaError_t err_ = (expr);                                                               \
    if (err_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(err_)); \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)

// Median microseconds of `launch` over `iterations` runs after 3 warm-ups, by CUDA events.
double TimeMicros(const std::function<void()>& launch, int iterations = 20) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int i = -3; i < iterations; ++i) {
    CHECK_CUDA(cudaEventRecord(start));
    launch();
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    if (i >= 0) ms.push_back(t);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2] * 1000.0;
}

double CpuMicros(const std::function<void()>& work) {
  const auto start = std::chrono::steady_clock::now();
  work();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
      .count();
}

struct Row {
  std::string name;
  double gpu_us, cpu_us, bytes;
};

}  // namespace

int main(int argc, char** argv) {
  using namespace dsa;
  using namespace dsa::cuda;
  std::vector<Row> rows;
  auto model = PatternModel::Create(PatternModelConfig{});
  if (!model.ok()) return 1;
  std::vector<float> radius, cosine;
  BoxMullerFirstNormalTables(&radius, &cosine);
  PatternDeviceTables tables;
  CHECK_CUDA(UploadPatternTables(model->Tables(), radius.data(), cosine.data(), &tables));
  const int dim = model->head_dim(), heads = model->num_heads();

  // Index keys: 64K slots of one layer (range mode, no prefix).
  {
    const int64_t n = 65536;
    float* keys = nullptr;
    CHECK_CUDA(cudaMalloc(&keys, n * dim * sizeof(float)));
    PatternIndexKeysParams p;
    p.tables = tables;
    p.num_keys = n;
    p.first_slot = 100000;
    p.keys = keys;
    const double gpu = TimeMicros([&] { CHECK_CUDA(LaunchPatternIndexKeys(p, nullptr)); });
    std::vector<float> cpu_keys(4096 * dim);
    const double cpu =
        CpuMicros([&] { (void)model->IndexKeys(0, 100000, 4096, cpu_keys); }) * (n / 4096.0);
    rows.push_back({"pattern index keys, 64K slots", gpu, cpu, n * dim * 4.0});
    CHECK_CUDA(cudaFree(keys));
  }
  // Indexer queries: 1 and 64 rows.
  for (int num_rows : {1, 64}) {
    std::vector<int32_t> layers(num_rows, 1);
    std::vector<int64_t> positions(num_rows);
    for (int r = 0; r < num_rows; ++r) positions[r] = 131072 + r;
    int32_t* d_layers = nullptr;
    int64_t* d_positions = nullptr;
    float* queries = nullptr;
    CHECK_CUDA(cudaMalloc(&d_layers, num_rows * sizeof(int32_t)));
    CHECK_CUDA(cudaMalloc(&d_positions, num_rows * sizeof(int64_t)));
    CHECK_CUDA(cudaMalloc(&queries, size_t{1} * num_rows * heads * dim * sizeof(float)));
    CHECK_CUDA(cudaMemcpy(d_layers, layers.data(), num_rows * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_positions, positions.data(), num_rows * 8, cudaMemcpyHostToDevice));
    PatternIndexerQueriesParams p;
    p.tables = tables;
    p.num_rows = num_rows;
    p.layers = d_layers;
    p.positions = d_positions;
    p.queries = queries;
    const double gpu = TimeMicros([&] { CHECK_CUDA(LaunchPatternIndexerQueries(p, nullptr)); });
    std::vector<float> q(heads * dim), w(heads);
    const double cpu = CpuMicros([&] {
      for (int r = 0; r < num_rows; ++r) (void)model->IndexerQuery(1, positions[r], q, w);
    });
    const double cpu_weights = CpuMicros([&] {
      for (int r = 0; r < num_rows; ++r) (void)model->HeadWeights(1, positions[r], w);
    });
    rows.push_back({"pattern indexer queries, " + std::to_string(num_rows) + " rows", gpu, cpu,
                    num_rows * heads * dim * 4.0});
    rows.push_back({"  (head weights on the CPU, " + std::to_string(num_rows) + " rows)", 0.0,
                    cpu_weights, num_rows * heads * 4.0});
    CHECK_CUDA(cudaFree(d_layers));
    CHECK_CUDA(cudaFree(d_positions));
    CHECK_CUDA(cudaFree(queries));
  }
  // MLA KV rows: 64K slots into a pool; MLA queries: 64 rows x 128 heads.
  {
    const int64_t n = 65536, blocks = n / 64;
    std::vector<int32_t> table(blocks);
    for (int64_t j = 0; j < blocks; ++j) table[j] = static_cast<int32_t>((j * 7) % blocks);
    int32_t* d_table = nullptr;
    __nv_bfloat16* pool = nullptr;
    CHECK_CUDA(cudaMalloc(&d_table, blocks * 4));
    CHECK_CUDA(cudaMalloc(&pool, n * 576 * 2));
    CHECK_CUDA(cudaMemcpy(d_table, table.data(), blocks * 4, cudaMemcpyHostToDevice));
    MlaKvRowsParams p;
    p.seed = 1;
    p.num_slots = n;
    p.block_table = d_table;
    p.num_physical_blocks = blocks;
    p.kv_pool = pool;
    const double gpu = TimeMicros([&] { CHECK_CUDA(LaunchMlaKvRows(p, nullptr)); });
    std::vector<uint16_t> row(576);
    const double cpu = CpuMicros([&] {
                         for (int64_t s = 0; s < 4096; ++s) (void)MlaKvRow(1, 0, s, row);
                       }) *
                       (n / 4096.0);
    rows.push_back({"MLA KV rows, 64K slots", gpu, cpu, n * 576 * 2.0});
    CHECK_CUDA(cudaFree(d_table));
    CHECK_CUDA(cudaFree(pool));
    const int num_rows = 64;
    std::vector<int64_t> positions(num_rows);
    for (int r = 0; r < num_rows; ++r) positions[r] = 131072 + r;
    int64_t* d_positions = nullptr;
    __nv_bfloat16* queries = nullptr;
    CHECK_CUDA(cudaMalloc(&d_positions, num_rows * 8));
    CHECK_CUDA(cudaMalloc(&queries, num_rows * 128 * 576 * 2));
    CHECK_CUDA(cudaMemcpy(d_positions, positions.data(), num_rows * 8, cudaMemcpyHostToDevice));
    MlaQueryRowsParams q;
    q.num_rows = num_rows;
    q.positions = d_positions;
    q.queries = queries;
    const double gpu_q = TimeMicros([&] { CHECK_CUDA(LaunchMlaQueryRows(q, nullptr)); });
    std::vector<uint16_t> qrow(128 * 576);
    const double cpu_q = CpuMicros([&] {
      for (int r = 0; r < num_rows; ++r) (void)MlaAttentionQuery(1, 0, positions[r], qrow);
    });
    rows.push_back({"MLA attention queries, 64 rows", gpu_q, cpu_q, num_rows * 128 * 576 * 2.0});
    CHECK_CUDA(cudaFree(d_positions));
    CHECK_CUDA(cudaFree(queries));
  }
  CHECK_CUDA(FreePatternTables(&tables));

  // The stand-in at its defaults, against a device-to-device copy of 1 GiB (read + write).
  double copy_bytes_per_s = 0.0;
  {
    const size_t bytes = size_t{1} << 30;
    void *a = nullptr, *b = nullptr;
    CHECK_CUDA(cudaMalloc(&a, bytes));
    CHECK_CUDA(cudaMalloc(&b, bytes));
    CHECK_CUDA(cudaMemset(a, 1, bytes));
    const double us =
        TimeMicros([&] { CHECK_CUDA(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice)); }, 10);
    copy_bytes_per_s = 2.0 * bytes / (us * 1e-6);
    CHECK_CUDA(cudaFree(a));
    CHECK_CUDA(cudaFree(b));
  }
  std::printf("device-to-device copy: %.2f TB/s (read + write)\n", copy_bytes_per_s / 1e12);
  std::string standin_json;
  for (int variant = 0; variant < 6; ++variant) {
    const int act_rows = variant % 3 == 0 ? 1 : variant % 3 == 1 ? 8 : 64;
    LayerStandinParams params;
    params.max_rows = 64;
    params.layout = variant < 3 ? StandinWeightLayout::kRowMajorOutputByHidden
                                : StandinWeightLayout::kRowMajorHiddenByOutput;
    LayerStandin standin;
    CHECK_CUDA(CreateLayerStandin(params, &standin));
    __nv_bfloat16 *x = nullptr, *y = nullptr;
    CHECK_CUDA(cudaMalloc(&x, act_rows * kStandinHiddenDim * 2));
    CHECK_CUDA(cudaMalloc(&y, act_rows * standin.weight_rows * 2));
    CHECK_CUDA(cudaMemset(x, 0x3c, act_rows * kStandinHiddenDim * 2));
    LayerStandinTiming t;
    CHECK_CUDA(MeasureLayerStandin(&standin, x, act_rows, y, 50, nullptr, &t));
    std::printf(
        "stand-in layout %d rows %2d: weights %lld bytes (%zu buffers), GEMM %.1f us = %.2f TB/s "
        "(%.2f of "
        "the copy), layer (GEMM + %.0f us spin) %.1f us\n",
        static_cast<int>(params.layout), act_rows, static_cast<long long>(t.weight_bytes_per_layer),
        standin.weights.size(), t.gemm_micros, t.weight_bytes_per_second / 1e12,
        t.weight_bytes_per_second / copy_bytes_per_s, params.busy_micros, t.layer_micros);
    char text[256];
    std::snprintf(text, sizeof(text),
                  "%s{\"layout\": %d, \"rows\": %d, \"weight_bytes\": %lld, \"gemm_us\": %.2f, "
                  "\"layer_us\": %.2f, "
                  "\"weight_bytes_per_s\": %.4g}",
                  standin_json.empty() ? "" : ", ", static_cast<int>(params.layout), act_rows,
                  static_cast<long long>(t.weight_bytes_per_layer), t.gemm_micros, t.layer_micros,
                  t.weight_bytes_per_second);
    standin_json += text;
    CHECK_CUDA(cudaFree(x));
    CHECK_CUDA(cudaFree(y));
    CHECK_CUDA(DestroyLayerStandin(&standin));
  }
  std::printf("%-44s %12s %12s %10s %10s\n", "generator", "GPU us", "CPU us", "CPU/GPU",
              "GPU GB/s");
  std::string gen_json;
  for (const Row& r : rows) {
    std::printf("%-44s %12.1f %12.1f %10.1f %10.1f\n", r.name.c_str(), r.gpu_us, r.cpu_us,
                r.gpu_us > 0 ? r.cpu_us / r.gpu_us : 0.0,
                r.gpu_us > 0 ? r.bytes / (r.gpu_us * 1e3) : 0.0);
    char text[256];
    std::snprintf(text, sizeof(text), "%s{\"name\": \"%s\", \"gpu_us\": %.2f, \"cpu_us\": %.1f}",
                  gen_json.empty() ? "" : ", ", r.name.c_str(), r.gpu_us, r.cpu_us);
    gen_json += text;
  }
  if (argc > 1) {
    FILE* f = std::fopen(argv[1], "w");
    if (f != nullptr) {
      std::fprintf(f, "{\"copy_bytes_per_s\": %.4g, \"standin\": [%s], \"generators\": [%s]}\n",
                   copy_bytes_per_s, standin_json.c_str(), gen_json.c_str());
      std::fclose(f);
    }
  }
  return 0;
}
