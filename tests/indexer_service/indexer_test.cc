// Tests of the indexer engine (indexer_service/indexer.h; DESIGN.md 4 and 5): selections against a
// naive reference (quantize + decode + triple loop, full-sort top-K), SPIN through the engine (rho
// = 0 equals all-keep, EMAs change only for scored slots, deferred speculative updates replayed on
// Commit), the DSA edge cases, and precise statuses for bad requests that leave the state unchanged
// (checked against a fresh twin that never saw the bad request).
#include "indexer_service/indexer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "indexer_service/sparsity_controller.h"
#include "indexer_service/topk.h"
#include "tests/indexer_service/reference.h"

namespace dsa {
namespace {

using ::absl::StatusCode;
using testing_reference::FullSortTopK;
using testing_reference::NaiveScores;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---------------------------------------------------------------------------------------------
// Helpers: a test-side copy of every key appended, the EMA (the naive reference and full-sort
// top-K are in reference.h).

std::unique_ptr<Indexer> MakeIndexer(int64_t capacity_blocks, int num_heads, int head_dim) {
  auto indexer = Indexer::Create({capacity_blocks, num_heads, head_dim});
  EXPECT_TRUE(indexer.ok()) << indexer.status();
  return std::move(*indexer);
}

SequenceOptions Options(int top_k, double rho, bool enabled = true, int num_layers = 1,
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

std::vector<float> RandomValues(std::mt19937& rng, size_t count) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(count);
  for (float& x : v) x = normal(rng);
  return v;
}

struct Query {
  std::vector<float> query;    // [H, D]
  std::vector<float> weights;  // [H]
};

Query RandomQuery(std::mt19937& rng, int num_heads, int head_dim) {
  std::uniform_real_distribution<float> positive(0.1f, 1.0f);
  Query q{RandomValues(rng, static_cast<size_t>(num_heads) * head_dim),
          std::vector<float>(num_heads)};
  for (float& w : q.weights) w = positive(rng);
  return q;
}

std::vector<int32_t> RowSelection(const SelectResult& result, size_t row) {
  return std::vector<int32_t>(result.selections.begin() + row * result.top_k,
                              result.selections.begin() + (row + 1) * result.top_k);
}

const float* RowScores(const SelectResult& result, size_t row) {
  return result.scores.data() + row * result.blocks.size() * 64;
}

// Checks row `row` of a Select that returned scores: every entry is the reference score (relative
// error <= 1e-5 of the row's largest score), -inf past the row's position, and the selection is the
// full-sort top-K of those scores.
void ExpectRowMatchesReference(const SelectResult& result, size_t row, int64_t position,
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

float At(const std::vector<float>& v, int64_t i) {
  return i < static_cast<int64_t>(v.size()) ? v[i] : 0.0f;
}

// The EMA of DESIGN.md 4.2 step 8 for one row, written out: for every scored slot i <= position.
void HandEma(std::vector<float>& v, std::vector<float>& d, float a, int64_t position,
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
void ExpectSameEma(const std::vector<float>& got, const std::vector<float>& want,
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

SpinState GetSpin(const Indexer& indexer, uint64_t id, int layer) {
  auto state = indexer.GetSpinState(id, layer);
  EXPECT_TRUE(state.ok()) << state.status();
  return *state;
}

absl::StatusOr<SelectResult> SelectOne(Indexer& indexer, uint64_t id, int layer, const Query& q,
                                       int64_t position, bool return_scores = true) {
  const IndexerRow row{q.query, q.weights, position};
  return indexer.Select(id, layer, std::span<const IndexerRow>(&row, 1), return_scores);
}

// ---------------------------------------------------------------------------------------------
// Construction

TEST(IndexerTest, CreateValidatesOptions) {
  EXPECT_EQ(Indexer::Create({-1, 4, 8}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Indexer::Create({4, 0, 8}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Indexer::Create({4, 1025, 8}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Indexer::Create({4, 4, 0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Indexer::Create({4, 4, 1025}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Indexer::Create({0, 1, 1}).ok());
}

TEST(IndexerTest, CreateSequenceValidatesOptions) {
  auto indexer = MakeIndexer(8, 2, 4);
  ASSERT_TRUE(indexer->CreateSequence(1, Options(16, 0.4)).ok());
  EXPECT_EQ(indexer->CreateSequence(1, Options(16, 0.4)).code(), StatusCode::kAlreadyExists);
  SequenceOptions bad = Options(16, 0.4);
  bad.num_layers = 0;
  EXPECT_EQ(indexer->CreateSequence(2, bad).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(indexer->CreateSequence(2, Options(0, 0.4)).code(), StatusCode::kInvalidArgument);
  for (double rho : {1.0, -0.1, 1.5}) {
    EXPECT_EQ(indexer->CreateSequence(2, Options(16, rho)).code(), StatusCode::kInvalidArgument)
        << rho;
  }
  for (double decay : {1.0, -0.5}) {
    bad = Options(16, 0.4);
    bad.spin.ema_decay = decay;
    EXPECT_EQ(indexer->CreateSequence(2, bad).code(), StatusCode::kInvalidArgument) << decay;
  }
  EXPECT_EQ(indexer->CreateSequence(2, Options(16, 0.4, true, 1, 1.0)).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(indexer->num_sequences(), 1);
  EXPECT_EQ(indexer->NumSlots(2, 0).status().code(), StatusCode::kNotFound);
}

// ---------------------------------------------------------------------------------------------
// Selections

TEST(IndexerTest, HandCaseThroughTheEngine) {
  // The 2-slot, 2-head, D = 4 case of scoring_test: z = [4.125, 3]; K = 4 -> [0, 1, -1, -1].
  auto indexer = MakeIndexer(4, 2, 4);
  ASSERT_TRUE(indexer->CreateSequence(1, Options(4, 0.4)).ok());
  const std::vector<float> keys = {3.5f, 1.0f, -0.5f, 0.25f, -1.75f, 0.5f, 1.0f, 0.0f};
  ASSERT_TRUE(indexer->AppendIndexKeys(1, 0, keys, 2).ok());
  const Query q{{1.0f, 2.0f, 0.0f, -1.0f, 0.0f, 1.0f, 1.0f, 1.0f}, {0.5f, 2.0f}};
  auto result = SelectOne(*indexer, 1, 0, q, 1);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->selections, (std::vector<int32_t>{0, 1, -1, -1}));
  EXPECT_EQ(result->top_k, 4);
  EXPECT_EQ(result->blocks, (std::vector<int32_t>{0}));
  EXPECT_EQ(result->blocks_scored, 1);
  EXPECT_EQ(result->blocks_visible, 1);
  EXPECT_TRUE(result->all_blocks);
  ASSERT_EQ(result->scores.size(), 64u);
  EXPECT_FLOAT_EQ(result->scores[0], 4.125f);
  EXPECT_FLOAT_EQ(result->scores[1], 3.0f);
  // Row at position 0 (a second sequence with the same keys: positions only move forward): only
  // slot 0.
  ASSERT_TRUE(indexer->CreateSequence(2, Options(4, 0.4)).ok());
  ASSERT_TRUE(indexer->AppendIndexKeys(2, 0, keys, 2).ok());
  result = SelectOne(*indexer, 2, 0, q, 0, /*return_scores=*/false);
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->selections, (std::vector<int32_t>{0, -1, -1, -1}));
  EXPECT_TRUE(result->scores.empty());
}

TEST(IndexerTest, DenseSelectionsMatchTheReference) {
  const int H = 4, D = 16, K = 32;
  auto indexer = MakeIndexer(16, H, D);
  ASSERT_TRUE(indexer->CreateSequence(1, Options(K, 0.4, /*enabled=*/false)).ok());
  std::mt19937 rng(1);
  std::vector<float> keys = RandomValues(rng, 300 * D);
  ASSERT_TRUE(indexer->AppendIndexKeys(1, 0, keys, 300).ok());
  for (int64_t position : {0, 10, 63, 64, 200, 299}) {
    const Query q = RandomQuery(rng, H, D);
    auto result = SelectOne(*indexer, 1, 0, q, position);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_TRUE(result->all_blocks);
    EXPECT_EQ(result->blocks_visible, position / 64 + 1);
    ExpectRowMatchesReference(*result, 0, position, keys, D, q, H, "t=" + std::to_string(position));
    // And directly against the reference scores: the selection holds the K best reference scores
    // (up to the fp32 error of the scorer).
    const std::vector<double> ref = NaiveScores(keys, position + 1, D, q.query, q.weights, H);
    std::vector<double> sorted = ref;
    std::sort(sorted.rbegin(), sorted.rend());
    const int taken = std::min<int>(K, static_cast<int>(position + 1));
    for (int i = 0; i < taken; ++i) {
      EXPECT_NEAR(ref[result->selections[i]], sorted[i], 1e-5 * sorted[0]) << "rank " << i;
    }
    for (int i = taken; i < K; ++i) EXPECT_EQ(result->selections[i], -1);
  }
}

TEST(IndexerTest, RhoZeroEqualsAllKeep) {
  const int H = 2, D = 8, K = 64;
  std::mt19937 rng(2);
  for (double gamma : {0.0, 0.05, 0.3}) {
    auto indexer = MakeIndexer(64, H, D);
    ASSERT_TRUE(indexer->CreateSequence(1, Options(K, 0.0, true, 1, gamma)).ok());
    ASSERT_TRUE(indexer->CreateSequence(2, Options(K, 0.4, /*enabled=*/false)).ok());
    std::vector<float> keys = RandomValues(rng, 1000 * D);
    ASSERT_TRUE(indexer->AppendIndexKeys(1, 0, keys, 1000).ok());
    ASSERT_TRUE(indexer->AppendIndexKeys(2, 0, keys, 1000).ok());
    for (int64_t position = 999; position < 1030; ++position) {
      if (position >= 1000) {
        const std::vector<float> key = RandomValues(rng, D);
        ASSERT_TRUE(indexer->AppendIndexKeys(1, 0, key, 1).ok());
        ASSERT_TRUE(indexer->AppendIndexKeys(2, 0, key, 1).ok());
      }
      const Query q = RandomQuery(rng, H, D);
      auto spin = SelectOne(*indexer, 1, 0, q, position);
      auto dense = SelectOne(*indexer, 2, 0, q, position);
      ASSERT_TRUE(spin.ok() && dense.ok());
      ASSERT_EQ(spin->selections, dense->selections) << "gamma " << gamma << " t " << position;
      EXPECT_EQ(spin->blocks, dense->blocks);
      EXPECT_EQ(spin->blocks_scored, spin->blocks_visible);
      EXPECT_TRUE(spin->all_blocks);
    }
    ExpectSameEma(GetSpin(*indexer, 1, 0).vertical(), GetSpin(*indexer, 2, 0).vertical(), "V");
    ExpectSameEma(GetSpin(*indexer, 1, 0).diagonal(), GetSpin(*indexer, 2, 0).diagonal(), "D");
  }
}

TEST(IndexerTest, EmaChangesOnlyForScoredSlots) {
  const int H = 2, D = 8, K = 64;
  auto indexer = MakeIndexer(64, H, D);
  SequenceOptions options = Options(K, 0.5);
  options.spin.ema_decay = 0.75;
  ASSERT_TRUE(indexer->CreateSequence(1, options).ok());
  std::mt19937 rng(3);
  std::vector<float> keys = RandomValues(rng, 2000 * D);
  ASSERT_TRUE(indexer->AppendIndexKeys(1, 0, keys, 2000).ok());
  std::vector<float> v, d;  // the hand-rolled EMA state, from zero
  int pruned_steps = 0;
  for (int64_t position = 1990; position < 2000; ++position) {
    const SpinState before = GetSpin(*indexer, 1, 0);
    ExpectSameEma(before.vertical(), v, "V before");
    ExpectSameEma(before.diagonal(), d, "D before");
    const Query q = RandomQuery(rng, H, D);
    auto result = SelectOne(*indexer, 1, 0, q, position);
    ASSERT_TRUE(result.ok());
    ExpectRowMatchesReference(*result, 0, position, keys, D, q, H, "t=" + std::to_string(position));
    if (position == 1990) {
      EXPECT_TRUE(result->all_blocks) << "the first select is the warm-up";
    } else {
      // B = 32 (N <= 2048) blocks visible, m = max(1, ceil(0.5 * 32)) = 16.
      EXPECT_EQ(result->blocks_visible, 32);
      EXPECT_EQ(result->blocks_scored, 16);
      EXPECT_FALSE(result->all_blocks);
      EXPECT_EQ(result->blocks.front(), 0);  // the sink block
      EXPECT_EQ(result->blocks.back(), 31);  // the newest block
      ++pruned_steps;
    }
    HandEma(v, d, 0.75f, position, result->blocks, result->scores.data());
    const SpinState after = GetSpin(*indexer, 1, 0);
    ExpectSameEma(after.vertical(), v, "V after t=" + std::to_string(position));
    ExpectSameEma(after.diagonal(), d, "D after t=" + std::to_string(position));
    // Unscored slots kept their exact values.
    std::set<int32_t> scored(result->blocks.begin(), result->blocks.end());
    for (int64_t i = 0; i <= position; ++i) {
      if (!scored.count(static_cast<int32_t>(i / 64))) {
        ASSERT_EQ(At(after.vertical(), i), At(before.vertical(), i)) << "unscored slot " << i;
      }
    }
  }
  EXPECT_EQ(pruned_steps, 9);
}

TEST(IndexerTest, ExplorationDrawsRepeatForTheSameSeedAndSequence) {
  // Exploration is seeded per sequence: sequence 1 in two engines with seed 7 draws the same blocks
  // every step; sequence 2 with the same seed 7, and sequence 1 with seed 8, must differ at some
  // step. gamma = 0.3 and m = 16 of 32 blocks: 5 blocks a step are random.
  const int H = 2, D = 8, K = 64;
  auto indexer = MakeIndexer(200, H, D);
  auto twin = MakeIndexer(200, H, D);
  ASSERT_TRUE(indexer->CreateSequence(1, Options(K, 0.5, true, 1, 0.3, 7)).ok());
  ASSERT_TRUE(indexer->CreateSequence(2, Options(K, 0.5, true, 1, 0.3, 7)).ok());
  ASSERT_TRUE(twin->CreateSequence(1, Options(K, 0.5, true, 1, 0.3, 7)).ok());
  ASSERT_TRUE(twin->CreateSequence(3, Options(K, 0.5, true, 1, 0.3, 8)).ok());
  std::mt19937 rng(19);
  const std::vector<float> keys = RandomValues(rng, 2000 * D);
  for (uint64_t id = 1; id <= 2; ++id) {
    ASSERT_TRUE(indexer->AppendIndexKeys(id, 0, keys, 2000).ok());
  }
  ASSERT_TRUE(twin->AppendIndexKeys(1, 0, keys, 2000).ok());
  ASSERT_TRUE(twin->AppendIndexKeys(3, 0, keys, 2000).ok());
  int differ_sequence = 0, differ_seed = 0;
  for (int64_t position = 1990; position < 2000; ++position) {
    const Query q = RandomQuery(rng, H, D);
    auto a = SelectOne(*indexer, 1, 0, q, position, false);
    auto a_twin = SelectOne(*twin, 1, 0, q, position, false);
    auto other_sequence = SelectOne(*indexer, 2, 0, q, position, false);
    auto other_seed = SelectOne(*twin, 3, 0, q, position, false);
    ASSERT_TRUE(a.ok() && a_twin.ok() && other_sequence.ok() && other_seed.ok());
    EXPECT_EQ(a->blocks, a_twin->blocks) << position;
    EXPECT_EQ(a->selections, a_twin->selections) << position;
    if (a->blocks != other_sequence->blocks) ++differ_sequence;
    if (a->blocks != other_seed->blocks) ++differ_seed;
  }
  EXPECT_GE(differ_sequence, 5);
  EXPECT_GE(differ_seed, 5);
}

TEST(IndexerTest, ConcurrentSelectsOnDifferentSequencesMatchSerialOnes) {
  // The engine is documented thread-safe: four threads, each driving its own sequence through
  // appends and selects, get the answers a serial run gets.
  const int H = 2, D = 8, K = 64, kThreads = 4, kSteps = 20;
  std::mt19937 rng(20);
  std::vector<std::vector<float>> keys(kThreads);
  std::vector<std::vector<Query>> queries(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    keys[t] = RandomValues(rng, (500 + kSteps) * D);
    for (int s = 0; s < kSteps; ++s) queries[t].push_back(RandomQuery(rng, H, D));
  }
  auto drive = [&](Indexer& indexer, int t, std::vector<std::vector<int32_t>>& out) {
    const uint64_t id = 100 + t;
    EXPECT_TRUE(indexer.CreateSequence(id, Options(K, 0.5)).ok());
    EXPECT_TRUE(
        indexer.AppendIndexKeys(id, 0, std::span<const float>(keys[t].data(), 500 * D), 500).ok());
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_TRUE(
          indexer
              .AppendIndexKeys(id, 0, std::span<const float>(keys[t].data() + (500 + s) * D, D), 1)
              .ok());
      auto result = SelectOne(indexer, id, 0, queries[t][s], 500 + s, false);
      EXPECT_TRUE(result.ok());
      out.push_back(result.ok() ? result->selections : std::vector<int32_t>{});
    }
  };
  std::vector<std::vector<std::vector<int32_t>>> serial(kThreads), parallel(kThreads);
  auto serial_indexer = MakeIndexer(100, H, D);
  for (int t = 0; t < kThreads; ++t) drive(*serial_indexer, t, serial[t]);
  auto shared_indexer = MakeIndexer(100, H, D);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] { drive(*shared_indexer, t, parallel[t]); });
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(parallel[t], serial[t]) << "thread " << t;
  EXPECT_EQ(shared_indexer->num_sequences(), kThreads);
}

TEST(IndexerTest, SelectBatchEqualsOneSelectPerGroup) {
  // Three sequences (one with verifier rows of d = 2 on two layers) batched per step, against a
  // twin running one Select per group: same selections, scores, block counts and EMAs. Then errors:
  // a bad group among distinct sequences changes nothing; with a repeated sequence the groups
  // before the bad one are applied and counted.
  const int H = 2, D = 8, K = 64;
  std::mt19937 rng(31);
  auto batched = MakeIndexer(200, H, D);
  auto twin = MakeIndexer(200, H, D);
  const int64_t kContext = 600;
  for (Indexer* indexer : {batched.get(), twin.get()}) {
    for (uint64_t id : {1u, 2u, 3u}) {
      ASSERT_TRUE(indexer->CreateSequence(id, Options(K, 0.5, true, 2)).ok());
    }
  }
  std::vector<std::vector<float>> keys;
  for (int i = 0; i < 6; ++i) keys.push_back(RandomValues(rng, (kContext + 40) * D));
  for (uint64_t id : {1u, 2u, 3u}) {
    for (int layer = 0; layer < 2; ++layer) {
      const std::vector<float>& k = keys[(id - 1) * 2 + layer];
      for (Indexer* indexer : {batched.get(), twin.get()}) {
        ASSERT_TRUE(indexer
                        ->AppendIndexKeys(id, layer, std::span<const float>(k.data(), kContext * D),
                                          kContext)
                        .ok());
      }
    }
  }
  int64_t position = kContext;
  for (int step = 0; step < 6; ++step) {
    const int rows = step == 3 ? 3 : 1;  // sequence 3 verifies a draft at step 3
    for (int layer = 0; layer < 2; ++layer) {
      std::vector<Query> queries;
      std::vector<std::vector<IndexerRow>> row_sets(3);
      for (uint64_t id : {1u, 2u, 3u}) {
        const int n = id == 3 ? rows : 1;
        const std::vector<float>& k = keys[(id - 1) * 2 + layer];
        for (Indexer* indexer : {batched.get(), twin.get()}) {
          const int64_t slots = *indexer->NumSlots(id, layer);
          ASSERT_TRUE(indexer
                          ->AppendIndexKeys(id, layer,
                                            std::span<const float>(k.data() + slots * D, n * D), n)
                          .ok());
        }
        for (int r = 0; r < n; ++r) queries.push_back(RandomQuery(rng, H, D));
      }
      size_t q = 0;
      std::vector<SelectGroup> groups;
      for (uint64_t id : {1u, 2u, 3u}) {
        const int n = id == 3 ? rows : 1;
        const int64_t first = *batched->NumSlots(id, layer) - n;
        for (int r = 0; r < n; ++r, ++q) {
          row_sets[id - 1].push_back({queries[q].query, queries[q].weights, first + r});
        }
        groups.push_back({id, layer, row_sets[id - 1]});
      }
      size_t applied = 0;
      auto results = batched->SelectBatch(groups, &applied);
      ASSERT_TRUE(results.ok()) << results.status();
      EXPECT_EQ(applied, 3u);
      for (size_t g = 0; g < groups.size(); ++g) {
        auto expected = twin->Select(groups[g].sequence_id, layer, groups[g].rows);
        ASSERT_TRUE(expected.ok());
        EXPECT_EQ((*results)[g].selections, expected->selections) << "step " << step << " g " << g;
        EXPECT_EQ((*results)[g].blocks, expected->blocks);
        EXPECT_EQ((*results)[g].blocks_visible, expected->blocks_visible);
      }
    }
    if (rows > 1) {
      ASSERT_TRUE(batched->Commit(3, 1).ok());
      ASSERT_TRUE(twin->Commit(3, 1).ok());
    }
    ++position;
  }
  for (uint64_t id : {1u, 2u, 3u}) {
    for (int layer = 0; layer < 2; ++layer) {
      ExpectSameEma(GetSpin(*batched, id, layer).vertical(), GetSpin(*twin, id, layer).vertical(),
                    "V");
      ExpectSameEma(GetSpin(*batched, id, layer).diagonal(), GetSpin(*twin, id, layer).diagonal(),
                    "D");
    }
  }
  // Distinct sequences, group 1 stale (its position was selected already): nothing changes.
  const Query q1 = RandomQuery(rng, H, D), q2 = RandomQuery(rng, H, D);
  for (uint64_t id : {1u, 2u}) {
    const int64_t slots = *batched->NumSlots(id, 0);
    ASSERT_TRUE(batched
                    ->AppendIndexKeys(
                        id, 0, std::span<const float>(keys[(id - 1) * 2].data() + slots * D, D), 1)
                    .ok());
  }
  const int64_t newest1 = *batched->NumSlots(1, 0) - 1;
  const std::vector<IndexerRow> fresh = {{q1.query, q1.weights, newest1}};
  const std::vector<IndexerRow> stale = {{q2.query, q2.weights, newest1 - 1}};
  const std::vector<float> v_before = GetSpin(*batched, 1, 0).vertical();
  size_t applied = 7;
  const std::vector<SelectGroup> bad = {{1, 0, fresh}, {2, 0, stale}};
  auto result = batched->SelectBatch(bad, &applied);
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(result.status().message().find("group 1: "), std::string::npos);
  EXPECT_EQ(applied, 0u);
  EXPECT_EQ(GetSpin(*batched, 1, 0).vertical(), v_before);
  // The same sequence twice (layer 0 then a bad layer 9): group 0 is applied.
  const std::vector<SelectGroup> repeated = {{1, 0, fresh}, {1, 9, fresh}};
  result = batched->SelectBatch(repeated, &applied);
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(applied, 1u);
  EXPECT_NE(GetSpin(*batched, 1, 0).vertical(), v_before);
  EXPECT_EQ(batched->SelectBatch({}, &applied).status().code(), StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// Speculative decoding

// Context 5,000 with verifier rows at 4,997..4,999 (d = 2), K = 2048, rho = 0.4: B = 79,
// m = max(32, ceil(0.6 * 79) = 48) = 48 per row.
TEST(IndexerTest, VerifierRowsDeferUpdatesUntilCommit) {
  const int H = 2, D = 8, K = 2048;
  for (int accepted : {0, 1, 2}) {
    SCOPED_TRACE("accepted " + std::to_string(accepted));
    auto indexer = MakeIndexer(100, H, D);
    ASSERT_TRUE(indexer->CreateSequence(1, Options(K, 0.4)).ok());
    std::mt19937 rng(4);
    std::vector<float> keys = RandomValues(rng, 5000 * D);
    ASSERT_TRUE(
        indexer->AppendIndexKeys(1, 0, std::span<const float>(keys.data(), 4997 * D), 4997).ok());
    ASSERT_TRUE(
        SelectOne(*indexer, 1, 0, RandomQuery(rng, H, D), 4996).ok());  // warm-up at t = 4996
    ASSERT_TRUE(
        indexer->AppendIndexKeys(1, 0, std::span<const float>(keys.data() + 4997 * D, 3 * D), 3)
            .ok());
    ASSERT_EQ(*indexer->NumSlots(1, 0), 5000);

    const SpinState before = GetSpin(*indexer, 1, 0);
    const Query qs[] = {RandomQuery(rng, H, D), RandomQuery(rng, H, D), RandomQuery(rng, H, D)};
    const IndexerRow rows[] = {{qs[0].query, qs[0].weights, 4997},
                               {qs[1].query, qs[1].weights, 4998},
                               {qs[2].query, qs[2].weights, 4999}};
    auto result = indexer->Select(1, 0, rows, true);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->blocks_visible, 79);
    EXPECT_LT(result->blocks_scored, 79);
    EXPECT_GE(result->blocks_scored, 48);
    EXPECT_EQ(result->blocks.front(), 0);
    EXPECT_EQ(result->blocks.back(), 78);
    for (size_t r = 0; r < 3; ++r) {
      const int64_t position = 4997 + static_cast<int64_t>(r);
      ExpectRowMatchesReference(*result, r, position, keys, D, qs[r], H,
                                "row " + std::to_string(r));
      const std::vector<int32_t> selection = RowSelection(*result, r);
      EXPECT_LE(*std::max_element(selection.begin(), selection.end()), position);
      std::set<int32_t> distinct(selection.begin(), selection.end());
      distinct.erase(-1);
      EXPECT_EQ(distinct.size(),
                static_cast<size_t>(std::count_if(selection.begin(), selection.end(),
                                                  [](int32_t s) { return s >= 0; })));
    }
    // Deferred: the EMAs did not move.
    SpinState pending = GetSpin(*indexer, 1, 0);
    EXPECT_EQ(pending.vertical(), before.vertical());
    EXPECT_EQ(pending.diagonal(), before.diagonal());

    ASSERT_TRUE(indexer->Commit(1, accepted).ok());
    EXPECT_EQ(*indexer->NumSlots(1, 0), 4997 + accepted + 1);

    // Hand-rolled replay of rows 0..accepted, in order, from the pre-step state.
    std::vector<float> v = before.vertical(), d = before.diagonal();
    for (int r = 0; r <= accepted; ++r)
      HandEma(v, d, 0.5f, 4997 + r, result->blocks, RowScores(*result, r));
    const SpinState after = GetSpin(*indexer, 1, 0);
    ExpectSameEma(after.vertical(), v, "V");
    ExpectSameEma(after.diagonal(), d, "D");
    // The same replay through SpinState::Update, row by row, on a copy of the pre-step state.
    SpinState by_rows = before;
    for (int r = 0; r <= accepted; ++r) {
      by_rows.Update(4997 + r, result->blocks,
                     std::span<const float>(RowScores(*result, r), result->blocks.size() * 64));
    }
    ExpectSameEma(after.vertical(), by_rows.vertical(), "V vs row-by-row Update");
    ExpectSameEma(after.diagonal(), by_rows.diagonal(), "D vs row-by-row Update");
    // Rejected rows never touch the EMAs: slots and offsets only they could reach stay zero. Slot
    // 4997 + r + 1 .. 4999 is visible only to rows beyond r; offset 4999 (slot 0 from t = 4999)
    // only to row 2, offset 4998 only to rows 1 and 2.
    for (int64_t slot = 4997 + accepted + 1; slot <= 4999; ++slot) {
      EXPECT_EQ(At(after.vertical(), slot), 0.0f) << "V[" << slot << "]";
    }
    for (int64_t offset = 4997 + accepted + 1; offset <= 4999; ++offset) {
      EXPECT_EQ(At(after.diagonal(), offset), 0.0f) << "D[" << offset << "]";
    }

    // The next decode step works as usual, at t = 4997 + a + 1.
    const int64_t next = 4997 + accepted + 1;
    std::vector<float> next_keys(keys.begin(), keys.begin() + next * D);
    const std::vector<float> new_key = RandomValues(rng, D);
    next_keys.insert(next_keys.end(), new_key.begin(), new_key.end());
    ASSERT_TRUE(indexer->AppendIndexKeys(1, 0, new_key, 1).ok());
    const Query q = RandomQuery(rng, H, D);
    auto step = SelectOne(*indexer, 1, 0, q, next);
    ASSERT_TRUE(step.ok()) << step.status();
    ExpectRowMatchesReference(*step, 0, next, next_keys, D, q, H, "next step");
  }
}

TEST(IndexerTest, CommitEqualsRunningTheRowsOneByOne) {
  // The EMA state after Commit(a) equals a twin sequence on which the accepted rows were run as
  // single-row steps with the same blocks: we cannot force those blocks through Select, so the twin
  // is the SPIN state before the step with Update applied row by row (the deferred replay), and a
  // second twin checks the state of every layer after a multi-layer step.
  const int H = 2, D = 8, K = 64;
  auto indexer = MakeIndexer(200, H, D);
  ASSERT_TRUE(indexer->CreateSequence(1, Options(K, 0.5, true, 2)).ok());
  std::mt19937 rng(5);
  std::vector<float> keys0 = RandomValues(rng, 1504 * D), keys1 = RandomValues(rng, 1504 * D);
  ASSERT_TRUE(
      indexer->AppendIndexKeys(1, 0, std::span<const float>(keys0.data(), 1500 * D), 1500).ok());
  ASSERT_TRUE(
      indexer->AppendIndexKeys(1, 1, std::span<const float>(keys1.data(), 1500 * D), 1500).ok());
  for (int layer = 0; layer < 2; ++layer) {
    ASSERT_TRUE(SelectOne(*indexer, 1, layer, RandomQuery(rng, H, D), 1499).ok());
  }
  ASSERT_TRUE(
      indexer->AppendIndexKeys(1, 0, std::span<const float>(keys0.data() + 1500 * D, 4 * D), 4)
          .ok());
  ASSERT_TRUE(
      indexer->AppendIndexKeys(1, 1, std::span<const float>(keys1.data() + 1500 * D, 4 * D), 4)
          .ok());
  std::vector<SpinState> before;
  std::vector<SelectResult> results;
  for (int layer = 0; layer < 2; ++layer) {
    before.push_back(GetSpin(*indexer, 1, layer));
    std::vector<Query> qs;
    std::vector<IndexerRow> rows;
    for (int r = 0; r < 4; ++r) qs.push_back(RandomQuery(rng, H, D));
    for (int r = 0; r < 4; ++r) rows.push_back({qs[r].query, qs[r].weights, 1500 + r});
    auto result = indexer->Select(1, layer, rows, true);
    ASSERT_TRUE(result.ok()) << result.status();
    for (int r = 0; r < 4; ++r) {
      ExpectRowMatchesReference(*result, r, 1500 + r, layer == 0 ? keys0 : keys1, D, qs[r], H,
                                "layer " + std::to_string(layer) + " row " + std::to_string(r));
    }
    results.push_back(std::move(*result));
  }
  ASSERT_TRUE(indexer->Commit(1, 2).ok());
  for (int layer = 0; layer < 2; ++layer) {
    EXPECT_EQ(*indexer->NumSlots(1, layer), 1503);  // t + a + 1 = 1500 + 2 + 1
    std::vector<float> v = before[layer].vertical(), d = before[layer].diagonal();
    SpinState by_rows = before[layer];
    for (int r = 0; r <= 2; ++r) {
      HandEma(v, d, 0.5f, 1500 + r, results[layer].blocks, RowScores(results[layer], r));
      by_rows.Update(
          1500 + r, results[layer].blocks,
          std::span<const float>(RowScores(results[layer], r), results[layer].blocks.size() * 64));
    }
    const SpinState after = GetSpin(*indexer, 1, layer);
    ExpectSameEma(after.vertical(), v, "V layer " + std::to_string(layer));
    ExpectSameEma(after.diagonal(), d, "D layer " + std::to_string(layer));
    ExpectSameEma(after.vertical(), by_rows.vertical(), "V by rows");
    ExpectSameEma(after.diagonal(), by_rows.diagonal(), "D by rows");
    EXPECT_EQ(At(after.vertical(), 1503), 0.0f);  // row 3 was rejected
  }
}

TEST(IndexerTest, Row0UpdatePolicyReplaysRowZeroOnly) {
  const int H = 2, D = 8;
  auto indexer = MakeIndexer(40, H, D);
  SequenceOptions options = Options(64, 0.5);
  options.spin.spec_update = SpecUpdatePolicy::kRow0;
  ASSERT_TRUE(indexer->CreateSequence(1, options).ok());
  std::mt19937 rng(6);
  std::vector<float> keys = RandomValues(rng, 700 * D);
  ASSERT_TRUE(indexer->AppendIndexKeys(1, 0, keys, 700).ok());
  const Query qs[] = {RandomQuery(rng, H, D), RandomQuery(rng, H, D), RandomQuery(rng, H, D)};
  const IndexerRow rows[] = {{qs[0].query, qs[0].weights, 697},
                             {qs[1].query, qs[1].weights, 698},
                             {qs[2].query, qs[2].weights, 699}};
  auto result = indexer->Select(1, 0, rows, true);
  ASSERT_TRUE(result.ok());
  ASSERT_TRUE(indexer->Commit(1, 2).ok());
  std::vector<float> v, d;
  HandEma(v, d, 0.5f, 697, result->blocks, RowScores(*result, 0));
  ExpectSameEma(GetSpin(*indexer, 1, 0).vertical(), v, "V");
  ExpectSameEma(GetSpin(*indexer, 1, 0).diagonal(), d, "D");
  EXPECT_EQ(*indexer->NumSlots(1, 0), 700);  // all drafts accepted: nothing truncated
}

// ---------------------------------------------------------------------------------------------
// Edge cases of DESIGN.md 4.1

// Keys that score exactly 1 or exactly 0 with H = 1, D = 4, q = [0, 2^-6, 0, 0], w = [1]:
// winner [448, 64, 0, 0] (scale 1): q . k = 1; loser [448, -64, 0, 0]: q . k = -1 -> ReLU 0.
const Query kUnitQuery{{0.0f, 1.0f / 64.0f, 0.0f, 0.0f}, {1.0f}};
void PushKey(std::vector<float>& keys, bool winner) {
  keys.insert(keys.end(), {448.0f, winner ? 64.0f : -64.0f, 0.0f, 0.0f});
}

TEST(IndexerTest, ReluZerosFillTheSelection) {
  // 8,320 slots, 100 scoring 1.0 and the rest exactly 0.0, K = 2048: the winners (ascending) then
  // the lowest zero slots; 2,048 distinct, no -1. The winners sit in slots < 2,560 (40 blocks).
  auto indexer = MakeIndexer(140, 1, 4);
  ASSERT_TRUE(indexer->CreateSequence(1, Options(2048, 0.4)).ok());
  std::mt19937 rng(8);
  std::vector<int32_t> candidates(2560);
  for (int i = 0; i < 2560; ++i) candidates[i] = i;
  std::shuffle(candidates.begin(), candidates.end(), rng);
  std::vector<int32_t> winners(candidates.begin(), candidates.begin() + 100);
  std::sort(winners.begin(), winners.end());
  std::vector<bool> is_winner(8321, false);
  for (int32_t w : winners) is_winner[w] = true;
  std::vector<float> keys;
  for (int i = 0; i < 8320; ++i) PushKey(keys, is_winner[i]);
  ASSERT_TRUE(indexer->AppendIndexKeys(1, 0, keys, 8320).ok());

  auto result = SelectOne(*indexer, 1, 0, kUnitQuery, 8319);
  ASSERT_TRUE(result.ok());
  EXPECT_TRUE(result->all_blocks);  // warm-up
  std::vector<int32_t> expected = winners;
  for (int32_t i = 0; expected.size() < 2048; ++i) {
    if (!is_winner[i]) expected.push_back(i);
  }
  EXPECT_EQ(result->selections, expected);
  for (size_t e = 0; e < result->scores.size(); ++e) {
    ASSERT_EQ(result->scores[e], is_winner[e] ? 1.0f : 0.0f) << "slot " << e;
  }

  // The next step is pruned (N = 8,321: B = 131, m = max(32, ceil(0.6 * 131)) = 79). The winners'
  // blocks (and the blocks of slot w + 1, through D) predict 0.5, the rest 0, so every winner's
  // block is chosen; the selection is the winners, then the lowest zero slots of the scored blocks.
  std::vector<float> key;
  PushKey(key, false);
  ASSERT_TRUE(indexer->AppendIndexKeys(1, 0, key, 1).ok());
  result = SelectOne(*indexer, 1, 0, kUnitQuery, 8320);
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->blocks_visible, 131);
  EXPECT_EQ(result->blocks_scored, 79);
  std::set<int32_t> scored(result->blocks.begin(), result->blocks.end());
  for (int32_t w : winners)
    ASSERT_TRUE(scored.count(w / 64)) << "winner block " << w / 64 << " skipped";
  expected = winners;
  for (int32_t block : result->blocks) {
    for (int32_t i = block * 64; i < block * 64 + 64 && i <= 8320 && expected.size() < 2048; ++i) {
      if (!is_winner[i]) expected.push_back(i);
    }
  }
  std::sort(expected.begin() + 100, expected.end());
  EXPECT_EQ(result->selections, expected);
  EXPECT_EQ(std::count(result->selections.begin(), result->selections.end(), -1), 0);
}

TEST(IndexerTest, FewerSelectableSlotsThanK) {
  // Three slots scoring 3, 2, 1 (keys [448, 64 c, 0, 0] for c = 3, 2, 1), K = 16:
  // [0, 1, 2] then 13 x -1.
  auto indexer = MakeIndexer(2, 1, 4);
  ASSERT_TRUE(indexer->CreateSequence(1, Options(16, 0.4)).ok());
  const std::vector<float> keys = {448, 192, 0, 0, 448, 128, 0, 0, 448, 64, 0, 0};
  ASSERT_TRUE(indexer->AppendIndexKeys(1, 0, keys, 3).ok());
  auto result = SelectOne(*indexer, 1, 0, kUnitQuery, 2);
  ASSERT_TRUE(result.ok());
  std::vector<int32_t> expected = {0, 1, 2};
  expected.resize(16, -1);
  EXPECT_EQ(result->selections, expected);
  EXPECT_FLOAT_EQ(result->scores[0], 3.0f);
  EXPECT_FLOAT_EQ(result->scores[1], 2.0f);
  EXPECT_FLOAT_EQ(result->scores[2], 1.0f);
}

TEST(IndexerTest, ShortContextsSelectEverySlotOnceAndPruneNothing) {
  const int H = 2, D = 8, K = 2048;
  for (int64_t n : {64, 1000}) {
    auto indexer = MakeIndexer(20, H, D);
    ASSERT_TRUE(indexer->CreateSequence(1, Options(K, 0.5)).ok());
    std::mt19937 rng(9);
    // The context grows to n over the warm-up and two steps past it (a decode step appends its
    // key).
    std::vector<float> keys = RandomValues(rng, n * D);
    ASSERT_TRUE(
        indexer->AppendIndexKeys(1, 0, std::span<const float>(keys.data(), (n - 2) * D), n - 2)
            .ok());
    for (int step = 0; step < 3; ++step) {
      if (step > 0) {
        const int64_t slot = n - 3 + step;
        ASSERT_TRUE(
            indexer->AppendIndexKeys(1, 0, std::span<const float>(keys.data() + slot * D, D), 1)
                .ok());
      }
      if (step < 2) {
        ASSERT_TRUE(SelectOne(*indexer, 1, 0, RandomQuery(rng, H, D), n - 3 + step).ok());
        continue;
      }
      const Query q = RandomQuery(rng, H, D);
      auto result = SelectOne(*indexer, 1, 0, q, n - 1);
      ASSERT_TRUE(result.ok());
      EXPECT_EQ(result->blocks_scored, result->blocks_visible) << "N " << n << " step " << step;
      EXPECT_EQ(result->blocks_visible, (n + 63) / 64);
      EXPECT_TRUE(result->all_blocks);
      std::vector<int32_t> head(result->selections.begin(), result->selections.begin() + n);
      std::sort(head.begin(), head.end());
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(head[i], i) << "N " << n;
      for (int64_t i = n; i < K; ++i) ASSERT_EQ(result->selections[i], -1);
      ExpectRowMatchesReference(*result, 0, n - 1, keys, D, q, H, "N " + std::to_string(n));
    }
  }
}

TEST(IndexerTest, PruningStartsOnlyAboveK) {
  // K = 2048, rho = 0.5. N = 2,048 (after the warm-up): every block. N = 2,049: B = 33,
  // m = min(33, max(32, ceil(16.5))) = 32, so one full block is skipped; with the newest block
  // holding one slot, 31 x 64 + 1 = 1,985 slots are scored and the selection ends in 63 x -1.
  const int H = 2, D = 8, K = 2048;
  auto indexer = MakeIndexer(40, H, D);
  ASSERT_TRUE(indexer->CreateSequence(1, Options(K, 0.5)).ok());
  std::mt19937 rng(10);
  std::vector<float> keys = RandomValues(rng, 2049 * D);
  ASSERT_TRUE(
      indexer->AppendIndexKeys(1, 0, std::span<const float>(keys.data(), 2047 * D), 2047).ok());
  ASSERT_TRUE(SelectOne(*indexer, 1, 0, RandomQuery(rng, H, D), 2046).ok());  // warm-up

  ASSERT_TRUE(
      indexer->AppendIndexKeys(1, 0, std::span<const float>(keys.data() + 2047 * D, D), 1).ok());
  Query q = RandomQuery(rng, H, D);
  auto result = SelectOne(*indexer, 1, 0, q, 2047);
  ASSERT_TRUE(result.ok());
  EXPECT_TRUE(result->all_blocks);
  EXPECT_EQ(result->blocks_scored, 32);
  EXPECT_EQ(result->blocks_visible, 32);
  std::vector<int32_t> sorted = result->selections;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 2048; ++i) ASSERT_EQ(sorted[i], i);
  ExpectRowMatchesReference(*result, 0, 2047, keys, D, q, H, "N 2048");

  ASSERT_TRUE(
      indexer->AppendIndexKeys(1, 0, std::span<const float>(keys.data() + 2048 * D, D), 1).ok());
  q = RandomQuery(rng, H, D);
  result = SelectOne(*indexer, 1, 0, q, 2048);
  ASSERT_TRUE(result.ok());
  EXPECT_FALSE(result->all_blocks);
  EXPECT_EQ(result->blocks_visible, 33);
  EXPECT_EQ(result->blocks_scored, 32);
  EXPECT_EQ(result->blocks.front(), 0);
  EXPECT_EQ(result->blocks.back(), 32);
  EXPECT_EQ(std::count(result->selections.begin(), result->selections.end(), -1), 63);
  ExpectRowMatchesReference(*result, 0, 2048, keys, D, q, H, "N 2049");
}

TEST(IndexerTest, ContextOf257Slots) {
  // 257 slots: blocks 0..3 full, block 4 holds slot 256 only. 257 finite scores, nothing past 256.
  const int H = 2, D = 8, K = 2048;
  auto indexer = MakeIndexer(10, H, D);
  ASSERT_TRUE(indexer->CreateSequence(1, Options(K, 0.4)).ok());
  std::mt19937 rng(11);
  std::vector<float> keys = RandomValues(rng, 257 * D);
  ASSERT_TRUE(indexer->AppendIndexKeys(1, 0, keys, 257).ok());
  const Query q = RandomQuery(rng, H, D);
  auto result = SelectOne(*indexer, 1, 0, q, 256);
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->blocks, (std::vector<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(result->blocks_visible, 5);
  ASSERT_EQ(result->scores.size(), 5u * 64);
  EXPECT_EQ(std::count_if(result->scores.begin(), result->scores.end(),
                          [](float z) { return std::isfinite(z); }),
            257);
  EXPECT_TRUE(std::isfinite(result->scores[4 * 64]));
  for (int s = 1; s < 64; ++s) EXPECT_EQ(result->scores[4 * 64 + s], -kInf);
  EXPECT_EQ(*std::max_element(result->selections.begin(), result->selections.end()), 256);
  EXPECT_EQ(std::count(result->selections.begin(), result->selections.end(), -1), K - 257);
  ExpectRowMatchesReference(*result, 0, 256, keys, D, q, H, "N 257");
  // A row at position 200 of the same keys (a second sequence) sees slots 0..200 only.
  ASSERT_TRUE(indexer->CreateSequence(2, Options(K, 0.5)).ok());
  ASSERT_TRUE(indexer->AppendIndexKeys(2, 0, keys, 257).ok());
  auto early = SelectOne(*indexer, 2, 0, q, 200);
  ASSERT_TRUE(early.ok());
  EXPECT_EQ(*std::max_element(early->selections.begin(), early->selections.end()), 200);
  EXPECT_EQ(std::count(early->selections.begin(), early->selections.end(), -1), K - 201);
}

// ---------------------------------------------------------------------------------------------
// Prefix sharing, turns, release

TEST(IndexerTest, PrefixSharedSequenceSelectsOverTheSharedKeys) {
  const int H = 2, D = 8, K = 32;
  auto indexer = MakeIndexer(10, H, D);
  ASSERT_TRUE(indexer->CreateSequence(1, Options(K, 0.4, false)).ok());
  std::mt19937 rng(12);
  std::vector<float> keys1 = RandomValues(rng, 200 * D);
  ASSERT_TRUE(indexer->AppendIndexKeys(1, 0, keys1, 200).ok());
  EXPECT_EQ(indexer->CreateSequenceFromPrefix(2, Options(K, 0.4, false), 1, 100).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(indexer->CreateSequenceFromPrefix(2, Options(K, 0.4, false), 9, 128).code(),
            StatusCode::kNotFound);
  EXPECT_EQ(indexer->CreateSequenceFromPrefix(2, Options(K, 0.4, false, 2), 1, 128).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(indexer->CreateSequenceFromPrefix(1, Options(K, 0.4, false), 1, 128).code(),
            StatusCode::kAlreadyExists);
  ASSERT_TRUE(indexer->CreateSequenceFromPrefix(2, Options(K, 0.4, false), 1, 128).ok());
  EXPECT_EQ(*indexer->NumSlots(2, 0), 128);
  EXPECT_EQ(indexer->Usage().used_blocks, 4);
  EXPECT_EQ(indexer->Usage().shared_blocks, 2);
  std::vector<float> keys2(keys1.begin(), keys1.begin() + 128 * D);
  const std::vector<float> tail = RandomValues(rng, 10 * D);
  keys2.insert(keys2.end(), tail.begin(), tail.end());
  ASSERT_TRUE(indexer->AppendIndexKeys(2, 0, tail, 10).ok());
  const Query q = RandomQuery(rng, H, D);
  auto r2 = SelectOne(*indexer, 2, 0, q, 137);
  ASSERT_TRUE(r2.ok());
  ExpectRowMatchesReference(*r2, 0, 137, keys2, D, q, H, "sequence 2");
  auto r1 = SelectOne(*indexer, 1, 0, q, 199);
  ASSERT_TRUE(r1.ok());
  ExpectRowMatchesReference(*r1, 0, 199, keys1, D, q, H, "sequence 1");
  ASSERT_TRUE(indexer->Release(1).ok());
  EXPECT_EQ(indexer->Usage().used_blocks, 3);  // the two shared blocks and sequence 2's third
  ASSERT_TRUE(indexer->Release(2).ok());
  EXPECT_EQ(indexer->Usage().used_blocks, 0);
  EXPECT_EQ(indexer->num_sequences(), 0);
  EXPECT_EQ(SelectOne(*indexer, 1, 0, q, 0).status().code(), StatusCode::kNotFound);
}

TEST(IndexerTest, BeginTurnResetsTheEmasAndWarmsUpAgain) {
  const int H = 2, D = 8, K = 64;
  auto indexer = MakeIndexer(20, H, D);
  ASSERT_TRUE(indexer->CreateSequence(1, Options(K, 0.5)).ok());
  std::mt19937 rng(13);
  std::vector<float> keys = RandomValues(rng, 1000 * D);
  ASSERT_TRUE(indexer->AppendIndexKeys(1, 0, keys, 1000).ok());
  ASSERT_TRUE(SelectOne(*indexer, 1, 0, RandomQuery(rng, H, D), 996)->all_blocks);
  EXPECT_FALSE(SelectOne(*indexer, 1, 0, RandomQuery(rng, H, D), 997)->all_blocks);
  ASSERT_TRUE(indexer->BeginTurn(1).ok());
  const SpinState reset = GetSpin(*indexer, 1, 0);
  EXPECT_TRUE(reset.warmup_pending());
  for (float v : reset.vertical()) ASSERT_EQ(v, 0.0f);
  for (float v : reset.diagonal()) ASSERT_EQ(v, 0.0f);
  EXPECT_TRUE(SelectOne(*indexer, 1, 0, RandomQuery(rng, H, D), 998)->all_blocks);
  EXPECT_FALSE(SelectOne(*indexer, 1, 0, RandomQuery(rng, H, D), 999)->all_blocks);
  EXPECT_EQ(indexer->BeginTurn(2).code(), StatusCode::kNotFound);
}

TEST(IndexerTest, FullPoolIsResourceExhaustedAndNothingChanges) {
  const int H = 2, D = 8;
  auto indexer = MakeIndexer(3, H, D);
  ASSERT_TRUE(indexer->CreateSequence(1, Options(64, 0.4)).ok());
  std::mt19937 rng(14);
  std::vector<float> keys = RandomValues(rng, 300 * D);
  ASSERT_TRUE(
      indexer->AppendIndexKeys(1, 0, std::span<const float>(keys.data(), 100 * D), 100).ok());
  const CacheUsage before = indexer->Usage();
  EXPECT_EQ(
      indexer->AppendIndexKeys(1, 0, std::span<const float>(keys.data() + 100 * D, 100 * D), 100)
          .code(),
      StatusCode::kResourceExhausted);
  EXPECT_EQ(*indexer->NumSlots(1, 0), 100);
  EXPECT_EQ(indexer->Usage().used_blocks, before.used_blocks);
  EXPECT_EQ(indexer->Usage().free_blocks, before.free_blocks);
  ASSERT_TRUE(
      indexer->AppendIndexKeys(1, 0, std::span<const float>(keys.data() + 100 * D, 50 * D), 50)
          .ok());
  EXPECT_EQ(*indexer->NumSlots(1, 0), 150);
  const Query q = RandomQuery(rng, H, D);
  auto result = SelectOne(*indexer, 1, 0, q, 149);
  ASSERT_TRUE(result.ok());
  ExpectRowMatchesReference(*result, 0, 149, keys, D, q, H, "after the failed append");
}

TEST(IndexerTest, TruncateIndexKeysUndoesUnselectedAppendsOnly) {
  const int H = 2, D = 8;
  auto indexer = MakeIndexer(8, H, D);
  ASSERT_TRUE(indexer->CreateSequence(1, Options(64, 0.4, true, 2)).ok());
  std::mt19937 rng(15);
  std::vector<float> keys = RandomValues(rng, 300 * D);
  ASSERT_TRUE(
      indexer->AppendIndexKeys(1, 0, std::span<const float>(keys.data(), 100 * D), 100).ok());
  const CacheUsage before = indexer->Usage();
  ASSERT_TRUE(
      indexer->AppendIndexKeys(1, 0, std::span<const float>(keys.data() + 100 * D, 150 * D), 150)
          .ok());
  EXPECT_GT(indexer->Usage().used_blocks, before.used_blocks);
  ASSERT_TRUE(indexer->TruncateIndexKeys(1, 0, 100).ok());
  EXPECT_EQ(*indexer->NumSlots(1, 0), 100);
  EXPECT_EQ(indexer->Usage().used_blocks, before.used_blocks);
  EXPECT_EQ(indexer->Usage().free_blocks, before.free_blocks);

  // Errors: unknown sequence, layer, length out of range.
  EXPECT_EQ(indexer->TruncateIndexKeys(2, 0, 0).code(), StatusCode::kNotFound);
  EXPECT_EQ(indexer->TruncateIndexKeys(1, 2, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(indexer->TruncateIndexKeys(1, -1, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(indexer->TruncateIndexKeys(1, 0, 101).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(indexer->TruncateIndexKeys(1, 0, -1).code(), StatusCode::kOutOfRange);

  // A selected slot cannot be removed; slots after it can, and selections are unchanged.
  const Query q = RandomQuery(rng, H, D);
  ASSERT_TRUE(SelectOne(*indexer, 1, 0, q, 79).ok());
  EXPECT_EQ(indexer->TruncateIndexKeys(1, 0, 79).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(*indexer->NumSlots(1, 0), 100);
  ASSERT_TRUE(indexer->TruncateIndexKeys(1, 0, 80).ok());
  EXPECT_EQ(*indexer->NumSlots(1, 0), 80);
  ASSERT_TRUE(
      indexer->AppendIndexKeys(1, 0, std::span<const float>(keys.data() + 80 * D, 20 * D), 20)
          .ok());
  auto result = SelectOne(*indexer, 1, 0, q, 99);
  ASSERT_TRUE(result.ok());
  ExpectRowMatchesReference(*result, 0, 99, keys, D, q, H, "after truncate and re-append");
}

TEST(IndexerTest, AppendsCheckTheirFirstSlotUnderTheAppendsLock) {
  // Two callers that both saw 100 slots: the first append wins, the second is refused and changes
  // nothing (before, the check and the append took the lock separately and both could pass).
  const int H = 2, D = 8;
  auto indexer = MakeIndexer(8, H, D);
  ASSERT_TRUE(indexer->CreateSequence(1, Options(64, 0.4, true, 1)).ok());
  std::mt19937 rng(16);
  const std::vector<float> keys = RandomValues(rng, 120 * D);
  ASSERT_TRUE(indexer->AppendIndexKeysAt(1, 0, 0, std::span(keys).first(100 * D), 100).ok());
  ASSERT_TRUE(
      indexer->AppendIndexKeysAt(1, 0, 100, std::span(keys).subspan(100 * D, 10 * D), 10).ok());
  const absl::Status late =
      indexer->AppendIndexKeysAt(1, 0, 100, std::span(keys).subspan(110 * D, 10 * D), 10);
  EXPECT_EQ(late.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(late.message(), "first_slot 100 but layer 0 of sequence 1 holds 110 slots");
  EXPECT_EQ(*indexer->NumSlots(1, 0), 110);
  EXPECT_EQ(indexer->AppendIndexKeysAt(9, 0, 0, std::span(keys).first(D), 1).code(),
            StatusCode::kNotFound);
}

TEST(IndexerTest, ASelectsNewKeysAtAStaleSlotAreRefusedAndAFailedBatchUndoesItsAppends) {
  const int H = 2, D = 8;
  auto indexer = MakeIndexer(16, H, D);
  ASSERT_TRUE(indexer->CreateSequence(1, Options(64, 0.4, true, 1)).ok());
  ASSERT_TRUE(indexer->CreateSequence(2, Options(64, 0.4, true, 1)).ok());
  std::mt19937 rng(17);
  const std::vector<float> keys = RandomValues(rng, 300 * D);
  ASSERT_TRUE(indexer->AppendIndexKeys(1, 0, std::span(keys).first(200 * D), 200).ok());
  ASSERT_TRUE(indexer->AppendIndexKeys(2, 0, std::span(keys).first(200 * D), 200).ok());
  const Query q = RandomQuery(rng, H, D);
  const IndexerRow row{q.query, q.weights, 200};
  const std::span<const float> new_key = std::span(keys).subspan(200 * D, D);
  // Keys meant for slot 199 of a layer that holds 200: refused, nothing appended or selected.
  SelectGroup stale{1, 0, std::span<const IndexerRow>(&row, 1)};
  stale.new_index_keys = new_key;
  stale.new_keys_first_slot = 199;
  auto refused = indexer->SelectBatch(std::span<const SelectGroup>(&stale, 1));
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("group 0 new_index_keys: they go at slot 199 but "
                                            "layer 0 holds 200 slots (another call appended)"),
            std::string::npos)
      << refused.status();
  EXPECT_EQ(*indexer->NumSlots(1, 0), 200);
  // A batch whose second group fails (its row is past its layer) removes the first group's keys.
  SelectGroup good{1, 0, std::span<const IndexerRow>(&row, 1)};
  good.new_index_keys = new_key;
  good.new_keys_first_slot = 200;
  const IndexerRow past{q.query, q.weights, 205};
  SelectGroup bad{2, 0, std::span<const IndexerRow>(&past, 1)};
  const SelectGroup both[] = {good, bad};
  size_t applied = 9;
  EXPECT_FALSE(indexer->SelectBatch(both, &applied).ok());
  EXPECT_EQ(applied, 0u);
  EXPECT_EQ(*indexer->NumSlots(1, 0), 200);
  // The same step alone appends its key and selects at the new slot.
  auto selected = indexer->SelectBatch(std::span<const SelectGroup>(&good, 1));
  ASSERT_TRUE(selected.ok()) << selected.status();
  EXPECT_EQ(*indexer->NumSlots(1, 0), 201);
}

// ---------------------------------------------------------------------------------------------
// Bad requests: precise status, no state change, and the next good request answers as on a twin.

constexpr int kH = 2, kD = 8, kK = 64;
constexpr int64_t kSlots = 600;

struct Snapshot {
  std::vector<int64_t> slots;
  int64_t used_blocks, free_blocks, shared_blocks, num_sequences;
  std::vector<std::vector<float>> vertical, diagonal;
  std::vector<bool> warmup;
};

Snapshot Take(const Indexer& indexer) {
  Snapshot s;
  for (int layer = 0; layer < 2; ++layer) {
    s.slots.push_back(*indexer.NumSlots(1, layer));
    const SpinState spin = GetSpin(indexer, 1, layer);
    s.vertical.push_back(spin.vertical());
    s.diagonal.push_back(spin.diagonal());
    s.warmup.push_back(spin.warmup_pending());
  }
  const CacheUsage usage = indexer.Usage();
  s.used_blocks = usage.used_blocks;
  s.free_blocks = usage.free_blocks;
  s.shared_blocks = usage.shared_blocks;
  s.num_sequences = indexer.num_sequences();
  return s;
}

void ExpectSameSnapshot(const Snapshot& a, const Snapshot& b, const std::string& what) {
  EXPECT_EQ(a.slots, b.slots) << what;
  EXPECT_EQ(a.used_blocks, b.used_blocks) << what;
  EXPECT_EQ(a.free_blocks, b.free_blocks) << what;
  EXPECT_EQ(a.shared_blocks, b.shared_blocks) << what;
  EXPECT_EQ(a.num_sequences, b.num_sequences) << what;
  EXPECT_EQ(a.vertical, b.vertical) << what;
  EXPECT_EQ(a.diagonal, b.diagonal) << what;
  EXPECT_EQ(a.warmup, b.warmup) << what;
}

// Sequence 1: 2 layers, K = 64, rho = 0.5, 600 keys per layer (10 blocks each), warm-up pending.
// Capacity 21 blocks: one free.
std::unique_ptr<Indexer> BuildForBadRequests(bool pending_step) {
  auto indexer = MakeIndexer(21, kH, kD);
  EXPECT_TRUE(indexer->CreateSequence(1, Options(kK, 0.5, true, 2)).ok());
  std::mt19937 rng(15);
  for (int layer = 0; layer < 2; ++layer) {
    const std::vector<float> keys = RandomValues(rng, kSlots * kD);
    EXPECT_TRUE(indexer->AppendIndexKeys(1, layer, keys, kSlots).ok());
  }
  if (pending_step) {
    // Warm layer 0 up, then a 3-row step at 597..599 on layer 0 awaiting Commit.
    EXPECT_TRUE(SelectOne(*indexer, 1, 0, RandomQuery(rng, kH, kD), 596).ok());
    std::vector<Query> qs;
    std::vector<IndexerRow> rows;
    for (int r = 0; r < 3; ++r) qs.push_back(RandomQuery(rng, kH, kD));
    for (int r = 0; r < 3; ++r) rows.push_back({qs[r].query, qs[r].weights, 597 + r});
    EXPECT_TRUE(indexer->Select(1, 0, rows).ok());
  }
  return indexer;
}

absl::Status Append(Indexer& indexer, uint64_t id, int layer, int64_t num_keys, size_t values,
                    float poison = 0.0f);

// The good request after each bad one: one row at 599 on each layer (with pending_step: Commit(1)
// first), compared field by field with the twin.
void ExpectSameAnswerAsTwin(Indexer& indexer, Indexer& twin, bool pending_step,
                            const std::string& what) {
  if (pending_step) {
    ASSERT_TRUE(indexer.Commit(1, 1).ok()) << what;
    ASSERT_TRUE(twin.Commit(1, 1).ok()) << what;
  }
  std::mt19937 rng(16);
  for (int layer = 0; layer < 2; ++layer) {
    const Query q = RandomQuery(rng, kH, kD);
    if (pending_step) {  // Commit(1) keeps 597 + 1 + 1 slots: the next decode key goes to 599
      ASSERT_TRUE(Append(indexer, 1, layer, 1, kD).ok()) << what;
      ASSERT_TRUE(Append(twin, 1, layer, 1, kD).ok()) << what;
    }
    const int64_t position = 599;
    auto got = SelectOne(indexer, 1, layer, q, position);
    auto want = SelectOne(twin, 1, layer, q, position);
    ASSERT_TRUE(got.ok()) << what << ": " << got.status();
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(got->selections, want->selections) << what << " layer " << layer;
    EXPECT_EQ(got->blocks, want->blocks) << what << " layer " << layer;
    EXPECT_EQ(got->all_blocks, want->all_blocks) << what << " layer " << layer;
  }
  ExpectSameSnapshot(Take(indexer), Take(twin), what + " (after the good request)");
}

struct BadRequest {
  std::string name;
  StatusCode code;
  std::function<absl::Status(Indexer&)> call;
};

absl::Status SelectRows(Indexer& indexer, uint64_t id, int layer, std::vector<int64_t> positions,
                        std::function<void(std::vector<Query>&)> spoil = nullptr) {
  std::mt19937 rng(17);
  std::vector<Query> qs;
  for (size_t r = 0; r < positions.size(); ++r) qs.push_back(RandomQuery(rng, kH, kD));
  if (spoil) spoil(qs);
  std::vector<IndexerRow> rows;
  for (size_t r = 0; r < positions.size(); ++r)
    rows.push_back({qs[r].query, qs[r].weights, positions[r]});
  return indexer.Select(id, layer, rows).status();
}

absl::Status Append(Indexer& indexer, uint64_t id, int layer, int64_t num_keys, size_t values,
                    float poison) {
  std::mt19937 rng(18);
  std::vector<float> keys = RandomValues(rng, values);
  if (poison != 0.0f && !keys.empty()) keys[keys.size() / 2] = poison;
  return indexer.AppendIndexKeys(id, layer, keys, num_keys);
}

std::vector<BadRequest> BadRequestsWithoutPendingStep() {
  return {
      {"query too short", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {599}, [](auto& q) { q[0].query.pop_back(); });
       }},
      {"query too long", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {599}, [](auto& q) { q[0].query.push_back(1.0f); });
       }},
      {"weights too short", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {599}, [](auto& q) { q[0].weights.pop_back(); });
       }},
      {"NaN in query", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {599}, [](auto& q) { q[0].query[3] = kNaN; });
       }},
      {"inf in weights", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {599}, [](auto& q) { q[0].weights[1] = kInf; });
       }},
      {"NaN in the last verifier row", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {597, 598, 599}, [](auto& q) { q[2].query[0] = kNaN; });
       }},
      {"no rows", StatusCode::kInvalidArgument, [](Indexer& x) { return SelectRows(x, 1, 0, {}); }},
      {"equal positions", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {598, 598});
       }},
      {"decreasing positions", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {599, 598});
       }},
      {"verifier rows not ending at the newest slot", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {10, 11, 12});
       }},
      {"verifier rows with a gap", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {597, 599});
       }},
      {"append with a wrapping key count", StatusCode::kInvalidArgument,
       [](Indexer& x) { return Append(x, 1, 0, (int64_t{1} << 61) + 1, 8); }},
      {"negative position", StatusCode::kInvalidArgument,
       [](Indexer& x) { return SelectRows(x, 1, 0, {-1}); }},
      {"position at the slot count", StatusCode::kOutOfRange,
       [](Indexer& x) { return SelectRows(x, 1, 0, {600}); }},
      {"last verifier row beyond slots", StatusCode::kOutOfRange,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {598, 599, 600});
       }},
      {"select layer out of range", StatusCode::kInvalidArgument,
       [](Indexer& x) { return SelectRows(x, 1, 2, {599}); }},
      {"select unknown sequence", StatusCode::kNotFound,
       [](Indexer& x) { return SelectRows(x, 7, 0, {599}); }},
      {"NaN in keys", StatusCode::kInvalidArgument,
       [](Indexer& x) { return Append(x, 1, 0, 4, 4 * kD, kNaN); }},
      {"inf in keys", StatusCode::kInvalidArgument,
       [](Indexer& x) { return Append(x, 1, 1, 4, 4 * kD, -kInf); }},
      {"key shape", StatusCode::kInvalidArgument,
       [](Indexer& x) { return Append(x, 1, 0, 4, 4 * kD - 1); }},
      {"append layer out of range", StatusCode::kInvalidArgument,
       [](Indexer& x) { return Append(x, 1, -1, 1, kD); }},
      {"append unknown sequence", StatusCode::kNotFound,
       [](Indexer& x) { return Append(x, 7, 0, 1, kD); }},
      {"pool full", StatusCode::kResourceExhausted,
       [](Indexer& x) { return Append(x, 1, 0, 129, 129 * kD); }},
      {"duplicate sequence", StatusCode::kAlreadyExists,
       [](Indexer& x) { return x.CreateSequence(1, Options(16, 0.0, false, 1)); }},
      {"duplicate sequence from prefix", StatusCode::kAlreadyExists,
       [](Indexer& x) { return x.CreateSequenceFromPrefix(1, Options(kK, 0.5, true, 2), 1, 64); }},
      {"rho 1", StatusCode::kInvalidArgument,
       [](Indexer& x) { return x.CreateSequence(2, Options(kK, 1.0)); }},
      {"rho negative", StatusCode::kInvalidArgument,
       [](Indexer& x) { return x.CreateSequence(2, Options(kK, -0.25)); }},
      {"decay 1", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         SequenceOptions o = Options(kK, 0.5);
         o.spin.ema_decay = 1.0;
         return x.CreateSequence(2, o);
       }},
      {"decay negative", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         SequenceOptions o = Options(kK, 0.5);
         o.spin.ema_decay = -0.1;
         return x.CreateSequence(2, o);
       }},
      {"prefix not a multiple of 64", StatusCode::kInvalidArgument,
       [](Indexer& x) { return x.CreateSequenceFromPrefix(2, Options(kK, 0.5, true, 2), 1, 100); }},
      {"prefix longer than the source", StatusCode::kInvalidArgument,
       [](Indexer& x) { return x.CreateSequenceFromPrefix(2, Options(kK, 0.5, true, 2), 1, 640); }},
      {"prefix layer count", StatusCode::kInvalidArgument,
       [](Indexer& x) { return x.CreateSequenceFromPrefix(2, Options(kK, 0.5, true, 1), 1, 64); }},
      {"prefix unknown source", StatusCode::kNotFound,
       [](Indexer& x) { return x.CreateSequenceFromPrefix(2, Options(kK, 0.5, true, 2), 9, 64); }},
      {"commit with nothing pending", StatusCode::kFailedPrecondition,
       [](Indexer& x) { return x.Commit(1, 0); }},
      {"commit unknown sequence", StatusCode::kNotFound, [](Indexer& x) { return x.Commit(7, 0); }},
      {"begin turn unknown sequence", StatusCode::kNotFound,
       [](Indexer& x) { return x.BeginTurn(7); }},
      {"release unknown sequence", StatusCode::kNotFound, [](Indexer& x) { return x.Release(7); }},
  };
}

