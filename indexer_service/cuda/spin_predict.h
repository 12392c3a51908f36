// SPIN block prediction on the GPU (DESIGN.md 4.2 steps 2-4 and 6; SPIN paper eq. (1)-(2) and
// Algorithm 1): per row, the predicted block scores S[j] from the sequence's V and D EMAs, and
// optionally the row's block plan without exploration. Bit-identical to SpinState::
// PredictBlockScores and, with exploration_fraction = 0, the same blocks as SpinState::Plan
// (indexer_service/spin.h). Framework-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dsa::cuda {

/// Mirrors dsa::BlockPooling (same order). Only kMax is implemented on the GPU.
enum class SpinPooling : int { kMax = 0, kTop4Mean = 1, kMean = 2 };
/// Mirrors dsa::BlockReduction (same order). Only kA1 is implemented on the GPU.
enum class SpinReduction : int { kA1 = 0, kA0 = 1, kA2 = 2 };

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
  /// int64 [num_rows]: where row r's B entries start in `scores` (and in `selected`).
  const int64_t* row_block_offset = nullptr;
  /// Pooling and reduction of the row's SPIN config (only kMax / kA1; see CanImplement).
  SpinPooling pooling = SpinPooling::kMax;
  SpinReduction reduction = SpinReduction::kA1;
  /// fp32 out: S[j] of row r at scores[row_block_offset[r] + j], j in [0, B).
  float* scores = nullptr;

  // Optional block plan (skipped when `selected` is null): the non-warm-up path of PlanRow.
  /// int32 out: row r's chosen blocks, ascending, at selected[row_block_offset[r] + i],
  /// i in [0, selected_count[r]); entries past the count are left as they were.
  int32_t* selected = nullptr;
  /// int32 out [num_rows]: how many blocks row r chose (B when t + 1 <= top_k).
  int32_t* selected_count = nullptr;
  /// K of the model (>= 1), rho of the config in [0, 1), gamma which must be 0 here (exploration
  /// is not on the GPU).
  int top_k = 0;
  double target_block_sparsity = 0.4;
  double exploration_fraction = 0.0;
};

/// Whether SpinPredictParams describe a launch this kernel supports; on false, *why (when not
/// null) names the reason (a static string).
bool CanImplementSpinPredict(const SpinPredictParams& params, const char** why = nullptr);

/// No workspace is needed: 0 bytes.
inline size_t SpinPredictScratchBytes(const SpinPredictParams&) { return 0; }

/// Kernel 1 (one warp per block, grid rows x block chunks): S[j] = max over the block's visible
/// slots i of max(V[i], D[t - i]), with std::max's and std::max_element's tie rules (the first of
/// equal values wins, so +0 / -0 come out as on the CPU). Kernel 2 (only when `selected` is set;
/// one CTA per row): all blocks when t + 1 <= top_k; otherwise the sink block 0 and the newest
/// block B - 1, then the best m_t - (forced) other blocks by S (higher first, ties to the lower
/// block; each block's rank counted against every other, exact for any B), where
/// m_t = min(B, max(ceil(K / 64), ceil((1 - rho) B))) in fp64 as SpinState::BlockBudget.
/// Asynchronous on `stream`. cudaErrorInvalidValue when CanImplementSpinPredict fails.
cudaError_t LaunchSpinPredict(const SpinPredictParams& params, cudaStream_t stream);

}  // namespace dsa::cuda
