// Tests of the indexer engine (indexer_service/indexer.h; DESIGN.md 4.1 and 5): the DSA edge cases
// (ReLU zeros, fewer slots than K, short contexts, pruning only above K, a context of 257 slots),
// prefix sharing, turns, a full pool, and the undo of index-key appends.
#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "indexer_service/indexer.h"
#include "tests/indexer_service/indexer_test_helpers.h"

namespace dsa::indexer_test {
namespace {

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

}  // namespace
}  // namespace dsa::indexer_test
