// The attention side's generated inputs (see model_inputs.h).
#include "attention_worker/model_inputs.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/philox.h"
#include "common/status_macros.h"

namespace dsa {
namespace {

PhiloxKey KeyOf(uint64_t seed) {
  return PhiloxKey{{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)}};
}

}  // namespace

void UniformRow(uint64_t seed, uint32_t stream, int layer, int64_t index, std::span<float> out) {
  const PhiloxKey key = KeyOf(seed);
  const auto lo = static_cast<uint32_t>(index);
  const auto hi = static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32);
  for (size_t j = 0; j < out.size(); j += 4) {
    const auto group = static_cast<uint32_t>(j / 4);
    const PhiloxCounter words = Philox4x32(
        PhiloxCounter{{lo, hi, static_cast<uint32_t>(layer), (stream << 24) | group}}, key);
    for (size_t w = 0; w < 4 && j + w < out.size(); ++w) {
      out[j + w] = 2.0f * UniformFloat(words.c[w]) - 1.0f;
    }
  }
}

void KvCacheRow(uint64_t seed, int layer, int64_t slot, std::span<float> key_out,
                std::span<float> value_out) {
  UniformRow(seed, kKvKeyStream, layer, slot, key_out);
  UniformRow(seed, kKvValueStream, layer, slot, value_out);
}

void AttentionQuery(uint64_t seed, int layer, int64_t position, std::span<float> out) {
  UniformRow(seed, kAttentionQueryStream, layer, position, out);
}

absl::Status SequenceIndexKeys(const PatternModel& model,
                               std::span<const uint64_t> prefix_block_ids, int full_layer,
                               int64_t first_slot, int64_t num_slots, std::span<float> out) {
  const int64_t head_dim = model.head_dim();
  if (first_slot < 0 || num_slots < 0 || static_cast<int64_t>(out.size()) != num_slots * head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("bad key range: first_slot ", first_slot,
                                                   ", num_slots ", num_slots, ", out size ",
                                                   out.size()));
  }
  const int64_t prefix_end = kPrefixBlockTokens * static_cast<int64_t>(prefix_block_ids.size());
  const int64_t end = first_slot + num_slots;
  int64_t slot = first_slot;
  while (slot < end) {
    float* dst = out.data() + (slot - first_slot) * head_dim;
    if (slot < prefix_end) {
      const int64_t block = slot / kPrefixBlockTokens;
      const int offset = static_cast<int>(slot % kPrefixBlockTokens);
      const int n = static_cast<int>(std::min<int64_t>(end - slot, kPrefixBlockTokens - offset));
      DSA_RETURN_IF_ERROR(
          model.PrefixBlockIndexKeys(full_layer, prefix_block_ids[block], offset, slot, n,
                                     std::span<float>(dst, static_cast<size_t>(n * head_dim))));
      slot += n;
    } else {
      DSA_RETURN_IF_ERROR(
          model.IndexKeys(full_layer, slot, end - slot,
                          std::span<float>(dst, static_cast<size_t>((end - slot) * head_dim))));
      slot = end;
    }
  }
  return absl::OkStatus();
}

}  // namespace dsa
