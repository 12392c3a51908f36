// GPU SPIN block prediction and plan (gamma = 0) against the CPU SpinState: S bit for bit against
// PredictBlockScores and the chosen blocks against Plan, on seeded EMA states built by the CPU's
// own Update (random scored blocks, unscored -inf entries, tie-heavy quantized scores), V and D
// shorter or longer than the position, empty states, contexts from 1 to 131072 slots, many
// ragged rows in one launch and rows with no visible slot. Skips without a GPU.
#include "indexer_service/cuda/spin_predict.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "indexer_service/block_pool.h"
#include "indexer_service/spin.h"
#include "tests/indexer_service/cuda/cuda_test_util.h"

namespace dsa::cuda {
namespace {

using testing::DeviceBuffer;
using testing::NoUsableGpu;

// One row of a launch: a CPU state and the position it predicts at.
struct Row {
  std::unique_ptr<SpinState> state;
  int64_t position = 0;
};

// A state after the warm-up Plan and updates at a few positions up to `last_update` (none when
// it is < 0): each block scored with probability 0.7, 10% of entries unscored (-inf); `ties`
// quantizes scores to quarters so that many predictions are equal.
std::unique_ptr<SpinState> MakeState(const SpinConfig& config, int top_k, int64_t last_update,
                                     bool ties, uint64_t seed) {
  auto state = std::make_unique<SpinState>(config, top_k, /*layer=*/3);
  const int64_t zero = 0;
  state->Plan(std::span<const int64_t>(&zero, 1));  // clears the warm-up
  if (last_update < 0) return state;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> value(-1.0f, 3.0f);
  std::uniform_int_distribution<int> quarter(-4, 12);
  std::bernoulli_distribution scored(0.7), unscored(0.1);
  const int64_t updates[] = {last_update / 3, (2 * last_update) / 3, last_update};
  for (int64_t p : updates) {
    std::vector<int32_t> blocks;
    std::vector<float> scores;
    for (int64_t j = 0; j < CeilDiv(p + 1, kBlockSize); ++j) {
      if (!scored(rng)) continue;
      blocks.push_back(static_cast<int32_t>(j));
      for (int s = 0; s < kBlockSize; ++s) {
        float z = ties ? 0.25f * static_cast<float>(quarter(rng)) : value(rng);
        if (unscored(rng)) z = -INFINITY;
        scores.push_back(z);
      }
    }
    state->Update(p, blocks, scores);
  }
  return state;
}

// Runs the GPU kernels over `rows` and compares S and the plan with the CPU.
void CheckRows(std::vector<Row>& rows, int top_k, double rho) {
  const int n = static_cast<int>(rows.size());
  std::vector<DeviceBuffer> arrays;
  std::vector<const float*> v_ptr(n), d_ptr(n);
  std::vector<int64_t> v_len(n), d_len(n), positions(n), offsets(n);
  int64_t total = 0;
  for (int r = 0; r < n; ++r) {
    const SpinState& s = *rows[r].state;
    arrays.push_back(DeviceBuffer::From(s.vertical()));
    v_ptr[r] = arrays.back().as<float>();
    arrays.push_back(DeviceBuffer::From(s.diagonal()));
    d_ptr[r] = arrays.back().as<float>();
    v_len[r] = static_cast<int64_t>(s.vertical().size());
    d_len[r] = static_cast<int64_t>(s.diagonal().size());
    positions[r] = rows[r].position;
    offsets[r] = total;
    total += positions[r] < 0 ? 0 : CeilDiv(positions[r] + 1, kBlockSize);
  }
  const float sentinel = std::bit_cast<float>(0x7fc0dead);
  constexpr int32_t kUnwritten = -7;
  DeviceBuffer scores = DeviceBuffer::From(std::vector<float>(total + 1, sentinel));
  DeviceBuffer selected = DeviceBuffer::From(std::vector<int32_t>(total + 1, kUnwritten));
  DeviceBuffer counts = DeviceBuffer::From(std::vector<int32_t>(n, kUnwritten));
  DeviceBuffer dv = DeviceBuffer::From(v_ptr), dd = DeviceBuffer::From(d_ptr);
  DeviceBuffer dvl = DeviceBuffer::From(v_len), ddl = DeviceBuffer::From(d_len);
  DeviceBuffer dpos = DeviceBuffer::From(positions), doff = DeviceBuffer::From(offsets);
  SpinPredictParams p;
  p.num_rows = n;
  p.positions = dpos.as<int64_t>();
  p.vertical = dv.as<const float*>();
  p.vertical_len = dvl.as<int64_t>();
  p.diagonal = dd.as<const float*>();
  p.diagonal_len = ddl.as<int64_t>();
  p.row_block_offset = doff.as<int64_t>();
  p.scores = scores.as<float>();
  p.selected = selected.as<int32_t>();
  p.selected_count = counts.as<int32_t>();
  p.top_k = top_k;
  p.target_block_sparsity = rho;
  p.exploration_fraction = 0.0;
  const char* why = nullptr;
  ASSERT_TRUE(CanImplementSpinPredict(p, &why)) << why;
  DSA_CUDA_OK(LaunchSpinPredict(p, nullptr));
  DSA_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got_s = scores.ToHost<float>();
  const std::vector<int32_t> got_sel = selected.ToHost<int32_t>();
  const std::vector<int32_t> got_count = counts.ToHost<int32_t>();
  for (int r = 0; r < n; ++r) {
    const int64_t t = positions[r];
    SCOPED_TRACE(::testing::Message() << "row " << r << " position " << t << " |V| " << v_len[r]
                                      << " |D| " << d_len[r] << " K " << top_k << " rho " << rho);
    const std::vector<float> want_s = rows[r].state->PredictBlockScores(t);
    const int64_t b = static_cast<int64_t>(want_s.size());
    int64_t bad = 0;
    for (int64_t j = 0; j < b; ++j) {
      if (std::bit_cast<uint32_t>(got_s[offsets[r] + j]) != std::bit_cast<uint32_t>(want_s[j])) {
        if (++bad <= 5)
          ADD_FAILURE() << "S[" << j << "] " << got_s[offsets[r] + j] << " want " << want_s[j];
      }
    }
    EXPECT_EQ(bad, 0);
    std::vector<int32_t> want_sel;
    if (t >= 0) want_sel = rows[r].state->Plan(std::span<const int64_t>(&t, 1)).row_blocks[0];
    ASSERT_EQ(got_count[r], static_cast<int32_t>(want_sel.size()));
    for (size_t i = 0; i < want_sel.size(); ++i) {
      ASSERT_EQ(got_sel[offsets[r] + i], want_sel[i]) << "entry " << i;
    }
    for (int64_t i = static_cast<int64_t>(want_sel.size()); i < b; ++i) {
      ASSERT_EQ(got_sel[offsets[r] + i], kUnwritten) << "entry " << i << " past the count";
    }
  }
  EXPECT_TRUE(std::isnan(got_s[total]));  // nothing written past the last row
  EXPECT_EQ(got_sel[total], kUnwritten);
}

SpinConfig Config(double rho) {
  SpinConfig config;
  config.target_block_sparsity = rho;
  config.exploration_fraction = 0.0;
  return config;
}

// Each context in one launch with four states: full (updates up to t), half, empty and tie-heavy
// full; under several (K, rho).
TEST(SpinPredictTest, ContextsAgainstCpu) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  const int64_t contexts[] = {1, 63, 64, 65, 2047, 2048, 2049, 16385, 131072};
  const struct {
    int top_k;
    double rho;
  } settings[] = {{2048, 0.4}, {64, 0.4}, {128, 0.9}, {64, 0.0}, {2048, 0.7}};
  for (const auto& setting : settings) {
    std::vector<Row> rows;
    uint64_t seed = 11;
    for (int64_t n : contexts) {
      const int64_t t = n - 1;
      const int64_t lasts[] = {t, t / 2 - 1, -1, t};
      for (int k = 0; k < 4; ++k) {
        rows.push_back(
            {MakeState(Config(setting.rho), setting.top_k, lasts[k], k == 3, ++seed), t});
      }
    }
    CheckRows(rows, setting.top_k, setting.rho);
  }
}

// Many rows of random lengths in one launch: V and D shorter or longer than the position, rows
// with no visible slot (position -1: nothing written, count 0).
TEST(SpinPredictTest, RaggedRowsInOneLaunch) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  std::mt19937_64 rng(2026);
  std::uniform_int_distribution<int64_t> position(-1, 6000);
  for (const double rho : {0.4, 0.8}) {
    std::vector<Row> rows;
    for (int r = 0; r < 96; ++r) {
      const int64_t t = r % 17 == 5 ? -1 : position(rng);
      std::uniform_int_distribution<int64_t> last(-1, 2 * std::max<int64_t>(t, 0));
      rows.push_back({MakeState(Config(rho), 256, last(rng), r % 3 == 0, 100 + r), t});
    }
    CheckRows(rows, 256, rho);
  }
}

