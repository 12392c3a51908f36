// The attention side's MLA rows on the CPU, as bf16 bits: a KV cache slot's 576-dim latent row and
// a decode row's 128 x 576 absorbed query, pure functions of (seed, layer, slot or position)
// through Philox4x32-10. The GPU writes the same bits (attention_worker/cuda/mla_inputs.h).
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "contracts/layout.h"

namespace dsa {

/// Query heads of DeepSeek-V3.2's attention.
inline constexpr int kMlaAttentionHeads = 128;

/// The latent row of KV slot `slot` at model layer `layer`: bf16 bits [576], round to nearest
/// even of UniformRow(seed, kKvKeyStream, layer, slot) (model_inputs.h: the values KvCacheRow's key
/// row starts with).
/// Errors: INVALID_ARGUMENT (layer < 0, slot < 0, out.size() != 576).
absl::Status MlaKvRow(uint64_t seed, int layer, int64_t slot, std::span<uint16_t> out576);

/// The absorbed attention query of the decode row at `position` of model layer `layer`: bf16 bits
/// [num_heads, 576] row-major (out.size() = num_heads * 576), round to nearest even of
/// UniformRow(seed, kAttentionQueryStream, layer, position) over all num_heads * 576 values
/// (AttentionQuery's values for that size). Errors: INVALID_ARGUMENT (layer < 0, position < 0,
/// out.size() not a positive multiple of 576 or above 2^26).
absl::Status MlaAttentionQuery(uint64_t seed, int layer, int64_t position, std::span<uint16_t> out);

}  // namespace dsa
