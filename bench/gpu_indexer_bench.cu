// bench_gpu_indexer: times the GPU scan (tensor-core and CUDA-core) and top-K (K = 2048) of
// indexer_service/cuda at rows x slots shapes (one row per sequence, H = 64, D = 128, all blocks),
// with the HBM floor of 132 bytes a slot at the device-to-device copy bandwidth measured in the
// same run. CUDA events around each launch after warm-up, L2 flushed before each, medians. Up to
// 2^21 slots the tensor-core scan and top-K are also timed with their code warm and their data cold
// (tc_cw_us, topk_cw_us): after the flush the same launch runs on a twin problem's buffers first.
// usage: bench_gpu_indexer [--shapes 1x16384,1x65536,...] [--json OUT]
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/gpu_bench_util.cuh"
#include "indexer_service/cuda/scan.h"
#include "indexer_service/cuda/topk.h"

namespace {

using dsa::bench::DeviceCopy;
using dsa::bench::MedianUs;

constexpr int kHeads = 64, kHeadDim = 128, kTopK = 2048;

struct Result {
  int rows;
  int64_t slots;
  double scan_tc_us, scan_cc_us, topk_us, floor_us;
  double scan_tc_ws_us;  // the tensor-core scan with ScanQueryPrep::kWorkspace (two launches)
  // The tensor-core scan and top-K with their code warm and their data cold: after the flush, the
  // same launch on a twin problem's own buffers (NaN where the twin is not built).
  double scan_tc_code_warm_us, topk_code_warm_us;
};

// One shape's synthetic inputs (all blocks of `rows` sequences of `slots` slots, one row each) and
// the scan and top-K launches over them; owns its device buffers.
struct Problem {
  dsa::bench::DeviceBuffers buffers;
  dsa::cuda::ScanParams scan;
  dsa::cuda::TopKParams topk;

  Problem(int rows, int64_t slots) {
    const int64_t blocks_per_row = (slots + 63) / 64;
    const int64_t num_blocks = blocks_per_row * rows;
    const dsa::bench::SyntheticInputs in =
        dsa::bench::MakeSyntheticInputs(buffers, num_blocks, rows, kHeads, kHeadDim);

    std::vector<int32_t> first_row(rows + 1), logical(num_blocks), tables(num_blocks);
    std::vector<int64_t> block_offset(rows + 1), table_offset(rows), num_slots(rows, slots),
        position(rows, slots - 1), score_offset(rows), entries(rows, blocks_per_row * 64);
    for (int r = 0; r <= rows; ++r) {
      first_row[r] = r;
      block_offset[r] = r * blocks_per_row;
    }
    for (int r = 0; r < rows; ++r) {
      table_offset[r] = r * blocks_per_row;
      score_offset[r] = r * blocks_per_row * 64;
    }
    for (int64_t b = 0; b < num_blocks; ++b) {
      logical[b] = static_cast<int32_t>(b % blocks_per_row);
      tables[b] = static_cast<int32_t>(b);
    }
    float* scores = buffers.Keep(dsa::bench::DeviceZeros<float>(num_blocks * 64));
    int32_t* selection = buffers.Keep(dsa::bench::DeviceZeros<int32_t>(int64_t{rows} * kTopK));

    scan.pool = in.pool;
    scan.head_dim = kHeadDim;
    scan.num_heads = kHeads;
    scan.num_groups = rows;
    scan.num_rows = rows;
    scan.group_first_row = buffers.Keep(DeviceCopy(first_row));
    scan.group_block_offset = buffers.Keep(DeviceCopy(block_offset));
    scan.total_blocks = num_blocks;
    scan.logical_blocks = buffers.Keep(DeviceCopy(logical));
    scan.group_table_offset = buffers.Keep(DeviceCopy(table_offset));
    scan.block_tables = buffers.Keep(DeviceCopy(tables));
    scan.group_num_slots = buffers.Keep(DeviceCopy(num_slots));
    scan.query = in.query;
    scan.query_dtype = dsa::cuda::QueryDtype::kBFloat16;
    scan.head_weights = in.weights;
    scan.row_position = buffers.Keep(DeviceCopy(position));
    scan.row_score_offset = buffers.Keep(DeviceCopy(score_offset));
    scan.scores = scores;
    scan.workspace_bytes = dsa::cuda::ScanTensorCoresScratchBytes(scan);
    DSA_BENCH_CUDA(cudaMalloc(&scan.workspace, scan.workspace_bytes));
    buffers.Keep(scan.workspace);

    topk.scores = scores;
    topk.num_rows = rows;
    topk.row_score_offset = scan.row_score_offset;
    topk.row_num_entries = buffers.Keep(DeviceCopy(entries));
    topk.logical_blocks = scan.logical_blocks;
    topk.row_block_offset = scan.group_block_offset;
    topk.row_max_slot = scan.row_position;
    topk.max_row_entries = blocks_per_row * 64;  // a caller's host bound: every row, all blocks
    topk.k = kTopK;
    topk.selection = selection;
    // Real scores for top-K, whichever launch is timed first (all-zero scores are its slowest
    // case).
    DSA_BENCH_CUDA(dsa::cuda::LaunchScanTensorCores(scan, nullptr));
    DSA_BENCH_CUDA(cudaDeviceSynchronize());
  }
};

}  // namespace