TEST(SpinPredictTest, CanImplementRefusals) {
  SpinPredictParams p;
  const char* why = nullptr;
  EXPECT_TRUE(CanImplementSpinPredict(p, &why));  // zero rows: a no-op
  EXPECT_EQ(LaunchSpinPredict(p, nullptr), cudaSuccess);
  p.pooling = SpinPooling::kTop4Mean;
  EXPECT_FALSE(CanImplementSpinPredict(p, &why));
  EXPECT_NE(std::string(why).find("max"), std::string::npos);
  p.pooling = SpinPooling::kMax;
  p.reduction = SpinReduction::kA2;
  EXPECT_FALSE(CanImplementSpinPredict(p, &why));
  p.reduction = SpinReduction::kA1;
  float dummy_f = 0;
  int64_t dummy_i = 0;
  const float* dummy_p = &dummy_f;
  int32_t dummy_s = 0;
  p.num_rows = 1;
  EXPECT_FALSE(CanImplementSpinPredict(p, &why));  // null pointers
  p.positions = p.vertical_len = p.diagonal_len = p.row_block_offset = &dummy_i;
  p.vertical = p.diagonal = &dummy_p;
  p.scores = &dummy_f;
  EXPECT_TRUE(CanImplementSpinPredict(p, &why));
  p.selected = &dummy_s;
  EXPECT_FALSE(CanImplementSpinPredict(p, &why));  // no count
  p.selected_count = &dummy_s;
  p.top_k = 2048;
  EXPECT_TRUE(CanImplementSpinPredict(p, &why));
  p.exploration_fraction = 0.05;
  EXPECT_FALSE(CanImplementSpinPredict(p, &why));
  EXPECT_NE(std::string(why).find("exploration"), std::string::npos);
  EXPECT_EQ(LaunchSpinPredict(p, nullptr), cudaErrorInvalidValue);
  p.exploration_fraction = 0.0;
  p.target_block_sparsity = 1.0;
  EXPECT_FALSE(CanImplementSpinPredict(p, &why));
}

}  // namespace
}  // namespace dsa::cuda
