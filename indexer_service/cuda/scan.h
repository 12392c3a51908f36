// Scan on the GPU: index scores z_t[i] = s_i * sum_h w_t,h * ReLU(q_t,h . k_i) (DESIGN.md 2, 4.1)
// for a ragged batch of rows from many sequences, over a list of logical blocks per row group,
// reading the paged fp8 index-key cache. Rows of one group (the verifier rows of one sequence)
// share every key read. The CPU reference is ScoreBlocks (indexer_service/scoring.h).
// Framework-free: raw device pointers, sizes, a stream, a cudaError_t back.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dsa::cuda {

/// Element type of the indexer queries.
enum class QueryDtype : int { kFloat32 = 0, kBFloat16 = 1 };

/// Where the tensor-core scan converts the bf16 query to its f16 form (a per-row power-of-two
/// scale folded into the head weights). Both make the same f16 query and scaled weights, so the
/// same scores.
enum class ScanQueryPrep : int {
  /// kInKernel when num_rows <= num_groups (on average at most one row a group: each row's
  /// query is then converted about once per CTA), kWorkspace otherwise. The
  /// workspace is still required (ScanTensorCoresScratchBytes), so the choice never changes the
  /// contract.
  kAuto = 0,
  /// A first kernel converts every row once into the workspace; the scan reads it (two launches;
  /// best when groups have verifier rows, whose queries the scan reloads for every block).
  kWorkspace = 1,
  /// One launch: the scan CTA converts a row's bf16 query into shared memory when it reaches the
  /// row (no workspace; best for one row a group and short contexts, where the second launch
  /// cost ~5 us).
  kInKernel = 2,
};

/// One scan launch. All pointers are device pointers. A group is the rows of one (sequence, layer)
/// cache that score the same logical blocks; rows of group g are [group_first_row[g],
/// group_first_row[g + 1]) and its blocks are logical_blocks[group_block_offset[g] ..
/// group_block_offset[g + 1]).
struct ScanParams {
  /// Block pool base: blocks of 64 * (head_dim + 4) bytes (64 x head_dim fp8 e4m3 codes, then 64
  /// fp32 scales), as block_pool.h lays them out.
  const uint8_t* pool = nullptr;
  /// D, values per key and per query head.
  int head_dim = 0;
  /// H, query heads per row.
  int num_heads = 0;
  /// Number of groups (>= 0) and of rows (>= 0).
  int num_groups = 0;
  int num_rows = 0;
  /// int32 [num_groups + 1], non-decreasing, group_first_row[num_groups] == num_rows.
  const int32_t* group_first_row = nullptr;
  /// int64 [num_groups + 1], non-decreasing, from 0; the group's blocks in logical_blocks.
  const int64_t* group_block_offset = nullptr;
  /// Total blocks of all groups: group_block_offset[num_groups] (host copy; sets the grid). With
  /// device_total_blocks, an upper bound of it instead.
  int64_t total_blocks = 0;
  /// Optional device int64 [1]: the total when only the device knows it (a SPIN plan made on the
  /// GPU: the whole select then needs no host round trip and can be captured in a CUDA graph).
  /// The grid is sized for total_blocks; CTAs past the device total do nothing, and the
  /// tensor-core scan splits the device total over its CTAs.
  const int64_t* device_total_blocks = nullptr;
  /// int32 [total_blocks]: logical block ids (block j holds slots [64 j, 64 j + 64)), each < the
  /// group's ceil(num_slots / 64); any order.
  const int32_t* logical_blocks = nullptr;
  /// int64 [num_groups]: where group g's block table starts in block_tables.
  const int64_t* group_table_offset = nullptr;
  /// int32 [...]: concatenated block tables; logical block j of group g lives in pool block
  /// block_tables[group_table_offset[g] + j].
  const int32_t* block_tables = nullptr;
  /// int64 [num_groups]: filled slots of each group's cache; slots at or past it score -inf.
  const int64_t* group_num_slots = nullptr;
  /// [num_rows, num_heads, head_dim] row-major, fp32 or bf16 (query_dtype).
  const void* query = nullptr;
  QueryDtype query_dtype = QueryDtype::kFloat32;
  /// fp32 [num_rows, num_heads]: head weights w_t (query scale folded in).
  const float* head_weights = nullptr;
  /// int64 [num_rows]: the row's query position t; slots above it score -inf.
  const int64_t* row_position = nullptr;
  /// int64 [num_rows]: first entry of row r in `scores`.
  const int64_t* row_score_offset = nullptr;
  /// fp32 out: row r of group g gets (group_block_offset[g + 1] - group_block_offset[g]) * 64
  /// entries from scores[row_score_offset[r]]; entry j * 64 + s is the score of slot
  /// logical_blocks[group_block_offset[g] + j] * 64 + s, or -inf past the row's position or the
  /// group's filled slots (ScoreBlocks' layout).
  float* scores = nullptr;
  /// Tensor-core scan only: where the query is converted (see ScanQueryPrep).
  ScanQueryPrep query_prep = ScanQueryPrep::kAuto;
  /// Device scratch for the tensor-core scan (the query converted once per launch), 16-byte
  /// aligned, at least ScanTensorCoresScratchBytes(params) bytes (none with kInKernel); unused by
  /// the CUDA-core scan.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

/// The CUDA-core scan (fp32 FMA, any head_dim in [1, 256], any num_heads >= 1, fp32 or bf16
/// queries): one CTA per (group, block). On false, *why (when not null) names the reason.
bool CanImplementScanCudaCores(const ScanParams& params, const char** why = nullptr);
/// The tensor-core scan (f16 wgmma m64nNk16 on sm_90a, N = num_heads / 2 (the heads in two halves),
/// fp32 accumulation; fp8 keys
/// widened to f16 exactly in registers by one instruction a pair (A), the row's query as B in
/// shared memory; the bf16 query converted to f16 with a per-row power-of-two scale, folded back
/// through the head weights, either once per launch into the workspace or by the scan itself
/// (ScanQueryPrep); query-stationary, whole cache
/// blocks pipelined through shared memory by bulk asynchronous copies (TMA)): bf16 queries,
/// head_dim 64 or 128, num_heads 16, 32 or 64, a workspace of ScanTensorCoresScratchBytes (none
/// needed when query_prep is kInKernel).
bool CanImplementScanTensorCores(const ScanParams& params, const char** why = nullptr);

/// Workspace bytes of the CUDA-core scan: none.
inline size_t ScanCudaCoresScratchBytes(const ScanParams&) { return 0; }
/// Workspace bytes of the tensor-core scan: num_rows x num_heads x (2 head_dim + 4) (the f16
/// query and the scaled fp32 head weights); 0 when query_prep is kInKernel. kAuto asks for the
/// full size even where the launch then converts in the kernel.
size_t ScanTensorCoresScratchBytes(const ScanParams& params);

/// Launches the CUDA-core scan on `stream` (asynchronous). Scores match ScoreBlocks up to fp32
/// accumulation order. cudaErrorInvalidValue when CanImplementScanCudaCores fails.
cudaError_t LaunchScanCudaCores(const ScanParams& params, cudaStream_t stream);
/// Launches the tensor-core scan on `stream` (asynchronous; with kWorkspace two kernels: the
/// query conversion, then the scan; with kInKernel one). Same scores as ScoreBlocks with the query
/// rounded to bf16, up to accumulation order and the f16 rounding of query elements below 2^-28 of
/// their row's largest. cudaErrorInvalidValue when CanImplementScanTensorCores fails.
cudaError_t LaunchScanTensorCores(const ScanParams& params, cudaStream_t stream);

}  // namespace dsa::cuda
