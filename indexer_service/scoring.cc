// CPU index scoring (see scoring.h): per block, decode the fp8 keys once into a transposed fp32
// tile, then for every row and head accumulate q_h . k over the tile with the slot as the SIMD lane.
#include "indexer_service/scoring.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/fp8.h"

namespace dsa {
namespace {

// Scores one decoded block for one row: out[s] = scale[s] * sum_h w[h] * ReLU(sum_d q[h][d] k[d][s]).
// `keys_t` is fp32 [head_dim, kBlockSize] (transposed so the 64 slots are contiguous).
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
void ScoreTile(const float* __restrict keys_t, const float* __restrict scales,
               const float* __restrict query, const float* __restrict head_weights, int num_heads,
               int head_dim, float* __restrict out) {
  float total[kBlockSize] = {};
  for (int h = 0; h < num_heads; ++h) {
    float dot[kBlockSize] = {};
    const float* q = query + static_cast<size_t>(h) * head_dim;
    for (int d = 0; d < head_dim; ++d) {
      const float qd = q[d];
      const float* k = keys_t + static_cast<size_t>(d) * kBlockSize;
#pragma omp simd
      for (int s = 0; s < kBlockSize; ++s) dot[s] += qd * k[s];
    }
    const float w = head_weights[h];
#pragma omp simd
    for (int s = 0; s < kBlockSize; ++s) total[s] += w * std::max(dot[s], 0.0f);
  }
#pragma omp simd
  for (int s = 0; s < kBlockSize; ++s) out[s] = scales[s] * total[s];
}

}  // namespace

void ScoreBlocks(const KeyCacheView& cache, std::span<const int32_t> logical_blocks,
                 std::span<const IndexerRow> rows, int num_heads, std::span<float> scores) {
  const int head_dim = cache.pool->head_dim();
  const int64_t num_blocks = static_cast<int64_t>(logical_blocks.size());
  const int64_t row_stride = num_blocks * kBlockSize;
  const float* table = Fp8E4m3DecodeTable();
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

#pragma omp parallel
  {
    std::vector<float> keys_t(static_cast<size_t>(head_dim) * kBlockSize);
#pragma omp for schedule(dynamic, 4)
    for (int64_t j = 0; j < num_blocks; ++j) {
      const int64_t logical = logical_blocks[j];
      const int32_t block = cache.block_table[logical];
      const uint8_t* codes = cache.pool->keys(block);
      const float* block_scales = cache.pool->scales(block);
      const int64_t first_slot = logical * kBlockSize;
      const int64_t filled = std::min<int64_t>(kBlockSize, cache.num_slots - first_slot);
      for (int s = 0; s < kBlockSize; ++s) {
        const uint8_t* key = codes + static_cast<size_t>(s) * head_dim;
        for (int d = 0; d < head_dim; ++d) {
          keys_t[static_cast<size_t>(d) * kBlockSize + s] = s < filled ? table[key[d]] : 0.0f;
        }
      }
      float scales[kBlockSize];
      for (int s = 0; s < kBlockSize; ++s) scales[s] = s < filled ? block_scales[s] : 0.0f;
      for (size_t r = 0; r < rows.size(); ++r) {
        float* out = scores.data() + r * row_stride + j * kBlockSize;
        const int64_t visible = std::min<int64_t>(filled, rows[r].position + 1 - first_slot);
        if (visible <= 0) {
          std::fill(out, out + kBlockSize, kMinusInf);
          continue;
        }
        ScoreTile(keys_t.data(), scales, rows[r].query.data(), rows[r].head_weights.data(),
                  num_heads, head_dim, out);
        for (int64_t s = visible; s < kBlockSize; ++s) out[s] = kMinusInf;
      }
    }
  }
}

}  // namespace dsa
