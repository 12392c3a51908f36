// The attention side's MLA rows generated on the GPU: KV latent rows written
// into the paged bf16 pool through a block table, and the absorbed attention queries, bit-identical
// to the CPU's MlaKvRow / MlaAttentionQuery (attention_worker/mla_kv.h) through the one element
// definition of uniform_row.h. Framework-free: raw pointers, sizes, a stream, a cudaError_t back.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace dsa::cuda {

/// Latent rows of slots [first_slot, first_slot + num_slots) of one sequence at model layer
/// `layer`, into the paged pool (the layout of sparse_mla_decode.h: element (b * 64 + s) * 576 +
/// d).
struct MlaKvRowsParams {
  /// Philox key of the model (MlaKvRow's seed).
  uint64_t seed = 0;
  /// Model layer (>= 0).
  int layer = 0;
  /// First slot written (>= 0) and slots written (>= 0; 0 launches nothing).
  int64_t first_slot = 0;
  int64_t num_slots = 0;
  /// Device int32 [ceil((first_slot + num_slots) / 64)]: logical block j of the sequence lives in
  /// physical block block_table[j], in [0, num_physical_blocks).
  const int32_t* block_table = nullptr;
  /// Blocks in the pool (documents its extent; the kernel does not check entries against it).
  int64_t num_physical_blocks = 0;
  /// Device bf16 [num_physical_blocks, 64, 576]: rows of the slots are overwritten, nothing else.
  __nv_bfloat16* kv_pool = nullptr;
};

/// Absorbed queries of decode rows at one model layer: row r is MlaAttentionQuery(seed, layer,
/// positions[r]) with num_heads heads.
struct MlaQueryRowsParams {
  uint64_t seed = 0;
  /// Model layer (>= 0).
  int layer = 0;
  /// Rows (>= 0; 0 launches nothing).
  int num_rows = 0;
  /// Heads per row, in [1, 116508] (num_heads * 576 values below 2^26); 128 in DeepSeek-V3.2.
  int num_heads = 128;
  /// Device int64 [num_rows]: the rows' query positions (>= 0).
  const int64_t* positions = nullptr;
  /// Device bf16 out [num_rows, num_heads, 576].
  __nv_bfloat16* queries = nullptr;
};

/// Whether the launch is supported; on false, *why (when not null) names the reason.
bool CanImplementMlaKvRows(const MlaKvRowsParams& params, const char** why = nullptr);
bool CanImplementMlaQueryRows(const MlaQueryRowsParams& params, const char** why = nullptr);

/// Writes the rows on `stream` (asynchronous; one thread per 4 dims). cudaErrorInvalidValue when
/// the CanImplement check fails, else the launch error.
cudaError_t LaunchMlaKvRows(const MlaKvRowsParams& params, cudaStream_t stream);
cudaError_t LaunchMlaQueryRows(const MlaQueryRowsParams& params, cudaStream_t stream);

}  // namespace dsa::cuda
