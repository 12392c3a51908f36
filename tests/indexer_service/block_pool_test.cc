// Tests of the block pool and the paged index-key cache (indexer_service/block_pool.h,
// index_key_cache.h; DESIGN.md 4.1). Expected codes, scales, block ids and reference counts are
// worked out by hand in the comments; the byte layout is read straight from the pool memory.
#include "indexer_service/block_pool.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "indexer_service/index_key_cache.h"

namespace dsa {
namespace {

using ::absl::StatusCode;

// ---------------------------------------------------------------------------------------------
// BlockPool

TEST(BlockPoolTest, SizesFollowTheLayout) {
  BlockPool pool(3, 4);
  EXPECT_EQ(pool.capacity_blocks(), 3);
  EXPECT_EQ(pool.free_blocks(), 3);
  EXPECT_EQ(pool.used_blocks(), 0);
  EXPECT_EQ(pool.head_dim(), 4);
  EXPECT_EQ(pool.block_bytes(), 64u * (4 + 4));  // 64 x 4 fp8 codes + 64 fp32 scales = 512
  // Block b starts b * block_bytes into the storage; its scales follow its 64 x D codes.
  EXPECT_EQ(pool.keys(1) - pool.keys(0), 512);
  EXPECT_EQ(pool.keys(2) - pool.keys(0), 1024);
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(pool.scales(1)) - pool.keys(1), 64 * 4);