std::vector<BadRequest> BadRequestsWithPendingStep() {
  return {
      {"accepted above d", StatusCode::kOutOfRange, [](Indexer& x) { return x.Commit(1, 3); }},
      {"accepted negative", StatusCode::kOutOfRange, [](Indexer& x) { return x.Commit(1, -1); }},
      {"share the prefix of a sequence with a pending step", StatusCode::kFailedPrecondition,
       [](Indexer& x) { return x.CreateSequenceFromPrefix(9, Options(kK, 0.5, true, 2), 1, 64); }},
      {"append to the pending layer", StatusCode::kFailedPrecondition,
       [](Indexer& x) { return Append(x, 1, 0, 1, kD); }},
      {"begin turn while pending", StatusCode::kFailedPrecondition,
       [](Indexer& x) { return x.BeginTurn(1); }},
      {"select the pending layer again", StatusCode::kFailedPrecondition,
       [](Indexer& x) {
         return SelectRows(x, 1, 0, {597, 598, 599});
       }},
      {"other layer, other row count", StatusCode::kInvalidArgument,
       [](Indexer& x) { return SelectRows(x, 1, 1, {599}); }},
      {"other layer, other first position", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 1, {596, 597, 598});
       }},
      {"bad row on the other layer", StatusCode::kInvalidArgument,
       [](Indexer& x) {
         return SelectRows(x, 1, 1, {597, 598, 599}, [](auto& q) { q[1].weights[0] = kNaN; });
       }},
  };
}

