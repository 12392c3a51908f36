// The CPU reference of the attention worker's sparse MLA decode (DeepSeek-V3.2's attention over
// the indexer's top-K slots, DESIGN.md 3): every query head attends the same latent rows of a
// paged MLA KV cache, the value being the first 512 dims of the key's latent row (as MLA decodes).
// The GPU kernel (attention_worker/cuda/sparse_mla_decode.h) reads the same layout and is checked
// against this function.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "contracts/layout.h"

namespace dsa {

inline constexpr int kMlaQkDim = kMlaNopeDim + kMlaRopeDim;  // 576
/// Dims of a value: the first kMlaNopeDim dims of the latent row.
inline constexpr int kMlaVDim = kMlaNopeDim;  // 512

/// Paged MLA KV cache layout (host and device alike): a pool of num_physical_blocks blocks, each
/// 64 slots x 576 bf16, row-major: pool[b][s][d] at element (b * 64 + s) * 576 + d (1152 bytes a
/// slot, 73,728 bytes a block). Slot i of a sequence lives in physical block
/// block_table[i / 64], row i % 64; its key is the whole row, its value the row's dims [0, 512).

/// One batch of decode rows over a paged MLA KV pool. bf16 values are passed as their 16-bit
/// patterns (uint16_t), so the host copy of the device pool is read byte for byte.
struct MlaSparseDecodeBatch {
  /// H, query heads per row (>= 1); 128 in DeepSeek-V3.2.
  int num_heads = 128;
  /// Rows in the batch (>= 0).
  int num_rows = 0;
  /// K, selection entries per row (>= 0); 2048 in DeepSeek-V3.2.
  int top_k = 2048;
  /// Block-table entries per row (>= 0).
  int max_blocks_per_row = 0;
  /// Blocks in the pool (>= 0).
  int64_t num_physical_blocks = 0;
  /// Multiplies q . k before the softmax; 0 means 1 / sqrt(576).
  float softmax_scale = 0.0f;
  /// bf16 bits [num_physical_blocks, 64, 576] (the layout above).
  std::span<const uint16_t> kv_pool;
  /// bf16 bits [num_rows, num_heads, 576]: the absorbed query (nope dims, then RoPE dims).
  std::span<const uint16_t> query;
  /// int32 [num_rows, max_blocks_per_row]: row r's sequence maps logical block j to physical
  /// block block_tables[r * max_blocks_per_row + j]; entries past the row's
  /// ceil(num_slots / 64) blocks are not read.
  std::span<const int32_t> block_tables;
  /// int32 [num_rows]: filled slots of the row's sequence, in [1, 64 max_blocks_per_row].
  std::span<const int32_t> num_slots;
  /// int32 [num_rows]: the row's query position t, in [0, num_slots); it sees slots 0..t.
  std::span<const int32_t> positions;
  /// int32 [num_rows, top_k]: the row's selection (the indexer's output: best first, -1 unused).
  std::span<const int32_t> selections;
};

/// For each row r and head h, over the set S of the row's selected slots i with 0 <= i <= t_r
/// (entries -1 and entries past the position, which causality hides, are skipped):
///   out[r, h, :] = sum_{i in S} softmax_{i in S}(scale * q[r, h] . k_i) * v_i
///   lse[r, h]    = ln sum_{i in S} exp(scale * q[r, h] . k_i)   (natural log, as FlashMLA's)
/// with k_i the slot's 576-dim latent row and v_i its first 512 dims; fp32 arithmetic (the stable,
/// max-subtracted softmax). An empty S gives out = 0 and lse = -inf.
/// - out: fp32 [num_rows, num_heads, 512]; lse: fp32 [num_rows, num_heads].
/// Errors (INVALID_ARGUMENT, nothing written): a shape field out of range, a span whose size does
/// not match the shape, num_slots or a position out of its range, a selection entry < -1 or
/// >= the row's num_slots, a block-table entry the row reads outside [0, num_physical_blocks).
/// Entries should be distinct (the indexer's are); a repeated slot counts twice. Thread-safe.
absl::Status MlaSparseDecode(const MlaSparseDecodeBatch& batch, std::span<float> out,
                             std::span<float> lse);

/// The softmax scale a batch uses: batch.softmax_scale, or 1 / sqrt(576) when it is 0.
float MlaSoftmaxScale(const MlaSparseDecodeBatch& batch);

}  // namespace dsa
