// bench_gpu_attention: the sparse MLA decode of attention_worker/cuda (sparse_mla_decode.h) in
// DeepSeek-V3.2's shape (128 heads, 576-dim latent, K = 2048 selected slots a row) over paged
// pools of 64K and 128K-slot contexts, against its floors: the bytes it must read (K x 1152 bytes
// of gathered latent rows a row, plus query, selection, block-table entries and output) at
// 4.3 TB/s and at this run's measured copy bandwidth, and the bf16 tensor-core work at the
// 790 TFLOP/s a PyTorch matrix product reached on this GPU kind (device/KINDS.md).
// Median of CUDA-event timings after warm-up, the L2 flushed before each run.
// usage: bench_gpu_attention [--shapes 1x65536,8x65536,...] [--top_k 2048] [--splits 0,1,...]
//                            [--mma wgmma,mma_sync]
//                            [--cuda_cores_max_rows 8] [--reps 30] [--out results.json]
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

#include "attention_worker/cuda/sparse_mla_decode.h"
#include "bench/gpu_bench_util.cuh"

namespace dsa::bench {
namespace {

constexpr double kHbmTBs = 4.3;
constexpr double kTensorTflops = 790.0;

// Random bf16 latent rows: uniform in [-2, 2) (never NaN).
__global__ void FillBf16(__nv_bfloat16* data, int64_t count, uint64_t salt) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = __float2bfloat16((Hash(i * 2654435761ULL + salt) % 4096) * (1.0f / 1024) - 2.0f);
  }
}

struct Problem {
  int rows = 0, top_k = 0;
  int64_t context = 0;
  cuda::SparseMlaDecodeParams params;
};

Problem MakeProblem(DeviceBuffers& buffers, int rows, int64_t context, int top_k, uint32_t seed) {
  Problem pr;
  pr.rows = rows;
  pr.top_k = top_k;
  pr.context = context;
  const int blocks_per_row = static_cast<int>((context + 63) / 64);
  const int64_t num_blocks = int64_t{rows} * blocks_per_row;
  auto* pool = buffers.Keep(DeviceZeros<__nv_bfloat16>(num_blocks * 64 * kMlaKeyDim));
  FillBf16<<<2048, 256>>>(pool, num_blocks * 64 * kMlaKeyDim, seed);
  const int64_t query_values = int64_t{rows} * 128 * kMlaKeyDim;
  auto* query = buffers.Keep(DeviceZeros<__nv_bfloat16>(query_values));
  FillBf16<<<256, 256>>>(query, query_values, seed + 17);
  DSA_BENCH_CUDA(cudaGetLastError());
  std::mt19937 rng(seed);
  std::vector<int32_t> tables(num_blocks);  // every row's blocks all over the pool
  for (int64_t i = 0; i < num_blocks; ++i) tables[i] = static_cast<int32_t>(i);
  std::shuffle(tables.begin(), tables.end(), rng);
  std::vector<int32_t> selections;
  std::uniform_int_distribution<int64_t> pick(0, context - 1);
  for (int r = 0; r < rows; ++r) {
    std::unordered_set<int64_t> taken;
    while (static_cast<int>(taken.size()) < std::min<int64_t>(top_k, context)) {
      const int64_t slot = pick(rng);
      if (taken.insert(slot).second) selections.push_back(static_cast<int32_t>(slot));
    }
    for (int64_t e = static_cast<int64_t>(taken.size()); e < top_k; ++e) selections.push_back(-1);
  }
  std::vector<int32_t> num_slots(rows, static_cast<int32_t>(context));
  std::vector<int32_t> positions(rows, static_cast<int32_t>(context - 1));
  cuda::SparseMlaDecodeParams& p = pr.params;
  p.kv_pool = pool;
  p.num_physical_blocks = num_blocks;
  p.num_rows = rows;
  p.num_heads = 128;
  p.query = query;
  p.block_tables = buffers.Keep(DeviceCopy(tables));
  p.max_blocks_per_row = blocks_per_row;
  p.num_slots = buffers.Keep(DeviceCopy(num_slots));
  p.positions = buffers.Keep(DeviceCopy(positions));
  p.selections = buffers.Keep(DeviceCopy(selections));
  p.top_k = top_k;
  p.out = buffers.Keep(DeviceZeros<__nv_bfloat16>(int64_t{rows} * 128 * kMlaValueDim));
  p.lse = buffers.Keep(DeviceZeros<float>(int64_t{rows} * 128));
  DSA_BENCH_CUDA(cudaDeviceSynchronize());
  return pr;
}

// Bytes the decode must move: per row, the attended latent rows, their selection and block-table
// entries, the query, the bf16 output and the LSE.
double FloorBytes(const Problem& pr) {
  const double attended = std::min<int64_t>(pr.top_k, pr.context);
  const double per_row = attended * (kMlaKeyDim * 2.0 + 4 + 4) + 128.0 * kMlaKeyDim * 2 +
                         128.0 * kMlaValueDim * 2 + 128 * 4;
  return pr.rows * per_row;
}
double Flops(const Problem& pr) {
  const double attended = std::min<int64_t>(pr.top_k, pr.context);
  return 2.0 * pr.rows * 128 * attended * (kMlaKeyDim + kMlaValueDim);
}

// NaN outputs would mean a wrong read: fail loudly instead of timing them.
void CheckFinite(const Problem& pr) {
  std::vector<float> lse(int64_t{pr.rows} * 128);
  DSA_BENCH_CUDA(cudaMemcpy(lse.data(), pr.params.lse, lse.size() * 4, cudaMemcpyDeviceToHost));
  for (float v : lse) {
    if (!std::isfinite(v)) {
      std::fprintf(stderr, "non-finite LSE in the output: %f\n", v);
      std::exit(1);
    }
  }
}

}  // namespace
}  // namespace dsa::bench

