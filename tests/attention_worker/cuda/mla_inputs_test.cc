// The MLA rows on the GPU (mla_inputs.h) against the CPU's MlaKvRow / MlaAttentionQuery
// (mla_kv.h), bit for bit: KV rows through a shuffled block table into a pool whose other rows must
// stay untouched, slots past 2^20 and 2^32, several seeds and layers; query rows at positions past
// 2^32.
#include "attention_worker/cuda/mla_inputs.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "attention_worker/mla_kv.h"
#include "gtest/gtest.h"
#include "tests/indexer_service/cuda/cuda_test_util.h"

namespace dsa::cuda {
namespace {

using ::dsa::cuda::testing::DeviceBuffer;
using ::dsa::cuda::testing::NoUsableGpu;

constexpr int kDim = 576;
constexpr int kBlock = 64;
constexpr uint16_t kSentinel = 0xFFFF;  // a NaN pattern no row value has

TEST(MlaInputsTest, KvRowsLandInTheirBlocksBitForBit) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  struct Case {
    uint64_t seed;
    int layer;
    int64_t first_slot, num_slots;
  };
  const std::vector<Case> cases = {{0, 0, 0, 1},
                                   {1, 3, 37, 1500},
                                   {0xABCDEF0123456789ull, 60, (1 << 20) - 10, 200},
                                   {5, 1, (int64_t{1} << 32) + 5, 130},
                                   {5, 1, (int64_t{1} << 32) - 64, 64}};
  constexpr int kPhysicalBlocks = 40;
  std::mt19937 rng(3);
  for (const Case& c : cases) {
    const int64_t end = c.first_slot + c.num_slots;
    const int64_t logical_blocks = (end + kBlock - 1) / kBlock;
    const int64_t first_block = c.first_slot / kBlock;
    // Entries before the range are never read; those of the range are a shuffled subset.
    std::vector<int32_t> table(static_cast<size_t>(logical_blocks), -1);
    std::vector<int32_t> physical(kPhysicalBlocks);
    std::iota(physical.begin(), physical.end(), 0);
    std::shuffle(physical.begin(), physical.end(), rng);
    ASSERT_LE(logical_blocks - first_block, kPhysicalBlocks);
    for (int64_t j = first_block; j < logical_blocks; ++j) table[j] = physical[j - first_block];
    DeviceBuffer d_table = DeviceBuffer::From(table);
    std::vector<uint16_t> pool(static_cast<size_t>(kPhysicalBlocks) * kBlock * kDim, kSentinel);
    DeviceBuffer d_pool = DeviceBuffer::From(pool);
    MlaKvRowsParams p;
    p.seed = c.seed;
    p.layer = c.layer;
    p.first_slot = c.first_slot;
    p.num_slots = c.num_slots;
    p.block_table = d_table.as<int32_t>();
    p.num_physical_blocks = kPhysicalBlocks;
    p.kv_pool = d_pool.as<__nv_bfloat16>();
    const char* why = nullptr;
    ASSERT_TRUE(CanImplementMlaKvRows(p, &why)) << why;
    DSA_CUDA_OK(LaunchMlaKvRows(p, nullptr));
    DSA_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> gpu = d_pool.ToHost<uint16_t>();
    for (int64_t slot = c.first_slot; slot < end; ++slot) {
      const size_t at = (static_cast<size_t>(table[slot / kBlock]) * kBlock + slot % kBlock) * kDim;
      ASSERT_TRUE(
          MlaKvRow(c.seed, c.layer, slot, std::span<uint16_t>(pool.data() + at, kDim)).ok());
    }
    ASSERT_EQ(gpu, pool) << "seed " << c.seed << " first slot " << c.first_slot;
  }
}

TEST(MlaInputsTest, QueryRowsMatchTheCpu) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  for (int heads : {128, 1, 3}) {
    const std::vector<int64_t> positions = {
        0, 1, 4097, (1 << 20) + 3, (int64_t{1} << 32) + 9, (int64_t{1} << 41) + 1};
    const size_t row = static_cast<size_t>(heads) * kDim;
    std::vector<uint16_t> cpu(positions.size() * row);
    for (size_t r = 0; r < positions.size(); ++r) {
      ASSERT_TRUE(
          MlaAttentionQuery(77, 2, positions[r], std::span<uint16_t>(cpu.data() + r * row, row))
              .ok());
    }
    DeviceBuffer d_positions = DeviceBuffer::From(positions);
    DeviceBuffer d_queries(cpu.size() * sizeof(uint16_t));
    DSA_CUDA_OK(cudaMemset(d_queries.as<void>(), 0xFF, d_queries.bytes()));
    MlaQueryRowsParams p;
    p.seed = 77;
    p.layer = 2;
    p.num_rows = static_cast<int>(positions.size());
    p.num_heads = heads;
    p.positions = d_positions.as<int64_t>();
    p.queries = d_queries.as<__nv_bfloat16>();
    DSA_CUDA_OK(LaunchMlaQueryRows(p, nullptr));
    DSA_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(d_queries.ToHost<uint16_t>(), cpu) << heads << " heads";
  }
}

TEST(MlaInputsTest, RefusesBadLaunches) {
  MlaKvRowsParams kv;
  kv.num_slots = 3;
  EXPECT_FALSE(CanImplementMlaKvRows(kv));  // no table, no pool
  EXPECT_EQ(LaunchMlaKvRows(kv, nullptr), cudaErrorInvalidValue);
  kv.num_slots = 0;
  kv.first_slot = -1;
  EXPECT_FALSE(CanImplementMlaKvRows(kv));
  kv.first_slot = 0;
  EXPECT_TRUE(CanImplementMlaKvRows(kv));
  EXPECT_EQ(LaunchMlaKvRows(kv, nullptr), cudaSuccess);  // nothing to do
  MlaQueryRowsParams q;
  q.num_heads = 0;
  const char* why = nullptr;
  EXPECT_FALSE(CanImplementMlaQueryRows(q, &why));
  EXPECT_NE(why, nullptr);
  q.num_heads = 128;
  q.layer = -1;
  EXPECT_FALSE(CanImplementMlaQueryRows(q));
}

}  // namespace
}  // namespace dsa::cuda
