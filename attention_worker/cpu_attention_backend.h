// The CPU attention backend: fp32 KV rows per sequence and model layer (KvCacheRow), attention by
// the SparseAttention reference, queries by AttentionQuery (MQA: every head shares a slot's row).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "attention_worker/attention_backend.h"

namespace dsa {

/// Shapes of the CPU backend.
struct CpuAttentionBackendOptions {
  int num_model_layers = 1;  // >= 1
  int kv_dim = 32;           // Dk = Dv, >= 1
  int attention_heads = 8;   // query heads, >= 1
  uint64_t seed = 0;         // of KvCacheRow and AttentionQuery
  int fill_threads = 2;      // threads that generate KV rows of a long resize, >= 1
};

/// See AttentionBackend. Outputs fp32 [attention_heads, kv_dim] a row.
class CpuAttentionBackend final : public AttentionBackend {
 public:
  /// INVALID_ARGUMENT for a field out of range.
  static absl::StatusOr<std::unique_ptr<CpuAttentionBackend>> Create(
      const CpuAttentionBackendOptions& options);

  std::string Description() const override { return "cpu"; }
  int64_t output_values_per_row() const override {
    return int64_t{options_.attention_heads} * options_.kv_dim;
  }
  absl::Status ResizeSequence(uint64_t sequence_id, int64_t num_slots) override;
  absl::Status AttendLayer(int model_layer, std::span<const AttentionRowRef> rows,
                           std::span<float> outputs) override;

 private:
  struct SequenceKv {
    int64_t num_slots = 0;
    std::vector<std::vector<float>> keys;    // per model layer: fp32 [num_slots, kv_dim]
    std::vector<std::vector<float>> values;  // per model layer: fp32 [num_slots, kv_dim]
  };
  explicit CpuAttentionBackend(const CpuAttentionBackendOptions& options) : options_(options) {}
  std::shared_ptr<SequenceKv> Find(uint64_t sequence_id);

  const CpuAttentionBackendOptions options_;
  std::mutex mutex_;  // guards the map (each sequence's rows: the caller's serialization)
  absl::flat_hash_map<uint64_t, std::shared_ptr<SequenceKv>> sequences_;
};

}  // namespace dsa
