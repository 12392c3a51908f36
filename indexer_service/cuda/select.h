// The whole select of a batch on the GPU (DESIGN.md 4.2 steps 1-8): per row
// SPIN's block plan (prediction, budget, forced blocks, seeded exploration, block top-m), per group
// of verifier rows the union, the scan of the chosen blocks, top-K per row and the EMA update, all
// on one stream with no host round trip (every count the later kernels need stays on the device),
// so the launch sequence can be captured in a CUDA graph and replayed. V and D stay on the GPU.
// Same selections and the same V and D bits as the CPU engine (SpinState::Plan, ScoreBlocks,
// SelectTopK, SpinState::Update) on the same scores. Framework-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "indexer_service/cuda/scan.h"

namespace dsa::cuda {

/// Which scan the select runs (ScanParams; the tensor-core one takes bf16 queries only).
enum class SelectScan : int { kTensorCores = 0, kCudaCores = 1 };

/// How a group picks its blocks.
enum class SelectPlan : int32_t {
  /// Every visible block (SPIN off, or the warm-up select of a turn: paper 3.2).
  kAllBlocks = 0,
  /// SPIN's plan from the group's V and D (which still gives every block while t + 1 <= K).
  kSpin = 1,
};

/// One launch: a ragged batch of groups (one (sequence, full layer) each, its rows sharing every
/// key read) at one layer with one SPIN configuration. Device pointers unless noted.
struct SelectParams {
  // ---- the cache and the rows (ScanParams' meaning) ----
  /// Block pool base: blocks of 64 x (head_dim + 4) bytes (fp8 e4m3 codes, then 64 fp32 scales).
  const uint8_t* pool = nullptr;
  int head_dim = 0;    // D
  int num_heads = 0;   // H
  int num_groups = 0;  // >= 0, at most 65,535
  int num_rows = 0;    // >= 0, at most 65,535
  /// int32 [num_groups + 1], non-decreasing, from 0 to num_rows; every group has >= 1 row.
  const int32_t* group_first_row = nullptr;
  /// int64 [num_groups]: where group g's block table starts in block_tables.
  const int64_t* group_table_offset = nullptr;
  /// int32 [...]: concatenated block tables; logical block j of group g lives in pool block
  /// block_tables[group_table_offset[g] + j].
  const int32_t* block_tables = nullptr;
  /// int64 [num_groups]: filled slots of each group's cache; slots at or past it score -inf.
  const int64_t* group_num_slots = nullptr;
  const void* query = nullptr;  // [num_rows, num_heads, head_dim], query_dtype
  QueryDtype query_dtype = QueryDtype::kBFloat16;
  const float* head_weights = nullptr;  // fp32 [num_rows, num_heads]
  /// int64 [num_rows]: the row's position t (< its group's num_slots); a group's rows strictly
  /// increasing (verifier rows t..t+d).
  const int64_t* row_position = nullptr;
  SelectScan scan = SelectScan::kTensorCores;

  // ---- SPIN, per group ----
  const SelectPlan* group_plan = nullptr;  // [num_groups]
  /// [num_groups] device pointers to the group's V (per slot) and D (per offset), fp32, each of
  /// `spin_capacity[g]` entries, zero past the entries SPIN has written (fresh state is all zero);
  /// the capacity must be > the group's newest row position when `update` is set.
  float* const* vertical = nullptr;
  float* const* diagonal = nullptr;
  const int64_t* spin_capacity = nullptr;  // int64 [num_groups]
  /// uint64 [num_groups]: the exploration seed (SpinConfig::seed mixed with the sequence id by
  /// MixSeed, common/philox.h, as the indexer stores it).
  const uint64_t* group_seed = nullptr;

