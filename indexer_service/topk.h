// Top-K selection with DSA's rules (DESIGN.md 4.1): the K highest scores, ties to the lower slot,
// best first, -inf and NaN masked, -1 padding, never a slot beyond the row's position.
#pragma once

#include <cstdint>
#include <span>

namespace dsa {

/// Selects the top `k` slots of one row in linear time plus O(k log k): each entry becomes one
/// 64-bit rank (score, then slot); a threshold from a strided sample lets one SIMD pass keep only
/// candidates at or above it (falling back to every entry when fewer than k pass, so the result
/// never depends on the sample); radix narrowing handles heavy ties; introselect and a sort of the
/// k winners finish.
///
/// - scores: fp32 [n]; entry e is the score of slot SlotOf(e), where SlotOf(e) =
///   logical_blocks[e / 64] * 64 + e % 64 when `logical_blocks` is non-empty (then n must be
///   logical_blocks.size() * 64) and e itself otherwise.
/// - max_slot: the row's position t; slots above it are never selected.
/// - selection (out): int32 [k], best first; ties in score go to the lower slot; entries beyond the
///   number of selectable slots (score neither NaN nor -inf, slot <= max_slot) are -1. NaN counts
///   as -inf and -inf is never selected; +inf is a legal (largest) score. Entries of logical_blocks
///   must be distinct.
void SelectTopK(std::span<const float> scores, std::span<const int32_t> logical_blocks,
                int64_t max_slot, std::span<int32_t> selection);

/// Miss rate of a pruned selection against the dense one (SPIN paper section 4; DESIGN.md 2):
/// 1 - |pruned n dense| / |dense|, over the non-negative entries of both (int32 selections with -1
/// padding, any order). 0 when the dense selection is empty.
double SelectionMissRate(std::span<const int32_t> pruned, std::span<const int32_t> dense);

}  // namespace dsa
