// SPIN block prediction on the GPU (DESIGN.md 4.2 steps 2-6; SPIN paper eq. (1)-(2) and
// Algorithm 1): per row, the predicted block scores S[j] from the sequence's V and D EMAs,
// optionally the row's block plan with seeded random exploration, and the union of the plans of a
// group of verifier rows. Bit-identical to SpinState::PredictBlockScores, the same blocks as
// SpinState::Plan (indexer_service/spin.h). Framework-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dsa::cuda {

/// Mirrors dsa::BlockPooling (same order). Only kMax is implemented on the GPU.
enum class SpinPooling : int { kMax = 0, kTop4Mean = 1, kMean = 2 };
/// Mirrors dsa::BlockReduction (same order). Only kA1 is implemented on the GPU.
enum class SpinReduction : int { kA1 = 0, kA0 = 1, kA2 = 2 };
/// Mirrors dsa::ExplorationPolicy (same order). Only kRandom is implemented on the GPU (the other
/// two need the per-block last-scored positions, which the GPU does not keep).
enum class SpinExploration : int { kRandom = 0, kStalenessScore = 1, kBlockAge = 2 };

/// The largest max_visible_blocks whose plan runs in shared memory (S staged as 4-byte keys, plus a
/// 4-byte free list a block when more than 1,024 exploration draws are possible: at most 128 KiB):
/// 2^20 slots. Longer rows use the workspace under exploration (SpinPredictScratchBytes), and read
/// S from global memory without it.
inline constexpr int64_t kSpinSharedPlanBlocks = 16384;

/// One launch over a ragged batch of rows. All pointers are device pointers unless noted.
struct SpinPredictParams {
  /// Number of rows (>= 0; 0 is a no-op).
  int num_rows = 0;
  /// int64 [num_rows]: the row's position t. The row sees slots [0, t] and has
  /// B = ceil((t + 1) / 64) blocks; a row with t < 0 sees nothing: B = 0, nothing is written for
  /// it and its selected count is 0 (as PredictBlockScores(-1), an empty vector).
  const int64_t* positions = nullptr;
  /// [num_rows] device pointers to the row's V (fp32, per slot) and D (fp32, per offset), of
  /// vertical_len[r] and diagonal_len[r] (int64, >= 0) entries; slots or offsets at or past the
  /// length read as 0 (SpinState::V / D). Finite values. Rows may share arrays (verifier rows of
  /// one sequence); a pointer may be null when its length is 0.
  const float* const* vertical = nullptr;
  const int64_t* vertical_len = nullptr;
  const float* const* diagonal = nullptr;
  const int64_t* diagonal_len = nullptr;
  /// int64 [num_rows]: where row r's B entries start in `scores` (and in `selected`); when null,
  /// row r starts at r x row_block_stride (>= 1), which needs no array on the device.
  const int64_t* row_block_offset = nullptr;
  int64_t row_block_stride = 0;
  /// Pooling and reduction of the row's SPIN config (only kMax / kA1; see CanImplement).
  SpinPooling pooling = SpinPooling::kMax;
  SpinReduction reduction = SpinReduction::kA1;
  /// fp32 out: S[j] of row r at scores[row_block_offset[r] + j], j in [0, B).
  float* scores = nullptr;

