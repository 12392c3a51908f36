// Tests of the indexer engine (indexer_service/indexer.h; DESIGN.md 4 and 5): creation, selections
// against a naive reference (quantize + decode + triple loop, full-sort top-K), SPIN through the
// engine (rho = 0 equals all-keep, EMAs change only for scored slots), and deferred speculative
// updates replayed on Commit. The DSA edge cases are in indexer_edge_cases_test.cc, bad requests
// and audits in indexer_requests_test.cc.
#include "indexer_service/indexer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/indexer_service/indexer_test_helpers.h"

namespace dsa::indexer_test {
namespace {

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

}  // namespace
}  // namespace dsa::indexer_test
