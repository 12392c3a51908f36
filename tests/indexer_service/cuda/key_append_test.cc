// GPU append against the CPU quantizer (common/fp8.h QuantizeIndexKey): every byte of the pool
// must match, on seeded keys (fp32 and bf16) with zeros, denormal-range values, scales that
// underflow, huge magnitudes, exact rounding midpoints and partial blocks. Skips without a GPU.
#include "indexer_service/cuda/key_append.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "common/fp8.h"
#include "gtest/gtest.h"
#include "tests/indexer_service/cuda/cuda_test_util.h"

namespace dsa::cuda {
namespace {

using testing::DeviceBuffer;
using testing::FromBf16Bits;
using testing::NoUsableGpu;
using testing::ToBf16Bits;

constexpr uint8_t kUntouched = 0xab;

// The expected pool after quantizing `keys` (fp32 [num_keys, head_dim]) with the CPU quantizer
// into slots first_slot.. of `block_table`; every other byte stays kUntouched.
std::vector<uint8_t> ExpectedPool(std::span<const float> keys, int64_t num_keys, int head_dim,
                                  std::span<const int32_t> block_table, int64_t first_slot,
                                  int64_t pool_blocks) {
  const int64_t block_bytes = 64LL * (head_dim + 4);
  std::vector<uint8_t> pool(pool_blocks * block_bytes, kUntouched);
  for (int64_t i = 0; i < num_keys; ++i) {
    const int64_t slot = first_slot + i;
    uint8_t* block = pool.data() + block_bytes * block_table[slot / 64];
    const float scale =
        QuantizeIndexKey(keys.subspan(i * head_dim, head_dim),
                         std::span<uint8_t>(block + (slot % 64) * head_dim, head_dim));
    std::memcpy(block + 64 * head_dim + (slot % 64) * 4, &scale, 4);
  }
  return pool;
}

// Runs the GPU append of `keys` (fp32, or their bf16 bits when `bf16`) and compares the whole
// pool with ExpectedPool byte for byte.
void CheckAppend(const std::vector<float>& keys_fp32, int head_dim, int64_t first_slot,
                 const std::vector<int32_t>& block_table, int64_t pool_blocks, bool bf16) {
  const int64_t num_keys = static_cast<int64_t>(keys_fp32.size()) / head_dim;
  std::vector<float> keys = keys_fp32;
  std::vector<uint16_t> keys_bf16(keys.size());
  if (bf16) {
    for (size_t i = 0; i < keys.size(); ++i) {
      keys_bf16[i] = ToBf16Bits(keys[i]);
      keys[i] = FromBf16Bits(keys_bf16[i]);  // the CPU quantizes the values the GPU reads
    }
  }
  const std::vector<uint8_t> expected =
      ExpectedPool(keys, num_keys, head_dim, block_table, first_slot, pool_blocks);
  DeviceBuffer pool(expected.size());
  ASSERT_TRUE(pool.ok());
  DSA_CUDA_OK(cudaMemset(pool.as<void>(), kUntouched, expected.size()));
  DeviceBuffer device_keys = bf16 ? DeviceBuffer::From(keys_bf16) : DeviceBuffer::From(keys);
  DeviceBuffer table = DeviceBuffer::From(block_table);
  AppendParams params;
  params.keys = device_keys.as<void>();
  params.keys_dtype = bf16 ? KeyDtype::kBFloat16 : KeyDtype::kFloat32;
  params.num_keys = num_keys;
  params.head_dim = head_dim;
  params.block_table = table.as<int32_t>();
  params.first_slot = first_slot;
  params.pool = pool.as<uint8_t>();
  ASSERT_TRUE(CanImplementAppend(params));
  DSA_CUDA_OK(LaunchAppend(params, nullptr));
  DSA_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = pool.ToHost<uint8_t>();
  int64_t mismatches = 0;
  const int64_t block_bytes = 64LL * (head_dim + 4);
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == expected[i]) continue;
    if (++mismatches <= 8) {
      const int64_t block = i / block_bytes, offset = i % block_bytes;
      ADD_FAILURE() << "byte " << i << " (pool block " << block << ", offset " << offset
                    << (offset < 64 * head_dim ? " code" : " scale") << "): got " << int{got[i]}
                    << " want " << int{expected[i]};
    }
  }
  EXPECT_EQ(mismatches, 0) << (bf16 ? "bf16" : "fp32") << " head_dim " << head_dim;
}