  // Optional block plan (skipped when `selected` is null): the non-warm-up path of PlanRow.
  /// int32 out: row r's chosen blocks, ascending, at selected[row_block_offset[r] + i],
  /// i in [0, selected_count[r]); entries past the count are left as they were.
  int32_t* selected = nullptr;
  /// int32 out [num_rows]: how many blocks row r chose (B when t + 1 <= top_k); -1 when
  /// exploration is on and the row's B exceeds max_visible_blocks (nothing selected written).
  int32_t* selected_count = nullptr;
  /// K of the model (>= 1), rho and gamma of the config, both in [0, 1).
  int top_k = 0;
  double target_block_sparsity = 0.4;
  double exploration_fraction = 0.0;
  /// Exploration (gamma > 0 only): the policy (only kRandom), the sequence's exploration seed as
  /// SpinConfig::seed holds it (already mixed with the sequence id, MixSeed) and the full layer;
  /// draw i of row t is Philox4x32-10 word 0 of counter (t lo, t hi, i, layer) under key
  /// (seed lo, seed hi). `row_seed` (uint64 [num_rows], device, optional) gives each row its
  /// sequence's seed in a batch of sequences; when null every row uses `seed`. All rows of a
  /// launch share the layer.
  SpinExploration exploration = SpinExploration::kRandom;
  uint64_t seed = 0;
  const uint64_t* row_seed = nullptr;
  int layer = 0;
  /// Host values. max_visible_blocks: an upper bound of B over the rows; required (>= 1) with
  /// exploration, where it sizes the shared memory (<= kSpinSharedPlanBlocks) or, past that,
  /// selects the workspace; otherwise optional (0 = unknown). When set it also spreads kernel 1
  /// over B / 8 CTAs a row (one block a warp) instead of 64, and (<= kSpinSharedPlanBlocks) stages
  /// S in kernel 2's shared memory. total_blocks: the length of `scores`, every
  /// row_block_offset[r] + B <= total_blocks (sizes the workspace).
  int64_t max_visible_blocks = 0;
  int64_t total_blocks = 0;
  /// Device scratch, 16-byte aligned, of at least SpinPredictScratchBytes(params) bytes (null when
  /// that is 0).
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

/// Whether SpinPredictParams describe a launch this kernel supports; on false, *why (when not
/// null) names the reason (a static string).
bool CanImplementSpinPredict(const SpinPredictParams& params, const char** why = nullptr);

/// Workspace bytes: 0 without exploration or when max_visible_blocks <= kSpinSharedPlanBlocks
/// (the plan lives in shared memory); else 5 x total_blocks rounded up to 16 (an int32 free list
/// and a byte flag per block of every row).
size_t SpinPredictScratchBytes(const SpinPredictParams& params);

/// Kernel 1 (one warp per block, grid rows x block chunks): S[j] = max over the block's visible
/// slots i of max(V[i], D[t - i]), with std::max's and std::max_element's tie rules (the first of
/// equal values wins, so +0 / -0 come out as on the CPU). Kernel 2 (only when `selected` is set;
/// one CTA per row, S staged in shared memory as order-preserving keys when max_visible_blocks <=
/// kSpinSharedPlanBlocks, the forced and explored blocks keyed above every S): all blocks when
/// t + 1 <= top_k; otherwise the sink block 0 and the newest
/// block B - 1; then n = min(floor(gamma m_t + 0.5), m_t - forced) blocks explored by a partial
/// Fisher-Yates shuffle of blocks 1 .. B - 2 (draw i picks i + UniformBelow(word_i, B - 2 - i),
/// SpinState::Explore's draws: up to 1,024 draws made and resolved in parallel from the draws alone
/// (what each position held before each swap), more applied in order by one thread); then the best
/// m_t - forced - n remaining blocks by S (higher first, ties to the lower block) by an exact radix
/// select (four 8-bit histogram passes over S as ordered uint32, -0 as +0, then the lowest-numbered
/// blocks of the threshold value; one scan a 2,048-block tile writes the plan in ascending order),
/// where m_t = min(B, max(ceil(K / 64), ceil((1 - rho) B))) in fp64 as SpinState::BlockBudget.
/// Asynchronous on `stream`. cudaErrorInvalidValue when CanImplementSpinPredict fails.
cudaError_t LaunchSpinPredict(const SpinPredictParams& params, cudaStream_t stream);

/// The speculative union (DESIGN.md 4.2, SpecMaskPolicy::kRowLocalUnion): per group of verifier
/// rows, the sorted distinct union of the rows' plans (kernel 2's output), as SpinState::Plan's
/// `blocks`. One launch over a ragged batch of groups. Device pointers.
struct SpinUnionParams {
  /// Number of groups (>= 0; 0 is a no-op); at most 2^31 - 1.
  int num_groups = 0;
  /// int32 [num_groups + 1], non-decreasing: the rows of group g are [group_first_row[g],
  /// group_first_row[g + 1]).
  const int32_t* group_first_row = nullptr;
  /// int64 [rows]: where row r's list starts in `selected` (SpinPredictParams::row_block_offset).
  const int64_t* row_block_offset = nullptr;
  /// int32: row r's blocks, strictly increasing, at selected[row_block_offset[r] + i],
  /// i in [0, selected_count[r]) (kernel 2's output). A count <= 0 contributes nothing.
  const int32_t* selected = nullptr;
  const int32_t* selected_count = nullptr;
  /// int64 [num_groups]: where group g's union starts in union_blocks; room for (the largest
  /// block of its rows + 1) entries, e.g. the B of its newest row.
  const int64_t* group_block_offset = nullptr;
  /// int32 out: group g's union, ascending, at union_blocks[group_block_offset[g] + i],
  /// i in [0, union_count[g]); entries past the count are left as they were.
  int32_t* union_blocks = nullptr;
  /// int32 out [num_groups]: the size of each union.
  int32_t* union_count = nullptr;
};

/// Whether SpinUnionParams describe a launch LaunchSpinUnion supports; *why names the reason.
bool CanImplementSpinUnion(const SpinUnionParams& params, const char** why = nullptr);

/// No workspace: 0 bytes.
inline size_t SpinUnionScratchBytes(const SpinUnionParams&) { return 0; }

/// One CTA per group. A group of one row copies the row's list (already sorted and distinct);
/// otherwise a shared bitmap of 32,768 blocks at a time (exact for any B; rows' entries
/// are scanned once per 32,768-block chunk of the group's range), set by every row's entries, then
/// written in ascending order by a prefix sum of the words' population counts. Asynchronous on
/// `stream`; cudaErrorInvalidValue when CanImplementSpinUnion fails.
cudaError_t LaunchSpinUnion(const SpinUnionParams& params, cudaStream_t stream);

}  // namespace dsa::cuda
