// The exact index score of DSA's lightning indexer on the CPU (DESIGN.md 2 and 4.1):
// z_t[i] = s_i * sum_h w_t,h * ReLU(q_t,h . k_i), fp32 accumulation, over a list of blocks.
// This is the reference every GPU scan kernel is checked against.
#pragma once

#include <cstdint>
#include <span>

#include "indexer_service/index_key_cache.h"

namespace dsa {

/// One query row: the indexer query q_t (fp32 [num_heads, head_dim], row-major; fp8/bf16 queries
/// are decoded to fp32 by the caller), its head weights w_t (fp32 [num_heads], query scale folded
/// in) and its query position t (the row sees slots 0..t).
struct IndexerRow {
  std::span<const float> query;
  std::span<const float> head_weights;
  int64_t position = 0;
  /// The device-resident path only (Indexer::SelectBatch with a DeviceHandoff): the query fp32
  /// [num_heads, head_dim] in the scoring device's memory, read instead of `query` (then empty).
  const float* device_query = nullptr;
};

/// Scores every slot of the given logical blocks for every row, reading each key once for all rows
/// (verifier rows of one sequence share the key read).
///
/// - cache: the (sequence, layer) cache; every entry of `logical_blocks` must be in
///   [0, ceil(cache.num_slots / kBlockSize)) (checked by the caller).
/// - logical_blocks: [num_blocks] logical block indices, any order.
/// - rows: [num_rows]; every query has num_heads * cache.pool->head_dim() values and
///   head_weights.size() == num_heads (checked by the caller).
/// - scores (out): fp32 [num_rows, num_blocks * kBlockSize]; entry (r, j * 64 + s) is the score of
///   slot logical_blocks[j] * 64 + s for row r, or -inf when that slot is beyond rows[r].position
///   or beyond cache.num_slots.
/// Runs on all cores (OpenMP over blocks) with the widest SIMD the CPU offers. Thread-safe for
/// concurrent calls on a cache nobody modifies.
/// One ScoreBlocks call of a batch.
struct ScoreJob {
  const KeyCacheView* cache = nullptr;
  std::span<const int32_t> logical_blocks;
  std::span<const IndexerRow> rows;
  std::span<float> scores;  // fp32 [rows, logical_blocks.size() * kBlockSize]
};

/// ScoreBlocks for every job, in one parallel pass over all jobs' blocks (rows of many sequences
/// in one pass: DESIGN.md 3). Same contract and results as one ScoreBlocks call per job.
void ScoreBlockBatch(std::span<const ScoreJob> jobs, int num_heads);

void ScoreBlocks(const KeyCacheView& cache, std::span<const int32_t> logical_blocks,
                 std::span<const IndexerRow> rows, int num_heads, std::span<float> scores);

}  // namespace dsa