int main(int argc, char** argv) {
  std::string shapes = "1x16384,1x65536,1x131072,1x1048576,8x65536,64x65536";
  const char* json_path = nullptr;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--shapes") == 0) shapes = argv[i + 1];
    if (std::strcmp(argv[i], "--json") == 0) json_path = argv[i + 1];
  }
  const dsa::bench::L2Flush flush;
  // Copy bandwidth (read + write) of a 1 GiB device-to-device copy: the HBM ceiling of this run.
  const double copy_tb_s = dsa::bench::CopyBandwidthTBs(flush);
  std::printf("device-to-device copy: %.2f TB/s (read + write)\n", copy_tb_s);

  std::vector<Result> results;
  for (const std::string& shape : dsa::bench::Split(shapes)) {
    const dsa::bench::Shape parsed = dsa::bench::ParseShape(shape);
    const int rows = parsed.rows;
    const int64_t slots = parsed.slots;
    Problem problem(rows, slots);
    dsa::cuda::ScanParams& scan = problem.scan;
    const dsa::cuda::TopKParams& topk = problem.topk;

    Result res{rows, slots, 0, 0, 0, 0, 0, NAN, NAN};
    res.scan_cc_us = MedianUs([&] { return dsa::cuda::LaunchScanCudaCores(scan, nullptr); }, flush);
    res.scan_tc_us =
        MedianUs([&] { return dsa::cuda::LaunchScanTensorCores(scan, nullptr); }, flush);
    scan.query_prep = dsa::cuda::ScanQueryPrep::kWorkspace;
    res.scan_tc_ws_us =
        MedianUs([&] { return dsa::cuda::LaunchScanTensorCores(scan, nullptr); }, flush);
    scan.query_prep = dsa::cuda::ScanQueryPrep::kAuto;
    res.topk_us = MedianUs([&] { return dsa::cuda::LaunchTopK(topk, nullptr); }, flush);
    if (int64_t{rows} * slots <= dsa::bench::kMaxTwinSlots) {
      Problem twin(rows, slots);
      res.scan_tc_code_warm_us =
          MedianUs([&] { return dsa::cuda::LaunchScanTensorCores(scan, nullptr); }, flush, nullptr,
                   30, 5, [&] { return dsa::cuda::LaunchScanTensorCores(twin.scan, nullptr); });
      res.topk_code_warm_us =
          MedianUs([&] { return dsa::cuda::LaunchTopK(topk, nullptr); }, flush, nullptr, 30, 5,
                   [&] { return dsa::cuda::LaunchTopK(twin.topk, nullptr); });
    }
    res.floor_us = rows * slots * 132.0 / (copy_tb_s * 1e6);
    results.push_back(res);
  }

  std::printf("%5s %8s %10s %10s %10s %10s %10s %8s %8s %10s %10s\n", "rows", "slots", "floor_us",
              "scan_tc_us", "tc_ws_us", "scan_cc_us", "topk_us", "tc/floor", "tc_TB/s", "tc_cw_us",
              "topk_cw_us");
  for (const Result& r : results) {
    std::printf("%5d %8lld %10.1f %10.1f %10.1f %10.1f %10.1f %8.2f %8.2f %10.1f %10.1f\n", r.rows,
                static_cast<long long>(r.slots), r.floor_us, r.scan_tc_us, r.scan_tc_ws_us,
                r.scan_cc_us, r.topk_us, r.scan_tc_us / r.floor_us,
                r.rows * r.slots * 132.0 / r.scan_tc_us * 1e-6, r.scan_tc_code_warm_us,
                r.topk_code_warm_us);
  }
  if (json_path != nullptr) {
    FILE* f = std::fopen(json_path, "w");
    if (f == nullptr) return 1;
    std::fprintf(f, "{\"copy_tb_s\": %.4f, \"results\": [\n", copy_tb_s);
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      std::fprintf(
          f,
          " {\"rows\": %d, \"slots\": %lld, \"floor_us\": %.2f, \"scan_tensor_core_us\": "
          "%.2f, \"scan_tensor_core_workspace_us\": %.2f, \"scan_cuda_core_us\": %.2f, "
          "\"topk_us\": %.2f, \"scan_tensor_core_code_warm_us\": %s, "
          "\"topk_code_warm_us\": %s}%s\n",
          r.rows, static_cast<long long>(r.slots), r.floor_us, r.scan_tc_us, r.scan_tc_ws_us,
          r.scan_cc_us, r.topk_us, dsa::bench::JsonNumber(r.scan_tc_code_warm_us).c_str(),
          dsa::bench::JsonNumber(r.topk_code_warm_us).c_str(), i + 1 < results.size() ? "," : "");
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return 0;
}
