// The GPU sparse MLA decode (the CUDA-core kernel and the tensor-core kernel on mma.sync and on
// wgmma, sparse_mla_decode.h) against the
// CPU reference MlaSparseDecode on the same paged pool bytes, over a grid of seeded batches (rows
// 1, 3, 64; K 1, 100, 2048; contexts that are no multiple of 64, positions shorter than K,
// entries past the position, all -1, block tables all over the pool) and explicit split counts.
// Tolerance: bf16 inputs, fp32 accumulation, bf16 softmax weights (tensor cores) and a bf16
// output: max |gpu - cpu| <= 1e-2 x max |cpu| per batch; LSE within 1e-3 x max(1, |lse|), and
// exactly -inf where nothing is selected. Outputs are poisoned (NaN) before each launch, so an
// unwritten element fails.
#include "attention_worker/cuda/sparse_mla_decode.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention_worker/mla_sparse_attention.h"
#include "gtest/gtest.h"
#include "tests/attention_worker/mla_test_batch.h"
#include "tests/indexer_service/cuda/cuda_test_util.h"

namespace dsa::cuda {
namespace {

using ::dsa::testing::MakeMlaTestBatch;
using ::dsa::testing::MlaRowSpec;
using ::dsa::testing::MlaTestBatch;
using testing::DeviceBuffer;
using testing::FromBf16Bits;
using testing::NoUsableGpu;

constexpr float kOutTolerance = 1e-2f;  // of max |out|
constexpr float kLseTolerance = 1e-3f;  // of max(1, |lse|)

enum class Kernel { kCudaCores, kMmaSync, kWgmma };

const char* KernelName(Kernel kernel) {
  return kernel == Kernel::kCudaCores ? "cuda cores"
         : kernel == Kernel::kMmaSync ? "mma.sync"
                                      : "wgmma";
}

struct GpuResult {
  std::vector<float> out, lse;
};

// Runs `kernel` on the batch (num_splits for the tensor cores: 0 = auto) and returns its outputs.
void RunOnGpu(const MlaTestBatch& t, Kernel kernel, int num_splits, GpuResult& result) {
  const MlaSparseDecodeBatch& b = t.batch;
  DeviceBuffer pool = DeviceBuffer::From(t.pool), query = DeviceBuffer::From(t.query);
  DeviceBuffer tables = DeviceBuffer::From(t.tables), slots = DeviceBuffer::From(t.num_slots);
  DeviceBuffer positions = DeviceBuffer::From(t.positions);
  DeviceBuffer selections = DeviceBuffer::From(t.selections);
  const int64_t outputs = int64_t{b.num_rows} * b.num_heads * kMlaValueDim;
  DeviceBuffer out(outputs * 2), lse(int64_t{b.num_rows} * b.num_heads * 4);
  ASSERT_TRUE(pool.ok() && query.ok() && out.ok() && lse.ok());
  DSA_CUDA_OK(cudaMemset(out.as<void>(), 0xff, out.bytes()));  // bf16 NaN
  DSA_CUDA_OK(cudaMemset(lse.as<void>(), 0xff, lse.bytes()));  // fp32 NaN
  SparseMlaDecodeParams p;
  p.kv_pool = pool.as<const __nv_bfloat16>();
  p.num_physical_blocks = b.num_physical_blocks;
  p.num_rows = b.num_rows;
  p.num_heads = b.num_heads;
  p.query = query.as<const __nv_bfloat16>();
  p.block_tables = tables.as<const int32_t>();
  p.max_blocks_per_row = b.max_blocks_per_row;
  p.num_slots = slots.as<const int32_t>();
  p.positions = positions.as<const int32_t>();
  p.selections = selections.as<const int32_t>();
  p.top_k = b.top_k;
  p.softmax_scale = b.softmax_scale;
  p.out = out.as<__nv_bfloat16>();
  p.lse = lse.as<float>();
  p.num_splits = num_splits;
  DeviceBuffer workspace;
  const char* why = nullptr;
  if (kernel == Kernel::kCudaCores) {
    ASSERT_TRUE(CanImplementSparseMlaDecodeCudaCores(p, &why)) << why;
    DSA_CUDA_OK(LaunchSparseMlaDecodeCudaCores(p, nullptr));
  } else {
    workspace = DeviceBuffer(SparseMlaDecodeScratchBytes(p));
    ASSERT_TRUE(workspace.ok());
    p.workspace = workspace.as<void>();
    p.workspace_bytes = workspace.bytes();
    p.mma = kernel == Kernel::kMmaSync ? SparseMlaMma::kMmaSync : SparseMlaMma::kWgmma;
    ASSERT_TRUE(CanImplementSparseMlaDecodeTensorCores(p, &why)) << why;
    DSA_CUDA_OK(LaunchSparseMlaDecodeTensorCores(p, nullptr));
  }
  DSA_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint16_t> out_bits = out.ToHost<uint16_t>();
  result.out.resize(out_bits.size());
  for (size_t i = 0; i < out_bits.size(); ++i) result.out[i] = FromBf16Bits(out_bits[i]);
  result.lse = lse.ToHost<float>();
}

// Compares both kernels (the tensor cores at each of `splits`) with the CPU reference.
void ExpectMatchesCpu(const MlaTestBatch& t, const std::vector<int>& splits = {0}) {
  const MlaSparseDecodeBatch& b = t.batch;
  std::vector<float> ref_out(int64_t{b.num_rows} * b.num_heads * kMlaValueDim);
  std::vector<float> ref_lse(int64_t{b.num_rows} * b.num_heads);
  ASSERT_TRUE(MlaSparseDecode(b, ref_out, ref_lse).ok());
  float max_ref = 0.0f;
  for (float v : ref_out) max_ref = std::max(max_ref, std::abs(v));
  std::vector<std::pair<Kernel, int>> runs = {{Kernel::kCudaCores, 0}};
  for (int s : splits) {
    runs.push_back({Kernel::kMmaSync, s});
    runs.push_back({Kernel::kWgmma, s});
  }
  for (const auto& [kernel, num_splits] : runs) {
    SCOPED_TRACE(kernel == Kernel::kCudaCores
                     ? std::string("cuda cores")
                     : "tensor cores, splits " + std::to_string(num_splits));
    GpuResult gpu;
    RunOnGpu(t, kernel, num_splits, gpu);
    if (::testing::Test::HasFatalFailure()) return;
    float max_err = 0.0f;
    int64_t worst = 0;
    for (size_t i = 0; i < ref_out.size(); ++i) {
      const float err = std::abs(gpu.out[i] - ref_out[i]);
      if (!(err <= max_err)) {  // NaN (unwritten or a bad read) becomes the worst
        max_err = std::isnan(err) ? INFINITY : err;
        worst = static_cast<int64_t>(i);
      }
    }
    EXPECT_LE(max_err, kOutTolerance * std::max(max_ref, 1e-6f))
        << "worst element " << worst << " (row " << worst / (b.num_heads * kMlaValueDim)
        << "): gpu " << gpu.out[worst] << " cpu " << ref_out[worst] << ", max |cpu| " << max_ref;
    int lse_failures = 0;
    float max_lse_err = 0.0f;
    for (size_t i = 0; i < ref_lse.size(); ++i) {
      if (!std::isinf(ref_lse[i])) {
        max_lse_err = std::max(
            max_lse_err, std::abs(gpu.lse[i] - ref_lse[i]) / std::max(1.0f, std::abs(ref_lse[i])));
      }
      const bool ok = std::isinf(ref_lse[i])
                          ? gpu.lse[i] == ref_lse[i]
                          : std::abs(gpu.lse[i] - ref_lse[i]) <=
                                kLseTolerance * std::max(1.0f, std::abs(ref_lse[i]));
      if (!ok && ++lse_failures <= 5) {
        ADD_FAILURE() << "lse " << i << ": gpu " << gpu.lse[i] << " cpu " << ref_lse[i];
      }
    }
    EXPECT_EQ(lse_failures, 0);
    // The margins, for the record (tolerances 1e-2 and 1e-3).
    std::printf("    %s, splits %d: max |err| / max |out| %.2e, max lse err %.2e\n",
                KernelName(kernel), num_splits, max_err / std::max(max_ref, 1e-6f), max_lse_err);
  }
}

// `rows` rows with K entries: contexts of 1..3 K slots (rarely a multiple of 64), positions
// anywhere in the context (shorter than K too), selections of up to all visible slots, some
// naming slots past the position; every fifth row selects nothing.
std::vector<MlaRowSpec> RandomRows(int rows, int top_k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<MlaRowSpec> specs;
  for (int r = 0; r < rows; ++r) {
    MlaRowSpec s;
    s.num_slots = std::uniform_int_distribution<int>(1, std::max(2, 3 * top_k / 2))(rng);
    s.position = std::uniform_int_distribution<int>(s.num_slots / 2, s.num_slots - 1)(rng);
    s.num_selected = r % 5 == 4 ? 0 : std::uniform_int_distribution<int>(1, top_k)(rng);
    specs.push_back(s);
  }
  return specs;
}

struct GridCase {
  int rows, top_k;
};

class SparseMlaDecodeGridTest : public ::testing::TestWithParam<GridCase> {};

TEST_P(SparseMlaDecodeGridTest, MatchesCpuReference) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  const GridCase c = GetParam();
  const uint32_t seed = 1000u * c.rows + c.top_k;
  ExpectMatchesCpu(MakeMlaTestBatch(RandomRows(c.rows, c.top_k, seed), 128, c.top_k, seed));
  // A sharper softmax (larger logits).
  ExpectMatchesCpu(
      MakeMlaTestBatch(RandomRows(c.rows, c.top_k, seed + 1), 128, c.top_k, seed + 1, 3.0f));
}

INSTANTIATE_TEST_SUITE_P(Grid, SparseMlaDecodeGridTest,
                         ::testing::Values(GridCase{1, 1}, GridCase{1, 100}, GridCase{1, 2048},
                                           GridCase{3, 1}, GridCase{3, 100}, GridCase{3, 2048},
                                           GridCase{64, 1}, GridCase{64, 100}, GridCase{64, 2048}),
                         [](const ::testing::TestParamInfo<GridCase>& info) {
                           return "Rows" + std::to_string(info.param.rows) + "K" +
                                  std::to_string(info.param.top_k);
                         });

TEST(SparseMlaDecodeTest, FullSelectionsAtEverySplitCount) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  // Every entry attended (K slots before the position), and a context of 2 K + 37 slots whose
  // selection names slots past the position; 1 split (direct output) up to one a tile.
  const std::vector<MlaRowSpec> rows = {{2048, 2047, 2048}, {4133, 3000, 2048}};
  ExpectMatchesCpu(MakeMlaTestBatch(rows, 128, 2048, 7), {1, 2, 3, 7, 32, 0});
}

