// Where an attention worker keeps its KV cache and runs sparse attention over the indexer's
// selections: one interface, a CPU implementation (cpu_attention_backend.h) and a CUDA one
// (attention_worker/cuda/).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"

namespace dsa {

/// One decode row to attend at a model layer: its sequence, query position and selection.
struct AttentionRowRef {
  uint64_t sequence_id = 0;
  int64_t position = 0;                // t: the row attends slots <= t
  std::span<const int32_t> selection;  // int32 [K]: the selection of sigma(l), -1 padding
};

/// The KV cache of every model layer for the worker's sequences, and the attention over it.
/// Contents are a pure function of (seed, layer, slot) (the pattern model's KV generator), so a
/// sequence's rows can be regenerated on any backend. Thread-safety: calls for different sequences
/// may run concurrently; the caller serializes calls that touch the same sequence.
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;

  /// "cpu", or the device's description.
  virtual std::string Description() const = 0;

  /// Values of one attended row's output: attention_heads * value_dim.
  virtual int64_t output_values_per_row() const = 0;

  /// The unit slots are held in (the CUDA pool's 64-slot blocks; 1 on the CPU): a sequence of n
  /// slots takes ceil(n / g) * g of the backend's capacity, which is what the engine counts.
  virtual int64_t slot_granularity() const { return 1; }

  /// Sets the slots held for `sequence_id` (created on first use) to `num_slots` in every model
  /// layer: new slots [old, num_slots) get the generator's rows, a shrink drops the newest slots,
  /// 0 forgets the sequence. Errors: RESOURCE_EXHAUSTED (the device's memory; nothing changed).
  virtual absl::Status ResizeSequence(uint64_t sequence_id, int64_t num_slots) = 0;

  /// Attends every row of `rows` at `model_layer` over its selection (DeepSeek Sparse Attention's
  /// core attention over the top-K slots; DESIGN.md 3). With `outputs` non-empty (fp32
  /// [rows.size(), output_values_per_row()]), the outputs are copied there (tests, tools).
  /// Errors: INVALID_ARGUMENT (a selected slot beyond the sequence's slots, an unknown sequence,
  /// output size), INTERNAL (a device error).
  virtual absl::Status AttendLayer(int model_layer, std::span<const AttentionRowRef> rows,
                                   std::span<float> outputs) = 0;
};

}  // namespace dsa
