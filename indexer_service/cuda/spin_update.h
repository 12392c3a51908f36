// SPIN's EMA update on the GPU (DESIGN.md 4.2 step 8; SPIN paper Algorithm 1): after a row is
// scored, V[i] and D[t - i] move toward each scored slot's index score. Bit-identical to
// SpinState::Update (indexer_service/spin.h) for the A1 reduction with random exploration, over a
// ragged batch of sequences whose verifier rows are replayed in order. Framework-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "indexer_service/cuda/spin_predict.h"

namespace dsa::cuda {

/// One launch over a ragged batch of groups. A group is one sequence's state at one full layer
/// (its own V and D) and the rows replayed into it, in order (a plain decode step has one row; the
/// deferred speculative replay has rows 0 .. a). The rows of a group share one list of scored
/// blocks, as the scan's groups do (ScanParams), and their scores keep the scan's layout. All
/// pointers are device pointers unless noted.
struct SpinUpdateParams {
  /// Number of groups (>= 0; 0 is a no-op; at most 65,535) and of rows (>= 0; an upper bound is
  /// enough: group_first_row, on the device, says which rows each group replays).
  int num_groups = 0;
  int num_rows = 0;
  /// int32 [num_groups + 1], non-decreasing, group_first_row[num_groups] <= num_rows: the rows of
  /// group g are [group_first_row[g], group_first_row[g + 1]), applied in that order.
  const int32_t* group_first_row = nullptr;
  /// int64 [num_groups + 1], non-decreasing: group g's scored blocks are
  /// logical_blocks[group_block_offset[g] .. group_block_offset[g + 1]).
  const int64_t* group_block_offset = nullptr;
  /// int32: logical block ids, strictly increasing within a group (as Plan and LaunchSpinUnion
  /// produce them; the kernel finds a slot's block by binary search). Blocks past a row's position
  /// are allowed (their slots are skipped for that row).
  const int32_t* logical_blocks = nullptr;
  /// int64 [num_rows]: the row's position t (>= 0).
  const int64_t* row_position = nullptr;
  /// int64 [num_rows]: where row r's scores start in `scores`.
  const int64_t* row_score_offset = nullptr;
  /// fp32: row r of group g has (its block count) x 64 entries from scores[row_score_offset[r]];
  /// entry j * 64 + s is the index score of slot logical_blocks[group_block_offset[g] + j] * 64 +
  /// s (the scan's layout). Non-finite entries (-inf: masked or unscored) leave V and D as they
  /// are.
  const float* scores = nullptr;
  /// [num_groups] device pointers: the group's V (fp32 per slot) and D (fp32 per offset), updated
  /// in place; each at least (max row position + 1) entries, and entries past the length the
  /// state had before must be zero (SpinState grows its vectors with zeros). Groups must not share
  /// arrays.
  float* const* vertical = nullptr;
  float* const* diagonal = nullptr;
  /// a of the SPIN config, in [0, 1): V = a V + (1 - a) z with a and 1 - a rounded to fp32 as
  /// SpinState does.
  double ema_decay = 0.5;
  /// The reduction and exploration of the SPIN config: only kA1 and kRandom (the others keep
  /// block-level EMAs or per-block last-scored positions, which this kernel does not update).
  SpinReduction reduction = SpinReduction::kA1;
  SpinExploration exploration = SpinExploration::kRandom;
  /// Host value, a hint that sizes the grid only: the largest row position + 1 of the launch
  /// (0: a default of 64 CTAs a group). Any value gives the same result.
  int64_t max_visible_slots = 0;
  /// Host value, a hint that sizes the grid only: the most rows a group of the launch has (0:
  /// unknown). With 1 (every group a plain decode step, as LaunchSelect's update), the grid is a
  /// quarter as wide and each thread keeps four scored entries in flight. Any value gives the same
  /// result.
  int max_group_rows = 0;
};

/// Whether SpinUpdateParams describe a launch this kernel supports; on false, *why (when not null)
/// names the reason (a static string).
bool CanImplementSpinUpdate(const SpinUpdateParams& params, const char** why = nullptr);

/// No workspace is needed: 0 bytes.
inline size_t SpinUpdateScratchBytes(const SpinUpdateParams&) { return 0; }

/// Grid (chunks x groups). A group of one row (a plain decode step): one warp a tile of 128 scored
/// entries (lane l taking entries l, l + 32, l + 64, l + 96, their loads in flight together),
/// updating V[slot] and D[t - slot] directly. A group of several rows (the replay): one thread per
/// slot index x up to the group's largest position, owning V[x] and D[x] and applying the rows in
/// order; for V[x] it finds block x / 64 in the group's list once (binary search), for D[x] and
/// row t the block of slot t - x. Each update is __fadd_rn(__fmul_rn(a, old), __fmul_rn(1 - a, z)):
/// SpinState's two fp32 products and an add, never an FMA, so V and D come out bit for bit as on
/// the CPU. V and D are read and written only where a slot was scored: 16 bytes a scored slot, plus
/// its 4-byte score a row. Asynchronous on `stream`; cudaErrorInvalidValue when
/// CanImplementSpinUpdate fails.
cudaError_t LaunchSpinUpdate(const SpinUpdateParams& params, cudaStream_t stream);

}  // namespace dsa::cuda
