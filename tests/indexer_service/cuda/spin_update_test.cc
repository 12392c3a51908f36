// GPU SPIN EMA update against the CPU SpinState::Update: V and D bit for bit after one or several
// rows replayed in order, on seeded states built by the CPU's own Update (so V and D hold realistic
// values), over position 0, rows with no finite score, blocks past a row's position, finite scores
// past the position (skipped), tie-heavy scores, several EMA decays, a 2^20-slot row and a ragged
// batch of 64 groups in one launch. Skips without a GPU.
#include "indexer_service/cuda/spin_update.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
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

// Scores of one row over `blocks`: uniform in [-1, 3) (quarters when `ties`), each entry unscored
// (-inf) with probability `unscored`; entries past the position are -inf as the scan writes them,
// or finite when `finite_past` (Update must skip them either way).
std::vector<float> RowScores(std::span<const int32_t> blocks, int64_t position, bool ties,
                             double unscored, bool finite_past, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> value(-1.0f, 3.0f);
  std::uniform_int_distribution<int> quarter(-4, 12);
  std::bernoulli_distribution masked(unscored);
  std::vector<float> scores;
  scores.reserve(blocks.size() * kBlockSize);
  for (int32_t block : blocks) {
    for (int s = 0; s < kBlockSize; ++s) {
      const int64_t slot = static_cast<int64_t>(block) * kBlockSize + s;
      float z = ties ? 0.25f * static_cast<float>(quarter(rng)) : value(rng);
      if (masked(rng) || (slot > position && !finite_past)) z = -INFINITY;
      scores.push_back(z);
    }
  }
  return scores;
}

// Each block of [0, num_blocks) with probability `keep`, ascending.
std::vector<int32_t> RandomBlocks(int64_t num_blocks, double keep, std::mt19937_64& rng) {
  std::bernoulli_distribution take(keep);
  std::vector<int32_t> blocks;
  for (int64_t j = 0; j < num_blocks; ++j) {
    if (take(rng)) blocks.push_back(static_cast<int32_t>(j));
  }
  return blocks;
}

// A state after the warm-up and a few CPU updates up to `history` (none when < 0).
SpinState MakeState(double decay, int64_t history, bool ties, std::mt19937_64& rng) {
  SpinConfig config;
  config.ema_decay = decay;
  SpinState state(config, 2048, /*layer=*/1);
  const int64_t zero = 0;
  state.Plan(std::span<const int64_t>(&zero, 1));
  if (history < 0) return state;
  for (int64_t p : {history / 3, (2 * history) / 3, history}) {
    const std::vector<int32_t> blocks = RandomBlocks(CeilDiv(p + 1, kBlockSize), 0.7, rng);
    state.Update(p, blocks, RowScores(blocks, p, ties, 0.1, false, rng));
  }
  return state;
}

// One group of a launch: its state (updated on the CPU as the reference), its rows' positions in
// replay order, the shared block list and each row's scores.
struct Group {
  SpinState state;
  std::vector<int64_t> positions;
  std::vector<int32_t> blocks;
  std::vector<std::vector<float>> scores;
};

