// The CPU reference of the GQA attention kernels (gqa_attention.h), in double: one row's query
// heads over the slots it attends of one layer's keys and values. Header-only, framework-free, and
// built into every test that checks a kernel (no GPU needed to run it).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

namespace dsa::cuda {

/// out[h * head_dim + d] = sum_j softmax_j(scale * q_h . k_{g(h), j}) v_{g(h), j}[d] over the
/// attended slots j: the non-negative entries of `selection`, or every slot 0..position when it is
/// empty; g(h) = h / (num_heads / num_kv_heads).
/// - query: fp32 [num_heads * head_dim]; keys, values: fp32 [> every slot, num_kv_heads * head_dim]
///   (a layer of one sequence's cache); out: fp32 [num_heads * head_dim].
/// Requires at least one attended slot.
inline void GqaAttentionReference(const float* query, const float* keys, const float* values,
                                  int num_heads, int num_kv_heads, int head_dim, int64_t position,
                                  std::span<const int32_t> selection, double scale, float* out) {
  std::vector<int64_t> slots;
  for (const int32_t slot : selection) {
    if (slot >= 0) slots.push_back(slot);
  }
  if (selection.empty()) {
    for (int64_t t = 0; t <= position; ++t) slots.push_back(t);
  }
  const int group = num_heads / num_kv_heads;
  const int64_t kv_dim = static_cast<int64_t>(num_kv_heads) * head_dim;
  std::vector<double> logits(slots.size());
  for (int h = 0; h < num_heads; ++h) {
    const int64_t g = h / group;
    double peak = -INFINITY;
    for (size_t j = 0; j < slots.size(); ++j) {
      double dot = 0;
      for (int d = 0; d < head_dim; ++d) {
        dot += static_cast<double>(query[h * head_dim + d]) *
               keys[slots[j] * kv_dim + g * head_dim + d];
      }
      logits[j] = dot * scale;
      peak = std::max(peak, logits[j]);
    }
    double total = 0;
    for (double& z : logits) total += (z = std::exp(z - peak));
    for (int d = 0; d < head_dim; ++d) {
      double o = 0;
      for (size_t j = 0; j < slots.size(); ++j) {
        o += logits[j] * values[slots[j] * kv_dim + g * head_dim + d];
      }
      out[h * head_dim + d] = static_cast<float>(o / total);
    }
  }
}

}  // namespace dsa::cuda
