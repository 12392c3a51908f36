// GPU SPIN block prediction, plan (with random exploration) and speculative union against the CPU
// SpinState: S bit for bit against PredictBlockScores, the chosen blocks against Plan's row blocks
// and the union against Plan's blocks, on seeded EMA states built by the CPU's own Update (random
// scored blocks, unscored -inf entries, tie-heavy quantized scores), V and D shorter or longer
// than the position, empty states, contexts from 1 to 2^20 slots and past (the workspace path),
// gamma 0, 0.05 and 0.2 with random 64-bit seeds, many ragged rows in one launch, rows with no
// visible slot and a batch of 64 verifier groups. Skips without a GPU.
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

// One row of a launch: a CPU state (rows of one verifier group share it), the position it predicts
// at and the exploration seed its config holds; the layer is kLayer.
struct Row {
  std::shared_ptr<SpinState> state;
  int64_t position = 0;
  uint64_t seed = 0;  // the state's SpinConfig::seed
};

constexpr int kLayer = 3;

// The plan settings of a launch; max_visible_blocks 0 = the largest B of the rows.
struct Setting {
  int top_k = 2048;
  double rho = 0.4;
  double gamma = 0.0;
  int64_t max_visible_blocks = 0;
};

// A state after the warm-up Plan and updates at a few positions up to `last_update` (none when
// it is < 0): each block scored with probability 0.7, 10% of entries unscored (-inf); `ties`
// quantizes scores to quarters so that many predictions are equal.
std::unique_ptr<SpinState> MakeState(const SpinConfig& config, int top_k, int64_t last_update,
                                     bool ties, uint64_t seed) {
  auto state = std::make_unique<SpinState>(config, top_k, kLayer);
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

// The device side of one prediction launch over `rows`.
struct PredictLaunch {
  std::vector<DeviceBuffer> arrays;
  std::vector<int64_t> positions, offsets;
  int64_t total = 0;
  DeviceBuffer scores, selected, counts, workspace;
};

constexpr int32_t kUnwritten = -7;

// Copies the rows' V and D (rows whose states are the same object share arrays) and launches the
// prediction and plan with `setting`, the rows' seeds and kLayer.
void RunPredict(const std::vector<Row>& rows, const Setting& setting, PredictLaunch& launch) {
  const int n = static_cast<int>(rows.size());
  std::vector<const float*> v_ptr(n), d_ptr(n);
  std::vector<int64_t> v_len(n), d_len(n);
  std::vector<uint64_t> seeds(n);
  launch.positions.resize(n);
  launch.offsets.resize(n);
  int64_t max_blocks = 1;
  for (int r = 0; r < n; ++r) {
    const SpinState& s = *rows[r].state;
    if (r > 0 && rows[r - 1].state.get() == &s) {
      v_ptr[r] = v_ptr[r - 1];
      d_ptr[r] = d_ptr[r - 1];
    } else {
      launch.arrays.push_back(DeviceBuffer::From(s.vertical()));
      v_ptr[r] = launch.arrays.back().as<float>();
      launch.arrays.push_back(DeviceBuffer::From(s.diagonal()));
      d_ptr[r] = launch.arrays.back().as<float>();
    }
    v_len[r] = static_cast<int64_t>(s.vertical().size());
    d_len[r] = static_cast<int64_t>(s.diagonal().size());
    seeds[r] = rows[r].seed;
    const int64_t t = rows[r].position;
    launch.positions[r] = t;
    launch.offsets[r] = launch.total;
    const int64_t b = t < 0 ? 0 : CeilDiv(t + 1, kBlockSize);
    launch.total += b;
    max_blocks = std::max(max_blocks, b);
  }
  const float sentinel = std::bit_cast<float>(0x7fc0dead);
  launch.scores = DeviceBuffer::From(std::vector<float>(launch.total + 1, sentinel));
  launch.selected = DeviceBuffer::From(std::vector<int32_t>(launch.total + 1, kUnwritten));
  launch.counts = DeviceBuffer::From(std::vector<int32_t>(n, kUnwritten));
  DeviceBuffer dv = DeviceBuffer::From(v_ptr), dd = DeviceBuffer::From(d_ptr);
  DeviceBuffer dvl = DeviceBuffer::From(v_len), ddl = DeviceBuffer::From(d_len);
  DeviceBuffer dpos = DeviceBuffer::From(launch.positions);
  DeviceBuffer doff = DeviceBuffer::From(launch.offsets), dseed = DeviceBuffer::From(seeds);
  SpinPredictParams p;
  p.num_rows = n;
  p.positions = dpos.as<int64_t>();
  p.vertical = dv.as<const float*>();
  p.vertical_len = dvl.as<int64_t>();
  p.diagonal = dd.as<const float*>();
  p.diagonal_len = ddl.as<int64_t>();
  p.row_block_offset = doff.as<int64_t>();
  p.scores = launch.scores.as<float>();
  p.selected = launch.selected.as<int32_t>();
  p.selected_count = launch.counts.as<int32_t>();
  p.top_k = setting.top_k;
  p.target_block_sparsity = setting.rho;
  p.exploration_fraction = setting.gamma;
  p.row_seed = dseed.as<uint64_t>();
  p.layer = kLayer;
  p.max_visible_blocks = setting.max_visible_blocks > 0 ? setting.max_visible_blocks : max_blocks;
  p.total_blocks = launch.total;
  launch.workspace = DeviceBuffer(SpinPredictScratchBytes(p));
  p.workspace = launch.workspace.as<void>();
  p.workspace_bytes = launch.workspace.bytes();
  const char* why = nullptr;
  ASSERT_TRUE(CanImplementSpinPredict(p, &why)) << why;
  DSA_CUDA_OK(LaunchSpinPredict(p, nullptr));
  DSA_CUDA_OK(cudaDeviceSynchronize());
}

// Runs the GPU kernels over `rows` and compares S and the plan with the CPU.
void CheckRows(std::vector<Row>& rows, const Setting& setting) {
  const int n = static_cast<int>(rows.size());
  PredictLaunch launch;
  RunPredict(rows, setting, launch);
  if (::testing::Test::HasFatalFailure()) return;
  const std::vector<float> got_s = launch.scores.ToHost<float>();
  const std::vector<int32_t> got_sel = launch.selected.ToHost<int32_t>();
  const std::vector<int32_t> got_count = launch.counts.ToHost<int32_t>();
  const std::vector<int64_t>& positions = launch.positions;
  const std::vector<int64_t>& offsets = launch.offsets;
  for (int r = 0; r < n; ++r) {
    const int64_t t = positions[r];
    SCOPED_TRACE(::testing::Message()
                 << "row " << r << " position " << t << " |V| " << rows[r].state->vertical().size()
                 << " |D| " << rows[r].state->diagonal().size() << " K " << setting.top_k << " rho "
                 << setting.rho << " gamma " << setting.gamma << " seed " << rows[r].seed);
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
  EXPECT_TRUE(std::isnan(got_s[launch.total]));  // nothing written past the last row
  EXPECT_EQ(got_sel[launch.total], kUnwritten);
}

void CheckRows(std::vector<Row>& rows, int top_k, double rho) {
  CheckRows(rows, Setting{top_k, rho, 0.0, 0});
}

SpinConfig Config(double rho, double gamma = 0.0, uint64_t seed = 0) {
  SpinConfig config;
  config.target_block_sparsity = rho;
  config.exploration_fraction = gamma;
  config.seed = seed;
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

// The brief's grid: positions 0 .. 2^20 - 1, K 64 and 2048, rho 0 .. 0.5, gamma 0, 0.05 and 0.2,
// a random 64-bit seed a row; a full and a tie-heavy state a position, in one launch a setting.
TEST(SpinPredictTest, ExplorationGridAgainstCpu) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  const int64_t positions[] = {0, 1, 63, 64, 65, 2047, 2048, 2049, 16385, 131072, 1048575};
  std::mt19937_64 rng(4242);
  for (const int top_k : {64, 2048}) {
    for (const double rho : {0.0, 0.3, 0.4, 0.5}) {
      for (const double gamma : {0.0, 0.05, 0.2}) {
        std::vector<Row> rows;
        for (const int64_t t : positions) {
          for (const bool ties : {false, true}) {
            const uint64_t seed = rng();
            rows.push_back({MakeState(Config(rho, gamma, seed), top_k, t, ties, rng()), t, seed});
          }
        }
        CheckRows(rows, Setting{top_k, rho, gamma, 0});
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Ragged rows with exploration, in shared memory and (max_visible_blocks past 2^14) through the
// workspace; then rows past 2^20 slots (B = 23,438 > kSpinSharedPlanBlocks: the workspace).
TEST(SpinPredictTest, ExplorationRaggedAndWorkspace) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  std::mt19937_64 rng(77);
  std::uniform_int_distribution<int64_t> position(-1, 6000);
  for (const int64_t bound : {int64_t{0}, int64_t{20000}}) {
    for (const double gamma : {0.05, 0.2, 0.6}) {
      std::vector<Row> rows;
      for (int r = 0; r < 64; ++r) {
        const int64_t t = r % 17 == 5 ? -1 : position(rng);
        std::uniform_int_distribution<int64_t> last(-1, 2 * std::max<int64_t>(t, 0));
        const uint64_t seed = rng();
        rows.push_back(
            {MakeState(Config(0.4, gamma, seed), 256, last(rng), r % 3 == 0, 100 + r), t, seed});
      }
      CheckRows(rows, Setting{256, 0.4, gamma, bound});
      if (HasFatalFailure()) return;
    }
  }
}

TEST(SpinPredictTest, ExplorationPastTwoToTheTwenty) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  std::mt19937_64 rng(78);
  std::vector<Row> rows;
  for (const int64_t t : {int64_t{1499999}, int64_t{1048576}, int64_t{5000}}) {
    const uint64_t seed = rng();
    rows.push_back({MakeState(Config(0.4, 0.2, seed), 2048, t, false, rng()), t, seed});
  }
  CheckRows(rows, Setting{2048, 0.4, 0.2, 0});
}

// A row whose B exceeds max_visible_blocks under exploration is refused (count -1), the others
// are planned.
TEST(SpinPredictTest, RowPastTheBoundIsRefused) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  std::vector<Row> rows;
  rows.push_back({MakeState(Config(0.4, 0.2, 5), 64, 999, false, 1), 999, 5});
  rows.push_back({MakeState(Config(0.4, 0.2, 6), 64, 9999, false, 2), 9999, 6});
  PredictLaunch launch;
  RunPredict(rows, Setting{64, 0.4, 0.2, 16}, launch);
  if (HasFatalFailure()) return;
  const std::vector<int32_t> counts = launch.counts.ToHost<int32_t>();
  const int64_t t = 999;
  EXPECT_EQ(counts[0], static_cast<int32_t>(
                           rows[0].state->Plan(std::span<const int64_t>(&t, 1)).blocks.size()));
  EXPECT_EQ(counts[1], -1);
}

// `num_groups` groups of 1 to 5 verifier rows (positions t .. t + d sharing one state; group 1 at
// `long_position` when >= 0, group 2 at 100): each row's plan against Plan's row_blocks and the
// GPU union against Plan's blocks (kRowLocalUnion). Every fifth group has K = 64, the others 2048.
void CheckUnion(int num_groups, int64_t long_position, uint64_t rng_seed) {
  std::mt19937_64 rng(rng_seed);
  std::uniform_int_distribution<int64_t> position(0, 40000);
  std::uniform_int_distribution<int> rows_a_group(1, 5);
  for (const double gamma : {0.0, 0.05}) {
    std::vector<Row> rows;
    std::vector<int32_t> first_row{0};
    std::vector<std::vector<int64_t>> group_positions;
    for (int g = 0; g < num_groups; ++g) {
      const int64_t t = g == 1 && long_position >= 0 ? long_position : g == 2 ? 100 : position(rng);
      const int d = rows_a_group(rng);
      const uint64_t seed = rng();
      std::shared_ptr<SpinState> state =
          MakeState(Config(0.4, gamma, seed), g % 5 == 0 ? 64 : 2048, t, g % 3 == 0, rng());
      group_positions.emplace_back();
      for (int r = 0; r < d; ++r) {
        rows.push_back({state, t + r, seed});
        group_positions.back().push_back(t + r);
      }
      first_row.push_back(static_cast<int32_t>(rows.size()));
    }
    // K differs between groups: plan the two top_k classes in two launches into one layout.
    PredictLaunch launch64, launch2048;
    RunPredict(rows, Setting{64, 0.4, gamma, 0}, launch64);
    RunPredict(rows, Setting{2048, 0.4, gamma, 0}, launch2048);
    if (::testing::Test::HasFatalFailure()) return;
    std::vector<int32_t> selected = launch2048.selected.ToHost<int32_t>();
    std::vector<int32_t> counts = launch2048.counts.ToHost<int32_t>();
    const std::vector<int32_t> selected64 = launch64.selected.ToHost<int32_t>();
    const std::vector<int32_t> counts64 = launch64.counts.ToHost<int32_t>();
    std::vector<int64_t> group_offset;
    for (int g = 0; g < num_groups; ++g) {
      group_offset.push_back(launch2048.offsets[first_row[g + 1] - 1]);
      if (g % 5 != 0) continue;
      for (int r = first_row[g]; r < first_row[g + 1]; ++r) {
        counts[r] = counts64[r];
        std::copy_n(selected64.begin() + launch64.offsets[r], counts64[r],
                    selected.begin() + launch2048.offsets[r]);
      }
    }
    DeviceBuffer dfirst = DeviceBuffer::From(first_row);
    DeviceBuffer doff = DeviceBuffer::From(launch2048.offsets);
    DeviceBuffer dsel = DeviceBuffer::From(selected), dcount = DeviceBuffer::From(counts);
    DeviceBuffer dgroup_off = DeviceBuffer::From(group_offset);
    DeviceBuffer dunion =
        DeviceBuffer::From(std::vector<int32_t>(launch2048.total + 1, kUnwritten));
    DeviceBuffer dunion_count = DeviceBuffer::From(std::vector<int32_t>(num_groups, kUnwritten));
    SpinUnionParams u;
    u.num_groups = num_groups;
    u.group_first_row = dfirst.as<int32_t>();
    u.row_block_offset = doff.as<int64_t>();
    u.selected = dsel.as<int32_t>();
    u.selected_count = dcount.as<int32_t>();
    u.group_block_offset = dgroup_off.as<int64_t>();
    u.union_blocks = dunion.as<int32_t>();
    u.union_count = dunion_count.as<int32_t>();
    const char* why = nullptr;
    ASSERT_TRUE(CanImplementSpinUnion(u, &why)) << why;
    DSA_CUDA_OK(LaunchSpinUnion(u, nullptr));
    DSA_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<int32_t> got = dunion.ToHost<int32_t>();
    const std::vector<int32_t> got_count = dunion_count.ToHost<int32_t>();
    for (int g = 0; g < num_groups; ++g) {
      SCOPED_TRACE(::testing::Message()
                   << "group " << g << " rows " << group_positions[g].size() << " first position "
                   << group_positions[g][0] << " gamma " << gamma);
      const BlockPlan plan = rows[first_row[g]].state->Plan(group_positions[g]);
      for (int r = first_row[g]; r < first_row[g + 1]; ++r) {
        const std::vector<int32_t>& want = plan.row_blocks[r - first_row[g]];
        ASSERT_EQ(counts[r], static_cast<int32_t>(want.size())) << "row " << r;
        ASSERT_TRUE(std::equal(want.begin(), want.end(), selected.begin() + launch2048.offsets[r]))
            << "row " << r;
      }
      ASSERT_EQ(got_count[g], static_cast<int32_t>(plan.blocks.size()));
      ASSERT_TRUE(
          std::equal(plan.blocks.begin(), plan.blocks.end(), got.begin() + group_offset[g]));
    }
    EXPECT_EQ(got[launch2048.total], kUnwritten);
  }
}

TEST(SpinPredictTest, SpeculativeUnionOf64Groups) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  CheckUnion(64, -1, 99);
}

// A group past 2^21 slots: B = 32,813 (the plan in the workspace, the union in two bitmap chunks).
TEST(SpinPredictTest, SpeculativeUnionPastOneChunk) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  CheckUnion(3, 2100000, 98);
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
  EXPECT_FALSE(CanImplementSpinPredict(p, &why));  // no max_visible_blocks
  EXPECT_NE(std::string(why).find("max_visible_blocks"), std::string::npos);
  EXPECT_EQ(LaunchSpinPredict(p, nullptr), cudaErrorInvalidValue);
  p.max_visible_blocks = kSpinSharedPlanBlocks;
  EXPECT_TRUE(CanImplementSpinPredict(p, &why));
  EXPECT_EQ(SpinPredictScratchBytes(p), 0u);
  p.exploration = SpinExploration::kStalenessScore;
  EXPECT_FALSE(CanImplementSpinPredict(p, &why));
  EXPECT_NE(std::string(why).find("random"), std::string::npos);
  p.exploration = SpinExploration::kRandom;
  p.max_visible_blocks = kSpinSharedPlanBlocks + 1;
  EXPECT_FALSE(CanImplementSpinPredict(p, &why));  // no total_blocks
  p.total_blocks = 3 * kSpinSharedPlanBlocks;
  EXPECT_EQ(SpinPredictScratchBytes(p), static_cast<size_t>(15 * kSpinSharedPlanBlocks));
  EXPECT_FALSE(CanImplementSpinPredict(p, &why));  // no workspace
  EXPECT_NE(std::string(why).find("workspace"), std::string::npos);
  p.exploration_fraction = 1.0;
  EXPECT_FALSE(CanImplementSpinPredict(p, &why));
  p.exploration_fraction = 0.0;
  EXPECT_TRUE(CanImplementSpinPredict(p, &why));  // no exploration: no workspace needed
  EXPECT_EQ(SpinPredictScratchBytes(p), 0u);
  p.target_block_sparsity = 1.0;
  EXPECT_FALSE(CanImplementSpinPredict(p, &why));
  SpinUnionParams u;
  EXPECT_TRUE(CanImplementSpinUnion(u, &why));
  EXPECT_EQ(LaunchSpinUnion(u, nullptr), cudaSuccess);
  u.num_groups = 2;
  EXPECT_FALSE(CanImplementSpinUnion(u, &why));
  EXPECT_EQ(LaunchSpinUnion(u, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace dsa::cuda
