// Tests of the prefix block ids of token ids (coordinator/token_blocks.h): equal prefixes share,
// a one-token change changes its block's id and every later one, and the ids are a fixed function
// (values pinned from Python's hashlib: a change of the algorithm must be deliberate).
#include "coordinator/token_blocks.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace dsa {
namespace {

std::vector<int32_t> Tokens(int count, int32_t seed) {
  std::vector<int32_t> tokens(count);
  for (int i = 0; i < count; ++i) tokens[i] = (seed + i * 7919) % 49152;
  return tokens;
}

TEST(TokenBlocksTest, OneIdPerWhole512TokenBlock) {
  EXPECT_TRUE(PrefixBlockIdsOfTokens(Tokens(511, 1)).empty());
  EXPECT_EQ(PrefixBlockIdsOfTokens(Tokens(512, 1)).size(), 1u);
  EXPECT_EQ(PrefixBlockIdsOfTokens(Tokens(1535, 1)).size(), 2u);
  EXPECT_EQ(PrefixBlockIdsOfTokens(Tokens(1536, 1)).size(), 3u);
}

TEST(TokenBlocksTest, EqualPrefixesShareAndTheTailDoesNotMatter) {
  std::vector<int32_t> a = Tokens(1300, 5);
  std::vector<int32_t> b = a;
  b.resize(1100);
  b.push_back(3);  // differs after the second whole block
  const std::vector<uint64_t> ids_a = PrefixBlockIdsOfTokens(a);
  const std::vector<uint64_t> ids_b = PrefixBlockIdsOfTokens(b);
  ASSERT_EQ(ids_a.size(), 2u);
  EXPECT_EQ(ids_a, ids_b);
  EXPECT_NE(ids_a[0], ids_a[1]);
}

TEST(TokenBlocksTest, AOneTokenChangeInBlockZeroChangesEveryId) {
  const std::vector<int32_t> a = Tokens(2048, 9);
  std::vector<int32_t> b = a;
  b[300] += 1;
  const std::vector<uint64_t> ids_a = PrefixBlockIdsOfTokens(a);
  const std::vector<uint64_t> ids_b = PrefixBlockIdsOfTokens(b);
  ASSERT_EQ(ids_a.size(), 4u);
  for (size_t j = 0; j < ids_a.size(); ++j) EXPECT_NE(ids_a[j], ids_b[j]) << j;
  // A change in block 2 keeps blocks 0 and 1 (the chain is a prefix's, not a block's alone).
  std::vector<int32_t> c = a;
  c[1100] = 0;
  const std::vector<uint64_t> ids_c = PrefixBlockIdsOfTokens(c);
  EXPECT_EQ(ids_c[0], ids_a[0]);
  EXPECT_EQ(ids_c[1], ids_a[1]);
  EXPECT_NE(ids_c[2], ids_a[2]);
  EXPECT_NE(ids_c[3], ids_a[3]);
}

TEST(TokenBlocksTest, ABlockEqualToAnotherAtAnotherPositionGetsAnotherId) {
  // Two equal blocks in a row: the second's id has the first's as its parent.
  std::vector<int32_t> tokens = Tokens(512, 4);
  tokens.insert(tokens.end(), tokens.begin(), tokens.end());
  const std::vector<uint64_t> ids = PrefixBlockIdsOfTokens(tokens);
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_NE(ids[0], ids[1]);
}

TEST(TokenBlocksTest, TheIdsAreAFixedFunctionOfTheTokens) {
  // SHA-256 of 8 zero bytes and 512 zero tokens (2,056 zero bytes), first 8 bytes little-endian;
  // then of that id and 512 more zeros. Pinned: the ids must not change between builds, processes
  // or machines.
  const std::vector<uint64_t> ids = PrefixBlockIdsOfTokens(std::vector<int32_t>(1024, 0));
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(ids, PrefixBlockIdsOfTokens(std::vector<int32_t>(1024, 0)));
  // Computed independently with Python's hashlib.
  EXPECT_EQ(ids[0], 0x0a5caac16d69fed5ull);
  EXPECT_EQ(ids[1], 0xf3fa3c9bf918296cull);
}

}  // namespace
}  // namespace dsa
