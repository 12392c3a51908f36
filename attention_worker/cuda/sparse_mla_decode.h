// Sparse MLA decode on the GPU: each decode row's 128 query heads attend the
// K latent rows its selection names in a paged MLA KV cache, in DeepSeek-V3.2's decode shape (the
// heads share one 576-dim latent key per slot; the value is its first 512 dims). The CPU
// reference is dsa::MlaSparseDecode (attention_worker/mla_sparse_attention.h), on the same bytes.
// Framework-free: raw device pointers, sizes, a stream, a cudaError_t back.
//
// KV cache layout (the same as the CPU reference's): a pool of num_physical_blocks blocks, each
// 64 slots x 576 bf16, row-major: element (b * 64 + s) * 576 + d is dim d of row s of block b
// (1152 bytes a slot, 73,728 bytes a block). Dims [0, 512) are the "nope" latent (the value),
// dims [512, 576) the RoPE part of the key. Slot i of row r's sequence lives in physical block
// block_tables[r * max_blocks_per_row + i / 64], row i % 64.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "contracts/layout.h"

namespace dsa::cuda {

/// Which tensor-core instructions the tensor-core kernel uses.
enum class SparseMlaMma : int {
  /// kWgmma (the faster on the H200: docs/attention_gpu.md).
  kAuto = 0,
  /// Warp-level mma.sync m16n8k16 with ldmatrix from swizzled shared memory (sm_80 and later
  /// instructions; built for sm_90a here).
  kMmaSync = 1,
  /// Warpgroup-level wgmma m64nNk16 reading both operands from 128-byte-swizzled shared memory
  /// through matrix descriptors (sm_90a).
  kWgmma = 2,
};

/// One sparse MLA decode launch. All pointers are device pointers.
struct SparseMlaDecodeParams {
  /// bf16 [num_physical_blocks, 64, 576]: the latent pool (layout above).
  const __nv_bfloat16* kv_pool = nullptr;
  /// Blocks in the pool (only documents the pool's extent; block-table entries must be below it).
  int64_t num_physical_blocks = 0;
  /// Rows in the batch (>= 0; 0 launches nothing).
  int num_rows = 0;
  /// H, query heads per row: a multiple of 64 (64 or 128 in DeepSeek-V3.x).
  int num_heads = 128;
  /// bf16 [num_rows, num_heads, 576]: the absorbed queries (nope dims, then RoPE dims).
  const __nv_bfloat16* query = nullptr;
  /// int32 [num_rows, max_blocks_per_row]: logical block j of row r's sequence is physical block
  /// block_tables[r * max_blocks_per_row + j], in [0, num_physical_blocks).
  const int32_t* block_tables = nullptr;
  int max_blocks_per_row = 0;
  /// int32 [num_rows]: filled slots of the row's sequence, <= 64 * max_blocks_per_row.
  const int32_t* num_slots = nullptr;
  /// int32 [num_rows]: the row's query position t (it sees slots 0..t inclusive).
  const int32_t* positions = nullptr;
  /// int32 [num_rows, top_k]: the row's selection (slot ids, -1 unused). An entry that is
  /// negative, > the row's position or >= its num_slots is skipped (nothing is read for it).
  const int32_t* selections = nullptr;
  /// K, entries per selection (>= 1; 2048 in DeepSeek-V3.2).
  int top_k = 2048;
  /// Multiplies q . k before the softmax; 0 means 1 / sqrt(576).
  float softmax_scale = 0.0f;
  /// bf16 out [num_rows, num_heads, 512]: softmax-weighted sum of the selected values (zeros
  /// where nothing is selected).
  __nv_bfloat16* out = nullptr;
  /// fp32 out [num_rows, num_heads]: ln sum exp(scale q . k) over the selected slots (natural
  /// log, as FlashMLA's softmax_lse); -inf where nothing is selected. May be null.
  float* lse = nullptr;
  /// Tensor-core kernel: the selection is cut into this many consecutive pieces (split-KV), each
  /// attended by its own CTAs and merged by their log-sum-exps (0 = chosen from the batch size
  /// and the device's SM count: SparseMlaDecodeNumSplits). 1 writes out directly (no workspace).
  int num_splits = 0;
  /// Tensor-core kernel: which instructions (SparseMlaMma).
  SparseMlaMma mma = SparseMlaMma::kAuto;
  /// Device scratch for the split partials, 16-byte aligned, >= SparseMlaDecodeScratchBytes.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

/// The CUDA-core kernel (fp32 FMA, one CTA per (row, head); the simple, obviously-right version):
/// any num_heads >= 1, top_k in [1, 8192]. On false, *why (when not null) names the reason.
bool CanImplementSparseMlaDecodeCudaCores(const SparseMlaDecodeParams& params,
                                          const char** why = nullptr);
/// Launches the CUDA-core kernel on `stream` (asynchronous; no workspace).
/// cudaErrorInvalidValue when CanImplementSparseMlaDecodeCudaCores fails.
cudaError_t LaunchSparseMlaDecodeCudaCores(const SparseMlaDecodeParams& params,
                                           cudaStream_t stream);

/// The splits the tensor-core kernel uses for `params` on the current device: params.num_splits
/// when > 0, else about enough (row, 64-head group, split) CTAs to fill the SMs once, each with
/// at least one 64-entry tile of the selection. Always in [1, ceil(top_k / 64)].
int SparseMlaDecodeNumSplits(const SparseMlaDecodeParams& params);
/// Workspace bytes of the tensor-core kernel: 0 with one split, else
/// num_rows * num_heads * num_splits * (512 + 1) * 4 (the fp32 partial outputs and log-sum-exps).
size_t SparseMlaDecodeScratchBytes(const SparseMlaDecodeParams& params);
/// The tensor-core kernel (bf16 wgmma or mma.sync, fp32 accumulation; SparseMlaMma): one CTA per
/// (row, 64-head group, split), 8 warps; the split's selection tiles of 64 latent rows are
/// gathered into swizzled shared memory by cp.async two tiles deep; S = Q K^T, an online softmax,
/// then O += P V with P rounded to bf16; the splits merged by a second kernel (launched with
/// programmatic dependent launch). num_heads a multiple of 64, top_k >= 1, num_splits <=
/// min(128, ceil(top_k / 64)), a workspace of SparseMlaDecodeScratchBytes.
bool CanImplementSparseMlaDecodeTensorCores(const SparseMlaDecodeParams& params,
                                            const char** why = nullptr);
/// Launches the tensor-core kernel on `stream` (asynchronous; one kernel with one split, else the
/// split kernel and the combine). Matches the CPU reference up to fp32 accumulation order, the
/// bf16 rounding of the softmax weights and of the output. cudaErrorInvalidValue when
/// CanImplementSparseMlaDecodeTensorCores fails.
cudaError_t LaunchSparseMlaDecodeTensorCores(const SparseMlaDecodeParams& params,
                                             cudaStream_t stream);

}  // namespace dsa::cuda
