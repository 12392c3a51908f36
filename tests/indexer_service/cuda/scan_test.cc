// GPU scans (CUDA-core and tensor-core) against ScoreBlocks (indexer_service/scoring.h) on seeded
// caches over a grid of shapes: ragged batches of groups (sequences) with 1 to 4 verifier rows,
// contexts of 0 .. 131,072 slots, all blocks or a SPIN-like shuffled subset. Scores agree within
// 1e-3 relative, or within the worst-case fp32 reordering bound where the sum cancels.
#include "indexer_service/cuda/scan.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "common/fp8.h"
#include "gtest/gtest.h"
#include "indexer_service/block_pool.h"
#include "indexer_service/index_key_cache.h"
#include "indexer_service/scoring.h"
#include "tests/indexer_service/cuda/cuda_test_util.h"

namespace dsa::cuda {
namespace {

using testing::DeviceBuffer;
using testing::FromBf16Bits;
using testing::NoUsableGpu;
using testing::ToBf16Bits;

// The tensor-core scan with each query preparation (ScanQueryPrep): kAuto, the workspace kernel,
// and the conversion in the scan kernel, each over every shape.
enum class Kernel { kCudaCores, kTensorCores, kTensorCoresWorkspace, kTensorCoresInKernel };

struct GroupShape {
  int64_t num_slots;
  int num_rows;        // verifier rows, at positions num_slots - num_rows .. num_slots - 1
  bool sparse_blocks;  // a shuffled subset of the blocks (SPIN-like) instead of all, in order
};

// One batch: a host pool shared by all groups, the CPU scores, and the GPU launch inputs.
struct Batch {
  int num_heads, head_dim;
  BlockPool pool;
  std::vector<std::vector<int32_t>> tables, blocks;
  std::vector<int64_t> num_slots;
  std::vector<int> group_of_row;
  std::vector<float> query;    // fp32 [rows, H, D], bf16-representable
  std::vector<float> weights;  // fp32 [rows, H]
  std::vector<int64_t> position;
  Batch(int64_t capacity, int heads, int dim)
      : num_heads(heads), head_dim(dim), pool(capacity, dim) {}
};

// query_scale multiplies every query value (a power of two keeps them bf16-representable).
Batch MakeBatch(const std::vector<GroupShape>& groups, int num_heads, int head_dim, uint32_t seed,
                float query_scale = 1.0f) {
  int64_t capacity = 0;
  for (const GroupShape& g : groups) capacity += CeilDiv(g.num_slots, kBlockSize);
  Batch batch(capacity, num_heads, head_dim);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<int32_t> ids(capacity);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);  // block tables point all over the pool
  int64_t next_id = 0;
  std::vector<float> key(head_dim);
  for (size_t g = 0; g < groups.size(); ++g) {
    const int64_t num_blocks = CeilDiv(groups[g].num_slots, kBlockSize);
    std::vector<int32_t> table(ids.begin() + next_id, ids.begin() + next_id + num_blocks);
    next_id += num_blocks;
    // Garbage (NaN codes included) past the filled slots must still score -inf.
    for (int32_t id : table) {
      std::fill(batch.pool.keys(id), batch.pool.keys(id) + kBlockSize * head_dim, uint8_t{0x7f});
      std::fill(batch.pool.scales(id), batch.pool.scales(id) + kBlockSize, NAN);
    }
    for (int64_t i = 0; i < groups[g].num_slots; ++i) {
      const float magnitude = 0.5f + (i % 7);
      for (float& v : key) v = normal(rng) * magnitude;
      const int32_t id = table[i / kBlockSize];
      batch.pool.scales(id)[i % kBlockSize] = QuantizeIndexKey(
          key, std::span<uint8_t>(batch.pool.keys(id) + (i % kBlockSize) * head_dim, head_dim));
    }
    std::vector<int32_t> blocks(num_blocks);
    std::iota(blocks.begin(), blocks.end(), 0);
    if (groups[g].sparse_blocks && num_blocks > 2) {
      std::shuffle(blocks.begin() + 1, blocks.end() - 1, rng);
      const int64_t keep = std::max<int64_t>(2, num_blocks * 6 / 10);
      std::swap(blocks[1], blocks[num_blocks - 1]);  // sink and newest always taken
      blocks.resize(keep);
      std::shuffle(blocks.begin(), blocks.end(), rng);
    }
    batch.tables.push_back(std::move(table));
    batch.blocks.push_back(std::move(blocks));
    batch.num_slots.push_back(groups[g].num_slots);
    for (int r = 0; r < groups[g].num_rows; ++r) {
      batch.group_of_row.push_back(static_cast<int>(g));
      batch.position.push_back(groups[g].num_slots - groups[g].num_rows + r);
      for (int i = 0; i < num_heads * head_dim; ++i) {
        batch.query.push_back(FromBf16Bits(ToBf16Bits(normal(rng))) * query_scale);
      }
      for (int h = 0; h < num_heads; ++h) batch.weights.push_back(normal(rng));
    }
  }
  return batch;
}

// Runs the GPU scan of `kernel` on `batch` and compares every entry with ScoreBlocks. With
// `device_total`, the block total is given on the device and the host's total_blocks is only a
// bound (3x the total + 300), as the whole select on the GPU launches it.
void CheckScan(const Batch& batch, Kernel kernel, QueryDtype query_dtype,
               bool device_total = false) {
  const int num_groups = static_cast<int>(batch.tables.size());
  const int num_rows = static_cast<int>(batch.group_of_row.size());
  const int hd = batch.num_heads * batch.head_dim;
  // CPU reference, and the flattened GPU inputs.
  std::vector<int32_t> group_first_row(num_groups + 1, 0), logical_blocks, block_tables;
  std::vector<int64_t> group_block_offset(num_groups + 1, 0), group_table_offset(num_groups);
  std::vector<int64_t> row_score_offset(num_rows);
  int64_t total_entries = 0;
  for (int r = 0; r < num_rows; ++r) ++group_first_row[batch.group_of_row[r] + 1];
  for (int g = 0; g < num_groups; ++g) {
    group_first_row[g + 1] += group_first_row[g];
    group_block_offset[g + 1] = group_block_offset[g] + batch.blocks[g].size();
    group_table_offset[g] = static_cast<int64_t>(block_tables.size());
    block_tables.insert(block_tables.end(), batch.tables[g].begin(), batch.tables[g].end());
    logical_blocks.insert(logical_blocks.end(), batch.blocks[g].begin(), batch.blocks[g].end());
  }
  for (int r = 0; r < num_rows; ++r) {
    row_score_offset[r] = total_entries;
    total_entries += static_cast<int64_t>(batch.blocks[batch.group_of_row[r]].size()) * 64;
  }
  std::vector<float> expected(total_entries);
  for (int g = 0; g < num_groups; ++g) {
    KeyCacheView view{&batch.pool, batch.tables[g], batch.num_slots[g]};
    std::vector<IndexerRow> rows;
    for (int r = group_first_row[g]; r < group_first_row[g + 1]; ++r) {
      rows.push_back(
          {std::span<const float>(batch.query).subspan(r * hd, hd),
           std::span<const float>(batch.weights).subspan(r * batch.num_heads, batch.num_heads),
           batch.position[r]});
    }
    if (rows.empty()) continue;
    const int64_t width = static_cast<int64_t>(batch.blocks[g].size()) * 64;
    ScoreBlocks(view, batch.blocks[g], rows, batch.num_heads,
                std::span<float>(expected).subspan(row_score_offset[group_first_row[g]],
                                                   width * rows.size()));
  }
  std::vector<uint16_t> query_bf16(batch.query.size());
  for (size_t i = 0; i < query_bf16.size(); ++i) query_bf16[i] = ToBf16Bits(batch.query[i]);

  const size_t pool_bytes = batch.pool.capacity_blocks() * batch.pool.block_bytes();
  std::vector<uint8_t> pool_host(batch.pool.keys(0), batch.pool.keys(0) + pool_bytes);
  DeviceBuffer pool = DeviceBuffer::From(pool_host);
  DeviceBuffer d_first_row = DeviceBuffer::From(group_first_row);
  DeviceBuffer d_block_offset = DeviceBuffer::From(group_block_offset);
  DeviceBuffer d_blocks = DeviceBuffer::From(logical_blocks);
  DeviceBuffer d_table_offset = DeviceBuffer::From(group_table_offset);
  DeviceBuffer d_tables = DeviceBuffer::From(block_tables);
  DeviceBuffer d_num_slots = DeviceBuffer::From(batch.num_slots);
  DeviceBuffer d_query = query_dtype == QueryDtype::kFloat32 ? DeviceBuffer::From(batch.query)
                                                             : DeviceBuffer::From(query_bf16);
  DeviceBuffer d_weights = DeviceBuffer::From(batch.weights);
  DeviceBuffer d_position = DeviceBuffer::From(batch.position);
  DeviceBuffer d_score_offset = DeviceBuffer::From(row_score_offset);
  DeviceBuffer d_scores(total_entries * sizeof(float));
  ScanParams sizes;
  sizes.num_rows = num_rows;
  sizes.num_heads = batch.num_heads;
  sizes.head_dim = batch.head_dim;
  const bool tensor_cores = kernel != Kernel::kCudaCores;
  sizes.query_prep = kernel == Kernel::kTensorCoresWorkspace  ? ScanQueryPrep::kWorkspace
                     : kernel == Kernel::kTensorCoresInKernel ? ScanQueryPrep::kInKernel
                                                              : ScanQueryPrep::kAuto;
  DeviceBuffer workspace(tensor_cores ? ScanTensorCoresScratchBytes(sizes) : 0);
  ASSERT_TRUE(pool.ok() && d_scores.ok());
  if (total_entries > 0) {
    DSA_CUDA_OK(cudaMemset(d_scores.as<void>(), 0x7f, total_entries * sizeof(float)));  // NaN
  }
  ScanParams p;
  p.pool = pool.as<uint8_t>();
  p.head_dim = batch.head_dim;
  p.num_heads = batch.num_heads;
  p.num_groups = num_groups;
  p.num_rows = num_rows;
  p.group_first_row = d_first_row.as<int32_t>();
  p.group_block_offset = d_block_offset.as<int64_t>();
  p.total_blocks = group_block_offset[num_groups];
  DeviceBuffer d_total = DeviceBuffer::From(std::vector<int64_t>{p.total_blocks});
  if (device_total) {
    p.device_total_blocks = d_total.as<int64_t>();
    p.total_blocks = 3 * p.total_blocks + 300;
  }
  p.logical_blocks = d_blocks.as<int32_t>();
  p.group_table_offset = d_table_offset.as<int64_t>();
  p.block_tables = d_tables.as<int32_t>();
  p.group_num_slots = d_num_slots.as<int64_t>();
  p.query = d_query.as<void>();
  p.query_dtype = query_dtype;
  p.head_weights = d_weights.as<float>();
  p.row_position = d_position.as<int64_t>();
  p.row_score_offset = d_score_offset.as<int64_t>();
  p.scores = d_scores.as<float>();
  p.query_prep = sizes.query_prep;
  p.workspace = workspace.as<void>();
  p.workspace_bytes = workspace.bytes();
  const char* why = nullptr;
  if (kernel == Kernel::kCudaCores) {
    ASSERT_TRUE(CanImplementScanCudaCores(p, &why)) << why;
    DSA_CUDA_OK(LaunchScanCudaCores(p, nullptr));
  } else {
    ASSERT_TRUE(CanImplementScanTensorCores(p, &why)) << why;
    DSA_CUDA_OK(LaunchScanTensorCores(p, nullptr));
  }
  DSA_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = d_scores.ToHost<float>();

  // Compare: -inf where the CPU has -inf; otherwise |got - want| <= 1e-3 |want|, or, where the
  // sum cancels, <= 2 (D + H + 8) 2^-24 m, m = s_i sum_h |w_h| sum_d |q_hd k_id| (the worst-case
  // reordering error of two fp32 sums).
  const float* table = Fp8E4m3DecodeTable();
  int64_t failures = 0, checked = 0, relative_ok = 0;
  double worst_relative = 0.0;
  for (int r = 0; r < num_rows; ++r) {
    const int g = batch.group_of_row[r];
    for (size_t j = 0; j < batch.blocks[g].size(); ++j) {
      for (int s = 0; s < 64; ++s) {
        const int64_t e = row_score_offset[r] + static_cast<int64_t>(j) * 64 + s;
        const float want = expected[e], have = got[e];
        bool ok;
        if (std::isinf(want) && want < 0) {
          ok = std::isinf(have) && have < 0;
        } else {
          ++checked;
          const double diff = std::fabs(static_cast<double>(have) - want);
          const double relative = diff / std::max(std::fabs(static_cast<double>(want)), 1e-30);
          ok = diff <= 1e-3 * std::fabs(want);
          if (ok) {
            ++relative_ok;
            worst_relative = std::max(worst_relative, relative);
          } else {
            const int32_t id = batch.tables[g][batch.blocks[g][j]];
            const uint8_t* k = batch.pool.keys(id) + s * batch.head_dim;
            double m = 0.0;
            for (int h = 0; h < batch.num_heads; ++h) {
              double dot = 0.0;
              for (int d = 0; d < batch.head_dim; ++d) {
                dot += std::fabs(batch.query[r * hd + h * batch.head_dim + d] * table[k[d]]);
              }
              m += std::fabs(batch.weights[r * batch.num_heads + h]) * dot;
            }
            m *= batch.pool.scales(id)[s];
            ok = diff <= 2.0 * (batch.head_dim + batch.num_heads + 8) * 0x1p-24 * m;
          }
        }
        if (!ok && ++failures <= 8) {
          ADD_FAILURE() << "row " << r << " (group " << g << ", position " << batch.position[r]
                        << ") block " << batch.blocks[g][j] << " slot "
                        << batch.blocks[g][j] * 64 + s << ": got " << have << " want " << want;
        }
      }
    }
  }
  EXPECT_EQ(failures, 0) << "of " << checked << " finite scores";
  ::testing::Test::RecordProperty("worst_relative_error", std::to_string(worst_relative));
  if (checked > 0) {
    // Nearly every score must meet 1e-3 relative outright; the bound only covers cancellation.
    EXPECT_GE(static_cast<double>(relative_ok) / checked, 0.999) << relative_ok << "/" << checked;
  }
}

class ScanGrid : public ::testing::TestWithParam<Kernel> {};

TEST_P(ScanGrid, MatchesScoreBlocksOverContextLengths) {
  if (NoUsableGpu()) GTEST_SKIP() << "no sm_90 GPU";
  // One ragged launch: every context length, each with 1..4 verifier rows and both block lists.
  std::vector<GroupShape> groups;
  int v = 0;
  for (const int64_t slots : {0LL, 1LL, 63LL, 64LL, 65LL, 2047LL, 2048LL, 2049LL, 16385LL}) {
    for (const bool sparse : {false, true}) groups.push_back({slots, 1 + (v++ % 4), sparse});
  }
  const Batch batch = MakeBatch(groups, 64, 128, 7);
  CheckScan(batch, GetParam(), QueryDtype::kBFloat16);
}

TEST_P(ScanGrid, MatchesScoreBlocksOnALongContextWithFourVerifierRows) {
  if (NoUsableGpu()) GTEST_SKIP() << "no sm_90 GPU";
  const Batch batch = MakeBatch({{131072, 4, false}, {131072, 1, true}}, 64, 128, 11);
  CheckScan(batch, GetParam(), QueryDtype::kBFloat16);
}

TEST_P(ScanGrid, MatchesScoreBlocksOnSixtyFourRows) {
  if (NoUsableGpu()) GTEST_SKIP() << "no sm_90 GPU";
  std::vector<GroupShape> single(64, {2049, 1, false}), verifier(16, {4097, 4, true});
  for (int i = 0; i < 64; ++i) single[i].num_slots = 1000 + 97 * i;
  CheckScan(MakeBatch(single, 64, 128, 13), GetParam(), QueryDtype::kBFloat16);
  CheckScan(MakeBatch(verifier, 64, 128, 17), GetParam(), QueryDtype::kBFloat16);
}

TEST_P(ScanGrid, MatchesScoreBlocksOnAMillionSlots) {
  if (NoUsableGpu()) GTEST_SKIP() << "no sm_90 GPU";
  CheckScan(MakeBatch({{1048576, 1, false}}, 64, 128, 37), GetParam(), QueryDtype::kBFloat16);
}

TEST_P(ScanGrid, TakesTheTotalFromTheDeviceUnderAGridBound) {
  if (NoUsableGpu()) GTEST_SKIP() << "no sm_90 GPU";
  // Every CTA past the device total must do nothing (the score buffer holds exactly the total).
  std::vector<GroupShape> groups;
  for (const int64_t slots : {1LL, 65LL, 2049LL, 16385LL, 131072LL}) {
    groups.push_back({slots, 1, true});
  }
  groups.push_back({4097, 4, false});
  CheckScan(MakeBatch(groups, 64, 128, 29), GetParam(), QueryDtype::kBFloat16,
            /*device_total=*/true);
  CheckScan(MakeBatch({{300, 1, false}}, 64, 128, 31), GetParam(), QueryDtype::kBFloat16,
            /*device_total=*/true);
}

TEST_P(ScanGrid, MatchesScoreBlocksWithSmallerHeads) {
  if (NoUsableGpu()) GTEST_SKIP() << "no sm_90 GPU";
  CheckScan(MakeBatch({{1000, 2, false}, {129, 3, true}}, 16, 64, 19), GetParam(),
            QueryDtype::kBFloat16);
  CheckScan(MakeBatch({{700, 1, true}}, 32, 128, 23), GetParam(), QueryDtype::kBFloat16);
}

INSTANTIATE_TEST_SUITE_P(Kernels, ScanGrid,
                         ::testing::Values(Kernel::kCudaCores, Kernel::kTensorCores,
                                           Kernel::kTensorCoresWorkspace,
                                           Kernel::kTensorCoresInKernel),
                         [](const auto& info) {
                           switch (info.param) {
                             case Kernel::kCudaCores:
                               return "CudaCores";
                             case Kernel::kTensorCores:
                               return "TensorCores";
                             case Kernel::kTensorCoresWorkspace:
                               return "TensorCoresWorkspace";
                             default:
                               return "TensorCoresInKernel";
                           }
                         });

TEST_P(ScanGrid, MatchesScoreBlocksForQueriesOfAnyMagnitude) {
  if (NoUsableGpu()) GTEST_SKIP() << "no sm_90 GPU";
  // Beyond f16's range (2^20 x N(0, 1)) and deep below it (2^-30): the tensor-core scan rescales
  // each row by a power of two and folds the scale back through the head weights.
  CheckScan(MakeBatch({{3000, 2, false}}, 64, 128, 37, 0x1p20f), GetParam(), QueryDtype::kBFloat16);
  CheckScan(MakeBatch({{3000, 2, true}}, 64, 128, 41, 0x1p-30f), GetParam(), QueryDtype::kBFloat16);
}

TEST(ScanCudaCores, TakesFp32QueriesAndOddShapes) {
  if (NoUsableGpu()) GTEST_SKIP() << "no sm_90 GPU";
  CheckScan(MakeBatch({{300, 2, true}, {65, 1, false}}, 3, 40, 29), Kernel::kCudaCores,
            QueryDtype::kFloat32);
  CheckScan(MakeBatch({{2049, 4, false}}, 64, 128, 31), Kernel::kCudaCores, QueryDtype::kFloat32);
}

TEST(Scan, RefusesShapesItCannotRun) {
  ScanParams p;
  p.head_dim = 128;
  p.num_heads = 64;
  p.query_dtype = QueryDtype::kFloat32;
  const char* why = nullptr;
  EXPECT_TRUE(CanImplementScanCudaCores(p, &why));
  EXPECT_FALSE(CanImplementScanTensorCores(p, &why));  // fp32 query
  EXPECT_NE(why, nullptr);
  p.query_dtype = QueryDtype::kBFloat16;
  EXPECT_TRUE(CanImplementScanTensorCores(p, &why));
  p.total_blocks = 1;  // blocks to score but no workspace
  EXPECT_FALSE(CanImplementScanTensorCores(p, &why));
  p.total_blocks = 0;
  p.num_rows = 3;  // the workspace: none when the scan converts the query itself
  EXPECT_EQ(ScanTensorCoresScratchBytes(p), size_t{3} * 64 * (2 * 128 + 4));
  p.query_prep = ScanQueryPrep::kWorkspace;
  EXPECT_EQ(ScanTensorCoresScratchBytes(p), size_t{3} * 64 * (2 * 128 + 4));
  p.query_prep = ScanQueryPrep::kInKernel;
  EXPECT_EQ(ScanTensorCoresScratchBytes(p), size_t{0});
  p.query_prep = static_cast<ScanQueryPrep>(7);
  EXPECT_FALSE(CanImplementScanTensorCores(p, &why));
  p.query_prep = ScanQueryPrep::kAuto;
  p.num_heads = 24;
  EXPECT_FALSE(CanImplementScanTensorCores(p, &why));
  p.head_dim = 300;
  EXPECT_FALSE(CanImplementScanCudaCores(p, &why));
  p.head_dim = 128;
  p.total_blocks = 5;  // no pointers
  EXPECT_FALSE(CanImplementScanCudaCores(p, &why));
  EXPECT_EQ(LaunchScanCudaCores(p, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace dsa::cuda