// Copies every group's V and D to the device (zero padded to the largest position + 1, plus a
// guard of 64 zeros), runs one launch, applies the same rows on the CPU and compares bit for bit;
// the padding past the CPU's length must stay zero.
void CheckGroups(std::vector<Group>& groups, double decay) {
  const int n = static_cast<int>(groups.size());
  std::vector<DeviceBuffer> arrays;
  std::vector<float*> v_ptr(n), d_ptr(n);
  std::vector<int64_t> lengths(n);
  std::vector<int32_t> first_row{0}, blocks;
  std::vector<int64_t> block_offset{0}, positions, score_offset;
  std::vector<float> scores;
  int64_t max_slots = 0;
  for (int g = 0; g < n; ++g) {
    Group& group = groups[g];
    int64_t end = 0;
    for (int64_t t : group.positions) end = std::max(end, t + 1);
    max_slots = std::max(max_slots, end);
    const int64_t length =
        std::max<int64_t>({end, static_cast<int64_t>(group.state.vertical().size()),
                           static_cast<int64_t>(group.state.diagonal().size())}) +
        kBlockSize;
    lengths[g] = length;
    std::vector<float> v(length, 0.0f), d(length, 0.0f);
    std::copy(group.state.vertical().begin(), group.state.vertical().end(), v.begin());
    std::copy(group.state.diagonal().begin(), group.state.diagonal().end(), d.begin());
    arrays.push_back(DeviceBuffer::From(v));
    v_ptr[g] = arrays.back().as<float>();
    arrays.push_back(DeviceBuffer::From(d));
    d_ptr[g] = arrays.back().as<float>();
    for (size_t r = 0; r < group.positions.size(); ++r) {
      positions.push_back(group.positions[r]);
      score_offset.push_back(static_cast<int64_t>(scores.size()));
      scores.insert(scores.end(), group.scores[r].begin(), group.scores[r].end());
    }
    first_row.push_back(static_cast<int32_t>(positions.size()));
    blocks.insert(blocks.end(), group.blocks.begin(), group.blocks.end());
    block_offset.push_back(static_cast<int64_t>(blocks.size()));
  }
  DeviceBuffer dfirst = DeviceBuffer::From(first_row), doff = DeviceBuffer::From(block_offset);
  DeviceBuffer dblocks = DeviceBuffer::From(blocks), dpos = DeviceBuffer::From(positions);
  DeviceBuffer dscore_off = DeviceBuffer::From(score_offset), dscores = DeviceBuffer::From(scores);
  DeviceBuffer dv = DeviceBuffer::From(v_ptr), dd = DeviceBuffer::From(d_ptr);
  SpinUpdateParams p;
  p.num_groups = n;
  p.num_rows = static_cast<int>(positions.size());
  p.group_first_row = dfirst.as<int32_t>();
  p.group_block_offset = doff.as<int64_t>();
  p.logical_blocks = dblocks.as<int32_t>();
  p.row_position = dpos.as<int64_t>();
  p.row_score_offset = dscore_off.as<int64_t>();
  p.scores = dscores.as<float>();
  p.vertical = dv.as<float* const>();
  p.diagonal = dd.as<float* const>();
  p.ema_decay = decay;
  p.max_visible_slots = max_slots;
  const char* why = nullptr;
  ASSERT_TRUE(CanImplementSpinUpdate(p, &why)) << why;
  DSA_CUDA_OK(LaunchSpinUpdate(p, nullptr));
  DSA_CUDA_OK(cudaDeviceSynchronize());
  for (int g = 0; g < n; ++g) {
    Group& group = groups[g];
    for (size_t r = 0; r < group.positions.size(); ++r) {
      group.state.Update(group.positions[r], group.blocks, group.scores[r]);
    }
    const std::vector<float> got_v = arrays[2 * g].ToHost<float>();
    const std::vector<float> got_d = arrays[2 * g + 1].ToHost<float>();
    SCOPED_TRACE(::testing::Message()
                 << "group " << g << " rows " << group.positions.size() << " first position "
                 << group.positions[0] << " blocks " << group.blocks.size() << " decay " << decay);
    for (const bool vertical : {true, false}) {
      const std::vector<float>& want = vertical ? group.state.vertical() : group.state.diagonal();
      const std::vector<float>& got = vertical ? got_v : got_d;
      int64_t bad = 0;
      for (int64_t i = 0; i < lengths[g]; ++i) {
        const float w = i < static_cast<int64_t>(want.size()) ? want[i] : 0.0f;
        if (std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(w) && ++bad <= 5) {
          ADD_FAILURE() << (vertical ? "V[" : "D[") << i << "] " << got[i] << " want " << w;
        }
      }
      EXPECT_EQ(bad, 0) << (vertical ? "V" : "D");
    }
  }
}

// A group of `rows` rows at t, t + 1, ... (the verifier rows accepted by the replay) over blocks
// drawn from the newest row's visible blocks, plus `past` blocks beyond it.
Group MakeGroup(int64_t t, int rows, double decay, int64_t history, bool ties, double keep,
                int past, std::mt19937_64& rng) {
  Group group{MakeState(decay, history, ties, rng), {}, {}, {}};
  for (int r = 0; r < rows; ++r) group.positions.push_back(t + r);
  const int64_t visible = CeilDiv(t + rows, kBlockSize);
  group.blocks = RandomBlocks(visible, keep, rng);
  for (int k = 0; k < past; ++k) group.blocks.push_back(static_cast<int32_t>(visible + k));
  std::bernoulli_distribution finite_past(0.5);
  for (int r = 0; r < rows; ++r) {
    group.scores.push_back(RowScores(group.blocks, t + r, ties, 0.1, finite_past(rng), rng));
  }
  return group;
}

