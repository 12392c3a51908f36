// bench_gpu_spin: times SPIN on the GPU (spin_predict.h, spin_update.h) on synthetic EMA states:
// the prediction alone (kernel 1), prediction + plan with exploration (K = 2048, rho = 0.4,
// gamma = 0.05), the EMA update of one row that scored 60% of its blocks, and the union of
// 4-row verifier groups (predict_h: kernel 1 alone with max_visible_blocks; update1: the update
// with max_group_rows = 1); L2 flushed before each run, median of 20 after 3 warm-up runs, with the
// bytes each moves against the HBM floor (4.8 TB/s). usage: bench_gpu_spin [--shapes
// 1x131072,...] (rows x slots; each row its own sequence).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/gpu_bench_util.cuh"
#include "indexer_service/cuda/spin_predict.h"
#include "indexer_service/cuda/spin_update.h"

namespace {

using namespace dsa::cuda;
using dsa::bench::DeviceCopy;
using dsa::bench::MedianUs;

__global__ void FillHash(float* out, int64_t n, uint64_t salt) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t h = (static_cast<uint64_t>(i) + salt) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    out[i] = static_cast<float>(h & 0xffffff) / 16777216.0f * 4.0f - 1.0f;
  }
}

float* DeviceRandom(int64_t n, uint64_t salt) {
  float* p = nullptr;
  DSA_BENCH_CUDA(cudaMalloc(&p, std::max<int64_t>(1, n) * sizeof(float)));
  FillHash<<<1024, 256>>>(p, n, salt);
  DSA_BENCH_CUDA(cudaGetLastError());
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  std::string shapes = "1x131072,1x1048576,8x131072,64x65536";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--shapes") == 0) shapes = argv[i + 1];
  }
  const dsa::bench::L2Flush flush;
  const double hbm_bytes_per_us = 4.8e6;
  std::printf("%5s %8s %11s %13s %10s %11s %9s %10s %12s %11s\n", "rows", "slots", "predict_us",
              "+plan_us", "floor_us", "update_us", "floor_us", "union4_us", "predict_h_us",
              "update1_us");
  for (const std::string& shape : dsa::bench::Split(shapes)) {
    const dsa::bench::Shape parsed = dsa::bench::ParseShape(shape);
    const int rows = parsed.rows;
    const int64_t slots = parsed.slots;
    const int64_t t = slots - 1;
    const int64_t b = (slots + 63) / 64;
    // Per row (sequence): V and D of `slots` entries.
    std::vector<float*> v(rows), d(rows);
    std::vector<int64_t> positions(rows, t), lens(rows, slots), offsets(rows);
    for (int r = 0; r < rows; ++r) {
      v[r] = DeviceRandom(slots, 2 * r);
      d[r] = DeviceRandom(slots, 2 * r + 1);
      offsets[r] = r * b;
    }
    std::vector<const float*> cv(v.begin(), v.end()), cd(d.begin(), d.end());
    const float* const* dv = DeviceCopy(cv);
    const float* const* dd = DeviceCopy(cd);
    int64_t* dpos = DeviceCopy(positions);
    int64_t* dlen = DeviceCopy(lens);
    int64_t* doff = DeviceCopy(offsets);
    float* scores = DeviceRandom(rows * b, 99);
    int32_t* selected = nullptr;
    int32_t* counts = nullptr;
    DSA_BENCH_CUDA(cudaMalloc(&selected, rows * b * sizeof(int32_t)));
    DSA_BENCH_CUDA(cudaMalloc(&counts, rows * sizeof(int32_t)));
    SpinPredictParams p;
    p.num_rows = rows;
    p.positions = dpos;
    p.vertical = dv;
    p.vertical_len = dlen;
    p.diagonal = dd;
    p.diagonal_len = dlen;
    p.row_block_offset = doff;
    p.scores = scores;
    const double predict_us =
        MedianUs([&] { return LaunchSpinPredict(p, nullptr); }, flush, nullptr, 20, 3);
    p.max_visible_blocks = b;  // kernel 1 alone with the hint (one iteration a warp)
    const double predict_hint_us =
        MedianUs([&] { return LaunchSpinPredict(p, nullptr); }, flush, nullptr, 20, 3);
    p.selected = selected;
    p.selected_count = counts;
    p.top_k = 2048;
    p.target_block_sparsity = 0.4;
    p.exploration_fraction = 0.05;
    p.seed = 12345;
    p.max_visible_blocks = b;
    p.total_blocks = rows * b;
    void* workspace = nullptr;
    if (size_t bytes = SpinPredictScratchBytes(p); bytes > 0) {
      DSA_BENCH_CUDA(cudaMalloc(&workspace, bytes));
      p.workspace = workspace;
      p.workspace_bytes = bytes;
    }
    const double plan_us =
        MedianUs([&] { return LaunchSpinPredict(p, nullptr); }, flush, nullptr, 20, 3);
    const double predict_floor = rows * slots * 8.0 / hbm_bytes_per_us;
    // Update: each row scored the first 60% of its blocks plus the newest (one group a row).
    std::vector<int32_t> blocks, first_row(rows + 1);
    std::vector<int64_t> block_offset(rows + 1), score_offset(rows);
    const int64_t scored = std::max<int64_t>(1, (b * 6) / 10);
    for (int r = 0; r < rows; ++r) {
      first_row[r] = r;
      block_offset[r] = static_cast<int64_t>(blocks.size());
      score_offset[r] = static_cast<int64_t>(blocks.size()) * 64;
      for (int64_t j = 0; j < scored - 1; ++j) blocks.push_back(static_cast<int32_t>(j));
      blocks.push_back(static_cast<int32_t>(b - 1));
    }
    first_row[rows] = rows;
    block_offset[rows] = static_cast<int64_t>(blocks.size());
    int32_t* dblocks = DeviceCopy(blocks);
    int32_t* dfirst = DeviceCopy(first_row);
    int64_t* dboff = DeviceCopy(block_offset);
    int64_t* dsoff = DeviceCopy(score_offset);
    float* zs = DeviceRandom(static_cast<int64_t>(blocks.size()) * 64, 7);
    float* const* dvm = DeviceCopy(v);
    float* const* ddm = DeviceCopy(d);
    SpinUpdateParams u;
    u.num_groups = rows;
    u.num_rows = rows;
    u.group_first_row = dfirst;
    u.group_block_offset = dboff;
    u.logical_blocks = dblocks;
    u.row_position = dpos;
    u.row_score_offset = dsoff;
    u.scores = zs;
    u.vertical = dvm;
    u.diagonal = ddm;
    u.max_visible_slots = slots;
    const double update_us =
        MedianUs([&] { return LaunchSpinUpdate(u, nullptr); }, flush, nullptr, 20, 3);
    u.max_group_rows = 1;  // every group one row: the narrower grid, four entries a thread
    const double update1_us =
        MedianUs([&] { return LaunchSpinUpdate(u, nullptr); }, flush, nullptr, 20, 3);
    const double update_floor =
        static_cast<double>(blocks.size()) * 64 * (16.0 + 4.0) / hbm_bytes_per_us;
    // Union: the rows in groups of 4 (the plans above).
    const int groups = (rows + 3) / 4;
    std::vector<int32_t> union_first(groups + 1);
    std::vector<int64_t> union_offset(groups);
    for (int g = 0; g < groups; ++g) {
      union_first[g] = 4 * g;
      union_offset[g] = 4 * g * b;
    }
    union_first[groups] = rows;
    int32_t* dufirst = DeviceCopy(union_first);
    int64_t* duoff = DeviceCopy(union_offset);
    int32_t* union_blocks = nullptr;
    int32_t* union_count = nullptr;
    DSA_BENCH_CUDA(cudaMalloc(&union_blocks, rows * b * sizeof(int32_t)));
    DSA_BENCH_CUDA(cudaMalloc(&union_count, groups * sizeof(int32_t)));
    SpinUnionParams un;
    un.num_groups = groups;
    un.group_first_row = dufirst;
    un.row_block_offset = doff;
    un.selected = selected;
    un.selected_count = counts;
    un.group_block_offset = duoff;
    un.union_blocks = union_blocks;
    un.union_count = union_count;
    const double union_us =
        MedianUs([&] { return LaunchSpinUnion(un, nullptr); }, flush, nullptr, 20, 3);
    std::printf("%5d %8lld %11.1f %13.1f %10.1f %11.1f %9.1f %10.1f %12.1f %11.1f\n", rows,
                static_cast<long long>(slots), predict_us, plan_us, predict_floor, update_us,
                update_floor, union_us, predict_hint_us, update1_us);
    std::fflush(stdout);
    for (int r = 0; r < rows; ++r) {
      DSA_BENCH_CUDA(cudaFree(v[r]));
      DSA_BENCH_CUDA(cudaFree(d[r]));
    }
    for (void* ptr :
         {(void*)dv,     (void*)dd,       (void*)dpos,   (void*)dlen,         (void*)doff,
          (void*)scores, (void*)selected, (void*)counts, workspace,           (void*)dblocks,
          (void*)dfirst, (void*)dboff,    (void*)dsoff,  (void*)zs,           (void*)dvm,
          (void*)ddm,    (void*)dufirst,  (void*)duoff,  (void*)union_blocks, (void*)union_count}) {
      if (ptr != nullptr) DSA_BENCH_CUDA(cudaFree(ptr));
    }
  }
  return 0;
}
