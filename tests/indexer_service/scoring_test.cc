// Tests of the CPU index scorer (indexer_service/scoring.h; DESIGN.md 2 and 4.1): a hand-computed
// 2-slot, 2-head, D = 4 case, the -inf masking rules, and a comparison with a naive triple loop on
// independently quantized and decoded keys (double accumulation) over a grid of shapes.
#include "indexer_service/scoring.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "indexer_service/index_key_cache.h"
#include "tests/indexer_service/reference.h"

namespace dsa {
namespace {

using testing_reference::NaiveScores;
constexpr float kInf = std::numeric_limits<float>::infinity();

IndexKeyCache MakeCacheWithKeys(int head_dim, const std::vector<float>& keys, int64_t num_keys,
                                int64_t capacity_blocks = 64) {
  auto cache = IndexKeyCache::Create(capacity_blocks, head_dim);
  EXPECT_TRUE(cache.ok());
  EXPECT_TRUE(cache->AddSequence(1, 1).ok());
  EXPECT_TRUE(cache->Append(1, 0, keys, num_keys).ok());
  return std::move(*cache);
}

// Hand case. Keys quantize exactly (scales are powers of two, codes are E4M3 values):
//   k0 = [3.5, 1, -0.5, 0.25]: scale 1/128, codes [448, 128, -64, 32]
//   k1 = [-1.75, 0.5, 1, 0]:   scale 1/256, codes [-448, 128, 256, 0]
// Queries: head 0 = [1, 2, 0, -1], head 1 = [0, 1, 1, 1]; weights w = [0.5, 2].
//   slot 0: head 0: 3.5 + 2 + 0 - 0.25 = 5.25; head 1: 0 + 1 - 0.5 + 0.25 = 0.75
//           z = 0.5 * 5.25 + 2 * 0.75 = 4.125
//   slot 1: head 0: -1.75 + 1 + 0 + 0 = -0.75 -> ReLU 0; head 1: 0 + 0.5 + 1 + 0 = 1.5
//           z = 0.5 * 0 + 2 * 1.5 = 3
const std::vector<float> kHandKeys = {3.5f, 1.0f, -0.5f, 0.25f, -1.75f, 0.5f, 1.0f, 0.0f};
const std::vector<float> kHandQuery = {1.0f, 2.0f, 0.0f, -1.0f, 0.0f, 1.0f, 1.0f, 1.0f};
const std::vector<float> kHandWeights = {0.5f, 2.0f};

TEST(ScoringTest, TwoSlotsTwoHeadsByHand) {
  IndexKeyCache cache = MakeCacheWithKeys(4, kHandKeys, 2);
  const KeyCacheView view = *cache.View(1, 0);
  const std::vector<int32_t> blocks = {0};
  const IndexerRow row{kHandQuery, kHandWeights, 1};
  std::vector<float> scores(64, 123.0f);
  ScoreBlocks(view, blocks, std::span<const IndexerRow>(&row, 1), 2, scores);
  EXPECT_FLOAT_EQ(scores[0], 4.125f);
  EXPECT_FLOAT_EQ(scores[1], 3.0f);
  for (int s = 2; s < 64; ++s)
    EXPECT_EQ(scores[s], -kInf) << "slot " << s << " is beyond num_slots";
}

TEST(ScoringTest, RowsSeeOnlyUpToTheirPosition) {
  IndexKeyCache cache = MakeCacheWithKeys(4, kHandKeys, 2);
  const KeyCacheView view = *cache.View(1, 0);
  const std::vector<int32_t> blocks = {0};
  // Row 0 at position 0 sees slot 0 only; row 1 at position 1 sees both. Row 1 has row 0's query
  // with the weights swapped (w = [2, 0.5]): slot 0 -> 2 * 5.25 + 0.5 * 0.75 = 10.875,
  // slot 1 -> 2 * 0 + 0.5 * 1.5 = 0.75.
  const std::vector<float> swapped_weights = {2.0f, 0.5f};
  const IndexerRow rows[] = {{kHandQuery, kHandWeights, 0}, {kHandQuery, swapped_weights, 1}};
  std::vector<float> scores(2 * 64, 123.0f);
  ScoreBlocks(view, blocks, rows, 2, scores);
  EXPECT_FLOAT_EQ(scores[0], 4.125f);
  EXPECT_EQ(scores[1], -kInf);
  EXPECT_FLOAT_EQ(scores[64 + 0], 10.875f);
  EXPECT_FLOAT_EQ(scores[64 + 1], 0.75f);
  for (int s = 2; s < 64; ++s) {
    EXPECT_EQ(scores[s], -kInf);
    EXPECT_EQ(scores[64 + s], -kInf);
  }
}

TEST(ScoringTest, NegativeDotProductsGiveExactZeros) {
  // k = [448, -64, 0, 0] (scale 1), q = [0, 2^-6, 0, 0]: q . k = -1 -> ReLU 0 -> z = 0 exactly;
  // k = [448, 64, 0, 0]: q . k = 1 -> z = 1 exactly.
  const std::vector<float> keys = {448.0f, -64.0f, 0.0f, 0.0f, 448.0f, 64.0f, 0.0f, 0.0f};
  IndexKeyCache cache = MakeCacheWithKeys(4, keys, 2);
  const std::vector<float> query = {0.0f, 1.0f / 64.0f, 0.0f, 0.0f};
  const std::vector<float> weights = {1.0f};
  const IndexerRow row{query, weights, 1};
  const std::vector<int32_t> blocks = {0};
  std::vector<float> scores(64);
  ScoreBlocks(*cache.View(1, 0), blocks, std::span<const IndexerRow>(&row, 1), 1, scores);
  EXPECT_EQ(scores[0], 0.0f);
  EXPECT_FALSE(std::signbit(scores[0]));
  EXPECT_EQ(scores[1], 1.0f);
}

// Slot s holds key [v, -v, 0, 0] with v = (s % 8 + 1) * 2^(s / 8 % 4): amax = v, scale = v / 448,
// codes [448, -448, 0, 0]. With q = [1, 0, 0, 0] and w = [1], z = scale * 448 = v within one
// rounding of v / 448.
TEST(ScoringTest, BlocksInAnyOrderAndAPartialLastBlock) {
  const int head_dim = 4;
  const int64_t num_slots = 150;  // blocks 0, 1 full; block 2 holds slots 128..149
  std::vector<float> keys;
  std::vector<float> expected(num_slots);
  for (int64_t s = 0; s < num_slots; ++s) {
    const float v = static_cast<float>(s % 8 + 1) * static_cast<float>(1 << (s / 8 % 4));
    keys.insert(keys.end(), {v, -v, 0.0f, 0.0f});
    expected[s] = v;
  }
  IndexKeyCache cache = MakeCacheWithKeys(head_dim, keys, num_slots);
  const std::vector<float> query = {1.0f, 0.0f, 0.0f, 0.0f};
  const std::vector<float> weights = {1.0f};
  const IndexerRow rows[] = {{query, weights, 149}, {query, weights, 70}};
  const std::vector<int32_t> blocks = {2, 0, 1};
  std::vector<float> scores(2 * 3 * 64);
  ScoreBlocks(*cache.View(1, 0), blocks, rows, 1, scores);
  for (int r = 0; r < 2; ++r) {
    const int64_t position = rows[r].position;
    for (int j = 0; j < 3; ++j) {
      for (int s = 0; s < 64; ++s) {
        const int64_t slot = blocks[j] * 64 + s;
        const float got = scores[r * 192 + j * 64 + s];
        if (slot > position || slot >= num_slots) {
          EXPECT_EQ(got, -kInf) << "row " << r << " slot " << slot;
        } else {
          EXPECT_NEAR(got, expected[slot], 1e-6f * expected[slot])
              << "row " << r << " slot " << slot;
        }
      }
    }
  }
}

TEST(ScoringTest, AllZeroKeyScoresZero) {
  const std::vector<float> keys = {0.0f, 0.0f, 0.0f, 0.0f};
  IndexKeyCache cache = MakeCacheWithKeys(4, keys, 1);
  const std::vector<float> query = {1.0f, 1.0f, 1.0f, 1.0f};
  const std::vector<float> weights = {1.0f};
  const IndexerRow row{query, weights, 0};
  const std::vector<int32_t> blocks = {0};
  std::vector<float> scores(64);
  ScoreBlocks(*cache.View(1, 0), blocks, std::span<const IndexerRow>(&row, 1), 1, scores);
  EXPECT_EQ(scores[0], 0.0f);
}

struct Shape {
  int num_heads;
  int head_dim;
  int64_t num_slots;
};

// Random keys and queries over a grid; contexts not a multiple of 64. Two error measures:
//   relative: |got - ref| / |ref| over scores with ref >= 1e-3 x the row's largest (positive
//             weights, so no cancellation across heads);
//   normalized: |got - ref| / (s_i sum_h |w_h| sum_d |q_hd k_id|) over every slot, the bound that
//             fp32 accumulation order can move a score by (meaningful also for mixed-sign weights).
TEST(ScoringTest, MatchesNaiveReferenceOnRandomInputs) {
  const Shape shapes[] = {{4, 128, 1000}, {16, 128, 777}, {64, 128, 321}, {64, 128, 130},
                          {8, 64, 65},    {3, 7, 200},    {1, 1, 63}};
  std::mt19937 rng(20260101);
  double max_relative = 0.0, max_normalized = 0.0;
  for (const Shape& shape : shapes) {
    for (bool mixed_sign_weights : {false, true}) {
      const int H = shape.num_heads, D = shape.head_dim;
      const int64_t N = shape.num_slots;
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::uniform_real_distribution<float> positive(0.1f, 1.0f);
      std::vector<float> keys(N * D);
      for (int64_t i = 0; i < N; ++i) {
        const float slot_scale = std::exp(normal(rng));  // a spread of per-slot amax values
        for (int d = 0; d < D; ++d) keys[i * D + d] = normal(rng) * slot_scale;
      }
      IndexKeyCache cache = MakeCacheWithKeys(D, keys, N, (N + 63) / 64);
      const KeyCacheView view = *cache.View(1, 0);
      // Three rows (verifier-like) at the last positions and one early row.
      const int64_t positions[] = {N / 3, N - 3, N - 2, N - 1};
      std::vector<std::vector<float>> queries, weights;
      std::vector<IndexerRow> rows;
      for (int64_t position : positions) {
        std::vector<float> q(H * D), w(H);
        for (float& v : q) v = normal(rng);
        for (float& v : w) v = mixed_sign_weights ? normal(rng) : positive(rng);
        queries.push_back(std::move(q));
        weights.push_back(std::move(w));
        (void)position;
      }
      for (size_t r = 0; r < queries.size(); ++r)
        rows.push_back({queries[r], weights[r], positions[r]});
      // Every block, in a shuffled order.
      std::vector<int32_t> blocks((N + 63) / 64);
      for (size_t j = 0; j < blocks.size(); ++j) blocks[j] = static_cast<int32_t>(j);
      std::shuffle(blocks.begin(), blocks.end(), rng);
      const size_t stride = blocks.size() * 64;
      std::vector<float> scores(rows.size() * stride, 99.0f);
      ScoreBlocks(view, blocks, rows, H, scores);

      for (size_t r = 0; r < rows.size(); ++r) {
        std::vector<double> magnitudes;
        const std::vector<double> ref =
            NaiveScores(keys, N, D, queries[r], weights[r], H, &magnitudes);
        const double row_max = *std::max_element(ref.begin(), ref.end());
        for (size_t j = 0; j < blocks.size(); ++j) {
          for (int s = 0; s < 64; ++s) {
            const int64_t slot = static_cast<int64_t>(blocks[j]) * 64 + s;
            const float got = scores[r * stride + j * 64 + s];
            if (slot >= N || slot > rows[r].position) {
              ASSERT_EQ(got, -kInf) << "H=" << H << " D=" << D << " N=" << N << " slot " << slot;
              continue;
            }
            ASSERT_TRUE(std::isfinite(got)) << "slot " << slot;
            const double err = std::fabs(static_cast<double>(got) - ref[slot]);
            if (magnitudes[slot] > 0.0)
              max_normalized = std::max(max_normalized, err / magnitudes[slot]);
            else
              ASSERT_EQ(got, 0.0f);
            if (!mixed_sign_weights && ref[slot] >= 1e-3 * row_max) {
              max_relative = std::max(max_relative, err / ref[slot]);
            }
            ASSERT_LE(err, 1e-5 * magnitudes[slot])
                << "H=" << H << " D=" << D << " N=" << N << " row " << r << " slot " << slot
                << " got " << got << " ref " << ref[slot];
          }
        }
      }
    }
  }
  std::printf("scoring vs naive reference: max relative error %.3g, max normalized error %.3g\n",
              max_relative, max_normalized);
  EXPECT_LE(max_relative, 1e-5);
  EXPECT_LE(max_normalized, 1e-5);
}

}  // namespace
}  // namespace dsa