TEST(SpinUpdateTest, EdgeCasesAgainstCpu) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  for (const double decay : {0.5, 0.9, 0.3}) {
    std::mt19937_64 rng(7);
    std::vector<Group> groups;
    // Position 0 on an empty state and on one with history (V and D longer than the position).
    groups.push_back(MakeGroup(0, 1, decay, -1, false, 1.0, 0, rng));
    groups.push_back(MakeGroup(0, 1, decay, 500, false, 1.0, 0, rng));
    // A row with no finite score: nothing changes.
    {
      Group group = MakeGroup(3000, 1, decay, 3000, false, 1.0, 0, rng);
      for (float& z : group.scores[0]) z = -INFINITY;
      groups.push_back(std::move(group));
    }
    // Blocks past the position, with finite scores there.
    {
      Group group = MakeGroup(130, 1, decay, 100, false, 1.0, 3, rng);
      group.scores[0] = RowScores(group.blocks, 130, false, 0.0, true, rng);
      groups.push_back(std::move(group));
    }
    // Several rows replayed in order, across a block boundary, tie-heavy and not.
    groups.push_back(MakeGroup(2045, 5, decay, 2040, false, 0.6, 0, rng));
    groups.push_back(MakeGroup(4094, 4, decay, 4000, true, 0.6, 1, rng));
    groups.push_back(MakeGroup(63, 2, decay, 60, true, 1.0, 0, rng));
    // No scored block at all, and contexts that are not a multiple of 64.
    groups.push_back(MakeGroup(777, 1, decay, 700, false, 0.0, 0, rng));
    groups.push_back(MakeGroup(16384, 3, decay, 16000, false, 0.6, 0, rng));
    CheckGroups(groups, decay);
  }
}

// A 2^20-slot row (B = 16384) and a replay of 3 rows near it.
TEST(SpinUpdateTest, LongRowsAgainstCpu) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  std::mt19937_64 rng(11);
  std::vector<Group> groups;
  groups.push_back(MakeGroup(1048575, 1, 0.5, 1048000, false, 0.6, 0, rng));
  groups.push_back(MakeGroup(1048570, 3, 0.5, 900000, true, 0.6, 0, rng));
  CheckGroups(groups, 0.5);
}

// 64 independent groups of 1 to 5 rows at random positions in one launch.
TEST(SpinUpdateTest, RaggedBatchOf64Groups) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  std::mt19937_64 rng(2026);
  std::uniform_int_distribution<int64_t> position(0, 20000);
  std::uniform_int_distribution<int> rows(1, 5);
  std::uniform_real_distribution<double> keep(0.2, 1.0);
  std::vector<Group> groups;
  for (int g = 0; g < 64; ++g) {
    const int64_t t = g == 17 ? 131071 : position(rng);
    std::uniform_int_distribution<int64_t> history(-1, t + 100);
    groups.push_back(
        MakeGroup(t, rows(rng), 0.5, history(rng), g % 4 == 1, keep(rng), g % 7 == 3, rng));
  }
  CheckGroups(groups, 0.5);
}

TEST(SpinUpdateTest, CanImplementRefusals) {
  SpinUpdateParams p;
  const char* why = nullptr;
  EXPECT_TRUE(CanImplementSpinUpdate(p, &why));  // zero groups: a no-op
  EXPECT_EQ(LaunchSpinUpdate(p, nullptr), cudaSuccess);
  p.reduction = SpinReduction::kA2;
  EXPECT_FALSE(CanImplementSpinUpdate(p, &why));
  EXPECT_NE(std::string(why).find("A1"), std::string::npos);
  p.reduction = SpinReduction::kA1;
  p.exploration = SpinExploration::kBlockAge;
  EXPECT_FALSE(CanImplementSpinUpdate(p, &why));
  EXPECT_NE(std::string(why).find("random"), std::string::npos);
  p.exploration = SpinExploration::kRandom;
  p.ema_decay = 1.0;
  EXPECT_FALSE(CanImplementSpinUpdate(p, &why));
  p.ema_decay = 0.5;
  p.num_groups = 1;
  p.num_rows = 1;
  EXPECT_FALSE(CanImplementSpinUpdate(p, &why));  // null pointers
  EXPECT_EQ(LaunchSpinUpdate(p, nullptr), cudaErrorInvalidValue);
  p.num_groups = 70000;
  EXPECT_FALSE(CanImplementSpinUpdate(p, &why));
}

}  // namespace
}  // namespace dsa::cuda
