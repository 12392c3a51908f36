// Seeded sparse MLA decode batches for the tests of the CPU reference and of the GPU kernel: a
// paged latent pool whose block tables point all over it, bf16 queries, and selections of
// distinct slots (some past the row's position, -1 padding) built from per-row specs.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "attention_worker/mla_sparse_attention.h"

namespace dsa::testing {

/// fp32 -> bf16 bits, round-to-nearest-even (finite inputs).
inline uint16_t ToBf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
/// bf16 bits -> fp32 (exact).
inline float FromBf16(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }

/// One row: its sequence's filled slots, its position, and how many distinct slots of
/// [0, num_slots) its selection names (the rest of the top_k entries are -1; entries past the
/// position are skipped by causality).
struct MlaRowSpec {
  int32_t num_slots = 1;
  int32_t position = 0;
  int num_selected = 0;
};

/// A batch and the storage its spans point into.
struct MlaTestBatch {
  std::vector<uint16_t> pool, query;
  std::vector<int32_t> tables, num_slots, positions, selections;
  MlaSparseDecodeBatch batch;
};

/// Builds a batch of `rows` with `heads` heads and `top_k` entries a row. Keys are normal with a
/// per-slot magnitude, queries normal times `query_scale` (a larger scale sharpens the softmax).
/// Slots past a row's position hold NaN, so reading one shows in the output. Spare pool blocks
/// (one per row) keep the tables away from 0..n-1.
inline MlaTestBatch MakeMlaTestBatch(const std::vector<MlaRowSpec>& rows, int heads, int top_k,
                                     uint32_t seed, float query_scale = 1.0f) {
  MlaTestBatch t;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  int max_blocks = 1;
  int64_t total_blocks = 0;
  for (const MlaRowSpec& r : rows) {
    const int blocks = (r.num_slots + kBlockSize - 1) / kBlockSize;
    max_blocks = std::max(max_blocks, blocks);
    total_blocks += blocks + 1;
  }
  t.pool.assign(total_blocks * kBlockSize * kMlaQkDim, ToBf16(0.0f));
  std::vector<int32_t> ids(total_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  int64_t next = 0;
  t.tables.assign(rows.size() * max_blocks, -1);
  for (size_t r = 0; r < rows.size(); ++r) {
    const MlaRowSpec& spec = rows[r];
    const int blocks = (spec.num_slots + kBlockSize - 1) / kBlockSize;
    for (int j = 0; j < blocks; ++j) t.tables[r * max_blocks + j] = ids[next++];
    ++next;  // a spare block between sequences
    for (int32_t slot = 0; slot < blocks * kBlockSize; ++slot) {
      uint16_t* row =
          t.pool.data() +
          (int64_t{t.tables[r * max_blocks + slot / kBlockSize]} * kBlockSize + slot % kBlockSize) *
              kMlaQkDim;
      const bool hidden = slot > spec.position;  // past the position, or an unfilled slot
      const float magnitude = 0.5f + (slot % 5) * 0.25f;
      for (int d = 0; d < kMlaQkDim; ++d) {
        row[d] = hidden ? uint16_t{0x7fc0} : ToBf16(normal(rng) * magnitude);
      }
    }
    t.num_slots.push_back(spec.num_slots);
    t.positions.push_back(spec.position);
    std::vector<int32_t> slots(spec.num_slots);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    const int selected = std::min({spec.num_selected, spec.num_slots, top_k});
    for (int e = 0; e < top_k; ++e) t.selections.push_back(e < selected ? slots[e] : -1);
  }
  t.query.resize(rows.size() * heads * kMlaQkDim);
  for (uint16_t& q : t.query) q = ToBf16(normal(rng) * query_scale);
  t.batch.num_heads = heads;
  t.batch.num_rows = static_cast<int>(rows.size());
  t.batch.top_k = top_k;
  t.batch.max_blocks_per_row = max_blocks;
  t.batch.num_physical_blocks = total_blocks;
  t.batch.kv_pool = t.pool;
  t.batch.query = t.query;
  t.batch.block_tables = t.tables;
  t.batch.num_slots = t.num_slots;
  t.batch.positions = t.positions;
  t.batch.selections = t.selections;
  return t;
}

}  // namespace dsa::testing
