// bench_topk_peers: the indexer's top-K (indexer_service/cuda/topk.h) against FlashInfer's top-K
// kernels compiled into the same binary from the flashinfer-python wheel's headers
// (bench/peers/fetch_peers.sh), on the same scores, in one process: each launch timed with CUDA
// events after 5 warm-ups, the L2 flushed (256 MiB written) before each of 30 runs, the median
// reported. Every peer's selection is checked against ours: "same set" (the slots, ties included,
// as DSA's rule, ties to the lower slot, picks them) and "a top-K" (K distinct slots of the row
// whose scores are all >= the K-th largest score: right up to how ties are broken).
//
// Methods (K = 2048, fp32 scores [rows, slots], slot e = entry e):
//   dsa                  LaunchTopK: exact, best first, ties to the lower slot.
//   fi_exact             sampling::TopKDispatch, deterministic, TopKTieBreak::Small (FlashInfer's
//                        exact mode with DSA's tie rule), unsorted (its faster output).
//   fi_fast              sampling::TopKDispatch, non-deterministic, no tie rule (its fastest).
//   fi_clusters_exact    launch_fast_topk_clusters_exact (the Hopper cluster top-K), the
//                        buffers and cluster count that flashinfer.topk.topk_clusters_exact uses.
// Scores: a bell-shaped hash of the entry (the sum of four 16-bit uniforms: ~2^18 distinct values,
// so long rows hold ties at the K-th score), or --scores equal (every score 1.0).
//
// usage: bench_topk_peers [--shapes 1x16384,...] [--json PATH] [--scores bell|equal]
#include <cuda_runtime.h>

// FlashInfer's topk.cuh uses math:: from sampling.cuh without including it.
#include <flashinfer/sampling.cuh>
// clang-format off
#include <flashinfer/topk.cuh>
#include <flashinfer/fast_topk_clusters_exact.cuh>
// clang-format on

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "bench/gpu_bench_util.cuh"
#include "indexer_service/cuda/topk.h"

