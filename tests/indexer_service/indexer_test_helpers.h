// Helpers shared by the indexer engine's tests (indexer_test.cc, indexer_edge_cases_test.cc,
// indexer_requests_test.cc): a test-side copy of every key appended, the EMA written out, and
// checks of a select's rows against the naive reference and full-sort top-K of reference.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "indexer_service/indexer.h"
#include "tests/indexer_service/reference.h"

namespace dsa::indexer_test {

using ::absl::StatusCode;
using testing_reference::FullSortTopK;
using testing_reference::NaiveScores;
inline constexpr float kInf = std::numeric_limits<float>::infinity();
inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---------------------------------------------------------------------------------------------
// Helpers: a test-side copy of every key appended, the EMA (the naive reference and full-sort
// top-K are in reference.h).

inline std::unique_ptr<Indexer> MakeIndexer(int64_t capacity_blocks, int num_heads, int head_dim) {
  auto indexer = Indexer::Create({capacity_blocks, num_heads, head_dim});
  EXPECT_TRUE(indexer.ok()) << indexer.status();
  return std::move(*indexer);
}

inline SequenceOptions Options(int top_k, double rho, bool enabled = true, int num_layers = 1,
                               double gamma = 0.05, uint64_t seed = 1) {
  SequenceOptions options;
  options.num_layers = num_layers;
  options.top_k = top_k;
  options.spin.enabled = enabled;
  options.spin.target_block_sparsity = rho;
  options.spin.exploration_fraction = gamma;
  options.spin.seed = seed;
  return options;
}

inline std::vector<float> RandomValues(std::mt19937& rng, size_t count) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(count);
  for (float& x : v) x = normal(rng);
  return v;
}

struct Query {
  std::vector<float> query;    // [H, D]
  std::vector<float> weights;  // [H]
};

inline Query RandomQuery(std::mt19937& rng, int num_heads, int head_dim) {
  std::uniform_real_distribution<float> positive(0.1f, 1.0f);
  Query q{RandomValues(rng, static_cast<size_t>(num_heads) * head_dim),
          std::vector<float>(num_heads)};
  for (float& w : q.weights) w = positive(rng);
  return q;
}

inline std::vector<int32_t> RowSelection(const SelectResult& result, size_t row) {
  return std::vector<int32_t>(result.selections.begin() + row * result.top_k,
                              result.selections.begin() + (row + 1) * result.top_k);
}

inline const float* RowScores(const SelectResult& result, size_t row) {
  return result.scores.data() + row * result.blocks.size() * 64;
}

// Checks row `row` of a Select that returned scores: every entry is the reference score (relative
// error <= 1e-5 of the row's largest score), -inf past the row's position, and the selection is the
// full-sort top-K of those scores.
inline void ExpectRowMatchesReference(const SelectResult& result, size_t row, int64_t position,
                                      const std::vector<float>& keys, int head_dim, const Query& q,
                                      int num_heads, const std::string& where) {
  const std::vector<double> ref =
      NaiveScores(keys, position + 1, head_dim, q.query, q.weights, num_heads);
  const double row_max = std::max(1e-30, *std::max_element(ref.begin(), ref.end()));
  const float* scores = RowScores(result, row);
  for (size_t j = 0; j < result.blocks.size(); ++j) {
    for (int s = 0; s < 64; ++s) {
      const int64_t slot = result.blocks[j] * 64LL + s;
      const float got = scores[j * 64 + s];
      if (slot > position) {
        ASSERT_EQ(got, -kInf) << where << " slot " << slot;
      } else {
        ASSERT_NEAR(got, ref[slot], 1e-5 * row_max) << where << " slot " << slot;
      }
    }
  }
  const std::span<const float> row_scores(scores, result.blocks.size() * 64);
  ASSERT_EQ(RowSelection(result, row),
            FullSortTopK(row_scores, result.blocks, position, result.top_k))
      << where;
}

inline float At(const std::vector<float>& v, int64_t i) {
  return i < static_cast<int64_t>(v.size()) ? v[i] : 0.0f;
}

// The EMA of DESIGN.md 4.2 step 8 for one row, written out: for every scored slot i <= position.
inline void HandEma(std::vector<float>& v, std::vector<float>& d, float a, int64_t position,
                    const std::vector<int32_t>& blocks, const float* scores) {
  if (static_cast<int64_t>(v.size()) <= position) v.resize(position + 1, 0.0f);
  if (static_cast<int64_t>(d.size()) <= position) d.resize(position + 1, 0.0f);
  for (size_t j = 0; j < blocks.size(); ++j) {
    for (int s = 0; s < 64; ++s) {
      const int64_t i = blocks[j] * 64LL + s;
      const float z = scores[j * 64 + s];
      if (i > position || !std::isfinite(z)) continue;
      v[i] = a * v[i] + (1.0f - a) * z;
      d[position - i] = a * d[position - i] + (1.0f - a) * z;
    }
  }
}

// EMA vectors equal within 4 fp32 epsilons relative, missing entries reading as zero; reports the
// first mismatch.
inline void ExpectSameEma(const std::vector<float>& got, const std::vector<float>& want,
                          const std::string& what) {
  const size_t n = std::max(got.size(), want.size());
  for (size_t i = 0; i < n; ++i) {
    const float g = At(got, i), w = At(want, i);
    if (std::fabs(g - w) >
        4.0f * std::numeric_limits<float>::epsilon() * std::max(std::fabs(g), std::fabs(w))) {
      ADD_FAILURE() << what << "[" << i << "]: got " << g << ", want " << w;
      return;
    }
  }
}

inline SpinState GetSpin(const Indexer& indexer, uint64_t id, int layer) {
  auto state = indexer.GetSpinState(id, layer);
  EXPECT_TRUE(state.ok()) << state.status();
  return *state;
}

inline absl::StatusOr<SelectResult> SelectOne(Indexer& indexer, uint64_t id, int layer,
                                              const Query& q, int64_t position,
                                              bool return_scores = true) {
  const IndexerRow row{q.query, q.weights, position};
  return indexer.Select(id, layer, std::span<const IndexerRow>(&row, 1), return_scores);
}
}  // namespace dsa::indexer_test
