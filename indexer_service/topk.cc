// Top-K selection (see topk.h). Every selectable slot is one 64-bit rank, (order-preserving bits of
// its score) << 32 | ~slot, so the total order of DESIGN.md 4.1 (score descending, then slot
// ascending) is the descending order of distinct integers. A strided sample of the scores gives a
// threshold that at least K scores reach with near certainty; one AVX2 pass gathers the ranks
// of the scores at or above it (a few K on realistic scores). When fewer than K pass (an unlucky
// sample, few selectable slots), every selectable rank is gathered instead. Histograms of the
// ranks' bits narrow a large gathered set; nth_element and a sort of the K winners finish.
#include "indexer_service/topk.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <functional>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DSA_TOPK_X86 1
#endif

#include "indexer_service/block_pool.h"

namespace dsa {
namespace {

// A float's bits, mapped so that unsigned comparison orders like the floats (-0 counts as +0, so
// equal scores give equal keys). Only for scores that are neither NaN nor -inf.
inline uint32_t OrderedKey(float score) {
  const uint32_t bits = std::bit_cast<uint32_t>(score + 0.0f);  // -0 + 0 = +0; nothing else moves
  return bits ^ (static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) | 0x80000000u);
}

inline uint64_t Rank(float score, int64_t slot) {
  return static_cast<uint64_t>(OrderedKey(score)) << 32 | (~static_cast<uint32_t>(slot));
}

inline int32_t SlotOfRank(uint64_t rank) {
  return static_cast<int32_t>(~static_cast<uint32_t>(rank));
}

// A run of entries [first, end) of `scores` whose slots are consecutive, from first_slot, and at
// most the row's max_slot.
struct Run {
  int64_t first;
  int64_t end;
  int64_t first_slot;
};

std::vector<Run> SelectableRuns(size_t num_scores, std::span<const int32_t> logical_blocks,
                                int64_t max_slot) {
  const int64_t n = static_cast<int64_t>(num_scores);
  std::vector<Run> runs;
  if (logical_blocks.empty()) {
    const int64_t end = std::min(n, max_slot + 1);
    if (end > 0) runs.push_back({0, end, 0});
    return runs;
  }
  const int64_t num_blocks = std::min<int64_t>(static_cast<int64_t>(logical_blocks.size()),
                                               (n + kBlockSize - 1) / kBlockSize);
  for (int64_t j = 0; j < num_blocks; ++j) {
    const int64_t first_slot = static_cast<int64_t>(logical_blocks[j]) * kBlockSize;
    const int64_t first = j * kBlockSize;
    const int64_t length = std::min({int64_t{kBlockSize}, max_slot + 1 - first_slot, n - first});
    if (length <= 0) continue;
    if (!runs.empty() && runs.back().end == first &&
        runs.back().first_slot + (first - runs.back().first) == first_slot) {
      runs.back().end = first + length;  // the block list continues the previous run
    } else {
      runs.push_back({first, first + length, first_slot});
    }
  }
  return runs;
}

// Appends the rank of every entry of `run` whose score is >= threshold (so neither NaN nor -inf
// when threshold > -inf).
void GatherAtLeastScalar(const float* scores, Run run, float threshold,
                         std::vector<uint64_t>& ranks) {
  for (int64_t e = run.first; e < run.end; ++e) {
    if (scores[e] >= threshold) ranks.push_back(Rank(scores[e], run.first_slot + (e - run.first)));
  }
}

#if DSA_TOPK_X86
// GatherAtLeastScalar 16 scores at a time: one compare and mask per 8, then only the hits walked.
__attribute__((target("avx2,bmi"))) void GatherAtLeastAvx2(const float* scores, Run run,
                                                           float threshold,
                                                           std::vector<uint64_t>& ranks) {
  const __m256 threshold8 = _mm256_set1_ps(threshold);
  int64_t e = run.first;
  for (; e + 16 <= run.end; e += 16) {
    const __m256 low = _mm256_cmp_ps(_mm256_loadu_ps(scores + e), threshold8, _CMP_GE_OQ);
    const __m256 high = _mm256_cmp_ps(_mm256_loadu_ps(scores + e + 8), threshold8, _CMP_GE_OQ);
    uint32_t hits = static_cast<uint32_t>(_mm256_movemask_ps(low)) |
                    static_cast<uint32_t>(_mm256_movemask_ps(high)) << 8;
    while (hits != 0) {
      const int64_t i = e + std::countr_zero(hits);
      hits &= hits - 1;
      ranks.push_back(Rank(scores[i], run.first_slot + (i - run.first)));
    }
  }
  GatherAtLeastScalar(scores, {e, run.end, run.first_slot + (e - run.first)}, threshold, ranks);
}
#endif

void GatherAtLeast(const float* scores, Run run, float threshold, std::vector<uint64_t>& ranks) {
#if DSA_TOPK_X86
  static const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi");
  if (has_avx2) {
    GatherAtLeastAvx2(scores, run, threshold, ranks);
    return;
  }
#endif
  GatherAtLeastScalar(scores, run, threshold, ranks);
}

// The threshold of the fast path: a score that at least k selectable scores reach with near
// certainty, from a strided sample of up to 4096 scores (one in 8 at least); -inf where a sample
// cannot help (few entries, or k a large fraction of them).
float SampledThreshold(const float* scores, const std::vector<Run>& runs, size_t k) {
  constexpr int64_t kMaxSampleSize = 4096;
  int64_t num_entries = 0;
  for (const Run& run : runs) num_entries += run.end - run.first;
  if (num_entries < 8192 || static_cast<int64_t>(k) * 4 > num_entries) return -INFINITY;
  const int64_t stride = std::max<int64_t>(8, num_entries / kMaxSampleSize);
  std::vector<float> sample;
  sample.reserve(num_entries / stride + 1);
  int64_t skip = 0;  // entries to pass over before the next sample
  for (const Run& run : runs) {
    int64_t e = run.first + skip;
    for (; e < run.end; e += stride) {
      if (scores[e] > -INFINITY) sample.push_back(scores[e]);
    }
    skip = e - run.end;
  }
  // The sample's expected count at or above the K-th score is m * k / n; ask for 4 standard
  // deviations (and 2) more, so that for scores in no particular order fewer than k reach the
  // threshold with probability below 1e-4. Either way the result is exact: the caller checks the
  // count and falls back to gathering every rank.
  const double expected = static_cast<double>(sample.size()) * static_cast<double>(k) /
                          static_cast<double>(num_entries);
  const size_t rank = static_cast<size_t>(std::ceil(expected + 4.0 * std::sqrt(expected) + 2.0));
  if (rank >= sample.size()) return -INFINITY;
  std::nth_element(sample.begin(), sample.begin() + (rank - 1), sample.end(), std::greater<>());
  return sample[rank - 1];
}

// Narrows `ranks` (distinct, at least k) to at most max(4096, 4k) entries that still hold its k
// largest, by histograms of 11 bits of the ranks at a time from the top (MSD radix select).
void NarrowRanks(std::vector<uint64_t>& ranks, size_t k) {
  constexpr int kRadixBits = 11;
  const size_t small_enough = std::max<size_t>(4096, 4 * k);
  uint64_t prefix = 0;  // every kept rank r has r >> shift >= prefix (vacuous at shift 64)
  int shift = 64;
  while (ranks.size() > small_enough && shift > 0) {
    const int next_shift = std::max(shift - kRadixBits, 0);
    const uint64_t digit_mask = (uint64_t{1} << (shift - next_shift)) - 1;
    std::array<uint32_t, 1 << kRadixBits> digits{};
    size_t winners = 0;  // ranks above the prefix: in the top k whatever their lower bits
    for (uint64_t rank : ranks) {
      if (shift == 64 || (rank >> shift) == prefix) {
        ++digits[(rank >> next_shift) & digit_mask];
      } else {
        ++winners;
      }
    }
    // The digit of the k-th largest among the ranks that share the prefix.
    size_t need = k - winners;
    int digit = static_cast<int>(digit_mask);
    while (digits[digit] < need) need -= digits[digit--];
    prefix = (shift == 64 ? 0 : prefix << (shift - next_shift)) | static_cast<uint64_t>(digit);
    shift = next_shift;
    std::erase_if(ranks, [&](uint64_t rank) { return (rank >> shift) < prefix; });
  }
}

}  // namespace