void RunBadRequests(bool pending_step, const std::vector<BadRequest>& requests) {
  for (const BadRequest& request : requests) {
    SCOPED_TRACE(request.name);
    auto indexer = BuildForBadRequests(pending_step);
    auto twin = BuildForBadRequests(pending_step);
    const Snapshot before = Take(*indexer);
    ExpectSameSnapshot(before, Take(*twin), "twin before");
    const absl::Status status = request.call(*indexer);
    EXPECT_EQ(status.code(), request.code) << status;
    ExpectSameSnapshot(before, Take(*indexer), "state after the bad request");
    ExpectSameAnswerAsTwin(*indexer, *twin, pending_step, request.name);
  }
}

TEST(IndexerBadRequestTest, PreciseStatusAndNoStateChange) {
  RunBadRequests(false, BadRequestsWithoutPendingStep());
}

TEST(IndexerBadRequestTest, PreciseStatusAndNoStateChangeWhileAStepIsPending) {
  RunBadRequests(true, BadRequestsWithPendingStep());
}

TEST(IndexerBadRequestTest, GoodRequestsStillChangeState) {
  // The twin comparison must be able to fail: a request that does change state (a select past the
  // warm-up) makes the snapshots differ.
  auto indexer = BuildForBadRequests(false);
  const Snapshot before = Take(*indexer);
  ASSERT_TRUE(SelectRows(*indexer, 1, 0, {599}).ok());
  const Snapshot after = Take(*indexer);
  EXPECT_NE(before.warmup, after.warmup);
  EXPECT_NE(before.vertical, after.vertical);
}

