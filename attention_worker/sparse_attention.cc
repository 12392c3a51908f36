// CPU sparse attention (see sparse_attention.h).
#include "attention_worker/sparse_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"

namespace dsa {

absl::Status SparseAttention(const SparseAttentionShape& shape, std::span<const float> query,
                             std::span<const float> keys, std::span<const float> values,
                             int64_t num_slots, std::span<const int32_t> selection,
                             std::span<float> out) {
  const int64_t h_count = shape.num_heads, dk = shape.key_dim, dv = shape.value_dim;
  if (h_count < 1 || dk < 1 || dv < 1 || num_slots < 0) {
    return absl::InvalidArgumentError("sparse attention: heads, dims must be >= 1, slots >= 0");
  }
  if (static_cast<int64_t>(query.size()) != h_count * dk ||
      static_cast<int64_t>(keys.size()) != num_slots * dk ||
      static_cast<int64_t>(values.size()) != num_slots * dv ||
      static_cast<int64_t>(out.size()) != h_count * dv) {
    return absl::InvalidArgumentError(
        absl::StrCat("sparse attention: sizes query ", query.size(), ", keys ", keys.size(),
                     ", values ", values.size(), ", out ", out.size(), " do not fit H ", h_count,
                     ", Dk ", dk, ", Dv ", dv, ", slots ", num_slots));
  }
  std::vector<int32_t> slots;
  slots.reserve(selection.size());
  for (int32_t slot : selection) {
    if (slot < -1 || slot >= num_slots) {
      return absl::InvalidArgumentError(
          absl::StrCat("sparse attention: selected slot ", slot, " outside [-1, ", num_slots, ")"));
    }
    if (slot >= 0) slots.push_back(slot);
  }
  const float scale =
      shape.softmax_scale != 0 ? shape.softmax_scale : 1.0f / std::sqrt(static_cast<float>(dk));
  std::fill(out.begin(), out.end(), 0.0f);
  if (slots.empty()) return absl::OkStatus();
  std::vector<float> logits(slots.size());
  for (int64_t h = 0; h < h_count; ++h) {
    const float* q = query.data() + h * dk;
    float max_logit = -INFINITY;
    for (size_t j = 0; j < slots.size(); ++j) {
      const float* k = keys.data() + static_cast<int64_t>(slots[j]) * dk;
      float dot = 0.0f;
      for (int64_t d = 0; d < dk; ++d) dot += q[d] * k[d];
      logits[j] = scale * dot;
      max_logit = std::max(max_logit, logits[j]);
    }
    float denominator = 0.0f;
    for (float& logit : logits) {
      logit = std::exp(logit - max_logit);
      denominator += logit;
    }
    float* o = out.data() + h * dv;
    for (size_t j = 0; j < slots.size(); ++j) {
      const float weight = logits[j] / denominator;
      const float* v = values.data() + static_cast<int64_t>(slots[j]) * dv;
      for (int64_t d = 0; d < dv; ++d) o[d] += weight * v[d];
    }
  }
  return absl::OkStatus();
}

}  // namespace dsa
