// The CPU sparse-attention reference of the attention worker: attention of one decode row over the
// slots its selection names (DeepSeek Sparse Attention's core attention over the top-K slots, in
// MQA form: every query head attends the same per-slot key and value, as MLA decodes).
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"

namespace dsa {

/// Shapes of one sparse-attention call.
struct SparseAttentionShape {
  int num_heads = 16;       // H, query heads (>= 1)
  int key_dim = 128;        // Dk, query and key dimension (>= 1)
  int value_dim = 128;      // Dv, value dimension (>= 1)
  float softmax_scale = 0;  // multiplies q . k before the softmax; 0 means 1 / sqrt(Dk)
};

/// out[h, :] = sum_{i in S} softmax_{i in S}(scale * q[h] . k[i]) * v[i], where S is the set of
/// non-negative entries of `selection` (int32 [K], -1 padding, as the indexer returns it).
///
/// - query: fp32 [H, Dk]; keys: fp32 [num_slots, Dk]; values: fp32 [num_slots, Dv] (row-major).
/// - out: fp32 [H, Dv]. An empty S gives zeros.
/// fp32 inputs, fp32 accumulation with the max-subtracted (stable) softmax.
/// Errors (INVALID_ARGUMENT, nothing written): span sizes that do not match the shape, a shape
/// field < 1, a selected slot >= num_slots or < -1. Entries must be distinct (the indexer's
/// selections are); a repeated slot counts twice. Thread-safe.
absl::Status SparseAttention(const SparseAttentionShape& shape, std::span<const float> query,
                             std::span<const float> keys, std::span<const float> values,
                             int64_t num_slots, std::span<const int32_t> selection,
                             std::span<float> out);

}  // namespace dsa
