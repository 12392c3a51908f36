// The synthetic model behind the engine's model seam: the pattern model's indexer inputs
// (pattern_model.h, model_inputs.h) and an AttentionBackend's generated KV cache and sparse
// attention (CPU or CUDA). No tokens: Extend returns no next token and steps sample nothing.
#pragma once

#include <memory>

#include "attention_worker/attention_backend.h"
#include "attention_worker/attention_model.h"
#include "attention_worker/pattern_model.h"

namespace dsa {

/// AttentionModel over a PatternModel (its layers are the schedule's full layers, by rank) and a
/// backend holding the KV of every model layer. Thread-safety: AttentionModel's.
class PatternAttentionModel : public AttentionModel {
 public:
  /// INVALID_ARGUMENT: no backend.
  static absl::StatusOr<std::unique_ptr<PatternAttentionModel>> Create(
      PatternModel model, std::unique_ptr<AttentionBackend> backend);

  const PatternModel& pattern_model() const { return model_; }
  AttentionBackend& backend() { return *backend_; }

  const ModelShape& shape() const override { return shape_; }
  std::string Description() const override { return backend_->Description(); }
  int64_t output_values_per_row() const override { return backend_->output_values_per_row(); }
  int64_t slot_granularity() const override { return backend_->slot_granularity(); }
  /// `tokens` must be empty (INVALID_ARGUMENT otherwise); the backend's ResizeSequence.
  absl::StatusOr<std::optional<int32_t>> Extend(uint64_t sequence_id, int64_t first_slot,
                                                int64_t end_slot, std::span<const int32_t> tokens,
                                                const SamplingParams& sampling) override;
  /// SequenceIndexKeys (model_inputs.h) of pattern layer `full_rank`.
  absl::Status IndexKeys(uint64_t sequence_id, std::span<const uint64_t> prefix_block_ids,
                         int full_rank, int64_t first_slot, int64_t num_slots,
                         std::span<float> out) const override;
  void DropIndexKeys(uint64_t sequence_id) override {}
  absl::Status Truncate(uint64_t sequence_id, int64_t num_slots) override;
  /// Writes the rows' KV (the backend's generator) first; tokens must be -1.
  absl::StatusOr<std::unique_ptr<ModelStep>> BeginStep(std::span<const ModelRow> rows) override;
  absl::Status Synchronize() override { return backend_->Synchronize(); }
  int device_ordinal() const override { return backend_->device_ordinal(); }
  absl::Status EnableDeviceSelects() override { return backend_->EnableDeviceSelects(model_); }
  absl::StatusOr<std::unique_ptr<DeviceStep>> BeginDeviceStep() override {
    return backend_->BeginDeviceStep();
  }

 private:
  PatternAttentionModel(PatternModel model, std::unique_ptr<AttentionBackend> backend);

  const PatternModel model_;
  const std::unique_ptr<AttentionBackend> backend_;
  ModelShape shape_;
};

}  // namespace dsa
