// Tests of the Philox4x32-10 generator and its range mappings (common/philox.h, DESIGN.md 4.2 step
// 5).
#include "common/philox.h"

#include <array>
#include <cstdint>

#include "gtest/gtest.h"

namespace dsa {
namespace {

std::array<uint32_t, 4> Words(PhiloxCounter c) { return {c.c[0], c.c[1], c.c[2], c.c[3]}; }

// Known-answer vectors of Random123 (kat_vectors, "philox4x32 10" lines). Each was also checked
// against randomgen 2.5.1's Philox(number=4, width=32), an independent implementation.
TEST(PhiloxTest, Random123KnownAnswerZeroCounterZeroKey) {
  const PhiloxCounter out = Philox4x32(PhiloxCounter{{0, 0, 0, 0}}, PhiloxKey{{0, 0}});
  EXPECT_EQ(Words(out), (std::array<uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
}

TEST(PhiloxTest, Random123KnownAnswerAllOnes) {
  const PhiloxCounter out =
      Philox4x32(PhiloxCounter{{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}},
                 PhiloxKey{{0xffffffff, 0xffffffff}});
  EXPECT_EQ(Words(out), (std::array<uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
}

TEST(PhiloxTest, Random123KnownAnswerPiDigits) {
  const PhiloxCounter out =
      Philox4x32(PhiloxCounter{{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}},
                 PhiloxKey{{0xa4093822, 0x299f31d0}});
  EXPECT_EQ(Words(out), (std::array<uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

// Further vectors generated with randomgen 2.5.1: Philox(number=4, width=32, counter=C - 1, key=K)
// .random_raw(4) (randomgen increments the 128-bit counter, word 0 lowest, before each block).
TEST(PhiloxTest, RandomgenVectors) {
  EXPECT_EQ(Words(Philox4x32(PhiloxCounter{{1, 2, 3, 4}}, PhiloxKey{{5, 6}})),
            (std::array<uint32_t, 4>{0xc0c839bc, 0x889c87c5, 0x61986739, 0x2d4623d0}));
  EXPECT_EQ(Words(Philox4x32(PhiloxCounter{{0x80000000, 0, 0x7fffffff, 1}},
                             PhiloxKey{{0xdeadbeef, 0x12345678}})),
            (std::array<uint32_t, 4>{0xab201a58, 0x003f2419, 0x6a958eee, 0xe976959d}));
}

TEST(PhiloxTest, ChangingOneCounterOrKeyWordChangesEveryOutputWord) {
  // Ten rounds diffuse one changed input bit into all four output words.
  const PhiloxCounter base{{1, 2, 3, 4}};
  const PhiloxKey key{{5, 6}};
  const auto a = Words(Philox4x32(base, key));
  const auto b = Words(Philox4x32(PhiloxCounter{{1, 2, 3, 5}}, key));
  const auto c = Words(Philox4x32(base, PhiloxKey{{5, 7}}));
  for (int i = 0; i < 4; ++i) {
    EXPECT_NE(a[i], b[i]) << i;
    EXPECT_NE(a[i], c[i]) << i;
  }
}

TEST(UniformBelowTest, HandComputedValues) {
  // floor(word * range / 2^32).
  EXPECT_EQ(UniformBelow(0, 10), 0u);
  EXPECT_EQ(UniformBelow(0xffffffff, 10), 9u);
  EXPECT_EQ(UniformBelow(0x80000000, 10), 5u);
  EXPECT_EQ(UniformBelow(0x40000000, 4), 1u);
  EXPECT_EQ(UniformBelow(0x3fffffff, 4), 0u);
  EXPECT_EQ(UniformBelow(0xc0000000, 4), 3u);
  EXPECT_EQ(UniformBelow(0xffffffff, 1), 0u);
  EXPECT_EQ(UniformBelow(0xffffffff, 0xffffffff), 0xfffffffeu);
  EXPECT_EQ(UniformBelow(0x12345678, 0xffffffff), 0x12345677u);
  EXPECT_EQ(UniformBelow(0x80000000, 3), 1u);  // 1.5 -> 1
}

TEST(UniformBelowTest, StaysInRangeAndCoversIt) {
  // 40,000 Philox words mapped to [0, 7): every value is below 7 and every bucket is hit near
  // 40000 / 7 = 5714 times (a fixed key, so the counts are fixed; the bound is loose).
  std::array<int, 7> counts{};
  for (uint32_t i = 0; i < 10000; ++i) {
    const PhiloxCounter out = Philox4x32(PhiloxCounter{{i, 0, 0, 0}}, PhiloxKey{{42, 7}});
    for (uint32_t word : out.c) {
      const uint32_t v = UniformBelow(word, 7);
      ASSERT_LT(v, 7u);
      ++counts[v];
    }
  }
  for (int bucket = 0; bucket < 7; ++bucket) {
    EXPECT_GT(counts[bucket], 5400) << bucket;
    EXPECT_LT(counts[bucket], 6030) << bucket;
  }
}

TEST(UniformFloatTest, HandComputedValuesInHalfOpenUnitInterval) {
  EXPECT_EQ(UniformFloat(0), 0.0f);
  EXPECT_EQ(UniformFloat(0x000000ff), 0.0f);  // the low 8 bits are dropped
  EXPECT_EQ(UniformFloat(0x00000100), 0x1p-24f);
  EXPECT_EQ(UniformFloat(0x80000000), 0.5f);
  EXPECT_EQ(UniformFloat(0x40000000), 0.25f);
  EXPECT_EQ(UniformFloat(0xffffffff), 1.0f - 0x1p-24f);  // largest value, still below 1
  EXPECT_LT(UniformFloat(0xffffffff), 1.0f);
}

TEST(UniformFloatTest, PhiloxWordsMapIntoHalfOpenUnitInterval) {
  double sum = 0;
  int n = 0;
  for (uint32_t i = 0; i < 10000; ++i) {
    const PhiloxCounter out = Philox4x32(PhiloxCounter{{i, 1, 2, 3}}, PhiloxKey{{9, 9}});
    for (uint32_t word : out.c) {
      const float f = UniformFloat(word);
      ASSERT_GE(f, 0.0f);
      ASSERT_LT(f, 1.0f);
      sum += f;
      ++n;
    }
  }
  EXPECT_NEAR(sum / n, 0.5, 0.01);  // standard error is 0.29 / sqrt(40000) = 0.0014
}

}  // namespace
}  // namespace dsa
