// Adaptive sparsity: holds a sequence's audited miss rate near a target by moving its SPIN target
// block sparsity rho, where the SPIN paper fixes rho per deployment (section 3.3). The indexer's
// dense-shadow audit (IndexerOptions::audit_fraction) is the feedback: after each select that says
// something about the miss rate, rho steps down by kSparsityDecrease when the observed miss is
// above the target and up by kSparsityIncrease otherwise (within [0, kMaxAdaptiveSparsity]). At
// equilibrium the steps balance: about one observation in six (0.01 / (0.05 + 0.01)) exceeds the
// target, so the controller holds the miss rate's 83rd percentile at the target, and a burst of
// misses is corrected five times faster than sparsity is regained (as TCP's AIMD backs off).
#pragma once

#include <algorithm>

namespace dsa {

/// How far rho moves down after a select whose miss exceeded the target, and up after one that did
/// not.
inline constexpr double kSparsityDecrease = 0.05;
inline constexpr double kSparsityIncrease = 0.01;
/// The most sparsity the controller moves to (m_t keeps at least a fifth of the blocks).
inline constexpr double kMaxAdaptiveSparsity = 0.8;

/// The target block sparsity after one observation: `observed_miss` (in [0, 1]: the mean miss
/// rate of a select's audited rows, or 0 for a select that pruned nothing because rho is 0) against
/// `miss_target` (in (0, 1)). `rho` in [0, kMaxAdaptiveSparsity].
inline double NextTargetSparsity(double rho, double observed_miss, double miss_target) {
  return observed_miss > miss_target ? std::max(0.0, rho - kSparsityDecrease)
                                     : std::min(kMaxAdaptiveSparsity, rho + kSparsityIncrease);
}

}  // namespace dsa
