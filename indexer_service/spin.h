// SPIN, the shadow predictive indexer (SPIN paper, section 3 and Algorithm 1; DESIGN.md 4.2):
// per sequence and full layer, EMAs of past index scores along slots (V) and offsets (D) predict
// which 64-slot blocks matter, so the indexer scores only those.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "contracts/spin_config.h"

namespace dsa {

/// INVALID_ARGUMENT naming the field when rho, a, gamma or the miss target is outside [0, 1) or
/// not finite.
absl::Status ValidateSpinConfig(const SpinConfig& config);

/// Parses "max" | "top4" | "mean", "a0" | "a1" | "a2", "random" | "staleness" | "age".
absl::Status ParseBlockPooling(const std::string& name, BlockPooling* out);
absl::Status ParseBlockReduction(const std::string& name, BlockReduction* out);
absl::Status ParseExplorationPolicy(const std::string& name, ExplorationPolicy* out);

/// The blocks chosen for one decode step of one sequence and layer.
struct BlockPlan {
  /// Per row: the sorted logical blocks its own mask chose (what it would score alone).
  std::vector<std::vector<int32_t>> row_blocks;
  /// The sorted union over rows (what is scored; equal to row_blocks[0] for a single row).
  std::vector<int32_t> blocks;
  /// True when every visible block is scored (SPIN off, warm-up, or N_t <= K for every row).
  bool all_blocks = false;
  /// ceil(N_t / 64) of the last row: the blocks visible to the step.
  int64_t visible_blocks = 0;
};

/// The SPIN state of one sequence at one full layer: V[i] per slot, D[o] per offset, fp32, zero at
/// start (plus block-level EMAs for A2 and last-scored positions for block-age exploration).
/// Not thread-safe.
class SpinState {
 public:
  /// `config` must be valid (ValidateSpinConfig); top_k >= 1; layer is mixed into the seed.
  SpinState(const SpinConfig& config, int top_k, int layer);

  /// Chooses the blocks to score for verifier rows at `positions` (strictly increasing, >= 0; a
  /// plain decode step has one row). Steps 1-6 of DESIGN.md 4.2 per row, then the union (or row 0's
  /// mask with each row's newest block, under kRow0Sharing). The first call after construction or
  /// BeginTurn() is the warm-up: it scores every block and clears the warm-up flag. The two forced
  /// blocks are taken even when m_t < 2 (only possible with K <= 64), so a row never loses its sink
  /// or its own newest block; then the plan holds 2 blocks.
  BlockPlan Plan(std::span<const int64_t> positions);

  /// Applies step 8 for one row at `position`: for every scored slot i <= position (a finite
  /// entry of `scores`), V[i] = a V[i] + (1 - a) z[i] and D[position - i] likewise; unscored slots
  /// keep their values. `blocks` are the scored logical blocks and `scores` is fp32
  /// [blocks.size() * 64], laid out as ScoreBlocks' output for this row.
  void Update(int64_t position, std::span<const int32_t> blocks, std::span<const float> scores);

  /// Multi-turn reset (paper 3.2): V, D and the block EMAs go to zero; the next Plan is a warm-up.
  void BeginTurn();

  /// Predicted block scores S[j] for a row at `position` (A1/A0 slot pooling or A2 block EMAs),
  /// [ceil((position + 1) / 64)]. Exposed for tests and tools.
  std::vector<float> PredictBlockScores(int64_t position) const;

  bool warmup_pending() const { return warmup_pending_; }
  /// Moves rho (the adaptive-sparsity controller); in [0, 1).
  void set_target_block_sparsity(double rho) { config_.target_block_sparsity = rho; }
  /// For a device that plans in place of Plan (indexer_service/scoring_device.h): whether this
  /// select is the turn's warm-up, clearing the flag as Plan does.
  bool TakeWarmup() {
    const bool warmup = warmup_pending_;
    warmup_pending_ = false;
    return warmup;
  }
  /// Replaces V (fp32 per slot) and D (fp32 per offset t - i) with these, of any length (entries
  /// past it read as 0); the plan bookkeeping (warm-up flag, block ages) is kept. E.g. a device's
  /// copy, for GetSpinState.
  void SetEmas(std::vector<float> vertical, std::vector<float> diagonal) {
    vertical_ = std::move(vertical);
    diagonal_ = std::move(diagonal);
  }
  const std::vector<float>& vertical() const { return vertical_; }  // V, [slots seen]
  const std::vector<float>& diagonal() const { return diagonal_; }  // D, [offsets seen]

  /// m_t = min(B_t, max(ceil(K / 64), ceil((1 - rho) * B_t))) (Algorithm 1 line 4).
  static int64_t BlockBudget(int64_t visible_blocks, int top_k, double target_block_sparsity);

 private:
  std::vector<int32_t> PlanRow(int64_t position) const;
  void Explore(int64_t position, int64_t count, const std::vector<float>& predicted,
               std::vector<bool>& taken, std::vector<int32_t>& chosen) const;
  float V(int64_t slot) const {
    return slot < static_cast<int64_t>(vertical_.size()) ? vertical_[slot] : 0.0f;
  }
  float D(int64_t offset) const {
    return offset < static_cast<int64_t>(diagonal_.size()) ? diagonal_[offset] : 0.0f;
  }

  SpinConfig config_;
  int top_k_;
  int layer_;
  bool warmup_pending_ = true;
  std::vector<float> vertical_;
  std::vector<float> diagonal_;
  std::vector<float> block_vertical_;  // A2: per logical block
  std::vector<float> block_diagonal_;  // A2: per block offset
  std::vector<int64_t>
      block_last_scored_;  // position at which each block was last scored (-1 never)
};

}  // namespace dsa