TEST(SparseMlaDecodeTest, AllMinusOneGivesZerosAndMinusInfinity) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  MlaTestBatch t = MakeMlaTestBatch({{100, 99, 0}, {640, 639, 0}, {70, 5, 0}}, 128, 2048, 8);
  for (int e = 0; e < 2048; ++e) t.selections[2 * 2048 + e] = e < 60 ? 10 + e : -1;  // past pos
  ExpectMatchesCpu(t, {1, 4, 0});
}

TEST(SparseMlaDecodeTest, SixtyFourHeadsAndAScale) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  MlaTestBatch t = MakeMlaTestBatch(RandomRows(5, 300, 9), 64, 300, 9);
  t.batch.softmax_scale = 0.1f;
  ExpectMatchesCpu(t, {1, 2, 0});
}

TEST(SparseMlaDecodeTest, RefusesWhatItCannotRun) {
  SparseMlaDecodeParams p;
  p.num_rows = 0;  // nothing to launch: no pointers needed
  const char* why = nullptr;
  EXPECT_TRUE(CanImplementSparseMlaDecodeTensorCores(p, &why)) << why;
  EXPECT_TRUE(CanImplementSparseMlaDecodeCudaCores(p, &why)) << why;
  p.num_heads = 96;
  EXPECT_FALSE(CanImplementSparseMlaDecodeTensorCores(p, &why));
  EXPECT_NE(std::string(why).find("multiple of 64"), std::string::npos);
  EXPECT_TRUE(CanImplementSparseMlaDecodeCudaCores(p));
  p.num_heads = 128;
  p.top_k = 0;
  EXPECT_FALSE(CanImplementSparseMlaDecodeTensorCores(p));
  EXPECT_FALSE(CanImplementSparseMlaDecodeCudaCores(p));
  p.top_k = 2048;
  p.num_splits = 33;
  EXPECT_FALSE(CanImplementSparseMlaDecodeTensorCores(p, &why));
  p.num_splits = 0;
  p.mma = static_cast<SparseMlaMma>(7);
  EXPECT_FALSE(CanImplementSparseMlaDecodeTensorCores(p, &why));
  p.mma = SparseMlaMma::kAuto;
  p.num_rows = 4;  // pointers now required
  EXPECT_FALSE(CanImplementSparseMlaDecodeTensorCores(p, &why));
  EXPECT_EQ(LaunchSparseMlaDecodeTensorCores(p, nullptr), cudaErrorInvalidValue);
  p.top_k = 9000;
  EXPECT_FALSE(CanImplementSparseMlaDecodeCudaCores(p));
}

TEST(SparseMlaDecodeTest, SplitsAndScratch) {
  SparseMlaDecodeParams p;
  p.num_rows = 64;
  p.num_heads = 128;
  p.top_k = 2048;
  p.num_splits = 1;
  EXPECT_EQ(SparseMlaDecodeNumSplits(p), 1);
  EXPECT_EQ(SparseMlaDecodeScratchBytes(p), 0u);
  p.num_splits = 7;  // 32 tiles: 5 a split, so 7 splits
  EXPECT_EQ(SparseMlaDecodeNumSplits(p), 7);
  p.num_splits = 12;  // 3 a split: 11 splits, none empty
  EXPECT_EQ(SparseMlaDecodeNumSplits(p), 11);
  EXPECT_EQ(SparseMlaDecodeScratchBytes(p), size_t{4} * 64 * 128 * 11 * 513);
  p.num_splits = 0;
  const int splits = SparseMlaDecodeNumSplits(p);
  EXPECT_GE(splits, 1);
  EXPECT_LE(splits, 32);
}

}  // namespace
}  // namespace dsa::cuda