  BlockPool deepseek(1, 128);
  EXPECT_EQ(deepseek.block_bytes(), 64u * 132u);  // 132 bytes a slot at D = 128
}

TEST(BlockPoolTest, AllocateReleaseAndReferenceCounts) {
  BlockPool pool(3, 4);
  auto first = pool.Allocate(2);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(*first, (std::vector<int32_t>{0, 1}));  // lowest ids first
  EXPECT_EQ(pool.ref_count(0), 1);
  EXPECT_EQ(pool.ref_count(1), 1);
  EXPECT_EQ(pool.ref_count(2), 0);
  EXPECT_EQ(pool.free_blocks(), 1);
  EXPECT_EQ(pool.used_blocks(), 2);

  // All or none: two blocks are not there, so nothing changes.
  auto too_many = pool.Allocate(2);
  EXPECT_EQ(too_many.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.free_blocks(), 1);
  EXPECT_EQ(pool.ref_count(2), 0);

  auto empty = pool.Allocate(0);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
  EXPECT_EQ(pool.free_blocks(), 1);

  pool.Retain(1);
  EXPECT_EQ(pool.ref_count(1), 2);
  pool.Release(1);
  EXPECT_EQ(pool.ref_count(1), 1);
  EXPECT_EQ(pool.free_blocks(), 1);  // still referenced
  pool.Release(1);
  EXPECT_EQ(pool.ref_count(1), 0);
  EXPECT_EQ(pool.free_blocks(), 2);

  auto again = pool.Allocate(2);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(pool.free_blocks(), 0);
  EXPECT_EQ(pool.Allocate(1).status().code(), StatusCode::kResourceExhausted);
}

TEST(BlockPoolTest, AllocateTakesLowestIdsAfterOutOfOrderReleases) {
  // The header promises "lowest ids first" whatever order blocks came back in.
  BlockPool pool(5, 4);
  ASSERT_TRUE(pool.Allocate(5).ok());
  pool.Release(1);
  pool.Release(3);
  pool.Release(0);
  auto one = pool.Allocate(1);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(*one, (std::vector<int32_t>{0}));
  auto two = pool.Allocate(2);
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(*two, (std::vector<int32_t>{1, 3}));
}

// ---------------------------------------------------------------------------------------------
// IndexKeyCache

constexpr int kDim = 4;

// Hand-quantized key patterns (D = 4). For a factor f (a power of two):
//   pattern 0: f * [3.5, 1, -0.5, 0.25]: amax = 3.5 f, scale = 3.5 f / 448 = f / 128 (exact);
//              key / scale = [448, 128, -64, 32] -> E4M3 codes [0x7e, 0x70, 0xe8, 0x60].
//   pattern 1: f * [448, 3, 17, -1]: scale = f; key / scale = [448, 3, 17, -1] -> codes
//              [0x7e, 0x44, 0x58 (17 is a tie between 16 and 18: even mantissa -> 16), 0xb8].
//   pattern 2: all zero: scale 0, codes 0.
struct HandKey {
  float values[kDim];
  float scale;
  uint8_t codes[kDim];
};

HandKey KeyForSlot(int64_t slot) {
  const float f = static_cast<float>(1 << ((slot / 3) % 4));  // 1, 2, 4, 8
  switch (slot % 3) {
    case 0:
      return {{3.5f * f, 1.0f * f, -0.5f * f, 0.25f * f}, f / 128.0f, {0x7e, 0x70, 0xe8, 0x60}};
    case 1:
      return {{448.0f * f, 3.0f * f, 17.0f * f, -1.0f * f}, f, {0x7e, 0x44, 0x58, 0xb8}};
    default:
      return {{0.0f, 0.0f, 0.0f, 0.0f}, 0.0f, {0, 0, 0, 0}};
  }
}

std::vector<float> HandKeys(int64_t first_slot, int64_t count) {
  std::vector<float> keys;
  for (int64_t s = first_slot; s < first_slot + count; ++s) {
    const HandKey k = KeyForSlot(s);
    keys.insert(keys.end(), k.values, k.values + kDim);
  }
  return keys;
}

// Reads slot `slot` of a (sequence, layer) straight from the pool bytes at the DESIGN.md 4.1
// layout: block base + (slot % 64) * D for the codes, base + 64 * D + 4 * (slot % 64) for the
// scale.
void ExpectSlotHolds(const KeyCacheView& view, int64_t slot, const HandKey& expected) {
  const int32_t block = view.block_table[slot / 64];
  const uint8_t* base = view.pool->keys(0) + view.pool->block_bytes() * block;
  const int64_t offset = slot % 64;
  for (int d = 0; d < kDim; ++d) {
    EXPECT_EQ(base[offset * kDim + d], expected.codes[d]) << "slot " << slot << " dim " << d;
  }
  float scale;
  std::memcpy(&scale, base + 64 * kDim + 4 * offset, sizeof(float));
  EXPECT_EQ(scale, expected.scale) << "slot " << slot;
}

IndexKeyCache MakeCache(int64_t capacity_blocks) {
  auto cache = IndexKeyCache::Create(capacity_blocks, kDim);
  EXPECT_TRUE(cache.ok()) << cache.status();
  return std::move(*cache);
}

TEST(IndexKeyCacheTest, CreateValidatesArguments) {
  EXPECT_EQ(IndexKeyCache::Create(-1, 4).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(IndexKeyCache::Create(4, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(IndexKeyCache::Create(4, 1025).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(IndexKeyCache::Create(0, 1).ok());
  EXPECT_TRUE(IndexKeyCache::Create(1, 1024).ok());
}

TEST(IndexKeyCacheTest, AddSequenceErrors) {
  IndexKeyCache cache = MakeCache(4);
  ASSERT_TRUE(cache.AddSequence(7, 2).ok());
  EXPECT_TRUE(cache.Contains(7));
  EXPECT_EQ(cache.AddSequence(7, 2).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(cache.AddSequence(8, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(cache.Contains(8));
  EXPECT_EQ(*cache.NumSlots(7, 0), 0);
  EXPECT_EQ(*cache.NumSlots(7, 1), 0);
  EXPECT_EQ(cache.NumSlots(7, 2).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.NumSlots(9, 0).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(cache.View(9, 0).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(cache.View(7, -1).status().code(), StatusCode::kInvalidArgument);
}

TEST(IndexKeyCacheTest, AppendQuantizesIntoTheBlockLayoutAcrossABoundary) {
  IndexKeyCache cache = MakeCache(4);
  ASSERT_TRUE(cache.AddSequence(1, 1).ok());
  // 60 keys, then 10 more: slots 60..63 fill block 0, 64..69 open block 1.
  ASSERT_TRUE(cache.Append(1, 0, HandKeys(0, 60), 60).ok());
  EXPECT_EQ(cache.Usage().used_blocks, 1);
  ASSERT_TRUE(cache.Append(1, 0, HandKeys(60, 10), 10).ok());
  EXPECT_EQ(*cache.NumSlots(1, 0), 70);
  auto view = cache.View(1, 0);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->num_slots, 70);
  ASSERT_EQ(view->block_table.size(), 2u);
  EXPECT_EQ(view->block_table[0], 0);
  EXPECT_EQ(view->block_table[1], 1);
  for (int64_t s = 0; s < 70; ++s) ExpectSlotHolds(*view, s, KeyForSlot(s));
  const CacheUsage usage = cache.Usage();
  EXPECT_EQ(usage.capacity_blocks, 4);
  EXPECT_EQ(usage.used_blocks, 2);
  EXPECT_EQ(usage.free_blocks, 2);
  EXPECT_EQ(usage.shared_blocks, 0);
}

TEST(IndexKeyCacheTest, AppendOfEveryBoundaryAlignment) {
  // Appends of 1, 63, 64, 65 and 129 keys, each starting where the last ended.
  IndexKeyCache cache = MakeCache(8);
  ASSERT_TRUE(cache.AddSequence(1, 1).ok());
  int64_t slots = 0;
  for (int64_t n : {1, 63, 64, 65, 129}) {
    ASSERT_TRUE(cache.Append(1, 0, HandKeys(slots, n), n).ok());
    slots += n;
    EXPECT_EQ(cache.Usage().used_blocks, (slots + 63) / 64) << "after " << slots << " slots";
  }
  EXPECT_EQ(slots, 322);
  auto view = cache.View(1, 0);
  ASSERT_TRUE(view.ok());
  ASSERT_EQ(view->block_table.size(), 6u);
  for (int64_t s = 0; s < slots; ++s) ExpectSlotHolds(*view, s, KeyForSlot(s));
}

TEST(IndexKeyCacheTest, LayersAreIndependent) {
  IndexKeyCache cache = MakeCache(4);
  ASSERT_TRUE(cache.AddSequence(1, 2).ok());
  ASSERT_TRUE(cache.Append(1, 1, HandKeys(0, 5), 5).ok());
  EXPECT_EQ(*cache.NumSlots(1, 0), 0);
  EXPECT_EQ(*cache.NumSlots(1, 1), 5);
  ASSERT_TRUE(cache.Append(1, 0, HandKeys(0, 3), 3).ok());
  EXPECT_EQ(cache.View(1, 0)->block_table[0], 1);  // layer 1 took block 0 first
  EXPECT_EQ(cache.Usage().used_blocks, 2);
}

TEST(IndexKeyCacheTest, BadAppendsChangeNothing) {
  IndexKeyCache cache = MakeCache(4);
  ASSERT_TRUE(cache.AddSequence(1, 1).ok());
  ASSERT_TRUE(cache.Append(1, 0, HandKeys(0, 10), 10).ok());
  std::vector<float> nan_keys = HandKeys(10, 3);
  nan_keys[5] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> inf_keys = HandKeys(10, 3);
  inf_keys[11] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(cache.Append(1, 0, nan_keys, 3).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Append(1, 0, inf_keys, 3).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Append(1, 0, HandKeys(10, 3), 4).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Append(1, 1, HandKeys(10, 3), 3).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Append(2, 0, HandKeys(10, 3), 3).code(), StatusCode::kNotFound);
  EXPECT_EQ(*cache.NumSlots(1, 0), 10);
  EXPECT_EQ(cache.Usage().used_blocks, 1);
  // A good append lands at slot 10, so nothing of the bad ones was written.
  ASSERT_TRUE(cache.Append(1, 0, HandKeys(10, 3), 3).ok());
  auto view = cache.View(1, 0);
  for (int64_t s = 0; s < 13; ++s) ExpectSlotHolds(*view, s, KeyForSlot(s));
}

TEST(IndexKeyCacheTest, FullPoolIsResourceExhaustedWithNothingHalfWritten) {
  IndexKeyCache cache = MakeCache(3);
  ASSERT_TRUE(cache.AddSequence(1, 1).ok());
  ASSERT_TRUE(cache.Append(1, 0, HandKeys(0, 100), 100).ok());  // blocks 0, 1 (36 slots in 1)
  const KeyCacheView before_view = *cache.View(1, 0);
  const size_t pool_bytes = before_view.pool->block_bytes() * 3;
  const std::vector<uint8_t> before_bytes(before_view.pool->keys(0),
                                          before_view.pool->keys(0) + pool_bytes);
  const CacheUsage before = cache.Usage();
  EXPECT_EQ(cache.BlocksNeeded(1, 0, 100), 2);  // ceil(200 / 64) - 2

  // 100 more keys need blocks 2 and 3 but only one is free: nothing may be written, not even the
  // 28 free slots of block 1.
  EXPECT_EQ(cache.Append(1, 0, HandKeys(100, 100), 100).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(*cache.NumSlots(1, 0), 100);
  const CacheUsage after = cache.Usage();
  EXPECT_EQ(after.used_blocks, before.used_blocks);
  EXPECT_EQ(after.free_blocks, before.free_blocks);
  EXPECT_EQ(after.shared_blocks, before.shared_blocks);
  EXPECT_EQ(cache.View(1, 0)->block_table.size(), 2u);
  const std::vector<uint8_t> after_bytes(before_view.pool->keys(0),
                                         before_view.pool->keys(0) + pool_bytes);
  EXPECT_TRUE(before_bytes == after_bytes) << "the pool memory changed on a failed append";

  // A smaller append that fits (one more block) succeeds and lands at slot 100.
  ASSERT_TRUE(cache.Append(1, 0, HandKeys(100, 50), 50).ok());
  EXPECT_EQ(*cache.NumSlots(1, 0), 150);
  EXPECT_EQ(cache.Usage().free_blocks, 0);
  auto view = cache.View(1, 0);
  for (int64_t s = 0; s < 150; ++s) ExpectSlotHolds(*view, s, KeyForSlot(s));
  // Now the pool is full: even one key more past slot 191 fails, but slots up to 191 still fit.
  ASSERT_TRUE(cache.Append(1, 0, HandKeys(150, 42), 42).ok());
  EXPECT_EQ(cache.Append(1, 0, HandKeys(192, 1), 1).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(*cache.NumSlots(1, 0), 192);
}

TEST(IndexKeyCacheTest, BlocksNeededByHand) {
  IndexKeyCache cache = MakeCache(8);
  ASSERT_TRUE(cache.AddSequence(1, 1).ok());
  EXPECT_EQ(cache.BlocksNeeded(1, 0, 0), 0);
  EXPECT_EQ(cache.BlocksNeeded(1, 0, 1), 1);
  EXPECT_EQ(cache.BlocksNeeded(1, 0, 64), 1);
  EXPECT_EQ(cache.BlocksNeeded(1, 0, 65), 2);
  ASSERT_TRUE(cache.Append(1, 0, HandKeys(0, 70), 70).ok());
  EXPECT_EQ(cache.BlocksNeeded(1, 0, 58), 0);  // fits in block 1
  EXPECT_EQ(cache.BlocksNeeded(1, 0, 59), 1);
  EXPECT_EQ(cache.BlocksNeeded(2, 0, 10), 0);  // bad id
  EXPECT_EQ(cache.BlocksNeeded(1, 3, 10), 0);  // bad layer
}

TEST(IndexKeyCacheTest, PrefixSharingSharesBlocksWithoutCopy) {
  IndexKeyCache cache = MakeCache(6);
  ASSERT_TRUE(cache.AddSequence(1, 1).ok());
  ASSERT_TRUE(cache.Append(1, 0, HandKeys(0, 130), 130).ok());  // blocks 0, 1, 2
  ASSERT_TRUE(cache.AddSequenceWithPrefix(2, 1, 1, 128).ok());
  auto view2 = cache.View(2, 0);
  ASSERT_TRUE(view2.ok());
  EXPECT_EQ(view2->num_slots, 128);
  ASSERT_EQ(view2->block_table.size(), 2u);
  EXPECT_EQ(view2->block_table[0], 0);
  EXPECT_EQ(view2->block_table[1], 1);
  CacheUsage usage = cache.Usage();
  EXPECT_EQ(usage.used_blocks, 3);  // a shared block counts once
  EXPECT_EQ(usage.shared_blocks, 2);
  EXPECT_EQ(usage.free_blocks, 3);

  // Sequence 2 appends past its full last block: a new block (3), no copy.
  ASSERT_TRUE(cache.Append(2, 0, HandKeys(500, 10), 10).ok());
  view2 = cache.View(2, 0);
  ASSERT_EQ(view2->block_table.size(), 3u);
  EXPECT_EQ(view2->block_table[2], 3);
  for (int64_t s = 0; s < 128; ++s) ExpectSlotHolds(*view2, s, KeyForSlot(s));
  for (int64_t s = 128; s < 138; ++s) ExpectSlotHolds(*view2, s, KeyForSlot(500 + s - 128));
  auto view1 = cache.View(1, 0);
  for (int64_t s = 0; s < 130; ++s) ExpectSlotHolds(*view1, s, KeyForSlot(s));
  EXPECT_EQ(cache.Usage().used_blocks, 4);

  // Removing the source keeps the shared blocks alive for sequence 2; block 2 is freed.
  ASSERT_TRUE(cache.RemoveSequence(1).ok());
  usage = cache.Usage();
  EXPECT_EQ(usage.used_blocks, 3);
  EXPECT_EQ(usage.shared_blocks, 0);
  view2 = cache.View(2, 0);
  for (int64_t s = 0; s < 128; ++s) ExpectSlotHolds(*view2, s, KeyForSlot(s));
  ASSERT_TRUE(cache.RemoveSequence(2).ok());
  EXPECT_EQ(cache.Usage().used_blocks, 0);
  EXPECT_EQ(cache.RemoveSequence(2).code(), StatusCode::kNotFound);
}

TEST(IndexKeyCacheTest, PrefixErrors) {
  IndexKeyCache cache = MakeCache(6);
  ASSERT_TRUE(cache.AddSequence(1, 2).ok());
  ASSERT_TRUE(cache.Append(1, 0, HandKeys(0, 130), 130).ok());
  ASSERT_TRUE(cache.Append(1, 1, HandKeys(0, 64), 64).ok());
  const CacheUsage before = cache.Usage();
  EXPECT_EQ(cache.AddSequenceWithPrefix(2, 2, 9, 64).code(), StatusCode::kNotFound);
  EXPECT_EQ(cache.AddSequenceWithPrefix(1, 2, 1, 64).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(cache.AddSequenceWithPrefix(2, 1, 1, 64).code(),
            StatusCode::kInvalidArgument);  // layers
  EXPECT_EQ(cache.AddSequenceWithPrefix(2, 2, 1, 100).code(),
            StatusCode::kInvalidArgument);  // multiple
  EXPECT_EQ(cache.AddSequenceWithPrefix(2, 2, 1, 128).code(),
            StatusCode::kInvalidArgument);  // layer 1 has 64
  EXPECT_EQ(cache.AddSequenceWithPrefix(2, 2, 1, -64).code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(cache.Contains(2));
  const CacheUsage after = cache.Usage();
  EXPECT_EQ(after.used_blocks, before.used_blocks);
  EXPECT_EQ(after.shared_blocks, before.shared_blocks);
  ASSERT_TRUE(cache.AddSequenceWithPrefix(2, 2, 1, 64).ok());
  EXPECT_EQ(cache.Usage().shared_blocks, 2);  // block 0 of each layer
}

TEST(IndexKeyCacheTest, CopyOnWriteOfASharedPartialBlock) {
  IndexKeyCache cache = MakeCache(6);
  ASSERT_TRUE(cache.AddSequence(1, 1).ok());
  ASSERT_TRUE(cache.Append(1, 0, HandKeys(0, 130), 130).ok());  // blocks 0, 1, 2
  ASSERT_TRUE(cache.AddSequenceWithPrefix(2, 1, 1, 128).ok());
  // Sequence 2 drops back into block 1 (still shared with sequence 1).
  ASSERT_TRUE(cache.Truncate(2, 0, 100).ok());
  EXPECT_EQ(cache.Usage().shared_blocks, 2);
  EXPECT_EQ(cache.BlocksNeeded(2, 0, 5), 1);  // the copy
  // Its append must copy block 1 into a fresh block (3) before writing slots 100..104.
  ASSERT_TRUE(cache.Append(2, 0, HandKeys(1000, 5), 5).ok());
  auto view2 = cache.View(2, 0);
  ASSERT_EQ(view2->block_table.size(), 2u);
  EXPECT_EQ(view2->block_table[0], 0);
  EXPECT_EQ(view2->block_table[1], 3);
  EXPECT_EQ(view2->num_slots, 105);
  for (int64_t s = 0; s < 100; ++s) ExpectSlotHolds(*view2, s, KeyForSlot(s));
  for (int64_t s = 100; s < 105; ++s) ExpectSlotHolds(*view2, s, KeyForSlot(1000 + s - 100));
  // Sequence 1 still sees its own slots 100..129 in block 1.
  auto view1 = cache.View(1, 0);
  EXPECT_EQ(view1->block_table[1], 1);
  for (int64_t s = 0; s < 130; ++s) ExpectSlotHolds(*view1, s, KeyForSlot(s));
  const CacheUsage usage = cache.Usage();
  EXPECT_EQ(usage.used_blocks, 4);
  EXPECT_EQ(usage.shared_blocks, 1);  // block 0 only

  // The source writing into its shared partial block copies too: sequence 3 shares 64 slots of
  // sequence 2; sequence 2 truncates to 40 and appends.
  ASSERT_TRUE(cache.AddSequenceWithPrefix(3, 1, 2, 64).ok());
  EXPECT_EQ(cache.Usage().shared_blocks, 1);  // block 0, now with three references
  ASSERT_TRUE(cache.Truncate(2, 0, 40).ok());
  ASSERT_TRUE(cache.Append(2, 0, HandKeys(2000, 1), 1).ok());
  auto view3 = cache.View(3, 0);
  for (int64_t s = 0; s < 64; ++s) ExpectSlotHolds(*view3, s, KeyForSlot(s));
  view1 = cache.View(1, 0);
  for (int64_t s = 0; s < 130; ++s) ExpectSlotHolds(*view1, s, KeyForSlot(s));
  view2 = cache.View(2, 0);
  for (int64_t s = 0; s < 40; ++s) ExpectSlotHolds(*view2, s, KeyForSlot(s));
  ExpectSlotHolds(*view2, 40, KeyForSlot(2000));
  EXPECT_NE(view2->block_table[0], 0);
}

TEST(IndexKeyCacheTest, CopyOnWriteNeedsAFreeBlock) {
  IndexKeyCache cache = MakeCache(2);
  ASSERT_TRUE(cache.AddSequence(1, 1).ok());
  ASSERT_TRUE(cache.Append(1, 0, HandKeys(0, 100), 100).ok());  // blocks 0, 1: pool full
  ASSERT_TRUE(cache.AddSequenceWithPrefix(2, 1, 1, 64).ok());
  ASSERT_TRUE(cache.Truncate(2, 0, 10).ok());
  EXPECT_EQ(cache.Append(2, 0, HandKeys(10, 1), 1).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(*cache.NumSlots(2, 0), 10);
  EXPECT_EQ(cache.Usage().shared_blocks, 1);
  auto view1 = cache.View(1, 0);
  for (int64_t s = 0; s < 100; ++s) ExpectSlotHolds(*view1, s, KeyForSlot(s));
}

TEST(IndexKeyCacheTest, TruncateReleasesBlocks) {
  IndexKeyCache cache = MakeCache(4);
  ASSERT_TRUE(cache.AddSequence(1, 1).ok());
  ASSERT_TRUE(cache.Append(1, 0, HandKeys(0, 130), 130).ok());
  EXPECT_EQ(cache.Truncate(1, 0, 131).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(cache.Truncate(1, 0, -1).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(cache.Truncate(1, 1, 10).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Truncate(2, 0, 10).code(), StatusCode::kNotFound);
  EXPECT_EQ(*cache.NumSlots(1, 0), 130);
  ASSERT_TRUE(cache.Truncate(1, 0, 130).ok());
  EXPECT_EQ(cache.Usage().used_blocks, 3);
  ASSERT_TRUE(cache.Truncate(1, 0, 65).ok());  // still needs blocks 0 and 1
  EXPECT_EQ(cache.Usage().used_blocks, 2);
  ASSERT_TRUE(cache.Truncate(1, 0, 64).ok());
  EXPECT_EQ(cache.Usage().used_blocks, 1);
  EXPECT_EQ(cache.View(1, 0)->block_table.size(), 1u);
  // An append after the truncation writes at slot 64 again.
  ASSERT_TRUE(cache.Append(1, 0, HandKeys(300, 2), 2).ok());
  auto view = cache.View(1, 0);
  for (int64_t s = 0; s < 64; ++s) ExpectSlotHolds(*view, s, KeyForSlot(s));
  ExpectSlotHolds(*view, 64, KeyForSlot(300));
  ExpectSlotHolds(*view, 65, KeyForSlot(301));
  ASSERT_TRUE(cache.Truncate(1, 0, 0).ok());
  EXPECT_EQ(cache.Usage().used_blocks, 0);
  EXPECT_EQ(*cache.NumSlots(1, 0), 0);
}

}  // namespace
}  // namespace dsa
