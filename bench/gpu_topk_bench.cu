// bench_gpu_topk: times the GPU top-K (K = 2048) alone on synthetic scores (normal-like, from a
// hash; the scan's layout: entries through a logical block list), L2 flushed before each run,
// median of 30 after 5 warm-up runs. A shape ending in 'e' (64x65536e) has every score equal (1.0:
// the histograms' worst case for same-address atomics). --host-bound passes the rows' length as
// TopKParams::max_row_entries, as the select and the scoring device do, so that the kernel without
// the sampled gather runs where every chunk is cached; without it the sampled kernel runs.
// usage: bench_gpu_topk [--shapes 1x16384,...] [--host-bound]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/gpu_bench_util.cuh"
#include "indexer_service/cuda/topk.h"

namespace {

using dsa::bench::DeviceCopy;

}  // namespace

int main(int argc, char** argv) {
  std::string shapes = "1x16384,1x65536,1x131072,1x1048576,8x65536,64x65536";
  bool host_bound = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--shapes") == 0) {
      if (i + 1 == argc) {
        std::fprintf(stderr, "bench_gpu_topk: --shapes needs a value (1x16384,...)\n");
        return 2;
      }
      shapes = argv[++i];
    } else if (std::strcmp(argv[i], "--host-bound") == 0) {
      host_bound = true;
    } else {
      std::fprintf(stderr, "bench_gpu_topk: unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  const dsa::bench::L2Flush flush;
  std::printf("%5s %8s %5s %10s\n", "rows", "slots", "equal", "topk_us");
  for (const std::string& shape : dsa::bench::Split(shapes)) {
    const dsa::bench::Shape parsed = dsa::bench::ParseShape(shape);
    const int rows = parsed.rows;
    const int64_t slots = parsed.slots;
    const bool equal = shape.back() == 'e';
    const int64_t blocks_per_row = (slots + 63) / 64;
    std::vector<int64_t> offset(rows), entries(rows, blocks_per_row * 64), block_offset(rows),
        max_slot(rows, slots - 1);
    std::vector<int32_t> blocks(rows * blocks_per_row);
    for (int r = 0; r < rows; ++r) {
      offset[r] = r * blocks_per_row * 64;
      block_offset[r] = r * blocks_per_row;
    }
    for (int64_t b = 0; b < rows * blocks_per_row; ++b) blocks[b] = b % blocks_per_row;
    float* scores = nullptr;
    int32_t* selection = nullptr;
    DSA_BENCH_CUDA(cudaMalloc(&scores, sizeof(float) * rows * blocks_per_row * 64));
    DSA_BENCH_CUDA(cudaMalloc(&selection, sizeof(int32_t) * rows * 2048));
    dsa::bench::FillBellScores<<<1024, 256>>>(scores, rows * blocks_per_row * 64, equal);
    dsa::cuda::TopKParams p;
    p.scores = scores;
    p.num_rows = rows;
    p.row_score_offset = DeviceCopy(offset);
    p.row_num_entries = DeviceCopy(entries);
    p.logical_blocks = DeviceCopy(blocks);
    p.row_block_offset = DeviceCopy(block_offset);
    p.row_max_slot = DeviceCopy(max_slot);
    p.k = 2048;
    p.selection = selection;
    if (host_bound) p.max_row_entries = blocks_per_row * 64;
    const double us =
        dsa::bench::MedianUs([&] { return dsa::cuda::LaunchTopK(p, nullptr); }, flush);
    std::printf("%5d %8lld %5s %10.1f\n", rows, static_cast<long long>(slots), equal ? "yes" : "no",
                us);
    for (const void* q :
         {(const void*)scores, (const void*)selection, (const void*)p.row_score_offset,
          (const void*)p.row_num_entries, (const void*)p.logical_blocks,
          (const void*)p.row_block_offset, (const void*)p.row_max_slot}) {
      DSA_BENCH_CUDA(cudaFree(const_cast<void*>(q)));
    }
  }
  return 0;
}
