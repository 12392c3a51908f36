// GPU top-K against SelectTopK (indexer_service/topk.h) and the full-sort reference
// (tests/indexer_service/reference.h) on the same scores: identical selections over ragged
// batches, with the fault kinds public kernels have shipped guarded: many equal scores in one bin,
// zero-length rows, fewer rows than SMs and more, and row offsets past 2^31 entries.
#include "indexer_service/cuda/topk.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "gtest/gtest.h"
#include "indexer_service/topk.h"
#include "tests/indexer_service/cuda/cuda_test_util.h"
#include "tests/indexer_service/reference.h"

namespace dsa::cuda {
namespace {

using testing::DeviceBuffer;
using testing::NoUsableGpu;

// kSampledLow / kSampledHigh: the first 8 entries of every 128 far below / above the rest, so that
// a sample of runs at a stride that is a multiple of 128 sees only them.
enum class Fill { kRandom, kAllEqual, kFewValues, kSpecials, kOneBin, kSampledLow, kSampledHigh };

struct RowSpec {
  int64_t num_entries;
  int64_t max_slot;  // the row's position
  bool blocked;      // entries map to slots through a shuffled logical block list
  Fill fill;
};

struct Rows {
  std::vector<float> scores;
  std::vector<int64_t> offset, entries, block_offset, max_slot;
  std::vector<int32_t> blocks;
};

Rows MakeRows(const std::vector<RowSpec>& specs, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  Rows rows;
  for (const RowSpec& spec : specs) {
    rows.offset.push_back(static_cast<int64_t>(rows.scores.size()));
    rows.entries.push_back(spec.num_entries);
    rows.max_slot.push_back(spec.max_slot);
    rows.block_offset.push_back(static_cast<int64_t>(rows.blocks.size()));
    if (spec.blocked) {
      const int64_t num_blocks = (spec.num_entries + 63) / 64;
      std::vector<int32_t> ids(num_blocks + num_blocks / 3);  // some block ids are skipped
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      rows.blocks.insert(rows.blocks.end(), ids.begin(), ids.begin() + num_blocks);
    }
    for (int64_t e = 0; e < spec.num_entries; ++e) {
      float v = normal(rng);
      switch (spec.fill) {
        case Fill::kRandom:
          break;
        case Fill::kAllEqual:
          v = (e % 2) ? 0.0f : -0.0f;  // -0 and +0 are equal scores
          break;
        case Fill::kFewValues:
          v = static_cast<float>(static_cast<int>(rng() % 3)) - 1.0f;
          break;
        case Fill::kSpecials: {
          const uint32_t pick = rng() % 16;
          if (pick == 0) v = -std::numeric_limits<float>::infinity();
          if (pick == 1) v = std::numeric_limits<float>::quiet_NaN();
          if (pick == 2) v = std::numeric_limits<float>::infinity();
          if (pick == 3) v = std::numeric_limits<float>::denorm_min() * (rng() % 5);
          break;
        }
        case Fill::kOneBin:  // distinct scores whose top 24 bits are equal
          v = std::bit_cast<float>(0x3f800000u | static_cast<uint32_t>(rng() % 256));
          break;
        case Fill::kSampledLow:
          if (e % 128 < 8) v -= 100.0f;
          break;
        case Fill::kSampledHigh:
          if (e % 128 < 8) v += 100.0f;
          break;
      }
      rows.scores.push_back(v);
    }
  }
  return rows;
}

// Runs the GPU top-K over `rows` (scores at `base_offset` entries into a device buffer) and checks
// each row against SelectTopK and, for rows up to 20,000 entries, FullSortTopK. *fallbacks (when
// not null) receives TopKParams::sampled_fallbacks: the streamed rows that did not keep the
// sample's gather. max_row_entries is TopKParams' host bound (0: none).
void CheckTopK(const Rows& rows, int k, int64_t base_offset = 0, int* fallbacks = nullptr,
               int64_t max_row_entries = 0) {
  const int num_rows = static_cast<int>(rows.offset.size());
  std::vector<int64_t> offset = rows.offset;
  for (int64_t& o : offset) o += base_offset;
  const size_t total = base_offset + rows.scores.size();
  DeviceBuffer scores(total * sizeof(float));
  ASSERT_TRUE(scores.ok()) << "cannot allocate " << total * 4 << " bytes";
  if (!rows.scores.empty()) {
    DSA_CUDA_OK(cudaMemcpy(scores.as<float>() + base_offset, rows.scores.data(),
                           rows.scores.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  DeviceBuffer d_offset = DeviceBuffer::From(offset);
  DeviceBuffer d_entries = DeviceBuffer::From(rows.entries);
  DeviceBuffer d_block_offset = DeviceBuffer::From(rows.block_offset);
  DeviceBuffer d_max_slot = DeviceBuffer::From(rows.max_slot);
  DeviceBuffer d_blocks = DeviceBuffer::From(rows.blocks);
  DeviceBuffer d_selection(static_cast<size_t>(num_rows) * k * sizeof(int32_t));
  // Rows that use no block list get slot == entry: give them an empty list through a second
  // launch description (logical_blocks == nullptr) when the batch has no blocks at all.
  TopKParams p;
  p.scores = scores.as<float>();
  p.num_rows = num_rows;
  p.row_score_offset = d_offset.as<int64_t>();
  p.row_num_entries = d_entries.as<int64_t>();
  p.logical_blocks = rows.blocks.empty() ? nullptr : d_blocks.as<int32_t>();
  p.row_block_offset = d_block_offset.as<int64_t>();
  p.row_max_slot = d_max_slot.as<int64_t>();
  p.k = k;
  p.selection = d_selection.as<int32_t>();
  DeviceBuffer d_fallbacks = DeviceBuffer::From(std::vector<int32_t>{0});
  p.sampled_fallbacks = d_fallbacks.as<int32_t>();
  p.max_row_entries = max_row_entries;
  const char* why = nullptr;
  ASSERT_TRUE(CanImplementTopK(p, &why)) << why;
  DSA_CUDA_OK(LaunchTopK(p, nullptr));
  DSA_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int32_t> got = d_selection.ToHost<int32_t>();
  if (fallbacks != nullptr) *fallbacks = d_fallbacks.ToHost<int32_t>()[0];
  for (int r = 0; r < num_rows; ++r) {
    const std::span<const float> row_scores(rows.scores.data() + rows.offset[r], rows.entries[r]);
    std::span<const int32_t> row_blocks;
    if (!rows.blocks.empty()) {
      row_blocks = std::span<const int32_t>(rows.blocks.data() + rows.block_offset[r],
                                            (rows.entries[r] + 63) / 64);
    }
    std::vector<int32_t> want(k);
    SelectTopK(row_scores, row_blocks, rows.max_slot[r], want);
    const std::vector<int32_t> have(got.begin() + static_cast<int64_t>(r) * k,
                                    got.begin() + static_cast<int64_t>(r + 1) * k);
    if (have != want) {
      int64_t first = 0;
      while (have[first] == want[first]) ++first;
      ADD_FAILURE() << "row " << r << " (" << rows.entries[r] << " entries, max_slot "
                    << rows.max_slot[r] << ") differs from SelectTopK first at rank " << first
                    << ": got " << have[first] << " want " << want[first];
    }
    if (rows.entries[r] <= 20000) {
      EXPECT_EQ(have, testing_reference::FullSortTopK(row_scores, row_blocks, rows.max_slot[r], k))
          << "row " << r;
    }
  }
}

TEST(TopK, RefusesBadShapes) {
  TopKParams p;
  const char* why = nullptr;
  p.k = 0;
  EXPECT_FALSE(CanImplementTopK(p, &why));
  p.k = kMaxTopK + 1;
  EXPECT_FALSE(CanImplementTopK(p, &why));
  p.k = 2048;
  EXPECT_TRUE(CanImplementTopK(p, &why));  // no rows
  p.num_rows = 1;
  EXPECT_FALSE(CanImplementTopK(p, &why));
  EXPECT_EQ(LaunchTopK(p, nullptr), cudaErrorInvalidValue);
  p.num_rows = 0;
  p.max_row_entries = -1;
  EXPECT_FALSE(CanImplementTopK(p, &why));
  EXPECT_STREQ(why, "max_row_entries < 0");
  EXPECT_EQ(LaunchTopK(p, nullptr), cudaErrorInvalidValue);
}

TEST(TopK, MatchesSelectTopKOnRaggedRows) {
  if (NoUsableGpu()) GTEST_SKIP() << "no sm_90 GPU";
  std::vector<RowSpec> specs;
  for (const int64_t n : {0LL, 1LL, 63LL, 64LL, 65LL, 2047LL, 2048LL, 2049LL, 16385LL, 131072LL}) {
    specs.push_back({n, n - 1, false, Fill::kRandom});
    specs.push_back({n, n / 2, false, Fill::kSpecials});  // position masks the tail
  }
  CheckTopK(MakeRows(specs, 1), 2048);
  CheckTopK(MakeRows(specs, 2), 1);
  CheckTopK(MakeRows(specs, 3), 100);
}

TEST(TopK, MatchesSelectTopKThroughShuffledBlockLists) {
  if (NoUsableGpu()) GTEST_SKIP() << "no sm_90 GPU";
  std::vector<RowSpec> specs;
  for (const int64_t n : {64LL, 128LL, 2048LL, 4096LL, 65536LL}) {
    specs.push_back({n, 1 << 30, true, Fill::kRandom});
    specs.push_back({n, n, true, Fill::kFewValues});  // ties resolved by slot, not entry
    specs.push_back({n, 1 << 30, true, Fill::kSpecials});
  }
  CheckTopK(MakeRows(specs, 4), 2048);
}

TEST(TopK, SeparatesManyEqualScoresInOneBin) {
  if (NoUsableGpu()) GTEST_SKIP() << "no sm_90 GPU";
  const std::vector<RowSpec> specs = {{131072, 131071, false, Fill::kAllEqual},
                                      {131072, 131071, false, Fill::kFewValues},
                                      {131072, 131071, false, Fill::kOneBin},
                                      {1 << 20, (1 << 20) - 1, false, Fill::kAllEqual},
                                      {1 << 20, (1 << 20) - 1, false, Fill::kRandom}};
  CheckTopK(MakeRows(specs, 5), 2048);
}

// Rows streamed from global memory are first selected from a strided sample of runs of 8 entries
// (topk.cu, SampledGather). Rows whose sampled runs are unlike the rest make the sample's threshold
// take far too many ranks (low runs) or fewer than K (high runs): the exact select must take over.
TEST(TopK, SelectsExactlyWhereTheSampleMisjudgesTheRow) {
  if (NoUsableGpu()) GTEST_SKIP() << "no sm_90 GPU";
  for (const Fill fill : {Fill::kSampledLow, Fill::kSampledHigh}) {
    CheckTopK(MakeRows({{1 << 20, (1 << 20) - 1, false, fill}}, 11), 2048);
    std::vector<RowSpec> specs(64, {131072, 131071, false, fill});
    CheckTopK(MakeRows(specs, 12), 2048);
    CheckTopK(MakeRows(specs, 13), 7);
  }
  // Rows whose selectable entries are few (the position masks all but the first 40,000).
  CheckTopK(MakeRows({{1 << 20, 40000, false, Fill::kRandom}}, 14), 2048);
}

// A row of 2^20 entries is split over at most 16 CTAs: chunks past 32K entries, read from global
// memory. On representative scores the sample's gather holds the K best (no fallback), also when
// every score is equal and when fewer than K entries are selectable (the threshold then takes
// them all); on the row whose sampled runs lie far below the rest it does not, and the row falls
// back. Without the sampled path every streamed row would count as a fallback.
TEST(TopK, KeepsTheSampledGatherOfRepresentativeStreamedRows) {
  if (NoUsableGpu()) GTEST_SKIP() << "no sm_90 GPU";
  int fallbacks = -1;
  for (const Fill fill : {Fill::kRandom, Fill::kAllEqual, Fill::kFewValues}) {
    CheckTopK(MakeRows({{1 << 20, (1 << 20) - 1, false, fill}}, 15), 2048, 0, &fallbacks);
    EXPECT_EQ(fallbacks, 0) << static_cast<int>(fill);
  }
  CheckTopK(MakeRows({{1 << 20, 999, false, Fill::kRandom}}, 16), 2048, 0, &fallbacks);
  EXPECT_EQ(fallbacks, 0) << "fewer selectable entries than K";
  CheckTopK(MakeRows({{1 << 20, (1 << 20) - 1, true, Fill::kRandom}}, 17), 2048, 0, &fallbacks);
  EXPECT_EQ(fallbacks, 0) << "through a block list";
  CheckTopK(MakeRows({{1 << 20, (1 << 20) - 1, false, Fill::kSampledLow}}, 18), 2048, 0,
            &fallbacks);
  EXPECT_EQ(fallbacks, 1) << "sampled runs far below the rest";
}

// With a host bound that says every chunk is cached, the kernel without the sampled gather runs:
// the same selections on cached rows (one row on the largest cluster, 67 rows on the smallest);
// and where the bound is wrong (below a streamed row's entries), that row is still exact, through
// the streamed select, and counts as a fallback (the kernel with the sampled gather keeps the
// gather on such a row: the test above).
TEST(TopK, TakesTheKernelWithoutTheSampleWhereAHostBoundCachesEveryChunk) {
  if (NoUsableGpu()) GTEST_SKIP() << "no sm_90 GPU";
  int fallbacks = -1;
  for (const int64_t n : {1LL, 2049LL, 16384LL, 131072LL}) {
    CheckTopK(MakeRows({{n, n - 1, false, Fill::kRandom}}, 20), 2048, 0, &fallbacks, n);
    EXPECT_EQ(fallbacks, 0) << n;
    CheckTopK(MakeRows({{n, n - 1, true, Fill::kAllEqual}}, 21), 2048, 0, &fallbacks, n);
    EXPECT_EQ(fallbacks, 0) << n;
  }
  std::vector<RowSpec> specs;
  int64_t longest = 0;
  for (int r = 0; r < 67; ++r) {
    const int64_t n = (r % 4 == 0) ? 0 : 3000 + 300 * r;  // every chunk cached at any cluster
    longest = std::max(longest, n);
    specs.push_back({n, n - 1 - r, true, r % 3 == 0 ? Fill::kFewValues : Fill::kSpecials});
  }
  CheckTopK(MakeRows(specs, 22), 2048, 0, &fallbacks, longest);
  EXPECT_EQ(fallbacks, 0);
  CheckTopK(MakeRows({{1 << 20, (1 << 20) - 1, false, Fill::kRandom}}, 23), 2048, 0, &fallbacks,
            1000);
  EXPECT_EQ(fallbacks, 1) << "a bound below the row's entries";
}

TEST(TopK, HandlesZeroLengthRowsAndMoreRowsThanSms) {
  if (NoUsableGpu()) GTEST_SKIP() << "no sm_90 GPU";
  std::vector<RowSpec> specs;
  specs.reserve(300);
  for (int r = 0; r < 300; ++r) {
    specs.push_back({r % 5 == 0 ? 0 : 1000 + 37 * r, r % 7 == 0 ? -1 : 1 << 30, false,
                     r % 3 == 0 ? Fill::kSpecials : Fill::kRandom});
  }
  CheckTopK(MakeRows(specs, 6), 2048);
}

// One row, then batches of 2 .. 133 rows: every cluster size the launch picks (one row split over
// up to 16 CTAs down to one CTA a row), with rows much longer and much shorter than their cluster.
TEST(TopK, SplitsRowsOverClustersOfEverySize) {
  if (NoUsableGpu()) GTEST_SKIP() << "no sm_90 GPU";
  for (const int64_t n : {1LL, 2049LL, 16384LL, 131072LL, 1LL << 20}) {
    CheckTopK(MakeRows({{n, n - 1, false, Fill::kRandom}}, 8), 2048);
    CheckTopK(MakeRows({{n, n - 1, true, Fill::kFewValues}}, 9), 2048);
  }
  for (const int rows : {2, 3, 5, 8, 9, 16, 17, 33, 64, 67, 132, 133}) {
    SCOPED_TRACE(rows);
    std::vector<RowSpec> specs;
    for (int r = 0; r < rows; ++r) {  // a batch's rows all use block lists, or none does
      const int64_t n = (r % 4 == 0) ? 0 : 3000 + 9973 * r;
      specs.push_back({n, n - 1 - r, rows % 2 == 1, r % 3 == 0 ? Fill::kFewValues : Fill::kRandom});
    }
    CheckTopK(MakeRows(specs, 10 + rows), 2048);
  }
}

// A row that starts past 2^31 entries (8 GiB in): offsets must be 64-bit all the way.
TEST(TopK, ReadsRowsPastTwoToTheThirtyOneEntries) {
  if (NoUsableGpu()) GTEST_SKIP() << "no sm_90 GPU";
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  const int64_t base = (int64_t{1} << 31) + 12345;
  if (free_bytes < (base + 200000) * sizeof(float) + (1 << 30)) GTEST_SKIP() << "GPU too small";
  CheckTopK(
      MakeRows({{65536, 65535, false, Fill::kRandom}, {131072, 131071, false, Fill::kRandom}}, 7),
      2048, base);
}

}  // namespace
}  // namespace dsa::cuda
