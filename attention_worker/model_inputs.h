// The pattern model's inputs of the attention side, pure functions of seeds: the KV cache rows and
// attention queries of every model layer, and a sequence's index keys with the Mooncake trace's
// shared prefix blocks (docs/services.md "Attention worker model").
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "attention_worker/pattern_model.h"

namespace dsa {

/// Philox streams (the high byte of counter word 3) of the attention side's generated rows.
inline constexpr uint32_t kKvKeyStream = 1;
inline constexpr uint32_t kKvValueStream = 2;
inline constexpr uint32_t kAttentionQueryStream = 3;

/// out[j] = 2 * UniformFloat(word) - 1, uniform in [-1, 1): word j % 4 of Philox4x32-10
/// (common/philox.h) with key (seed lo, seed hi) and counter (index lo, index hi, layer,
/// stream << 24 | j / 4). Pure in (seed, stream, layer, index); any out.size(). The generator of
/// KvCacheRow and AttentionQuery (and of the GPU's copies of them, which must match it bit for
/// bit).
void UniformRow(uint64_t seed, uint32_t stream, int layer, int64_t index, std::span<float> out);

/// Key and value of KV slot `slot` at model layer `layer`: fp32 [kv_dim] each, uniform in [-1, 1),
/// a pure function of (seed, layer, slot) through Philox4x32-10 (common/philox.h). Sizes must
/// match (checked by the caller).
void KvCacheRow(uint64_t seed, int layer, int64_t slot, std::span<float> key_out,
                std::span<float> value_out);

/// Attention query of the decode row at `position` of model layer `layer`: fp32
/// [attention_heads, kv_dim] (out.size()), uniform in [-1, 1), a pure function of
/// (seed, layer, position) through Philox4x32-10.
void AttentionQuery(uint64_t seed, int layer, int64_t position, std::span<float> out);

/// Index keys of slots [first_slot, first_slot + num_slots) of full layer `full_layer` of a
/// sequence whose prompt has `prefix_block_ids` (one per kPrefixBlockTokens slots): slot i below
/// kPrefixBlockTokens * prefix_block_ids.size() takes offset i % 512 of block id[i / 512]
/// (PatternModel::PrefixBlockIndexKeys), other slots PatternModel::IndexKeys. Requests with equal
/// leading prefix ids thus get bit-identical keys there. out: fp32 [num_slots, head_dim].
/// Errors: the pattern model's INVALID_ARGUMENT.
absl::Status SequenceIndexKeys(const PatternModel& model,
                               std::span<const uint64_t> prefix_block_ids, int full_layer,
                               int64_t first_slot, int64_t num_slots, std::span<float> out);

}  // namespace dsa
