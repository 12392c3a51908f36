// The CPU sparse MLA decode (mla_sparse_attention.h) against the dense formula: the row's visible
// selected latent rows gathered into plain key/value arrays and attended by SparseAttention, the
// log-sum-exp in double; plus hand-checked cases and the INVALID_ARGUMENT paths.
#include "attention_worker/mla_sparse_attention.h"

#include <cmath>
#include <limits>
#include <vector>

#include "attention_worker/sparse_attention.h"
#include "gtest/gtest.h"
#include "tests/attention_worker/mla_test_batch.h"

namespace dsa {
namespace {

using testing::FromBf16;
using testing::MakeMlaTestBatch;
using testing::MlaRowSpec;
using testing::ToBf16;

// Dense attention of row r of `t` through SparseAttention over the gathered visible slots.
void DenseRow(const testing::MlaTestBatch& t, int r, std::vector<float>& out,
              std::vector<float>& lse) {
  const MlaSparseDecodeBatch& b = t.batch;
  std::vector<float> keys, values;
  std::vector<int32_t> dense_selection;
  for (int e = 0; e < b.top_k; ++e) {
    const int32_t slot = b.selections[r * b.top_k + e];
    if (slot < 0 || slot > b.positions[r]) continue;
    const int64_t block = b.block_tables[r * b.max_blocks_per_row + slot / kBlockSize];
    const uint16_t* row = b.kv_pool.data() + (block * kBlockSize + slot % kBlockSize) * kMlaQkDim;
    for (int d = 0; d < kMlaQkDim; ++d) keys.push_back(FromBf16(row[d]));
    for (int d = 0; d < kMlaVDim; ++d) values.push_back(FromBf16(row[d]));
    dense_selection.push_back(static_cast<int32_t>(dense_selection.size()));
  }
  const int64_t n = static_cast<int64_t>(dense_selection.size());
  std::vector<float> query(b.num_heads * kMlaQkDim);
  for (int i = 0; i < b.num_heads * kMlaQkDim; ++i) {
    query[i] = FromBf16(b.query[int64_t{r} * b.num_heads * kMlaQkDim + i]);
  }
  out.assign(b.num_heads * kMlaVDim, 0.0f);
  SparseAttentionShape shape{b.num_heads, kMlaQkDim, kMlaVDim, MlaSoftmaxScale(b)};
  ASSERT_TRUE(SparseAttention(shape, query, keys, values, n, dense_selection, out).ok());
  lse.assign(b.num_heads, -std::numeric_limits<float>::infinity());
  for (int h = 0; h < b.num_heads && n > 0; ++h) {
    std::vector<double> logits(n);
    double max_logit = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      double dot = 0;
      for (int d = 0; d < kMlaQkDim; ++d) {
        dot += double{query[h * kMlaQkDim + d]} * keys[j * kMlaQkDim + d];
      }
      logits[j] = MlaSoftmaxScale(b) * dot;
      max_logit = std::max(max_logit, logits[j]);
    }
    double sum = 0;
    for (double logit : logits) sum += std::exp(logit - max_logit);
    lse[h] = static_cast<float>(max_logit + std::log(sum));
  }
}

void ExpectMatchesDense(const testing::MlaTestBatch& t) {
  const MlaSparseDecodeBatch& b = t.batch;
  std::vector<float> out(int64_t{b.num_rows} * b.num_heads * kMlaVDim, NAN);
  std::vector<float> lse(int64_t{b.num_rows} * b.num_heads, NAN);
  ASSERT_TRUE(MlaSparseDecode(b, out, lse).ok());
  for (int r = 0; r < b.num_rows; ++r) {
    std::vector<float> dense_out, dense_lse;
    DenseRow(t, r, dense_out, dense_lse);
    for (int i = 0; i < b.num_heads * kMlaVDim; ++i) {
      ASSERT_NEAR(out[int64_t{r} * b.num_heads * kMlaVDim + i], dense_out[i], 1e-5f)
          << "row " << r << " element " << i;
    }
    for (int h = 0; h < b.num_heads; ++h) {
      const float got = lse[int64_t{r} * b.num_heads + h];
      if (std::isinf(dense_lse[h])) {
        EXPECT_EQ(got, dense_lse[h]);
      } else {
        EXPECT_NEAR(got, dense_lse[h], 1e-4f * std::max(1.0f, std::abs(dense_lse[h])));
      }
    }
  }
}

TEST(MlaSparseDecodeTest, MatchesDenseFormulaOverAGrid) {
  // Rows: a full short context, a position shorter than K (entries past it skipped), a context
  // that is no multiple of 64 with -1 padding, one selected slot, none.
  const std::vector<MlaRowSpec> rows = {
      {128, 127, 128}, {300, 150, 300}, {1000, 999, 70}, {65, 64, 1}, {64, 10, 0}};
  ExpectMatchesDense(MakeMlaTestBatch(rows, 8, 256, 1));
  ExpectMatchesDense(MakeMlaTestBatch(rows, 4, 100, 2, 4.0f));  // a sharper softmax
}

TEST(MlaSparseDecodeTest, OneSlotGivesItsValueAndLogit) {
  testing::MlaTestBatch t = MakeMlaTestBatch({{64, 63, 1}}, 2, 4, 3);
  std::vector<float> out(2 * kMlaVDim), lse(2);
  ASSERT_TRUE(MlaSparseDecode(t.batch, out, lse).ok());
  const int32_t slot = t.selections[0];
  const uint16_t* k = t.pool.data() + (int64_t{t.tables[0]} * kBlockSize + slot) * kMlaQkDim;
  for (int h = 0; h < 2; ++h) {
    double dot = 0;
    for (int d = 0; d < kMlaQkDim; ++d)
      dot += double{FromBf16(t.query[h * kMlaQkDim + d])} * FromBf16(k[d]);
    EXPECT_NEAR(lse[h], dot / 24.0, 1e-4);
    for (int d = 0; d < kMlaVDim; ++d) EXPECT_EQ(out[h * kMlaVDim + d], FromBf16(k[d]));
  }
}

TEST(MlaSparseDecodeTest, EmptySelectionGivesZerosAndMinusInfinity) {
  // All -1, and all past the position: both empty.
  testing::MlaTestBatch t = MakeMlaTestBatch({{64, 5, 0}, {64, 0, 0}}, 2, 8, 4);
  for (int e = 0; e < 8; ++e) t.selections[8 + e] = 10 + e;  // row 1 sees slot 0 only
  std::vector<float> out(2 * 2 * kMlaVDim, NAN), lse(4, 0.0f);
  ASSERT_TRUE(MlaSparseDecode(t.batch, out, lse).ok());
  for (float v : out) EXPECT_EQ(v, 0.0f);
  for (float v : lse) EXPECT_EQ(v, -std::numeric_limits<float>::infinity());
}

TEST(MlaSparseDecodeTest, SoftmaxScaleIsConfigurable) {
  testing::MlaTestBatch t = MakeMlaTestBatch({{200, 199, 150}}, 2, 160, 5);
  t.batch.softmax_scale = 0.125f;
  ExpectMatchesDense(t);
}

TEST(MlaSparseDecodeTest, RejectsBadShapes) {
  testing::MlaTestBatch t = MakeMlaTestBatch({{100, 99, 50}}, 2, 64, 6);
  std::vector<float> out(2 * kMlaVDim), lse(2);
  const auto code = [&](const MlaSparseDecodeBatch& b) {
    return MlaSparseDecode(b, out, lse).code();
  };
  ASSERT_EQ(code(t.batch), absl::StatusCode::kOk);
  MlaSparseDecodeBatch b = t.batch;
  b.num_heads = 0;
  EXPECT_EQ(code(b), absl::StatusCode::kInvalidArgument);
  b = t.batch;
  b.top_k = 63;  // selections span no longer matches
  EXPECT_EQ(code(b), absl::StatusCode::kInvalidArgument);
  b = t.batch;
  b.kv_pool = b.kv_pool.subspan(1);
  EXPECT_EQ(code(b), absl::StatusCode::kInvalidArgument);
  std::vector<float> short_out(kMlaVDim);
  EXPECT_EQ(MlaSparseDecode(t.batch, short_out, lse).code(), absl::StatusCode::kInvalidArgument);
  // A selected slot at or past num_slots, and below -1.
  t.selections[3] = 100;
  EXPECT_EQ(code(t.batch), absl::StatusCode::kInvalidArgument);
  t.selections[3] = -2;
  EXPECT_EQ(code(t.batch), absl::StatusCode::kInvalidArgument);
  t.selections[3] = -1;
  // A position past the filled slots, a slot count past the table, a block outside the pool.
  t.positions[0] = 100;
  EXPECT_EQ(code(t.batch), absl::StatusCode::kInvalidArgument);
  t.positions[0] = 99;
  t.num_slots[0] = 129;
  EXPECT_EQ(code(t.batch), absl::StatusCode::kInvalidArgument);
  t.num_slots[0] = 100;
  t.tables[1] = static_cast<int32_t>(t.batch.num_physical_blocks);
  EXPECT_EQ(code(t.batch), absl::StatusCode::kInvalidArgument);
  // A table back inside the pool is accepted again.
  t.tables[1] = t.tables[0] == 0 ? 1 : 0;
  EXPECT_EQ(code(t.batch), absl::StatusCode::kOk);
}

}  // namespace
}  // namespace dsa