int main(int argc, char** argv) {
  using namespace dsa::bench;
  std::string shapes = "1x65536,8x65536,64x65536,1x131072,8x131072,64x131072";
  std::string splits_list = "0";
  std::string mma_list = "wgmma,mma_sync";
  std::string out_path;
  int top_k = 2048, reps = 30, cuda_cores_max_rows = 8;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--shapes") == 0)
      shapes = argv[i + 1];
    else if (std::strcmp(argv[i], "--top_k") == 0)
      top_k = std::atoi(argv[i + 1]);
    else if (std::strcmp(argv[i], "--mma") == 0)
      mma_list = argv[i + 1];
    else if (std::strcmp(argv[i], "--splits") == 0)
      splits_list = argv[i + 1];
    else if (std::strcmp(argv[i], "--cuda_cores_max_rows") == 0)
      cuda_cores_max_rows = std::atoi(argv[i + 1]);
    else if (std::strcmp(argv[i], "--reps") == 0)
      reps = std::atoi(argv[i + 1]);
    else if (std::strcmp(argv[i], "--out") == 0)
      out_path = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  L2Flush flush;
  const double copy_tbs = CopyBandwidthTBs(flush);
  std::printf("device-to-device copy: %.2f TB/s (read + write)\n", copy_tbs);
  std::string json = "{\"copy_tbs\": " + JsonNumber(copy_tbs) + ", \"hbm_tbs\": 4.30, " +
                     "\"tensor_tflops\": 790.00, \"top_k\": " + std::to_string(top_k) +
                     ", \"results\": [";
  std::printf("%-14s %-12s %6s %10s %9s %9s %8s %8s %8s\n", "shape", "kernel", "splits", "time_us",
              "MB", "floor_us", "of_4.3", "of_copy", "TFLOP/s");
  bool first = true;
  uint32_t seed = 1;
  for (const std::string& item : Split(shapes)) {
    const Shape shape = ParseShape(item);
    DeviceBuffers buffers;
    Problem pr = MakeProblem(buffers, shape.rows, shape.slots, top_k, seed++);
    const double bytes = FloorBytes(pr), flops = Flops(pr);
    const double floor_us = bytes / (kHbmTBs * 1e12) * 1e6;
    const double copy_floor_us = bytes / (copy_tbs * 1e12) * 1e6;
    const double compute_floor_us = flops / (kTensorTflops * 1e12) * 1e6;
    std::vector<std::pair<std::string, int>> runs;
    for (const std::string& mma : Split(mma_list)) {
      for (const std::string& s : Split(splits_list)) runs.push_back({mma, std::atoi(s.c_str())});
    }
    if (shape.rows <= cuda_cores_max_rows) runs.push_back({"cuda_cores", 0});
    for (const auto& run : runs) {
      const std::string kernel = run.first;
      const int requested = run.second;
      dsa::cuda::SparseMlaDecodeParams p = pr.params;
      p.num_splits = requested;
      int splits = 0;
      void* workspace = nullptr;
      const bool tensor_cores = kernel != "cuda_cores";
      p.mma = kernel == "mma_sync" ? dsa::cuda::SparseMlaMma::kMmaSync
                                   : dsa::cuda::SparseMlaMma::kWgmma;
      if (tensor_cores) {
        splits = dsa::cuda::SparseMlaDecodeNumSplits(p);
        p.workspace_bytes = dsa::cuda::SparseMlaDecodeScratchBytes(p);
        if (p.workspace_bytes > 0) DSA_BENCH_CUDA(cudaMalloc(&workspace, p.workspace_bytes));
        p.workspace = workspace;
      }
      const auto launch = [&] {
        return tensor_cores ? dsa::cuda::LaunchSparseMlaDecodeTensorCores(p, nullptr)
                            : dsa::cuda::LaunchSparseMlaDecodeCudaCores(p, nullptr);
      };
      DSA_BENCH_CUDA(cudaMemset(p.lse, 0xff, int64_t{pr.rows} * 128 * 4));
      DSA_BENCH_CUDA(launch());
      DSA_BENCH_CUDA(cudaDeviceSynchronize());
      CheckFinite(pr);
      const double us = MedianUs(launch, flush, nullptr, reps);
      if (workspace != nullptr) DSA_BENCH_CUDA(cudaFree(workspace));
      const double tflops = flops / (us * 1e-6) / 1e12;
      std::printf("%-14s %-12s %6d %10.2f %9.2f %9.2f %8.3f %8.3f %8.1f\n", item.c_str(),
                  kernel.c_str(), splits, us, bytes / 1e6, floor_us, floor_us / us,
                  copy_floor_us / us, tflops);
      json += std::string(first ? "" : ", ") + "{\"rows\": " + std::to_string(pr.rows) +
              ", \"context\": " + std::to_string(pr.context) + ", \"kernel\": \"" + kernel +
              "\", \"splits\": " + std::to_string(splits) + ", \"time_us\": " + JsonNumber(us) +
              ", \"bytes\": " + std::to_string(static_cast<int64_t>(bytes)) +
              ", \"floor_us_4_3\": " + JsonNumber(floor_us) +
              ", \"floor_us_copy\": " + JsonNumber(copy_floor_us) +
              ", \"compute_floor_us\": " + JsonNumber(compute_floor_us) +
              ", \"tflops\": " + JsonNumber(tflops) + "}";
      first = false;
    }
  }
  json += "]}\n";
  if (!out_path.empty()) {
    FILE* f = std::fopen(out_path.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", out_path.c_str());
      return 1;
    }
    std::fputs(json.c_str(), f);
    std::fclose(f);
  }
  return 0;
}
