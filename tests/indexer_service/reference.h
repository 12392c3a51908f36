// Naive reference implementations shared by the indexer_service tests (scoring, top-K, indexer),
// written independently of the code under test: the index score as a triple loop, top-K by sort.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "common/fp8.h"

namespace dsa::testing_reference {

/// The index score z_i = s_i * sum_h w_h * ReLU(q_h . k_i) (DESIGN.md 2) of slots 0..num_slots-1
/// for one query row. Each fp32 key is quantized with the DESIGN.md 4.1 rule (common/fp8's
/// quantizer, tested on its own) into fp8 E4M3 codes and a per-slot scale s_i; the codes are
/// decoded and the dot products accumulated in double.
///   keys:    fp32 [>= num_slots, head_dim], row-major (slot i at keys[i * head_dim]).
///   query:   fp32 [num_heads, head_dim], row-major.
///   weights: fp32 [num_heads], the head weights w_h (any sign).
/// Returns double [num_slots]; no position masking (the caller passes position + 1 slots or masks).
/// When `magnitudes` is not null it receives double [num_slots]:
/// s_i * sum_h |w_h| * sum_d |q_hd * k_id|, the bound fp32 accumulation order can move z_i by.
inline std::vector<double> NaiveScores(std::span<const float> keys, int64_t num_slots, int head_dim,
                                       std::span<const float> query, std::span<const float> weights,
                                       int num_heads, std::vector<double>* magnitudes = nullptr) {
  std::vector<double> out(num_slots);
  if (magnitudes != nullptr) magnitudes->assign(num_slots, 0.0);
  std::vector<uint8_t> codes(head_dim);
  for (int64_t i = 0; i < num_slots; ++i) {
    const float scale =
        QuantizeIndexKey(std::span<const float>(keys.data() + i * head_dim, head_dim), codes);
    double total = 0.0, magnitude = 0.0;
    for (int h = 0; h < num_heads; ++h) {
      double dot = 0.0, abs_dot = 0.0;
      for (int d = 0; d < head_dim; ++d) {
        const double term = static_cast<double>(query[h * head_dim + d]) * DecodeFp8E4m3(codes[d]);
        dot += term;
        abs_dot += std::fabs(term);
      }
      total += weights[h] * std::max(dot, 0.0);
      magnitude += std::fabs(weights[h]) * abs_dot;
    }
    out[i] = scale * total;
    if (magnitudes != nullptr) (*magnitudes)[i] = scale * magnitude;
  }
  return out;
}

/// Top-`k` of one row by a full sort of every selectable (score, slot) pair, with DSA's rules
/// (DESIGN.md 4.1): score descending, ties to the lower slot; NaN and -inf entries masked; no slot
/// beyond `max_slot` (the row's position); -1 padding when fewer than k entries are selectable.
///   scores: fp32 [blocks.size() * 64] when `blocks` is non-empty (entry j * 64 + s is slot
///           blocks[j] * 64 + s), else fp32 [n] with entry e being slot e.
///   blocks: int32 [num_blocks], logical block ids in the order the scores are laid out; may be
///           empty for an unblocked row.
/// Returns int32 [k], best first.
inline std::vector<int32_t> FullSortTopK(std::span<const float> scores,
                                         std::span<const int32_t> blocks, int64_t max_slot, int k) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  std::vector<std::pair<float, int32_t>> all;
  for (size_t e = 0; e < scores.size(); ++e) {
    const int64_t slot = blocks.empty() ? static_cast<int64_t>(e)
                                        : blocks[e / 64] * 64LL + static_cast<int64_t>(e % 64);
    if (std::isnan(scores[e]) || scores[e] == -kInf || slot > max_slot) continue;
    all.push_back({scores[e], static_cast<int32_t>(slot)});
  }
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  std::vector<int32_t> out(k, -1);
  for (int i = 0; i < k && i < static_cast<int>(all.size()); ++i) out[i] = all[i].second;
  return out;
}

}  // namespace dsa::testing_reference