  // ---- shared by the launch (host values) ----
  int top_k = 0;                       // K, in [1, kMaxTopK]
  double target_block_sparsity = 0.4;  // rho in [0, 1)
  double exploration_fraction = 0.05;  // gamma in [0, 1)
  double ema_decay = 0.5;              // a in [0, 1)
  int layer = 0;                       // mixed into the exploration draws
  /// Apply the EMA update for groups of one row (a decode step; SpinState::Update). Groups of
  /// several rows (verifier rows) never update here: their scores stay in `scores` for the
  /// deferred replay at Commit (LaunchSpinUpdate over rows 0..a).
  bool update = true;
  /// Host bound: the largest ceil((t + 1) / 64) over the rows, in [1, 2^25] (sizes the buffers,
  /// the per-row strides and the grids). It must not be below the true value: rows are written
  /// with that stride, so an underestimate overruns the next row's plan (undefined results).
  int64_t max_visible_blocks = 0;
  /// Host hint: every group_plan entry is kAllBlocks (the plan kernels are then not launched).
  /// Setting it when a group is kSpin is an error the pipeline cannot see (that group's rows
  /// would score no block).
  bool host_all_blocks = false;
  /// Host hint: no group_plan entry is kAllBlocks (the fill of every visible block, which would do
  /// nothing, is then not launched). Same caveat as host_all_blocks.
  bool host_no_all_blocks = false;

  // ---- outputs ----
  /// int32 [num_rows, top_k]: best first, ties to the lower slot, -1 padding.
  int32_t* selection = nullptr;
  /// fp32, room for num_rows x max_visible_blocks x 64: row r's scores from row_score_offset[r],
  /// (its group's block count) x 64 entries in the scan's layout.
  float* scores = nullptr;
  /// int64 [num_rows], written by the pipeline: row r's first entry in `scores`.
  int64_t* row_score_offset = nullptr;
  /// int32, room for num_groups x max_visible_blocks: group g's scored blocks, ascending, at
  /// [group_block_offset[g], group_block_offset[g + 1]).
  int32_t* group_blocks = nullptr;
  /// int64 [num_groups + 1], written by the pipeline; [num_groups] is the scored block total.
  int64_t* group_block_offset = nullptr;

  /// Device scratch, 16-byte aligned, of SelectScratchBytes(params) bytes.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

/// Whether SelectParams describe a launch this pipeline supports: at most 65,535 groups and rows,
/// K in [1, kMaxTopK], ema_decay in [0, 1), max_visible_blocks in [1, 2^25], bf16 queries for the
/// tensor-core scan, every array and the workspace set, and what CanImplementSpinPredict and the
/// chosen scan's CanImplement accept; on false, *why (when not null) names the reason (a static
/// string).
bool CanImplementSelect(const SelectParams& params, const char** why = nullptr);

/// Workspace bytes (0 without rows): per row and visible block 8 (the predicted block scores and
/// the plan), per group and visible block 4 more when some group has several rows (the unions),
/// 88 a row and 12 (16 with unions) a group of bookkeeping, the tensor-core scan's workspace
/// (ScanTensorCoresScratchBytes) and the plan's (SpinPredictScratchBytes: 5 bytes a row and
/// visible block past kSpinSharedPlanBlocks blocks with exploration), each rounded up to 16.
size_t SelectScratchBytes(const SelectParams& params);

/// Launches, on `stream`: a setup kernel (per-row SPIN inputs), LaunchSpinPredict with the plan
/// (rows of kAllBlocks groups skipped; not launched with host_all_blocks), a fill of every visible
/// block for those rows, LaunchSpinUnion (not when every group has one row: the plans are the
/// unions), a layout kernel (compacted block lists and score offsets, the block total on
/// the device), the scan with device_total_blocks, LaunchTopK and, with `update`,
/// LaunchSpinUpdate over the groups of one row. With host_all_blocks and at most 1,024 groups, one
/// kernel replaces setup, fill, union, layout and compact (each group's list is 0 .. its rows' most
/// visible blocks - 1), so the chain is that kernel, the scan, top-K and the update. No host
/// synchronisation, allocation or copy: capturable in a CUDA graph. cudaErrorInvalidValue when
/// CanImplementSelect fails, else the first launch error.
cudaError_t LaunchSelect(const SelectParams& params, cudaStream_t stream);

}  // namespace dsa::cuda