// Seeded keys of many magnitudes, with the edge cases mixed in as whole keys.
std::vector<float> EdgeCaseKeys(int64_t num_keys, int head_dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> exponent(-30.0f, 30.0f);
  std::vector<float> keys(num_keys * head_dim);
  for (int64_t i = 0; i < num_keys; ++i) {
    float* key = keys.data() + i * head_dim;
    const float magnitude = std::exp2(exponent(rng));
    for (int d = 0; d < head_dim; ++d) key[d] = normal(rng) * magnitude;
    switch (i % 9) {
      case 0:  // all zeros: scale 0, zero codes
        std::fill(key, key + head_dim, 0.0f);
        break;
      case 1:  // denormal fp32 values: scale is denormal
        for (int d = 0; d < head_dim; ++d) key[d] = normal(rng) * 1e-39f;
        break;
      case 2:  // amax < 448 x the least denormal: the scale underflows to 0
        for (int d = 0; d < head_dim; ++d) key[d] = (d % 3 - 1) * 1e-43f;
        break;
      case 3:  // huge magnitudes near FLT_MAX
        for (int d = 0; d < head_dim; ++d) key[d] = normal(rng) * 1e37f;
        key[0] = 3.0e38f;  // finite in bf16 too (3.4e38 rounds to bf16 inf)
        break;
      case 4:  // one large entry, the rest deep in the fp8 subnormal range and below
        for (int d = 0; d < head_dim; ++d) key[d] = normal(rng) * 1e-4f;
        key[head_dim / 2] = -1.0f;
        break;
      case 5:  // negative zeros and one value
        for (int d = 0; d < head_dim; ++d) key[d] = -0.0f;
        key[head_dim - 1] = 2.5f;
        break;
      default:
        break;
    }
  }
  return keys;
}

TEST(KeyAppend, RefusesBadShapes) {
  AppendParams params;
  params.head_dim = 0;
  const char* why = nullptr;
  EXPECT_FALSE(CanImplementAppend(params, &why));
  EXPECT_NE(why, nullptr);
  params.head_dim = 128;
  params.num_keys = 1;  // null pointers
  EXPECT_FALSE(CanImplementAppend(params, &why));
  EXPECT_EQ(LaunchAppend(params, nullptr), cudaErrorInvalidValue);
  params.num_keys = 0;
  EXPECT_TRUE(CanImplementAppend(params, &why));
  EXPECT_EQ(why, nullptr);
}

TEST(KeyAppend, MatchesTheCpuQuantizerOnScatteredPartialBlocks) {
  if (NoUsableGpu()) GTEST_SKIP() << "no sm_90 GPU";
  for (const int head_dim : {128, 64, 40, 7}) {
    for (const bool bf16 : {false, true}) {
      // Pool of 16 blocks; the table scatters logical blocks; writes start mid-block.
      const std::vector<int32_t> block_table = {5, 2, 11, 7, 0, 15};
      for (const int64_t first_slot : {0LL, 1LL, 37LL, 63LL, 64LL}) {
        for (const int64_t num_keys : {1LL, 27LL, 64LL, 150LL}) {
          if (first_slot + num_keys > 6 * 64) continue;
          SCOPED_TRACE(::testing::Message()
                       << "first_slot " << first_slot << " num_keys " << num_keys);
          CheckAppend(EdgeCaseKeys(num_keys, head_dim, 1000 + head_dim + num_keys), head_dim,
                      first_slot, block_table, 16, bf16);
        }
      }
    }
  }
}

// With one entry of every key at 448 the scale is exactly 1, so the codes are the encoder applied
// to the other entries themselves: sweep fp32 bit patterns up to 448 (a stride through all of
// them, plus every rounding midpoint between E4M3 codes and its neighbours) in both signs.
TEST(KeyAppend, EncodesEveryRoundingCaseLikeTheCpu) {
  if (NoUsableGpu()) GTEST_SKIP() << "no sm_90 GPU";
  std::vector<float> values;
  for (uint32_t bits = 0; bits <= 0x43e00000u; bits += 997)
    values.push_back(std::bit_cast<float>(bits));
  for (int code = 0; code < 0x7e; ++code) {
    const float low = DecodeFp8E4m3(static_cast<uint8_t>(code));
    const float high = DecodeFp8E4m3(static_cast<uint8_t>(code + 1));
    const float mid = (low + high) / 2;  // exact: few mantissa bits
    values.push_back(mid);
    values.push_back(std::nextafter(mid, 0.0f));
    values.push_back(std::nextafter(mid, 1000.0f));
    values.push_back(low);
  }
  const int head_dim = 128;
  const int per_key = head_dim - 1;
  const int64_t num_keys = (static_cast<int64_t>(values.size()) * 2 + per_key - 1) / per_key;
  std::vector<float> keys(num_keys * head_dim, 0.0f);
  size_t next = 0;
  for (int64_t i = 0; i < num_keys; ++i) {
    keys[i * head_dim] = (i % 2) ? -448.0f : 448.0f;
    for (int d = 1; d < head_dim; ++d, ++next) {
      const size_t v = next % values.size();
      keys[i * head_dim + d] = next < values.size() ? values[v] : -values[v];
    }
  }
  const int64_t num_blocks = (num_keys + 63) / 64;
  std::vector<int32_t> block_table(num_blocks);
  std::iota(block_table.begin(), block_table.end(), 0);
  std::reverse(block_table.begin(), block_table.end());
  CheckAppend(keys, head_dim, 0, block_table, num_blocks, /*bf16=*/false);
}

}  // namespace
}  // namespace dsa::cuda
