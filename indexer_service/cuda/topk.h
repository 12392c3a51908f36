// Top-K on the GPU with DSA's rules (DESIGN.md 4.1): per row, the K highest scores, ties to the
// lower slot, best first, -inf and NaN masked, never a slot past the row's position, -1 padding.
// Same selections as SelectTopK (indexer_service/topk.h) on the same scores. Framework-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "contracts/limits.h"  // kMaxTopK: the largest K the kernel takes (its winners live in
                               // shared memory)

namespace dsa::cuda {

/// One top-K launch over a ragged batch of rows. All pointers are device pointers.
struct TopKParams {
  /// fp32 scores; row r's entries are scores[row_score_offset[r] + e], e in [0,
  /// row_num_entries[r]).
  const float* scores = nullptr;
  /// Number of rows (>= 0).
  int num_rows = 0;
  /// int64 [num_rows]: first entry of each row (64-bit: rows x width may pass 2^31).
  const int64_t* row_score_offset = nullptr;
  /// int64 [num_rows]: entries of each row, in [0, 2^31); 0 gives an all -1 selection.
  const int64_t* row_num_entries = nullptr;
  /// Optional int32 [...]: when not null, entry e of row r is slot
  /// logical_blocks[row_block_offset[r] + e / 64] * 64 + e % 64 (the scan's layout; the row's
  /// blocks are distinct); when null, entry e is slot e.
  const int32_t* logical_blocks = nullptr;
  /// int64 [num_rows]: where row r's blocks start in logical_blocks (unused when it is null).
  const int64_t* row_block_offset = nullptr;
  /// int64 [num_rows]: the row's position t; slots above it are never selected.
  const int64_t* row_max_slot = nullptr;
  /// K, in [1, kMaxTopK].
  int k = 0;
  /// int32 out [num_rows, k]: slots best first, -1 past the selectable ones.
  int32_t* selection = nullptr;
  /// Optional int32 [1] device counter (null: not counted): each row streamed from global memory
  /// (past 32K entries a CTA) whose sample did not hold its K best, or that skipped the sample,
  /// adds 1 (the row then took the select that reads it once a pass). For tests and profiles.
  int32_t* sampled_fallbacks = nullptr;
  /// Optional host bound on every row's entries (row_num_entries lives on the device); 0 = none,
  /// negative is refused. Where it says every CTA's chunk is held in shared memory, a kernel
  /// without the streamed rows' sampled gather runs: ~55 KB less code to fetch after a cold L2,
  /// ~9 us at one row (docs/history/gpu_kernels_steps.md, steps 18 and 19). A row past the
  /// bound is still selected exactly, by the slower streamed select.
  int64_t max_row_entries = 0;
};

/// Whether TopKParams describe a launch this kernel supports; on false, *why (when not null) names
/// the reason.
bool CanImplementTopK(const TopKParams& params, const char** why = nullptr);

/// No workspace is needed (candidates stay in shared memory): 0 bytes.
inline size_t TopKScratchBytes(const TopKParams&) { return 0; }

/// One thread-block cluster per row (1 to 16 CTAs, the most with which all rows' clusters are
/// resident at once), each CTA over a chunk of the row: held in shared memory when it has at most
/// 32K entries; else streamed, and first narrowed in one read to the ranks above a threshold
/// taken from a strided sample (the streamed select below runs instead when the sample misjudges
/// the row). An exact radix select on 64-bit ranks (order-preserving score bits << 32 | ~slot,
/// distinct, so ties go to the lower slot) by 11-bit histograms from the top, the bits every
/// selectable rank shares skipped, summed over the cluster in distributed shared memory, stops
/// when the K-th rank's bin is taken whole or the ranks at or above it fit CTA 0's candidate
/// buffer (exact counts: nothing can overflow or be dropped, however many scores are equal); CTA 0
/// then places each candidate by one counting pass (2,048 bins over the candidates' range, then
/// the larger ranks in its bin counted) and writes the K best in order (a radix select and a
/// bitonic sort when the bins are too crowded). DESIGN.md 4.1's order; docs/gpu_kernels.md,
/// "Top-K", has the figures. Asynchronous on `stream`. cudaErrorInvalidValue when CanImplementTopK
/// fails; cudaErrorInvalidDevice for a device index past 63; cudaErrorInvalidConfiguration when
/// no cluster fits the device; else the runtime's launch error.
cudaError_t LaunchTopK(const TopKParams& params, cudaStream_t stream);

}  // namespace dsa::cuda
