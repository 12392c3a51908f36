// Tests of top-K selection (indexer_service/topk.h; DESIGN.md 4.1): hand cases, the DSA edge
// cases (ReLU-zero ties, -inf padding, max_slot), and a comparison with a full sort on random
// scores with ties, -inf and NaN, blocked and unblocked.
#include "indexer_service/topk.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "tests/indexer_service/reference.h"

namespace dsa {
namespace {

using testing_reference::FullSortTopK;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<int32_t> TopK(const std::vector<float>& scores, const std::vector<int32_t>& blocks,
                          int64_t max_slot, int k) {
  std::vector<int32_t> selection(k, 12345);
  SelectTopK(scores, blocks, max_slot, selection);
  return selection;
}

TEST(TopKTest, HandCase) {
  // slot:                      0     1     2     3     4      5     6
  const std::vector<float> s = {1.0f, 5.0f, 3.0f, 5.0f, -kInf, kNaN, 2.0f};
  // Order: 5 (slot 1, lower of the tie), 5 (slot 3), 3 (slot 2), 2 (slot 6), 1 (slot 0).
  EXPECT_EQ(TopK(s, {}, 6, 4), (std::vector<int32_t>{1, 3, 2, 6}));
  EXPECT_EQ(TopK(s, {}, 6, 1), (std::vector<int32_t>{1}));
  // Five selectable slots (-inf at 4 and NaN at 5 are masked), then -1.
  EXPECT_EQ(TopK(s, {}, 6, 7), (std::vector<int32_t>{1, 3, 2, 6, 0, -1, -1}));
  // max_slot 2: slots 3.. are invisible.
  EXPECT_EQ(TopK(s, {}, 2, 4), (std::vector<int32_t>{1, 2, 0, -1}));
  // max_slot -1: nothing is visible.
  EXPECT_EQ(TopK(s, {}, -1, 3), (std::vector<int32_t>{-1, -1, -1}));
}

TEST(TopKTest, NegativeScoresAndZerosAreSelectable) {
  const std::vector<float> s = {-3.0f, 0.0f, -0.0f, -1.0f};
  // 0 and -0 compare equal: the tie goes to the lower slot.
  EXPECT_EQ(TopK(s, {}, 3, 4), (std::vector<int32_t>{1, 2, 3, 0}));
}

TEST(TopKTest, AllTiesGoToLowerSlots) {
  const std::vector<float> s(200, 0.5f);
  std::vector<int32_t> expected(64);
  for (int i = 0; i < 64; ++i) expected[i] = i;
  EXPECT_EQ(TopK(s, {}, 199, 64), expected);
}

TEST(TopKTest, FiftyOneSlotsThreeFiniteScores) {
  // Scores 3, 2, 1 at slots 0..2 and -inf elsewhere, K = 16: [0, 1, 2] then 13 x -1.
  std::vector<float> s(51, -kInf);
  s[0] = 3.0f;
  s[1] = 2.0f;
  s[2] = 1.0f;
  std::vector<int32_t> expected = {0, 1, 2};
  expected.resize(16, -1);
  EXPECT_EQ(TopK(s, {}, 50, 16), expected);
}

TEST(TopKTest, ReluZerosFillTheSelectionWithoutMinusOne) {
  // 8,320 slots, 100 scoring 1.0 and the rest exactly 0.0, K = 2048: the 100 winners (ties by
  // slot) come first, then the 1,948 lowest zero-score slots; 2,048 distinct slots, no -1.
  const int64_t n = 8320;
  std::mt19937 rng(7);
  std::vector<int32_t> slots(n);
  for (int64_t i = 0; i < n; ++i) slots[i] = static_cast<int32_t>(i);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<int32_t> winners(slots.begin(), slots.begin() + 100);
  std::sort(winners.begin(), winners.end());
  std::vector<float> s(n, 0.0f);
  for (int32_t w : winners) s[w] = 1.0f;

  std::vector<int32_t> expected = winners;
  for (int32_t i = 0; static_cast<int64_t>(expected.size()) < 2048; ++i) {
    if (s[i] == 0.0f) expected.push_back(i);
  }
  const std::vector<int32_t> got = TopK(s, {}, n - 1, 2048);
  EXPECT_EQ(got, expected);
  EXPECT_EQ(std::set<int32_t>(got.begin(), got.end()).size(), 2048u);
  EXPECT_EQ(std::count(got.begin(), got.end(), -1), 0);
}

TEST(TopKTest, LogicalBlocksMapEntriesToSlots) {
  // Two scored blocks given as {3, 1}: entry e < 64 is slot 192 + e, entry e >= 64 is slot 64 + e
  // - 64.
  std::vector<float> s(128, -kInf);
  s[0] = 1.0f;    // slot 192
  s[5] = 4.0f;    // slot 197
  s[63] = 2.0f;   // slot 255
  s[64] = 3.0f;   // slot 64
  s[100] = 4.0f;  // slot 100
  EXPECT_EQ(TopK(s, {3, 1}, 1000, 6), (std::vector<int32_t>{100, 197, 64, 255, 192, -1}));
  // max_slot 196 cuts block 3 after slot 196.
  EXPECT_EQ(TopK(s, {3, 1}, 196, 4), (std::vector<int32_t>{100, 64, 192, -1}));
}

TEST(TopKTest, KOfOne) {
  const std::vector<float> s = {0.0f, 2.0f, 2.0f};
  EXPECT_EQ(TopK(s, {}, 2, 1), (std::vector<int32_t>{1}));
}

TEST(TopKTest, MatchesFullSortOnRandomScores) {
  std::mt19937 rng(99);
  int cases = 0;
  for (int64_t num_blocks : {1, 3, 17, 70}) {
    for (bool blocked : {false, true}) {
      for (int k : {1, 7, 64, 300, 2048}) {
        for (int trial = 0; trial < 3; ++trial) {
          const int64_t n = num_blocks * 64;
          std::vector<float> s(n);
          // Few distinct values so ties are common; some -inf and NaN.
          std::uniform_int_distribution<int> value(-8, 8), kind(0, 19);
          for (float& v : s) {
            const int c = kind(rng);
            v = c == 0 ? -kInf : c == 1 ? kNaN : static_cast<float>(value(rng)) * 0.25f;
          }
          std::vector<int32_t> blocks;
          if (blocked) {
            std::vector<int32_t> all(num_blocks * 3);
            for (size_t j = 0; j < all.size(); ++j) all[j] = static_cast<int32_t>(j);
            std::shuffle(all.begin(), all.end(), rng);
            blocks.assign(all.begin(), all.begin() + num_blocks);
          }
          const int64_t span = blocked ? num_blocks * 3 * 64 : n;
          std::uniform_int_distribution<int64_t> max_slot_dist(-1, span + 10);
          const int64_t max_slot = trial == 0 ? span - 1 : max_slot_dist(rng);
          const std::vector<int32_t> got = TopK(s, blocks, max_slot, k);
          ASSERT_EQ(got, FullSortTopK(s, blocks, max_slot, k))
              << "blocks " << num_blocks << " blocked " << blocked << " k " << k << " max_slot "
              << max_slot;
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 4 * 2 * 5 * 3);
}

TEST(SelectionMissRate, HandCases) {
  // Pruned {1, 2, 3}, dense {2, 3, 4, 5}: 2 of 4 dense slots kept -> 0.5; order and -1 ignored.
  const std::vector<int32_t> pruned = {3, -1, 1, 2, -1};
  const std::vector<int32_t> dense = {5, 4, 3, 2};
  EXPECT_DOUBLE_EQ(SelectionMissRate(pruned, dense), 0.5);
  EXPECT_DOUBLE_EQ(SelectionMissRate(dense, dense), 0.0);
  const std::vector<int32_t> disjoint = {7, 8};
  EXPECT_DOUBLE_EQ(SelectionMissRate(disjoint, dense), 1.0);
  const std::vector<int32_t> empty = {-1, -1};
  EXPECT_DOUBLE_EQ(SelectionMissRate(pruned, empty), 0.0);
  EXPECT_DOUBLE_EQ(SelectionMissRate(empty, dense), 1.0);
}

}  // namespace
}  // namespace dsa