void SelectTopK(std::span<const float> scores, std::span<const int32_t> logical_blocks,
                int64_t max_slot, std::span<int32_t> selection) {
  const size_t k = selection.size();
  if (k == 0) return;
  const std::vector<Run> runs = SelectableRuns(scores.size(), logical_blocks, max_slot);

  std::vector<uint64_t> ranks;
  const float threshold = SampledThreshold(scores.data(), runs, k);
  if (threshold > -INFINITY) {
    ranks.reserve(4 * k);
    for (const Run& run : runs) GatherAtLeast(scores.data(), run, threshold, ranks);
  }
  if (ranks.size() < k) {
    // Every selectable rank: NaN and -inf fail `score > -inf`; +inf is a legal (largest) score.
    int64_t num_entries = 0;
    for (const Run& run : runs) num_entries += run.end - run.first;
    ranks.clear();
    ranks.reserve(num_entries);
    for (const Run& run : runs) {
      for (int64_t e = run.first; e < run.end; ++e) {
        if (scores[e] > -INFINITY)
          ranks.push_back(Rank(scores[e], run.first_slot + (e - run.first)));
      }
    }
  }
  if (ranks.size() > k) NarrowRanks(ranks, k);

  const size_t taken = std::min(k, ranks.size());
  if (ranks.size() > taken) {
    std::nth_element(ranks.begin(), ranks.begin() + taken, ranks.end(), std::greater<>());
  }
  std::sort(ranks.begin(), ranks.begin() + taken, std::greater<>());
  for (size_t i = 0; i < taken; ++i) selection[i] = SlotOfRank(ranks[i]);
  std::fill(selection.begin() + taken, selection.end(), -1);
}

double SelectionMissRate(std::span<const int32_t> pruned, std::span<const int32_t> dense) {
  std::vector<int32_t> a, b;
  for (int32_t slot : pruned) {
    if (slot >= 0) a.push_back(slot);
  }
  for (int32_t slot : dense) {
    if (slot >= 0) b.push_back(slot);
  }
  if (b.empty()) return 0.0;
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  size_t common = 0;
  for (size_t i = 0, j = 0; i < a.size() && j < b.size();) {
    if (a[i] < b[j]) {
      ++i;
    } else if (b[j] < a[i]) {
      ++j;
    } else {
      ++common, ++i, ++j;
    }
  }
  return 1.0 - static_cast<double>(common) / static_cast<double>(b.size());
}

}  // namespace dsa
