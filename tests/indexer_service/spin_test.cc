// Tests of SPIN's state (indexer_service/spin.h; DESIGN.md 4.2, SPIN paper section 3): config
// validation, the block budget over a grid against exact integer arithmetic, hand-computed plans
// (forced blocks, max pooling of max(V, D), ties to the lower block), warm-up, exploration count
// and determinism, the EMA update against a hand-rolled EMA, and the verifier-row union.
#include "indexer_service/spin.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace dsa {
namespace {

using ::absl::StatusCode;
constexpr float kInf = std::numeric_limits<float>::infinity();

SpinConfig Config(double rho, double gamma, uint64_t seed = 0) {
  SpinConfig config;
  config.target_block_sparsity = rho;
  config.exploration_fraction = gamma;
  config.seed = seed;
  return config;
}

std::vector<int32_t> Iota(int32_t first, int32_t last_inclusive) {
  std::vector<int32_t> v;
  for (int32_t j = first; j <= last_inclusive; ++j) v.push_back(j);
  return v;
}

BlockPlan PlanOne(SpinState& state, int64_t position) {
  const int64_t positions[] = {position};
  return state.Plan(positions);
}

// Scores for one Update call over `blocks`: slot i gets value(i) if i <= position, -inf otherwise.
template <typename F>
std::vector<float> BlockScores(const std::vector<int32_t>& blocks, int64_t position, F value) {
  std::vector<float> scores(blocks.size() * 64);
  for (size_t j = 0; j < blocks.size(); ++j) {
    for (int s = 0; s < 64; ++s) {
      const int64_t slot = blocks[j] * 64LL + s;
      scores[j * 64 + s] = slot <= position ? value(slot) : -kInf;
    }
  }
  return scores;
}

float At(const std::vector<float>& v, int64_t i) {
  return i < static_cast<int64_t>(v.size()) ? v[i] : 0.0f;
}

// ---------------------------------------------------------------------------------------------
// Config

TEST(SpinConfigTest, ValidateRanges) {
  EXPECT_TRUE(ValidateSpinConfig(SpinConfig{}).ok());
  for (double bad : {-0.1, 1.0, 1.5, std::nan(""), std::numeric_limits<double>::infinity()}) {
    SpinConfig rho;
    rho.target_block_sparsity = bad;
    EXPECT_EQ(ValidateSpinConfig(rho).code(), StatusCode::kInvalidArgument) << "rho " << bad;
    SpinConfig decay;
    decay.ema_decay = bad;
    EXPECT_EQ(ValidateSpinConfig(decay).code(), StatusCode::kInvalidArgument) << "a " << bad;
    SpinConfig gamma;
    gamma.exploration_fraction = bad;
    EXPECT_EQ(ValidateSpinConfig(gamma).code(), StatusCode::kInvalidArgument) << "gamma " << bad;
  }
  for (double good : {0.0, 0.5, 0.999}) {
    SpinConfig config;
    config.target_block_sparsity = good;
    config.ema_decay = good;
    config.exploration_fraction = good;
    EXPECT_TRUE(ValidateSpinConfig(config).ok()) << good;
  }
}

TEST(SpinConfigTest, ParseNames) {
  BlockPooling pooling = BlockPooling::kMax;
  EXPECT_TRUE(ParseBlockPooling("top4", &pooling).ok());
  EXPECT_EQ(pooling, BlockPooling::kTop4Mean);
  EXPECT_TRUE(ParseBlockPooling("mean", &pooling).ok());
  EXPECT_EQ(pooling, BlockPooling::kMean);
  EXPECT_TRUE(ParseBlockPooling("max", &pooling).ok());
  EXPECT_EQ(pooling, BlockPooling::kMax);
  EXPECT_EQ(ParseBlockPooling("avg", &pooling).code(), StatusCode::kInvalidArgument);
  BlockReduction reduction = BlockReduction::kA1;
  EXPECT_TRUE(ParseBlockReduction("a0", &reduction).ok());
  EXPECT_EQ(reduction, BlockReduction::kA0);
  EXPECT_TRUE(ParseBlockReduction("a2", &reduction).ok());
  EXPECT_EQ(reduction, BlockReduction::kA2);
  EXPECT_EQ(ParseBlockReduction("A3", &reduction).code(), StatusCode::kInvalidArgument);
  ExplorationPolicy policy = ExplorationPolicy::kRandom;
  EXPECT_TRUE(ParseExplorationPolicy("age", &policy).ok());
  EXPECT_EQ(policy, ExplorationPolicy::kBlockAge);
  EXPECT_TRUE(ParseExplorationPolicy("staleness", &policy).ok());
  EXPECT_EQ(policy, ExplorationPolicy::kStalenessScore);
  EXPECT_TRUE(ParseExplorationPolicy("random", &policy).ok());
  EXPECT_EQ(policy, ExplorationPolicy::kRandom);
  EXPECT_EQ(ParseExplorationPolicy("", &policy).code(), StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// Budget

TEST(SpinBudgetTest, HandValues) {
  EXPECT_EQ(SpinState::BlockBudget(10, 2048, 0.4), 10);      // min(10, max(32, 6))
  EXPECT_EQ(SpinState::BlockBudget(100, 2048, 0.4), 60);     // max(32, 60)
  EXPECT_EQ(SpinState::BlockBudget(33, 2048, 0.5), 32);      // max(32, ceil(16.5) = 17)
  EXPECT_EQ(SpinState::BlockBudget(2048, 2048, 0.4), 1229);  // ceil(1228.8)
  EXPECT_EQ(SpinState::BlockBudget(1000, 64, 0.9), 100);
  EXPECT_EQ(SpinState::BlockBudget(1000, 65, 0.999), 2);  // ceil(65 / 64) = 2 beats ceil(1.0)
  EXPECT_EQ(SpinState::BlockBudget(10, 64, 0.7), 3);      // (1 - 0.7) * 10 = 3 exactly
  EXPECT_EQ(SpinState::BlockBudget(100, 64, 0.45), 55);   // (1 - 0.45) * 100 = 55 exactly
  EXPECT_EQ(SpinState::BlockBudget(7, 1, 0.0), 7);
}

// m_t = min(B, max(ceil(K / 64), ceil((1 - rho) B))) with rho = p / 100 in exact integer
// arithmetic: ceil((100 - p) B / 100).
TEST(SpinBudgetTest, GridAgainstIntegerArithmetic) {
  int mismatches = 0;
  for (int p = 0; p < 100; ++p) {
    const double rho = p / 100.0;
    for (int top_k : {1, 63, 64, 65, 2048}) {
      for (int64_t b = 1; b <= 700; ++b) {
        const int64_t kept = ((100 - p) * b + 99) / 100;
        const int64_t expected = std::min<int64_t>(b, std::max<int64_t>((top_k + 63) / 64, kept));
        const int64_t got = SpinState::BlockBudget(b, top_k, rho);
        if (got != expected && ++mismatches <= 10) {
          ADD_FAILURE() << "rho " << rho << " K " << top_k << " B " << b << ": got " << got
                        << ", expected " << expected;
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
}

// ---------------------------------------------------------------------------------------------
// Plans

TEST(SpinPlanTest, FirstPlanIsTheWarmUp) {
  SpinState state(Config(0.9, 0.0), 64, 0);
  EXPECT_TRUE(state.warmup_pending());
  BlockPlan plan = PlanOne(state, 4999);  // N = 5000 -> 79 blocks
  EXPECT_EQ(plan.blocks, Iota(0, 78));
  EXPECT_EQ(plan.row_blocks.size(), 1u);
  EXPECT_EQ(plan.row_blocks[0], Iota(0, 78));
  EXPECT_TRUE(plan.all_blocks);
  EXPECT_EQ(plan.visible_blocks, 79);
  EXPECT_FALSE(state.warmup_pending());
  // The next plan prunes: m = max(1, ceil(0.1 * 79)) = 8.
  plan = PlanOne(state, 4999);
  EXPECT_EQ(plan.blocks.size(), 8u);
  EXPECT_FALSE(plan.all_blocks);
  // BeginTurn brings the warm-up back and zeroes the EMAs.
  const std::vector<int32_t> all = Iota(0, 78);
  state.Update(4999, all, BlockScores(all, 4999, [](int64_t) { return 1.0f; }));
  state.BeginTurn();
  EXPECT_TRUE(state.warmup_pending());
  for (float v : state.vertical()) EXPECT_EQ(v, 0.0f);
  for (float v : state.diagonal()) EXPECT_EQ(v, 0.0f);
  EXPECT_TRUE(PlanOne(state, 4999).all_blocks);
}

TEST(SpinPlanTest, DisabledScoresEverything) {
  SpinConfig config = Config(0.9, 0.0);
  config.enabled = false;
  SpinState state(config, 64, 0);
  for (int64_t position : {0, 63, 64, 4999, 10000}) {
    const BlockPlan plan = PlanOne(state, position);
    EXPECT_EQ(plan.blocks, Iota(0, static_cast<int32_t>(position / 64))) << position;
    EXPECT_TRUE(plan.all_blocks);
  }
}

TEST(SpinPlanTest, NoPruningUpToKSlots) {
  SpinState state(Config(0.5, 0.0), 2048, 0);
  PlanOne(state, 100);  // warm-up
  for (int64_t position : {0, 63, 999, 2046, 2047}) {
    const BlockPlan plan = PlanOne(state, position);
    EXPECT_TRUE(plan.all_blocks) << position;
    EXPECT_EQ(plan.blocks, Iota(0, static_cast<int32_t>(position / 64)));
  }
  // N = 2049: B = 33, m = max(32, 17) = 32 -> one block skipped.
  const BlockPlan plan = PlanOne(state, 2048);
  EXPECT_EQ(plan.visible_blocks, 33);
  EXPECT_EQ(plan.blocks.size(), 32u);
  EXPECT_FALSE(plan.all_blocks);
  EXPECT_EQ(plan.blocks.front(), 0);
  EXPECT_EQ(plan.blocks.back(), 32);
}

// A hand case (K = 64, rho = 0.6, gamma = 0, a = 0.5). One update at position 639 (10 blocks) with
// z = 8 at slot 200 (block 3), 4 at slot 500 (block 7), 2 at slot 600 (block 9), 0 elsewhere:
//   V[200] = 4, V[500] = 2, V[600] = 1; D[439] = 4, D[139] = 2, D[39] = 1.
// Plan at t = 640 (N = 641, B = 11, m = ceil(0.4 * 11) = 5): max(V[i], D[640 - i]) is 4 at slots
// 200 and 201 (block 3), 2 at 500, 501 (block 7), 1 at 600, 601 (block 9); forced {0, 10} + the 3
// best {3, 7, 9} -> {0, 3, 7, 9, 10}.
// Plan at t = 700 (B = 11, m = 5): the diagonal moves: D[439] -> slot 261 (block 4), D[139] -> 561
// (block 8), D[39] -> 661 (block 10). S = {b3: 4, b4: 4, b7: 2, b8: 2, b9: 1, b10: 1}; forced
// {0, 10} + 3 best with ties to the lower block {3, 4, 7} -> {0, 3, 4, 7, 10}.
SpinState HandState(SpinConfig config = Config(0.6, 0.0)) {
  SpinState state(config, 64, 0);
  const std::vector<int32_t> all = Iota(0, 9);
  PlanOne(state, 639);  // warm-up
  state.Update(639, all, BlockScores(all, 639, [](int64_t i) {
                 return i == 200 ? 8.0f : i == 500 ? 4.0f : i == 600 ? 2.0f : 0.0f;
               }));
  return state;
}

TEST(SpinPlanTest, HandCaseVerticalAndDiagonal) {
  SpinState state = HandState();
  EXPECT_EQ(At(state.vertical(), 200), 4.0f);
  EXPECT_EQ(At(state.vertical(), 500), 2.0f);
  EXPECT_EQ(At(state.vertical(), 600), 1.0f);
  EXPECT_EQ(At(state.diagonal(), 439), 4.0f);
  EXPECT_EQ(At(state.diagonal(), 139), 2.0f);
  EXPECT_EQ(At(state.diagonal(), 39), 1.0f);

  const std::vector<float> s640 = state.PredictBlockScores(640);
  EXPECT_EQ(s640, (std::vector<float>{0, 0, 0, 4, 0, 0, 0, 2, 0, 1, 0}));
  const std::vector<float> s700 = state.PredictBlockScores(700);
  EXPECT_EQ(s700, (std::vector<float>{0, 0, 0, 4, 4, 0, 0, 2, 2, 1, 1}));

  EXPECT_EQ(PlanOne(state, 640).blocks, (std::vector<int32_t>{0, 3, 7, 9, 10}));
  EXPECT_EQ(PlanOne(state, 700).blocks, (std::vector<int32_t>{0, 3, 4, 7, 10}));
  // Planning does not change the state.
  EXPECT_EQ(At(state.vertical(), 200), 4.0f);
}

TEST(SpinPlanTest, VerifierRowsScoreTheUnion) {
  SpinState state = HandState();
  const int64_t positions[] = {640, 700};
  const BlockPlan plan = state.Plan(positions);
  ASSERT_EQ(plan.row_blocks.size(), 2u);
  EXPECT_EQ(plan.row_blocks[0], (std::vector<int32_t>{0, 3, 7, 9, 10}));
  EXPECT_EQ(plan.row_blocks[1], (std::vector<int32_t>{0, 3, 4, 7, 10}));
  EXPECT_EQ(plan.blocks, (std::vector<int32_t>{0, 3, 4, 7, 9, 10}));
  EXPECT_EQ(plan.visible_blocks, 11);
  EXPECT_FALSE(plan.all_blocks);
}

TEST(SpinPlanTest, Row0SharingUsesRow0MaskPlusEachNewestBlock) {
  SpinConfig config = Config(0.6, 0.0);
  config.spec_mask = SpecMaskPolicy::kRow0Sharing;
  SpinState state = HandState(config);
  // Row 0 at 639 (N = 640, B = 10, m = 4): S = {b3: 4, b7: 2 (D[139] -> 500), b9: 1}; forced
  // {0, 9}, best 2 of the rest {3, 7} -> {0, 3, 7, 9}. Row 1 at 640 adds its newest block 10.
  const int64_t positions[] = {639, 640};
  const BlockPlan plan = state.Plan(positions);
  EXPECT_EQ(plan.row_blocks[0], (std::vector<int32_t>{0, 3, 7, 9}));
  EXPECT_EQ(plan.blocks, (std::vector<int32_t>{0, 3, 7, 9, 10}));
}

TEST(SpinPlanTest, PoolingOptions) {
  // One update at position 127 over block 1 only, z(i) = i - 64 for i = 64..127 (a = 0.5):
  // V[i] = (i - 64) / 2 and D[127 - i] = (i - 64) / 2, so at t = 127 slot i of block 1 predicts
  // max(V[i], D[127 - i]) = (i - 64) / 2, and block 0 (offsets 64..127, never updated) predicts 0.
  for (BlockPooling pooling : {BlockPooling::kMax, BlockPooling::kTop4Mean, BlockPooling::kMean}) {
    SpinConfig config = Config(0.5, 0.0);
    config.pooling = pooling;
    SpinState state(config, 64, 0);
    const std::vector<int32_t> block1 = {1};
    state.Update(127, block1,
                 BlockScores(block1, 127, [](int64_t i) { return static_cast<float>(i - 64); }));
    const std::vector<float> predicted = state.PredictBlockScores(127);
    ASSERT_EQ(predicted.size(), 2u);
    EXPECT_EQ(predicted[0], 0.0f);
    // max: 63 / 2; top-4 mean: (63 + 62 + 61 + 60) / 8 = 30.75; mean: (0 + ... + 63) / 128 = 15.75.
    const float expected = pooling == BlockPooling::kMax        ? 31.5f
                           : pooling == BlockPooling::kTop4Mean ? 30.75f
                                                                : 15.75f;
    EXPECT_FLOAT_EQ(predicted[1], expected);
  }
}

TEST(SpinPlanTest, PartialNewestBlockPoolsOnlyVisibleSlots) {
  // Mean pooling over the newest block uses only the slots up to t: at t = 129 block 2 has slots
  // 128, 129. V[128] = 3, V[129] = 1 (z = 6, 2 at position 129); D[1] = 3, D[0] = 1:
  //   slot 128: max(3, D[1] = 3) = 3, slot 129: max(1, D[0] = 1) = 1 -> mean 2.
  SpinConfig config = Config(0.5, 0.0);
  config.pooling = BlockPooling::kMean;
  SpinState state(config, 64, 0);
  const std::vector<int32_t> block2 = {2};
  state.Update(129, block2,
               BlockScores(block2, 129, [](int64_t i) { return i == 128 ? 6.0f : 2.0f; }));
  const std::vector<float> predicted = state.PredictBlockScores(129);
  ASSERT_EQ(predicted.size(), 3u);
  EXPECT_FLOAT_EQ(predicted[2], 2.0f);
}

// ---------------------------------------------------------------------------------------------
// Randomized plan properties: forced blocks, size m_t, distinct sorted blocks, fill by S.

// Reference S[j] = max over visible slots i of block j of max(V[i], D[t - i]).
std::vector<float> ReferenceBlockScores(const SpinState& state, int64_t position) {
  const int64_t num_blocks = (position + 64) / 64;
  std::vector<float> s(num_blocks, -kInf);
  for (int64_t i = 0; i <= position; ++i) {
    const float z = std::max(At(state.vertical(), i), At(state.diagonal(), position - i));
    s[i / 64] = std::max(s[i / 64], z);
  }
  return s;
}

TEST(SpinPlanTest, RandomStatesForcedBlocksBudgetAndFill) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (double gamma : {0.0, 0.05, 0.3}) {
    for (double rho : {0.0, 0.3, 0.5, 0.8}) {
      for (int top_k : {64, 256}) {
        SpinState state(Config(rho, gamma, 17), top_k, 0);
        PlanOne(state, 3000);  // warm-up
        // A few random partial updates so V and D are non-trivial.
        for (int step = 0; step < 4; ++step) {
          const int64_t position = 1500 + 300 * step;
          std::vector<int32_t> blocks;
          for (int32_t j = 0; j <= position / 64; ++j) {
            if (uniform(rng) < 0.5f) blocks.push_back(j);
          }
          std::vector<float> scores = BlockScores(
              blocks, position, [&](int64_t) { return uniform(rng) < 0.9f ? 0.0f : uniform(rng); });
          state.Update(position, blocks, scores);
        }
        for (int64_t position : {2500LL, 2600LL, 3001LL, 3100LL, 4000LL}) {
          const int64_t b = position / 64 + 1;
          const BlockPlan plan = PlanOne(state, position);
          const std::vector<int32_t>& blocks = plan.row_blocks[0];
          if (position + 1 <= top_k) continue;
          const int64_t m = std::min<int64_t>(
              b, std::max<int64_t>((top_k + 63) / 64,
                                   static_cast<int64_t>(std::ceil((1 - rho) * b - 1e-9))));
          EXPECT_EQ(static_cast<int64_t>(blocks.size()), m) << "rho " << rho << " t " << position;
          EXPECT_TRUE(std::is_sorted(blocks.begin(), blocks.end()));
          EXPECT_EQ(std::set<int32_t>(blocks.begin(), blocks.end()).size(), blocks.size());
          EXPECT_EQ(blocks.front(), 0);
          EXPECT_EQ(blocks.back(), b - 1);
          EXPECT_EQ(plan.blocks, blocks);
          const std::vector<float> s = ReferenceBlockScores(state, position);
          EXPECT_EQ(state.PredictBlockScores(position), s);
          if (gamma != 0.0) continue;
          // gamma = 0: the rest is exactly the m - 2 best S among blocks 1..B-2 (ties: lower
          // block).
          std::vector<int32_t> middle = Iota(1, static_cast<int32_t>(b - 2));
          std::stable_sort(middle.begin(), middle.end(),
                           [&](int32_t x, int32_t y) { return s[x] > s[y]; });
          std::vector<int32_t> expected(middle.begin(), middle.begin() + (m - 2));
          expected.push_back(0);
          expected.push_back(static_cast<int32_t>(b - 1));
          std::sort(expected.begin(), expected.end());
          EXPECT_EQ(blocks, expected) << "rho " << rho << " K " << top_k << " t " << position;
        }
      }
    }
  }
}

// Ablation options (paper 4.6), by hand.
TEST(SpinPlanTest, A0ExpandsTheTopKPredictedSlotsToBlocks) {
  // K = 2, the hand state's updates: predicted slot scores 4 at 200, 2 at 500, 1 at 600 (V and D
  // coincide at t = 639). Top-2 slots 200, 500 -> blocks 3, 7; forced 0, 9; gamma 0.
  SpinConfig config = Config(0.6, 0.0);
  config.reduction = BlockReduction::kA0;
  SpinState state(config, 2, 0);
  const std::vector<int32_t> all = Iota(0, 9);
  PlanOne(state, 639);
  state.Update(639, all, BlockScores(all, 639, [](int64_t i) {
                 return i == 200 ? 8.0f : i == 500 ? 4.0f : i == 600 ? 2.0f : 0.0f;
               }));
  EXPECT_EQ(PlanOne(state, 639).blocks, (std::vector<int32_t>{0, 3, 7, 9}));
}

TEST(SpinPlanTest, A2KeepsBlockLevelEmas) {
  // Update at t = 127 (newest block 1) over blocks {0, 1}: block 0 observes max 2 (slot 5), block 1
  // observes 0. a = 0.5: block V[0] = 1, block D[1 - 0] = 1; block V[1] = 0, block D[0] = 0.
  // Predicted at t = 191 (newest block 2): S[j] = max(block V[j], block D[2 - j]):
  //   j = 0: max(1, D[2] = 0) = 1; j = 1: max(0, D[1] = 1) = 1; j = 2: max(0, D[0] = 0) = 0.
  SpinConfig config = Config(0.5, 0.0);
  config.reduction = BlockReduction::kA2;
  SpinState state(config, 64, 0);
  const std::vector<int32_t> both = {0, 1};
  state.Update(127, both, BlockScores(both, 127, [](int64_t i) { return i == 5 ? 2.0f : 0.0f; }));
  EXPECT_EQ(state.PredictBlockScores(191), (std::vector<float>{1.0f, 1.0f, 0.0f}));
}

TEST(SpinPlanTest, BlockAgeExplorationTakesTheLeastRecentlyScoredBlocks) {
  // B = 10 (t = 639), K = 64, rho = 0.6 -> m = 4; gamma = 0.5 -> n_explore = 2 (capacity 2).
  // Every block scored at t = 600, then blocks {0, 1, 2, 9} at t = 620: the oldest blocks are 3..8
  // (age 39); the two lowest of them are explored -> {0, 3, 4, 9}.
  SpinConfig config = Config(0.6, 0.5);
  config.exploration = ExplorationPolicy::kBlockAge;
  SpinState state(config, 64, 0);
  PlanOne(state, 639);
  const std::vector<int32_t> all = Iota(0, 9);
  state.Update(600, all, BlockScores(all, 600, [](int64_t) { return 0.0f; }));
  const std::vector<int32_t> recent = {0, 1, 2, 9};
  state.Update(620, recent, BlockScores(recent, 620, [](int64_t) { return 0.0f; }));
  EXPECT_EQ(PlanOne(state, 639).blocks, (std::vector<int32_t>{0, 3, 4, 9}));
}

// ---------------------------------------------------------------------------------------------
// Exploration

// With V = D = 0 after the warm-up every S is 0, so the fill takes the lowest free blocks. Then
// the plan minus the forced blocks is E (explored) plus a fill F = the lowest blocks not in E; the
// longest run 1, 2, ..., L in the plan holds F and maybe some of E, and every block above the run
// is explored. So u = |plan \ ({0, B-1} + run)| <= n_explore, with equality whenever no explored
// block fell into the run; over 40 seeds that happens for some seed (each explored block lands in
// the run with probability about m / B).
int64_t ExploredAboveRun(const std::vector<int32_t>& blocks, int64_t num_blocks) {
  std::set<int32_t> chosen(blocks.begin(), blocks.end());
  int32_t run = 0;
  while (chosen.count(run + 1) && run + 1 < num_blocks - 1) ++run;
  int64_t above = 0;
  for (int32_t j : blocks) {
    if (j > run && j != num_blocks - 1) ++above;
  }
  return above;
}

TEST(SpinExplorationTest, CountIsRoundedGammaTimesBudgetCappedByCapacity) {
  struct Case {
    int64_t num_blocks;
    double rho, gamma;
    int64_t m, n_explore;  // by hand
  };
  // K = 64, so m = ceil((1 - rho) B); n_explore = min(floor(gamma m + 0.5), m - 2).
  const Case cases[] = {
      {400, 0.9, 0.05, 40, 2},       // 0.05 * 40 = 2
      {400, 0.9, 0.1, 40, 4},        //
      {400, 0.9, 0.25, 40, 10},      //
      {400, 0.95, 0.05, 20, 1},      // 1.0 + 0.5 -> 1
      {400, 0.95, 0.2, 20, 4},       //
      {400, 0.95, 0.5, 20, 10},      //
      {400, 0.99, 0.5, 4, 2},        // 2, capacity 2
      {400, 0.99, 0.9, 4, 2},        // floor(4.1) = 4 capped by capacity 4 - 2 = 2
      {400, 0.995, 0.5, 2, 0},       // capacity 0
      {400, 0.9, 0.0, 40, 0},        //
      {400, 0.975, 0.25, 10, 3},     // 2.5 + 0.5 -> 3 (a half rounds up)
      {4000, 0.9775, 0.35, 90, 32},  // 0.35 * 90 = 31.5 -> 32
  };
  for (const Case& c : cases) {
    const int64_t position = c.num_blocks * 64 - 1;
    int64_t max_above = 0;
    for (uint64_t seed = 1; seed <= 40; ++seed) {
      SpinState state(Config(c.rho, c.gamma, seed), 64, 0);
      PlanOne(state, position);  // warm-up, no update: V = D = 0
      const BlockPlan plan = PlanOne(state, position);
      const std::vector<int32_t>& blocks = plan.row_blocks[0];
      ASSERT_EQ(static_cast<int64_t>(blocks.size()), c.m)
          << "rho " << c.rho << " gamma " << c.gamma;
      EXPECT_EQ(std::set<int32_t>(blocks.begin(), blocks.end()).size(), blocks.size());
      EXPECT_EQ(blocks.front(), 0);
      EXPECT_EQ(blocks.back(), c.num_blocks - 1);
      const int64_t above = ExploredAboveRun(blocks, c.num_blocks);
      EXPECT_LE(above, c.n_explore) << "rho " << c.rho << " gamma " << c.gamma << " seed " << seed;
      max_above = std::max(max_above, above);
    }
    EXPECT_EQ(max_above, c.n_explore) << "rho " << c.rho << " gamma " << c.gamma << " m " << c.m;
  }
}

TEST(SpinExplorationTest, SameSeedSameDrawsOtherSeedLayerOrStepOtherDraws) {
  // t in [19072, 19112]: N = t + 1 in [19073, 19113] -> B = 299 throughout; rho 0.9 -> m = 30;
  // gamma 0.25 -> n_explore = floor(7.5 + 0.5) = 8.
  auto plan_of = [](uint64_t seed, int layer, int64_t t) {
    SpinState state(Config(0.9, 0.25, seed), 64, layer);
    PlanOne(state, t);  // warm-up; V = D = 0 after it
    return PlanOne(state, t).blocks;
  };
  int differ_seed = 0, differ_layer = 0, differ_step = 0;
  for (int64_t t = 19072; t < 19082; ++t) {
    const std::vector<int32_t> a = plan_of(11, 0, t);
    ASSERT_EQ(a.size(), 30u);
    EXPECT_EQ(a, plan_of(11, 0, t)) << "same seed, layer and step must draw the same blocks";
    if (a != plan_of(12, 0, t)) ++differ_seed;
    if (a != plan_of(11, 1, t)) ++differ_layer;
    if (a != plan_of(11, 0, t + 30)) ++differ_step;
  }
  // Eight draws from 297 blocks: two streams agreeing on all eight is essentially impossible.
  EXPECT_EQ(differ_seed, 10);
  EXPECT_EQ(differ_layer, 10);
  EXPECT_EQ(differ_step, 10);
}

TEST(SpinExplorationTest, ExploredBlocksCoverEveryCandidate) {
  // B = 40 (t in [2496, 2559]), rho 0.9 -> m = 4, gamma 0.5 -> 2 explored (the whole capacity
  // left after the forced blocks 0 and 39). Uniform draws over the 38 middle blocks: over 10 seeds
  // x 64 steps (1,280 draws) every middle block comes up.
  std::vector<int> hits(40, 0);
  for (uint64_t seed = 1; seed <= 10; ++seed) {
    SpinState state(Config(0.9, 0.5, seed), 64, 0);
    PlanOne(state, 2496);
    for (int64_t t = 2496; t < 2560; ++t) {
      const std::vector<int32_t> blocks = PlanOne(state, t).blocks;
      ASSERT_EQ(blocks.size(), 4u);
      ASSERT_EQ(blocks.front(), 0);
      ASSERT_EQ(blocks.back(), 39);
      for (int32_t j : blocks) ++hits[j];
    }
  }
  for (int j = 1; j < 39; ++j) EXPECT_GT(hits[j], 0) << "block " << j << " never explored";
}

// ---------------------------------------------------------------------------------------------
// EMA update

TEST(SpinUpdateTest, HandRolledEma) {
  SpinConfig config = Config(0.5, 0.0);
  config.ema_decay = 0.75;  // V = 0.75 V + 0.25 z
  SpinState state(config, 64, 0);
  // Step 1 at position 70 over block 1 (slots 64..70 visible): z(i) = i - 60.
  const std::vector<int32_t> block1 = {1};
  state.Update(70, block1,
               BlockScores(block1, 70, [](int64_t i) { return static_cast<float>(i - 60); }));
  for (int64_t i = 0; i < 64; ++i) EXPECT_EQ(At(state.vertical(), i), 0.0f) << i;
  for (int64_t i = 64; i <= 70; ++i) EXPECT_EQ(At(state.vertical(), i), 0.25f * (i - 60)) << i;
  // D[70 - i] = 0.25 (i - 60) for i in 64..70: D[0..6] = 2.5, 2.25, ..., 1.0; D[7..] = 0.
  for (int64_t o = 0; o <= 6; ++o) EXPECT_EQ(At(state.diagonal(), o), 0.25f * (10 - o)) << o;
  for (int64_t o = 7; o < 80; ++o) EXPECT_EQ(At(state.diagonal(), o), 0.0f) << o;

  // Step 2 at position 71 over blocks {0, 1}, with slot 65 unscored (-inf) and slot 3 NaN:
  // z(i) = 4 for every other visible slot.
  const std::vector<int32_t> both = {0, 1};
  std::vector<float> scores = BlockScores(both, 71, [](int64_t) { return 4.0f; });
  scores[64 + 1] = -kInf;
  scores[3] = std::numeric_limits<float>::quiet_NaN();
  state.Update(71, both, scores);
  for (int64_t i = 0; i <= 71; ++i) {
    float expected = i >= 64 && i <= 70 ? 0.25f * (i - 60) : 0.0f;  // after step 1
    if (i != 65 && i != 3) expected = 0.75f * expected + 0.25f * 4.0f;
    EXPECT_FLOAT_EQ(At(state.vertical(), i), expected) << "V[" << i << "]";
  }
  // D after step 2: start from step 1's D, then for every scored i: D[71 - i] updated with 4.
  std::vector<float> d(80, 0.0f);
  for (int64_t i = 64; i <= 70; ++i) d[70 - i] = 0.25f * (i - 60);
  for (int64_t i = 0; i <= 71; ++i) {
    if (i == 65 || i == 3) continue;
    d[71 - i] = 0.75f * d[71 - i] + 0.25f * 4.0f;
  }
  for (int64_t o = 0; o < 80; ++o)
    EXPECT_FLOAT_EQ(At(state.diagonal(), o), d[o]) << "D[" << o << "]";
}

TEST(SpinUpdateTest, SlotsBeyondThePositionAreIgnored) {
  // Scores finite past the position (as for a verifier row whose later slots exist) must not touch
  // V or D: Update(position) uses only slots i <= position.
  SpinState state(Config(0.5, 0.0), 64, 0);
  const std::vector<int32_t> block0 = {0};
  std::vector<float> scores(64, 2.0f);
  state.Update(10, block0, scores);
  for (int64_t i = 0; i <= 10; ++i) EXPECT_EQ(At(state.vertical(), i), 1.0f);
  for (int64_t i = 11; i < 64; ++i) EXPECT_EQ(At(state.vertical(), i), 0.0f) << i;
  for (int64_t o = 0; o <= 10; ++o) EXPECT_EQ(At(state.diagonal(), o), 1.0f);
  for (int64_t o = 11; o < 64; ++o) EXPECT_EQ(At(state.diagonal(), o), 0.0f) << o;
}

}  // namespace
}  // namespace dsa
