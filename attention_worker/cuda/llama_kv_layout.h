// The real model's KV cache on the GPU (docs/model.md): one contiguous allocation a sequence,
// fp32 [num_layers][2][capacity][kv_dim] (layer l's post-RoPE keys, then its values; slot t holds
// position t), and the per-row record the kernels find a row's cache by. Framework-free.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DSA_HOST_DEVICE __host__ __device__
#else
#define DSA_HOST_DEVICE
#endif

namespace dsa::cuda {

/// One row of a pass, as the kernels see it (device array [rows], 16-byte aligned records).
struct LlamaRowCache {
  /// The row's sequence cache: device fp32 [num_layers][2][capacity][kv_dim].
  float* kv_base = nullptr;
  /// Slots the cache holds room for (>= position + 1).
  int64_t capacity = 0;
  /// The row's position: it writes slot `position` and (dense) attends slots [0, position].
  int64_t position = 0;
  int64_t reserved = 0;  // padding to 32 bytes
};

/// Layer `layer`'s keys fp32 [capacity, kv_dim] of a cache.
DSA_HOST_DEVICE inline float* LlamaLayerKeys(float* kv_base, int64_t capacity, int kv_dim,
                                             int layer) {
  return kv_base + static_cast<int64_t>(2 * layer) * capacity * kv_dim;
}

/// Layer `layer`'s values fp32 [capacity, kv_dim] of a cache.
DSA_HOST_DEVICE inline float* LlamaLayerValues(float* kv_base, int64_t capacity, int kv_dim,
                                               int layer) {
  return kv_base + static_cast<int64_t>(2 * layer + 1) * capacity * kv_dim;
}

}  // namespace dsa::cuda
