// Tests of the CPU sparse-attention reference: a hand case, an independent double-precision dense
// reference over the selected slots, and the refused inputs.
#include "attention_worker/sparse_attention.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace dsa {
namespace {

TEST(SparseAttention, HandCase) {
  // One head, Dk = Dv = 2, scale 1. Slots: k0 = (0, 0), k1 = (ln 3, 0), k2 = (9, 9) unselected.
  // q = (1, 0): logits 0 and ln 3 -> weights 1/4, 3/4; out = v0 / 4 + 3 v1 / 4.
  const SparseAttentionShape shape{1, 2, 2, 1.0f};
  const std::vector<float> query = {1.0f, 0.0f};
  const std::vector<float> keys = {0.0f, 0.0f, std::log(3.0f), 0.0f, 9.0f, 9.0f};
  const std::vector<float> values = {4.0f, 0.0f, 0.0f, 8.0f, 100.0f, 100.0f};
  const std::vector<int32_t> selection = {1, 0, -1, -1};
  std::vector<float> out(2);
  ASSERT_TRUE(SparseAttention(shape, query, keys, values, 3, selection, out).ok());
  EXPECT_NEAR(out[0], 1.0f, 1e-6);
  EXPECT_NEAR(out[1], 6.0f, 1e-6);
}

TEST(SparseAttention, MatchesADensePassOverTheSelectedSlots) {
  const int H = 4, Dk = 32, Dv = 16;
  const int64_t N = 300;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> query(H * Dk), keys(N * Dk), values(N * Dv);
  for (float& x : query) x = normal(rng);
  for (float& x : keys) x = normal(rng);
  for (float& x : values) x = normal(rng);
  std::vector<int32_t> selection;
  for (int32_t s = 0; s < N; s += 3) selection.push_back(s);
  selection.push_back(-1);
  const SparseAttentionShape shape{H, Dk, Dv, 0.0f};
  std::vector<float> out(H * Dv);
  ASSERT_TRUE(SparseAttention(shape, query, keys, values, N, selection, out).ok());
  // Independent reference: double precision, the plain softmax formula, slots 0, 3, 6, ...
  for (int h = 0; h < H; ++h) {
    std::vector<double> weight;
    double total = 0;
    for (int64_t s = 0; s < N; s += 3) {
      double dot = 0;
      for (int d = 0; d < Dk; ++d) dot += double(query[h * Dk + d]) * keys[s * Dk + d];
      weight.push_back(std::exp(dot / std::sqrt(double(Dk))));
      total += weight.back();
    }
    for (int d = 0; d < Dv; ++d) {
      double expected = 0;
      size_t j = 0;
      for (int64_t s = 0; s < N; s += 3, ++j) expected += weight[j] / total * values[s * Dv + d];
      EXPECT_NEAR(out[h * Dv + d], expected, 1e-5) << "h " << h << " d " << d;
    }
  }
}

TEST(SparseAttention, EmptySelectionGivesZeros) {
  const SparseAttentionShape shape{2, 2, 2, 0.0f};
  std::vector<float> query(4, 1.0f), keys(4, 1.0f), values(4, 1.0f), out(4, 7.0f);
  const std::vector<int32_t> selection = {-1, -1};
  ASSERT_TRUE(SparseAttention(shape, query, keys, values, 2, selection, out).ok());
  EXPECT_EQ(out, std::vector<float>(4, 0.0f));
}

TEST(SparseAttention, BadInputIsInvalidArgumentAndWritesNothing) {
  const SparseAttentionShape shape{1, 2, 2, 0.0f};
  std::vector<float> query(2, 1.0f), keys(4, 1.0f), values(4, 1.0f), out(2, 7.0f);
  const std::vector<int32_t> beyond = {0, 2};
  const std::vector<int32_t> negative = {-2};
  const std::vector<int32_t> fine = {0};
  EXPECT_EQ(SparseAttention(shape, query, keys, values, 2, beyond, out).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SparseAttention(shape, query, keys, values, 2, negative, out).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<float> short_out(1);
  EXPECT_EQ(SparseAttention(shape, query, keys, values, 2, fine, short_out).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SparseAttention(SparseAttentionShape{0, 2, 2, 0.0f}, query, keys, values, 2, fine, out)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out, std::vector<float>(2, 7.0f));
}

}  // namespace
}  // namespace dsa