namespace {

namespace fis = flashinfer::sampling;
using dsa::bench::DeviceCopy;

constexpr int kTopK = 2048;
// RadixRowState's histograms and counters (flashinfer/topk.py: _ROW_STATES_NBYTES).
constexpr size_t kRowStatesBytes = size_t{1} << 20;

// flashinfer.topk.get_fast_topk_clusters and topk_clusters_exact's choice.
int FlashInferClusters(int rows, int64_t slots) {
  if (slots < 8192) return 1;
  if (rows <= 32) return 8;
  if (rows < 128) return 4;
  if (rows < 256) return 2;
  return 1;
}

// flashinfer.topk.get_num_cached_for_topk.
int FlashInferNumCached(int k) {
  int device = 0, optin = 0;
  DSA_BENCH_CUDA(cudaGetDevice(&device));
  DSA_BENCH_CUDA(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const int blocks_per_sm = 65536 / (1024 * 32);
  const int buffers_used = (k + 5 + 3 * 256 + 8) * 4;
  return (optin / blocks_per_sm - buffers_used - 1024) / 16;
}

struct Check {
  int rows_same_set = 0;  // rows whose set equals dsa's
  int rows_top_k = 0;     // rows whose selection is a top-K up to ties
};

// `selection` [rows, stride]: the first k entries of each row are the method's slots.
Check CheckRows(const std::vector<float>& scores, int rows, int64_t slots,
                const std::vector<int32_t>& selection, int stride,
                const std::vector<int32_t>& reference) {
  Check check;
  std::vector<float> row_sorted;
  for (int r = 0; r < rows; ++r) {
    const float* row = scores.data() + r * slots;
    row_sorted.assign(row, row + slots);
    std::nth_element(row_sorted.begin(), row_sorted.begin() + (kTopK - 1), row_sorted.end(),
                     std::greater<float>());
    const float kth = row_sorted[kTopK - 1];
    std::vector<int32_t> got(selection.begin() + static_cast<int64_t>(r) * stride,
                             selection.begin() + static_cast<int64_t>(r) * stride + kTopK);
    std::vector<int32_t> want(reference.begin() + static_cast<int64_t>(r) * kTopK,
                              reference.begin() + static_cast<int64_t>(r) * kTopK + kTopK);
    std::sort(got.begin(), got.end());
    std::sort(want.begin(), want.end());
    check.rows_same_set += got == want ? 1 : 0;
    bool top_k = std::adjacent_find(got.begin(), got.end()) == got.end();
    for (int32_t slot : got) top_k = top_k && slot >= 0 && slot < slots && row[slot] >= kth;
    check.rows_top_k += top_k ? 1 : 0;
  }
  return check;
}

struct Result {
  std::string shape, method;
  int rows = 0;
  int64_t slots = 0;
  double us = 0;
  Check check;
};

}  // namespace

int main(int argc, char** argv) {
  std::string shapes =
      "1x16384,1x65536,1x131072,1x1048576,8x16384,8x65536,8x131072,8x1048576,64x16384,64x65536,"
      "64x131072,64x1048576";
  std::string json_path, score_kind = "bell";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--shapes") == 0) shapes = argv[i + 1];
    if (std::strcmp(argv[i], "--json") == 0) json_path = argv[i + 1];
    if (std::strcmp(argv[i], "--scores") == 0) score_kind = argv[i + 1];
  }
  if (score_kind != "bell" && score_kind != "equal") {
    std::fprintf(stderr, "bench_topk_peers: --scores is bell or equal, not %s\n",
                 score_kind.c_str());
    return 2;
  }
  cudaDeviceProp prop{};
  DSA_BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  const dsa::bench::L2Flush flush;
  void* row_states = nullptr;
  DSA_BENCH_CUDA(cudaMalloc(&row_states, kRowStatesBytes));
  DSA_BENCH_CUDA(cudaMemset(row_states, 0, kRowStatesBytes));
  const int num_cached = FlashInferNumCached(kTopK);
  std::vector<Result> results;
  std::printf("%s, %d SMs; K %d, %s scores; medians of 30 (us), L2 flushed\n", prop.name,
              prop.multiProcessorCount, kTopK, score_kind.c_str());
  std::printf("%-10s %-18s %9s %9s %14s %10s\n", "shape", "method", "us", "vs dsa", "same set",
              "a top-K");
  for (const std::string& shape : dsa::bench::Split(shapes)) {
    const dsa::bench::Shape parsed = dsa::bench::ParseShape(shape);
    const int rows = parsed.rows;
    const int64_t slots = parsed.slots;
    const int64_t n = rows * slots;
    float* scores = nullptr;
    DSA_BENCH_CUDA(cudaMalloc(&scores, sizeof(float) * n));
    dsa::bench::FillBellScores<<<1024, 256>>>(scores, n, score_kind == "equal");
    DSA_BENCH_CUDA(cudaGetLastError());
    std::vector<int64_t> offset(rows), entries(rows, slots), max_slot(rows, slots - 1);
    for (int r = 0; r < rows; ++r) offset[r] = r * slots;
    int32_t* dsa_out = nullptr;
    int32_t* peer_out = nullptr;
    // FlashInfer's kernels write the values beside the slots (its deterministic finalize reads
    // and writes them unconditionally: a null buffer faults), as its Python API always asks.
    float* peer_values = nullptr;
    DSA_BENCH_CUDA(cudaMalloc(&dsa_out, sizeof(int32_t) * rows * kTopK));
    DSA_BENCH_CUDA(cudaMalloc(&peer_out, sizeof(int32_t) * rows * kTopK));
    DSA_BENCH_CUDA(cudaMalloc(&peer_values, sizeof(float) * rows * kTopK));
    dsa::cuda::TopKParams p;
    p.scores = scores;
    p.num_rows = rows;
    p.row_score_offset = DeviceCopy(offset);
    p.row_num_entries = DeviceCopy(entries);
    p.row_max_slot = DeviceCopy(max_slot);
    p.max_row_entries = slots;  // the host knows every row's length, as each peer is told
    p.k = kTopK;
    p.selection = dsa_out;
    const int clusters = FlashInferClusters(rows, slots);
    int* overflow = nullptr;  // [rows, 4 * (slots / clusters) * clusters]
    const int64_t overflow_per_row = 4 * (slots / clusters) * clusters;
    DSA_BENCH_CUDA(cudaMalloc(&overflow, sizeof(int) * rows * overflow_per_row));

    struct Method {
      const char* name;
      std::function<cudaError_t()> launch;
    };
    const std::vector<Method> methods = {
        {"dsa", [&] { return dsa::cuda::LaunchTopK(p, nullptr); }},
        {"fi_exact",
         [&] {
           return fis::TopKDispatch<float, int32_t>(
               scores, peer_out, peer_values, rows, kTopK, static_cast<uint32_t>(slots),
               static_cast<fis::RadixRowState*>(row_states),
               /*sorted_output=*/false, /*deterministic=*/true, fis::TopKTieBreak::Small, nullptr,
               /*dsa_graph_safe=*/false);
         }},
        {"fi_fast",
         [&] {
           return fis::TopKDispatch<float, int32_t>(
               scores, peer_out, peer_values, rows, kTopK, static_cast<uint32_t>(slots),
               static_cast<fis::RadixRowState*>(row_states),
               /*sorted_output=*/false, /*deterministic=*/false, fis::TopKTieBreak::None, nullptr,
               /*dsa_graph_safe=*/false);
         }},
        {"fi_clusters_exact",
         [&] {
           fis::launch_fast_topk_clusters_exact<float, int>(
               scores, peer_out, peer_values, static_cast<int>(slots),
               /*histogram=*/nullptr, overflow, static_cast<int>(slots / clusters), rows,
               static_cast<int>(slots), kTopK, num_cached, clusters, /*pdl_enabled=*/false, kTopK,
               nullptr);
           return cudaGetLastError();
         }},
    };
    std::vector<float> host_scores(n);
    DSA_BENCH_CUDA(
        cudaMemcpy(host_scores.data(), scores, sizeof(float) * n, cudaMemcpyDeviceToHost));
    std::vector<int32_t> reference(static_cast<size_t>(rows) * kTopK);
    double dsa_us = 0;
    for (const Method& method : methods) {
      const cudaError_t first = method.launch();
      Result result{shape, method.name, rows, slots, 0, {}};
      if (first != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
        std::printf("%-10s %-18s %9s (%s)\n", shape.c_str(), method.name, "refused",
                    cudaGetErrorString(first != cudaSuccess ? first : cudaGetLastError()));
        cudaGetLastError();
        result.us = -1;
        results.push_back(result);
        continue;
      }
      const bool ours = std::strcmp(method.name, "dsa") == 0;
      std::vector<int32_t> selection(static_cast<size_t>(rows) * kTopK);
      DSA_BENCH_CUDA(cudaMemcpy(selection.data(), ours ? dsa_out : peer_out,
                                sizeof(int32_t) * selection.size(), cudaMemcpyDeviceToHost));
      if (ours) reference = selection;
      result.check = CheckRows(host_scores, rows, slots, selection, kTopK, reference);
      result.us = dsa::bench::MedianUs(method.launch, flush);
      if (ours) dsa_us = result.us;
      std::printf("%-10s %-18s %9.1f %8.2fx %8d of %-3d %6d of %-3d\n", shape.c_str(), method.name,
                  result.us, result.us / dsa_us, result.check.rows_same_set, rows,
                  result.check.rows_top_k, rows);
      results.push_back(result);
    }
    for (const void* q :
         {(const void*)scores, (const void*)dsa_out, (const void*)peer_out,
          (const void*)peer_values, (const void*)overflow, (const void*)p.row_score_offset,
          (const void*)p.row_num_entries, (const void*)p.row_max_slot}) {
      DSA_BENCH_CUDA(cudaFree(const_cast<void*>(q)));
    }
  }
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << "{\"device\": \"" << prop.name << "\", \"k\": " << kTopK << ", \"scores\": \""
        << score_kind << "\", \"results\": [\n";
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      out << "  {\"shape\": \"" << r.shape << "\", \"rows\": " << r.rows
          << ", \"slots\": " << r.slots << ", \"method\": \"" << r.method
          << "\", \"us\": " << (r.us < 0 ? "null" : dsa::bench::JsonNumber(r.us))
          << ", \"rows_same_set\": " << r.check.rows_same_set
          << ", \"rows_top_k\": " << r.check.rows_top_k << "}"
          << (i + 1 < results.size() ? ",\n" : "\n");
    }
    out << "]}\n";
  }
  DSA_BENCH_CUDA(cudaFree(row_states));
  return 0;
}
