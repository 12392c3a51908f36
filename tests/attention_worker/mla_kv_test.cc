// The CPU MLA rows (mla_kv.h): bf16 round-to-nearest-even of the attention side's uniform rows
// (model_inputs.h UniformRow), pure in their coordinates, and their argument checks.
#include "attention_worker/mla_kv.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention_worker/model_inputs.h"
#include "gtest/gtest.h"

namespace dsa {
namespace {

// An independent bf16 rounding: the nearest bf16 (ties to the even mantissa) by exhaustive
// comparison of the two neighbours.
uint16_t NearestBf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t down = static_cast<uint16_t>(bits >> 16);
  const uint16_t up = static_cast<uint16_t>(down + 1);
  const double lo = std::bit_cast<float>(uint32_t{down} << 16);
  const double hi = std::bit_cast<float>(uint32_t{up} << 16);
  const double v = value;
  if (std::abs(v - lo) < std::abs(hi - v)) return down;
  if (std::abs(v - lo) > std::abs(hi - v)) return up;
  return (down & 1u) == 0 ? down : up;
}

TEST(MlaKvTest, KvRowIsTheKeyStreamRoundedToNearestEven) {
  for (uint64_t seed : {0ull, 7ull, 0x0123'4567'89ab'cdefull}) {
    for (int layer : {0, 1, 60}) {
      for (int64_t slot : {int64_t{0}, int64_t{63}, int64_t{1} << 20, (int64_t{1} << 32) + 5}) {
        std::vector<uint16_t> row(kMlaKeyDim);
        ASSERT_TRUE(MlaKvRow(seed, layer, slot, row).ok());
        std::vector<float> values(kMlaKeyDim);
        UniformRow(seed, kKvKeyStream, layer, slot, values);
        for (int d = 0; d < kMlaKeyDim; ++d) {
          ASSERT_EQ(row[d], NearestBf16(values[d]))
              << seed << " " << layer << " " << slot << " " << d;
          ASSERT_GE(values[d], -1.0f);
          ASSERT_LT(values[d], 1.0f);
        }
        // The same values KvCacheRow's key row holds.
        std::vector<float> key(kMlaKeyDim), value(kMlaKeyDim);
        KvCacheRow(seed, layer, slot, key, value);
        EXPECT_EQ(key, values);
      }
    }
  }
}

TEST(MlaKvTest, AttentionQueryIsTheQueryStream) {
  std::vector<uint16_t> query(static_cast<size_t>(kMlaAttentionHeads) * kMlaKeyDim);
  std::vector<float> values(query.size());
  for (int64_t position : {int64_t{0}, int64_t{4097}, (int64_t{1} << 33) + 1}) {
    ASSERT_TRUE(MlaAttentionQuery(3, 2, position, query).ok());
    AttentionQuery(3, 2, position, values);
    for (size_t j = 0; j < query.size(); ++j) ASSERT_EQ(query[j], NearestBf16(values[j])) << j;
  }
  // Fewer heads: a prefix of the same stream.
  std::vector<uint16_t> small(2 * kMlaKeyDim);
  ASSERT_TRUE(MlaAttentionQuery(3, 2, 4097, small).ok());
  ASSERT_TRUE(MlaAttentionQuery(3, 2, 4097, query).ok());
  EXPECT_TRUE(std::equal(small.begin(), small.end(), query.begin()));
}

TEST(MlaKvTest, RowsDifferAcrossCoordinates) {
  std::vector<uint16_t> a(kMlaKeyDim), b(kMlaKeyDim);
  ASSERT_TRUE(MlaKvRow(1, 0, 10, a).ok());
  ASSERT_TRUE(MlaKvRow(1, 0, 11, b).ok());
  EXPECT_NE(a, b);
  ASSERT_TRUE(MlaKvRow(1, 1, 10, b).ok());
  EXPECT_NE(a, b);
  ASSERT_TRUE(MlaKvRow(2, 0, 10, b).ok());
  EXPECT_NE(a, b);
  ASSERT_TRUE(MlaKvRow(1, 0, 10, b).ok());
  EXPECT_EQ(a, b);
}

TEST(MlaKvTest, RejectsBadArguments) {
  std::vector<uint16_t> row(kMlaKeyDim), short_row(kMlaKeyDim - 1);
  EXPECT_EQ(MlaKvRow(0, -1, 0, row).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MlaKvRow(0, 0, -1, row).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MlaKvRow(0, 0, 0, short_row).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MlaAttentionQuery(0, 0, -1, row).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MlaAttentionQuery(0, -1, 0, row).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MlaAttentionQuery(0, 0, 0, short_row).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MlaAttentionQuery(0, 0, 0, std::span<uint16_t>()).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dsa