TEST(IndexerTest, PositionsOnlyMoveForward) {
  // A second select at the same (or an earlier) position would update the EMAs twice.
  const int H = 2, D = 8, K = 64;
  auto indexer = MakeIndexer(20, H, D);
  ASSERT_TRUE(indexer->CreateSequence(1, Options(K, 0.5)).ok());
  std::mt19937 rng(21);
  const std::vector<float> keys = RandomValues(rng, 1000 * D);
  ASSERT_TRUE(indexer->AppendIndexKeys(1, 0, keys, 1000).ok());
  ASSERT_TRUE(SelectOne(*indexer, 1, 0, RandomQuery(rng, H, D), 999).ok());
  const SpinState before = GetSpin(*indexer, 1, 0);
  EXPECT_EQ(SelectOne(*indexer, 1, 0, RandomQuery(rng, H, D), 999).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(SelectOne(*indexer, 1, 0, RandomQuery(rng, H, D), 100).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(GetSpin(*indexer, 1, 0).vertical(), before.vertical());
  EXPECT_EQ(GetSpin(*indexer, 1, 0).diagonal(), before.diagonal());
}

TEST(IndexerTest, SpeculativeStepInModelOrderEqualsAllKeysFirst) {
  // A model computes layer 1's draft keys after layer 0's selection: append L0, select L0, append
  // L1, select L1, commit. The answers and the committed state equal appending every layer first.
  const int H = 2, D = 8, K = 64, kRows = 3;
  std::mt19937 rng(22);
  std::vector<std::vector<float>> keys = {RandomValues(rng, 1003 * D), RandomValues(rng, 1003 * D)};
  std::vector<Query> queries;
  for (int i = 0; i < 2 * kRows; ++i) queries.push_back(RandomQuery(rng, H, D));
  auto rows_of = [&](int layer) {
    std::vector<IndexerRow> rows;
    for (int r = 0; r < kRows; ++r) {
      const Query& q = queries[layer * kRows + r];
      rows.push_back({q.query, q.weights, 1000 + r});
    }
    return rows;
  };
  auto drafts = [&](int layer) {
    return std::span<const float>(keys[layer].data() + 1000 * D, kRows * D);
  };
  // Identical states before the step: the same prefill and the same warm-up query on both.
  auto model_order = MakeIndexer(80, H, D);
  auto keys_first = MakeIndexer(80, H, D);
  for (Indexer* indexer : {model_order.get(), keys_first.get()}) {
    ASSERT_TRUE(indexer->CreateSequence(1, Options(K, 0.5, true, 2)).ok());
    for (int layer = 0; layer < 2; ++layer) {
      ASSERT_TRUE(indexer
                      ->AppendIndexKeys(1, layer,
                                        std::span<const float>(keys[layer].data(), 1000 * D), 1000)
                      .ok());
      ASSERT_TRUE(SelectOne(*indexer, 1, layer, queries[0], 999).ok());  // warm-up
    }
  }
  std::vector<absl::StatusOr<SelectResult>> in_model_order, with_keys_first;
  for (int layer = 0; layer < 2; ++layer) {
    ASSERT_TRUE(model_order->AppendIndexKeys(1, layer, drafts(layer), kRows).ok());
    const auto rows = rows_of(layer);
    in_model_order.push_back(model_order->Select(1, layer, rows));
    ASSERT_TRUE(in_model_order.back().ok()) << in_model_order.back().status();
  }
  for (int layer = 0; layer < 2; ++layer) {
    ASSERT_TRUE(keys_first->AppendIndexKeys(1, layer, drafts(layer), kRows).ok());
  }
  for (int layer = 0; layer < 2; ++layer) {
    const auto rows = rows_of(layer);
    with_keys_first.push_back(keys_first->Select(1, layer, rows));
    ASSERT_TRUE(with_keys_first.back().ok());
  }
  for (int layer = 0; layer < 2; ++layer) {
    EXPECT_EQ(in_model_order[layer]->selections, with_keys_first[layer]->selections) << layer;
    EXPECT_EQ(in_model_order[layer]->blocks, with_keys_first[layer]->blocks) << layer;
  }
  ASSERT_TRUE(model_order->Commit(1, 1).ok());
  ASSERT_TRUE(keys_first->Commit(1, 1).ok());
  for (int layer = 0; layer < 2; ++layer) {
    EXPECT_EQ(*model_order->NumSlots(1, layer), 1002);  // t + a + 1 = 1000 + 1 + 1
    EXPECT_EQ(GetSpin(*model_order, 1, layer).vertical(),
              GetSpin(*keys_first, 1, layer).vertical());
    EXPECT_EQ(GetSpin(*model_order, 1, layer).diagonal(),
              GetSpin(*keys_first, 1, layer).diagonal());
  }
}

TEST(IndexerTest, AuditedSelectsReportTheMissRateAgainstTheDenseTopKAndChangeNothing) {
  // audit_fraction = 1: every pruned select is audited. The audited miss rate equals the one
  // computed from an all-keep twin sequence's selection (the dense top-K of the same row), the
  // warm-up (all blocks scored) is not audited, and the EMAs equal an engine without the audit.
  const int H = 2, D = 8, K = 64;
  IndexerOptions options{.capacity_blocks = 120, .num_heads = H, .head_dim = D};
  auto plain = *Indexer::Create(options);
  options.audit_fraction = 1.0;
  options.audit_seed = 5;
  auto audited = *Indexer::Create(options);
  std::mt19937 rng(23);
  const std::vector<float> keys = RandomValues(rng, 2010 * D);
  for (Indexer* x : {plain.get(), audited.get()}) {
    ASSERT_TRUE(x->CreateSequence(1, Options(K, 0.6, true, 1, 0.0)).ok());
    ASSERT_TRUE(x->CreateSequence(2, Options(K, 0.6, /*enabled=*/false)).ok());
    for (uint64_t id : {1, 2}) {
      ASSERT_TRUE(
          x->AppendIndexKeys(id, 0, std::span<const float>(keys.data(), 2000 * D), 2000).ok());
    }
  }
  int audited_steps = 0;
  double total_miss = 0;
  for (int64_t t = 1999; t < 2009; ++t) {
    if (t > 1999) {
      for (Indexer* x : {plain.get(), audited.get()}) {
        for (uint64_t id : {1, 2}) {
          ASSERT_TRUE(
              x->AppendIndexKeys(id, 0, std::span<const float>(keys.data() + t * D, D), 1).ok());
        }
      }
    }
    const Query q = RandomQuery(rng, H, D);
    auto a = SelectOne(*audited, 1, 0, q, t, false);
    auto p = SelectOne(*plain, 1, 0, q, t, false);
    auto dense = SelectOne(*audited, 2, 0, q, t, false);
    ASSERT_TRUE(a.ok() && p.ok() && dense.ok());
    EXPECT_EQ(a->selections, p->selections);
    EXPECT_TRUE(p->audit_miss_rates.empty());
    if (a->all_blocks) {
      EXPECT_TRUE(a->audit_miss_rates.empty()) << "warm-up at " << t;
      continue;
    }
    ++audited_steps;
    ASSERT_EQ(a->audit_miss_rates.size(), 1u);
    EXPECT_DOUBLE_EQ(a->audit_miss_rates[0], SelectionMissRate(a->selections, dense->selections));
    total_miss += a->audit_miss_rates[0];
  }
  EXPECT_EQ(audited_steps, 9);
  EXPECT_GT(total_miss, 0.0);  // rho = 0.6 on random keys loses some of the dense top-K
  EXPECT_EQ(GetSpin(*audited, 1, 0).vertical(), GetSpin(*plain, 1, 0).vertical());
  EXPECT_EQ(GetSpin(*audited, 1, 0).diagonal(), GetSpin(*plain, 1, 0).diagonal());
}

// Adaptive sparsity (sparsity_controller.h): each select plans with the rho the controller left
// after the selects before it, replayed here from their audited miss rates; a target that audits
// always exceed moves rho down, one they never reach moves it up, and at rho 0 a select over more
// than K slots counts as a miss of 0. The indexer's default target applies to a sequence that
// names none.
TEST(IndexerTest, AMissTargetMovesEachSequencesRhoFromItsAuditedMissRates) {
  const int H = 2, D = 8, K = 64;
  IndexerOptions options{.capacity_blocks = 160, .num_heads = H, .head_dim = D};
  options.audit_fraction = 1.0;
  options.miss_target = 0.99;  // for sequence 4, which names none: audits never exceed it
  auto indexer = *Indexer::Create(options);
  SequenceOptions strict = Options(K, 0.6, true, 1, 0.0);
  strict.spin.miss_target = 0.001;
  SequenceOptions loose = Options(K, 0.2, true, 1, 0.0);
  loose.spin.miss_target = 0.99;
  SequenceOptions from_zero = Options(K, 0.0, true, 1, 0.0);
  from_zero.spin.miss_target = 0.5;
  const SequenceOptions by_default = Options(K, 0.3, true, 1, 0.0);
  std::mt19937 rng(29);
  const std::vector<float> keys = RandomValues(rng, 2010 * D);
  const std::vector<std::pair<uint64_t, SequenceOptions>> sequences = {
      {1, strict}, {2, loose}, {3, from_zero}, {4, by_default}};
  for (const auto& [id, o] : sequences) {
    ASSERT_TRUE(indexer->CreateSequence(id, o).ok());
    ASSERT_TRUE(
        indexer->AppendIndexKeys(id, 0, std::span<const float>(keys.data(), 2000 * D), 2000).ok());
  }
  std::map<uint64_t, double> rho = {{1, 0.6}, {2, 0.2}, {3, 0.0}, {4, 0.3}};
  const std::map<uint64_t, double> target = {{1, 0.001}, {2, 0.99}, {3, 0.5}, {4, 0.99}};
  int strict_misses = 0;
  for (int64_t t = 1999; t < 2009; ++t) {
    const Query q = RandomQuery(rng, H, D);
    for (const auto& [id, o] : sequences) {
      if (t > 1999) {
        ASSERT_TRUE(
            indexer->AppendIndexKeys(id, 0, std::span<const float>(keys.data() + t * D, D), 1)
                .ok());
      }
      auto result = SelectOne(*indexer, id, 0, q, t, false);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_NEAR(result->target_block_sparsity, rho[id], 1e-12) << id << " at " << t;
      EXPECT_TRUE(result->spin);
      if (!result->all_blocks) {
        // SPIN planned with that rho: m_t blocks (gamma 0).
        EXPECT_EQ(result->blocks_scored,
                  SpinState::BlockBudget(result->blocks_visible, K, rho[id]));
      }
      if (!result->audit_miss_rates.empty()) {
        const double miss = result->audit_miss_rates[0];
        if (id == 1 && miss > target.at(1)) ++strict_misses;
        rho[id] = NextTargetSparsity(rho[id], miss, target.at(id));
      } else if (result->all_blocks && rho[id] == 0) {
        rho[id] = NextTargetSparsity(rho[id], 0.0, target.at(id));
      }
    }
  }
  EXPECT_GE(strict_misses, 3);                 // random keys: a strict target is missed often...
  EXPECT_LT(rho[1], 0.6 - 0.05 * 2);           // ...and rho came down
  EXPECT_NEAR(rho[2], 0.2 + 0.01 * 9, 1e-12);  // 9 audited selects after the warm-up, all below
  EXPECT_GT(rho[3], 0.0);                      // rose from 0
  EXPECT_NEAR(rho[4], 0.3 + 0.01 * 9, 1e-12);  // the indexer's default target
}

TEST(IndexerTest, AMissTargetWithoutAuditsIsRefused) {
  IndexerOptions options{.capacity_blocks = 4, .num_heads = 2, .head_dim = 4};
  options.miss_target = 0.05;
  const auto unaudited = Indexer::Create(options);
  EXPECT_EQ(unaudited.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unaudited.status().message().find("audit_fraction"), std::string::npos);
  options.miss_target = 1.0;
  options.audit_fraction = 0.5;
  EXPECT_EQ(Indexer::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.miss_target = 0;
  options.audit_fraction = 0;
  auto indexer = *Indexer::Create(options);
  SequenceOptions sequence = Options(64, 0.4);
  sequence.spin.miss_target = 0.05;
  const absl::Status refused = indexer->CreateSequence(1, sequence);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("--audit-fraction"), std::string::npos) << refused;
  sequence.spin.miss_target = 1.5;
  const absl::Status out_of_range = indexer->CreateSequence(1, sequence);
  EXPECT_EQ(out_of_range.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(out_of_range.message().find("miss target"), std::string::npos) << out_of_range;
  // All-keep needs no audits: its target is moot.
  SequenceOptions all_keep = Options(64, 0.4, /*enabled=*/false);
  all_keep.spin.miss_target = 0.05;
  EXPECT_TRUE(indexer->CreateSequence(2, all_keep).ok());
}

TEST(SparsityControllerTest, StepsDownAboveTheTargetAndUpOtherwiseWithinItsBounds) {
  EXPECT_NEAR(NextTargetSparsity(0.4, 0.10, 0.05), 0.4 - kSparsityDecrease, 1e-12);
  EXPECT_NEAR(NextTargetSparsity(0.4, 0.05, 0.05), 0.4 + kSparsityIncrease, 1e-12);  // at: up
  EXPECT_NEAR(NextTargetSparsity(0.4, 0.0, 0.05), 0.41, 1e-12);
  EXPECT_EQ(NextTargetSparsity(0.02, 0.9, 0.05), 0.0);
  EXPECT_EQ(NextTargetSparsity(kMaxAdaptiveSparsity, 0.0, 0.05), kMaxAdaptiveSparsity);
}

TEST(IndexerTest, AuditFractionOutsideTheUnitIntervalIsRefused) {
  for (double fraction : {-0.1, 1.5, std::nan("")}) {
    IndexerOptions options{.capacity_blocks = 4, .num_heads = 2, .head_dim = 4};
    options.audit_fraction = fraction;
    EXPECT_EQ(Indexer::Create(options).status().code(), StatusCode::kInvalidArgument) << fraction;
  }
}

}  // namespace
}  // namespace dsa
