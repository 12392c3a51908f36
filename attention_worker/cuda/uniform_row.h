// One element of the attention side's uniform rows (UniformRow of attention_worker/model_inputs.h,
// behind the KV cache rows and attention queries) and its bf16 rounding, for the GPU
// (DSA_HOST_DEVICE; the CPU's MlaKvRow rounds with the same function). Framework-free.
#pragma once

#include <cstdint>

#include "common/philox.h"

namespace dsa {

/// Philox streams (the high byte of counter word 3) of the attention side's rows, equal to
/// model_inputs.h's kKvKeyStream and kAttentionQueryStream (mla_kv.cc checks): the KV latent row of
/// a slot uses the key stream (the MLA latent row is the key; its first 512 dims are the value),
/// the attention query the query stream.
inline constexpr uint32_t kMlaKeyStream = 1;
inline constexpr uint32_t kMlaQueryStream = 3;

/// Philox4x32-10 block `group` of the uniform row (seed, stream, layer, index): key
/// (seed lo, seed hi), counter (index lo, index hi, layer, stream << 24 | group). Element j of the
/// row is 2 * UniformFloat(word j % 4 of block j / 4) - 1, in [-1, 1).
DSA_HOST_DEVICE inline PhiloxCounter UniformRowBlock(uint64_t seed, uint32_t stream, int layer,
                                                     int64_t index, uint32_t group) {
  const auto index_bits = static_cast<uint64_t>(index);
  return Philox4x32(
      PhiloxCounter{{static_cast<uint32_t>(index_bits), static_cast<uint32_t>(index_bits >> 32),
                     static_cast<uint32_t>(layer), (stream << 24) | group}},
      PhiloxKey{{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)}});
}

/// 2 * UniformFloat(word) - 1 (exact in fp32: 2u is exact, so a fused multiply-add gives the same
/// bits as the separate operations).
DSA_HOST_DEVICE inline float UniformRowValue(uint32_t word) {
  return 2.0f * UniformFloat(word) - 1.0f;
}

/// fp32 -> bf16 bits, round to nearest even (finite inputs; the rows are in [-1, 1)).
DSA_HOST_DEVICE inline uint16_t Bf16BitsNearestEven(float value) {
#if defined(__CUDA_ARCH__)
  const uint32_t bits = __float_as_uint(value);
#else
  uint32_t bits;
  __builtin_memcpy(&bits, &value, sizeof(bits));
#endif
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace dsa
