// The attention side's MLA rows on the CPU (see mla_kv.h).
#include "attention_worker/mla_kv.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "attention_worker/cuda/uniform_row.h"
#include "attention_worker/model_inputs.h"

namespace dsa {
namespace {

static_assert(kMlaKeyStream == kKvKeyStream && kMlaQueryStream == kAttentionQueryStream,
              "the GPU's streams (cuda/uniform_row.h) are the CPU's (model_inputs.h)");

constexpr size_t kMaxRowValues = size_t{1} << 26;  // groups of 4 fit the counter's 24 bits

void Bf16Row(uint64_t seed, uint32_t stream, int layer, int64_t index, std::span<uint16_t> out) {
  std::vector<float> values(out.size());
  UniformRow(seed, stream, layer, index, values);
  for (size_t j = 0; j < out.size(); ++j) out[j] = Bf16BitsNearestEven(values[j]);
}

}  // namespace

absl::Status MlaKvRow(uint64_t seed, int layer, int64_t slot, std::span<uint16_t> out576) {
  if (layer < 0 || slot < 0 || out576.size() != static_cast<size_t>(kMlaKeyDim)) {
    return absl::InvalidArgumentError(absl::StrCat("MlaKvRow: need layer >= 0 (", layer,
                                                   "), slot >= 0 (", slot, ") and 576 values (",
                                                   out576.size(), ")"));
  }
  Bf16Row(seed, kKvKeyStream, layer, slot, out576);
  return absl::OkStatus();
}

absl::Status MlaAttentionQuery(uint64_t seed, int layer, int64_t position,
                               std::span<uint16_t> out) {
  if (layer < 0 || position < 0 || out.empty() || out.size() % kMlaKeyDim != 0 ||
      out.size() > kMaxRowValues) {
    return absl::InvalidArgumentError(
        absl::StrCat("MlaAttentionQuery: need layer >= 0 (", layer, "), position >= 0 (", position,
                     ") and a positive multiple of 576 values up to 2^26 (", out.size(), ")"));
  }
  Bf16Row(seed, kAttentionQueryStream, layer, position, out);
  return absl::OkStatus();
}

}  // namespace dsa
