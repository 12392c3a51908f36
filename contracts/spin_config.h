// SPIN's settings of one sequence (SPIN paper, section 3 and 4.6; DESIGN.md 4.2): what a caller
// chooses, carried from the coordinator and the attention worker to the indexer. The algorithm
// that uses them is indexer_service/spin.h.
#pragma once

#include <cstdint>
#include <optional>

namespace dsa {

/// How slot predictions pool into a block prediction (paper 4.6; kMax is the default).
enum class BlockPooling { kMax, kTop4Mean, kMean };
/// Where slot-to-block reduction happens (paper 4.6): A1 pools predicted slot scores (default);
/// A0 takes the top-K predicted slots and expands them to blocks; A2 keeps block-level EMAs.
enum class BlockReduction { kA1, kA0, kA2 };
/// How the exploration share of the budget is filled (paper 3.2.1 and 4.6).
enum class ExplorationPolicy { kRandom, kStalenessScore, kBlockAge };
/// Verifier rows' shared mask: the union of per-row masks (default) or row 0's mask for all rows.
enum class SpecMaskPolicy { kRowLocalUnion, kRow0Sharing };
/// Deferred EMA update after acceptance: rows 0..a in order (default) or row 0 only.
enum class SpecUpdatePolicy { kPrefixValid, kRow0 };

/// SPIN settings of one sequence (all its full layers). Defaults are the paper's end-to-end ones.
struct SpinConfig {
  bool enabled = true;                 // false = all-keep (every block scored)
  double target_block_sparsity = 0.4;  // rho, in [0, 1)
  double ema_decay = 0.5;              // a, in [0, 1)
  double exploration_fraction = 0.05;  // gamma, in [0, 1)
  BlockPooling pooling = BlockPooling::kMax;
  BlockReduction reduction = BlockReduction::kA1;
  ExplorationPolicy exploration = ExplorationPolicy::kRandom;
  SpecMaskPolicy spec_mask = SpecMaskPolicy::kRowLocalUnion;
  SpecUpdatePolicy spec_update = SpecUpdatePolicy::kPrefixValid;
  uint64_t seed = 0;  // exploration seed (mixed with layer and position)
  /// Adaptive sparsity (sparsity_controller.h): hold the audited miss rate near this target by
  /// moving rho, in (0, 1); 0 = rho fixed; unset = the indexer's default
  /// (IndexerOptions::miss_target).
  std::optional<double> miss_target;
};

}  // namespace dsa
