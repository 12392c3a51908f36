// The real model's attention on the GPU (docs/model.md): grouped-query attention of a pass's rows
// over their sequences' KV caches (llama_kv_layout.h), fp32 with fp32 accumulation.
// - The sparse GQA decode: for each entry (a row with its selection, int32 [K] with -1 padding, or
//   with none: every slot 0..position) and each KV head, the query heads of the group attend
//   exactly the selected slots; one gather of each selected key and value row serves all of the
//   group's heads; a split over the entry's slots (128 a block) with an online-softmax merge.
// - The dense causal prefill: tiles of 64 rows of one cache x one query head, flash-style over
//   64-slot key/value tiles in shared memory, each row attending slots 0..its position.
// Framework-free: device pointers, sizes, a stream, a cudaError_t back (cudaErrorInvalidValue
// for what CanImplement... refuses or bad pointers). CPU reference: GqaAttentionReference
// (gqa_attention_reference.h), and LlamaForward's attention (attention_worker/llama_model.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "attention_worker/cuda/llama_kv_layout.h"

namespace dsa::cuda {

/// Slots one block of the decode kernel attends (4 warps x 32).
inline constexpr int kGqaDecodeSlotsPerBlock = 128;
/// Rows (and slots) of a prefill tile.
inline constexpr int kGqaPrefillTileRows = 64;

struct GqaDecodeParams {
  /// Device fp32: row r's query head h (post-RoPE) at queries + r * query_stride + h * head_dim.
  const float* queries = nullptr;
  int64_t query_stride = 0;  // values, >= num_heads * head_dim
  /// Device [pass rows]: each row's cache and position.
  const LlamaRowCache* caches = nullptr;
  /// Device int32 [num_entries]: the pass row of each entry (a row appears at most once).
  const int32_t* entry_rows = nullptr;
  /// Device int32 [num_entries + 1], non-decreasing from 0: entry e's selection is
  /// selections[offsets[e], offsets[e + 1]); an empty one means slots [0, position] (dense).
  const int32_t* selection_offsets = nullptr;
  /// Device int32 [offsets[num_entries]]: slots in [0, position] of the entry's row, each at most
  /// once, or -1 (padding, skipped); at least one slot an entry (checked on the host).
  const int32_t* selections = nullptr;
  int num_entries = 0;      // >= 1
  int max_entry_slots = 0;  // >= every entry's list length (position + 1 for a dense entry), >= 1
  int layer = 0;            // the cache layer read, >= 0
  int num_heads = 0;        // query heads, a multiple of num_kv_heads
  int num_kv_heads = 0;     // >= 1
  int head_dim = 0;         // CanImplementGqaDecode's values
  float scale = 0;          // the softmax's logit scale (head_dim^-1/2)
  /// Device fp32: entry e's row r gets head h at out + r * out_stride + h * head_dim.
  float* out = nullptr;
  int64_t out_stride = 0;  // values, >= num_heads * head_dim
  /// Device scratch of GqaDecodeScratchBytes (unused, may be null, when that is 0).
  void* scratch = nullptr;
};

/// Whether the decode kernel is built for this shape: head_dim in {8, 16, 32, 64, 128}, heads per
/// KV head (num_heads / num_kv_heads) in [1, 4]. When not, *why (if given) says why.
bool CanImplementGqaDecode(int num_heads, int num_kv_heads, int head_dim, const char** why);
/// Scratch bytes LaunchGqaDecode needs: the per-block partial results when an entry spans more
/// than one block (0 when max_entry_slots <= kGqaDecodeSlotsPerBlock).
size_t GqaDecodeScratchBytes(int num_entries, int max_entry_slots, int num_heads, int num_kv_heads,
                             int head_dim);
/// Launches the decode kernel (and, over several blocks an entry, the merge).
cudaError_t LaunchGqaDecode(const GqaDecodeParams& params, cudaStream_t stream);

/// A prefill tile: rows tile_rows[first, first + count) of the pass, all of one cache, in
/// increasing position order; count in [1, kGqaPrefillTileRows].
struct GqaPrefillTile {
  int32_t first = 0;
  int32_t count = 0;
};

struct GqaPrefillParams {
  const float* queries = nullptr;  // as GqaDecodeParams
  int64_t query_stride = 0;
  const LlamaRowCache* caches = nullptr;  // device [pass rows]
  const int32_t* tile_rows = nullptr;     // device int32 [*]: pass rows, see GqaPrefillTile
  const GqaPrefillTile* tiles = nullptr;  // device [num_tiles]
  int num_tiles = 0;                      // >= 1
  int layer = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // CanImplementGqaPrefill's
  float scale = 0;
  float* out = nullptr;  // as GqaDecodeParams
  int64_t out_stride = 0;
};

/// Whether the prefill kernel is built for this shape: head_dim 64, num_heads a multiple of
/// num_kv_heads. When not, *why (if given) says why.
bool CanImplementGqaPrefill(int num_heads, int num_kv_heads, int head_dim, const char** why);
/// Launches the prefill kernel: grid (num_tiles, num_heads). Sets the kernel's shared-memory limit
/// (53 KB) on first use on each device.
cudaError_t LaunchGqaPrefill(const GqaPrefillParams& params, cudaStream_t stream);

}  // namespace dsa::cuda
