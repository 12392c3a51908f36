// Append on the GPU: quantizes new index keys into the paged index-key cache (DESIGN.md 4.1),
// bit-identical to the CPU quantizer (common/fp8.h QuantizeIndexKey). Framework-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dsa::cuda {

/// Element type of index keys handed to the append.
enum class KeyDtype : int { kFloat32 = 0, kBFloat16 = 1 };

/// One append: keys for slots [first_slot, first_slot + num_keys) of one (sequence, layer) cache.
struct AppendParams {
  /// Device, [num_keys, head_dim] row-major, fp32 or bf16 (keys_dtype); finite values.
  const void* keys = nullptr;
  KeyDtype keys_dtype = KeyDtype::kFloat32;
  /// Number of keys (>= 0; 0 is a no-op).
  int64_t num_keys = 0;
  /// D, values per key, in [1, 1024].
  int head_dim = 0;
  /// Device int32 [ceil((first_slot + num_keys) / 64)]: logical block j lives in pool block
  /// block_table[j] (>= 0, within the pool).
  const int32_t* block_table = nullptr;
  /// First slot written (>= 0); may fall inside a partly filled block.
  int64_t first_slot = 0;
  /// Device base of the block pool: blocks of 64 * (head_dim + 4) bytes, each 64 x head_dim fp8
  /// e4m3 codes (slot-major) then 64 fp32 scales (block_pool.h layout).
  uint8_t* pool = nullptr;
};

/// Whether AppendParams describe a launch this kernel supports; on false, *why (when not null)
/// names the reason (a static string).
bool CanImplementAppend(const AppendParams& params, const char** why = nullptr);

/// No workspace is needed: always 0 bytes. Kept beside the kernel for a uniform launcher.
inline size_t AppendScratchBytes(const AppendParams&) { return 0; }

/// Quantizes every key: scale = amax / 448 (IEEE fp32 division), code[d] = E4M3(key[d] / scale),
/// round-to-nearest-even, saturating; an all-zero key (or one whose scale underflows) stores
/// scale 0 and zero codes. One warp per key. Asynchronous on `stream`.
/// Returns cudaErrorInvalidValue when CanImplementAppend fails, else the launch error.
cudaError_t LaunchAppend(const AppendParams& params, cudaStream_t stream);

}  // namespace dsa::cuda
