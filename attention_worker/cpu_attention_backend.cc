// The CPU attention backend (see cpu_attention_backend.h).
#include "attention_worker/cpu_attention_backend.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "attention_worker/model_inputs.h"
#include "attention_worker/sparse_attention.h"
#include "common/parallel_for.h"

namespace dsa {
absl::StatusOr<std::unique_ptr<CpuAttentionBackend>> CpuAttentionBackend::Create(
    const CpuAttentionBackendOptions& options) {
  if (options.num_model_layers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_model_layers must be >= 1, got ", options.num_model_layers));
  }
  if (options.kv_dim < 1) {
    return absl::InvalidArgumentError(absl::StrCat("kv_dim must be >= 1, got ", options.kv_dim));
  }
  if (options.attention_heads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention_heads must be >= 1, got ", options.attention_heads));
  }
  if (options.fill_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_threads must be >= 1, got ", options.fill_threads));
  }
  return std::unique_ptr<CpuAttentionBackend>(new CpuAttentionBackend(options));
}

std::shared_ptr<CpuAttentionBackend::SequenceKv> CpuAttentionBackend::Find(uint64_t sequence_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = sequences_.find(sequence_id);
  return it == sequences_.end() ? nullptr : it->second;
}

absl::Status CpuAttentionBackend::ResizeSequence(uint64_t sequence_id, int64_t num_slots) {
  std::shared_ptr<SequenceKv> kv;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (num_slots == 0) {
      sequences_.erase(sequence_id);
      return absl::OkStatus();
    }
    std::shared_ptr<SequenceKv>& entry = sequences_[sequence_id];
    if (entry == nullptr) {
      entry = std::make_shared<SequenceKv>();
      entry->keys.resize(options_.num_model_layers);
      entry->values.resize(options_.num_model_layers);
    }
    kv = entry;
  }
  const int kv_dim = options_.kv_dim;
  const int num_layers = options_.num_model_layers;
  const int64_t first_slot = kv->num_slots;
  const auto size = static_cast<size_t>(num_slots * kv_dim);
  for (int l = 0; l < num_layers; ++l) {
    kv->keys[l].resize(size);
    kv->values[l].resize(size);
  }
  kv->num_slots = num_slots;
  if (num_slots <= first_slot) return absl::OkStatus();
  // Work items: (layer, range of up to 4096 slots).
  constexpr int64_t kSlotsPerItem = 4096;
  const int64_t new_slots = num_slots - first_slot;
  const int64_t items_per_layer = (new_slots + kSlotsPerItem - 1) / kSlotsPerItem;
  const int threads = new_slots * num_layers >= 4096 ? options_.fill_threads : 1;
  ParallelFor(items_per_layer * num_layers, threads, [&](int64_t item) {
    const int layer = static_cast<int>(item / items_per_layer);
    const int64_t begin = first_slot + (item % items_per_layer) * kSlotsPerItem;
    const int64_t end = std::min(num_slots, begin + kSlotsPerItem);
    float* keys = kv->keys[layer].data();
    float* values = kv->values[layer].data();
    for (int64_t slot = begin; slot < end; ++slot) {
      KvCacheRow(options_.seed, layer, slot, std::span<float>(keys + slot * kv_dim, kv_dim),
                 std::span<float>(values + slot * kv_dim, kv_dim));
    }
  });
  return absl::OkStatus();
}

absl::Status CpuAttentionBackend::AttendLayer(int model_layer,
                                              std::span<const AttentionRowRef> rows,
                                              std::span<float> outputs) {
  const int64_t per_row = output_values_per_row();
  if (!outputs.empty() &&
      static_cast<int64_t>(outputs.size()) != per_row * static_cast<int64_t>(rows.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("outputs hold ", outputs.size(), " values, expected ", per_row * rows.size()));
  }
  if (model_layer < 0 || model_layer >= options_.num_model_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("model layer ", model_layer, " outside [0, ", options_.num_model_layers, ")"));
  }
  const SparseAttentionShape shape{options_.attention_heads, options_.kv_dim, options_.kv_dim, 0};
  std::vector<float> query(static_cast<size_t>(per_row));
  std::vector<float> output(static_cast<size_t>(per_row));
  for (size_t r = 0; r < rows.size(); ++r) {
    const AttentionRowRef& row = rows[r];
    std::shared_ptr<SequenceKv> kv = Find(row.sequence_id);
    if (kv == nullptr || row.position < 0 || row.position >= kv->num_slots) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", row.sequence_id, " holds no KV slot ", row.position));
    }
    AttentionQuery(options_.seed, model_layer, row.position, query);
    const int64_t num_slots = row.position + 1;
    const auto kv_size = static_cast<size_t>(num_slots * options_.kv_dim);
    std::span<float> out = outputs.empty() ? std::span<float>(output)
                                           : outputs.subspan(r * static_cast<size_t>(per_row),
                                                             static_cast<size_t>(per_row));
    const absl::Status status =
        SparseAttention(shape, query, std::span<const float>(kv->keys[model_layer].data(), kv_size),
                        std::span<const float>(kv->values[model_layer].data(), kv_size), num_slots,
                        row.selection, out);
    if (!status.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", row.sequence_id, " layer ",
                                                     model_layer, " row at ", row.position, ": ",
                                                     status.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace dsa
