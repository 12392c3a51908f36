// Top-K selection (see topk.h): gather the selectable (score, slot) pairs, introselect the K-th
// under the total order (score descending, slot ascending), then sort the K winners.
#include "indexer_service/topk.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "indexer_service/block_pool.h"

namespace dsa {
namespace {

struct Candidate {
  float score;
  int32_t slot;
};

// The total order of DESIGN.md 4.1: higher score first, then lower slot.
inline bool Better(const Candidate& a, const Candidate& b) {
  return a.score > b.score || (a.score == b.score && a.slot < b.slot);
}

}  // namespace

void SelectTopK(std::span<const float> scores, std::span<const int32_t> logical_blocks,
                int64_t max_slot, std::span<int32_t> selection) {
  const size_t k = selection.size();
  std::vector<Candidate> candidates;
  candidates.reserve(std::min(scores.size(), static_cast<size_t>(max_slot + 1)));
  const bool blocked = !logical_blocks.empty();
  for (size_t e = 0; e < scores.size(); ++e) {
    const float score = scores[e];
    // NaN and -inf are masked; +inf is a legal (largest) score.
    if (std::isnan(score) || score == -INFINITY) continue;
    const int64_t slot =
        blocked ? static_cast<int64_t>(logical_blocks[e / kBlockSize]) * kBlockSize + e % kBlockSize
                : static_cast<int64_t>(e);
    if (slot > max_slot) continue;
    candidates.push_back({score, static_cast<int32_t>(slot)});
  }
  const size_t taken = std::min(k, candidates.size());
  if (candidates.size() > k) {
    std::nth_element(candidates.begin(), candidates.begin() + k, candidates.end(), Better);
  }
  std::sort(candidates.begin(), candidates.begin() + taken, Better);
  for (size_t i = 0; i < taken; ++i) selection[i] = candidates[i].slot;
  std::fill(selection.begin() + taken, selection.end(), -1);
}

}  // namespace dsa
