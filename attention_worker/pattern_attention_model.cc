// The synthetic model behind the model seam (see pattern_attention_model.h).
#include "attention_worker/pattern_attention_model.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention_worker/model_inputs.h"
#include "common/status_macros.h"

namespace dsa {

namespace {

class PatternModelStep : public ModelStep {
 public:
  PatternModelStep(const PatternModel& model, AttentionBackend& backend, std::vector<ModelRow> rows)
      : model_(model), backend_(backend), rows_(std::move(rows)) {}

  absl::Status PrepareIndexerInputs(int model_layer, int full_rank) override {
    if (full_rank < 0 || full_rank >= model_.num_layers()) {
      return absl::InvalidArgumentError(
          absl::StrCat("full layer ", full_rank, " outside [0, ", model_.num_layers(), ")"));
    }
    return absl::OkStatus();
  }

  absl::Status IndexerInputs(int full_rank, int first_row, int num_rows,
                             std::span<const uint64_t> prefix_block_ids, std::span<float> queries,
                             std::span<float> head_weights,
                             std::span<float> index_keys) const override {
    const int num_heads = model_.num_heads();
    const int head_dim = model_.head_dim();
    if (first_row < 0 || num_rows < 1 || first_row + num_rows > static_cast<int>(rows_.size()) ||
        head_weights.size() != static_cast<size_t>(num_rows) * num_heads ||
        index_keys.size() != static_cast<size_t>(num_rows) * head_dim ||
        (!queries.empty() &&
         queries.size() != static_cast<size_t>(num_rows) * num_heads * head_dim)) {
      return absl::InvalidArgumentError("indexer inputs: rows or span sizes out of range");
    }
    for (int r = 0; r < num_rows; ++r) {
      const ModelRow& row = rows_[first_row + r];
      const std::span<float> weights =
          head_weights.subspan(static_cast<size_t>(r) * num_heads, static_cast<size_t>(num_heads));
      if (queries.empty()) {
        DSA_RETURN_IF_ERROR(model_.HeadWeights(full_rank, row.position, weights));
      } else {
        DSA_RETURN_IF_ERROR(
            model_.IndexerQuery(full_rank, row.position,
                                queries.subspan(static_cast<size_t>(r) * num_heads * head_dim,
                                                static_cast<size_t>(num_heads) * head_dim),
                                weights));
      }
    }
    // A sequence's rows are contiguous: its keys in one call.
    for (int r = 0; r < num_rows;) {
      int end = r + 1;
      while (end < num_rows &&
             rows_[first_row + end].sequence_id == rows_[first_row + r].sequence_id) {
        ++end;
      }
      DSA_RETURN_IF_ERROR(SequenceIndexKeys(
          model_, prefix_block_ids, full_rank, rows_[first_row + r].position, end - r,
          index_keys.subspan(static_cast<size_t>(r) * head_dim,
                             static_cast<size_t>(end - r) * head_dim)));
      r = end;
    }
    return absl::OkStatus();
  }

  absl::Status AttendLayer(int model_layer, std::span<const AttentionRowRef> rows,
                           std::span<float> outputs) override {
    return backend_.AttendLayer(model_layer, rows, outputs);
  }

  absl::StatusOr<std::vector<int32_t>> Finish() override { return std::vector<int32_t>(); }

 private:
  const PatternModel& model_;
  AttentionBackend& backend_;
  const std::vector<ModelRow> rows_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PatternAttentionModel>> PatternAttentionModel::Create(
    PatternModel model, std::unique_ptr<AttentionBackend> backend) {
  if (backend == nullptr) return absl::InvalidArgumentError("no attention backend");
  return std::unique_ptr<PatternAttentionModel>(
      new PatternAttentionModel(std::move(model), std::move(backend)));
}

PatternAttentionModel::PatternAttentionModel(PatternModel model,
                                             std::unique_ptr<AttentionBackend> backend)
    : model_(std::move(model)), backend_(std::move(backend)) {
  shape_.name = "pattern";
  shape_.num_indexer_layers = model_.num_layers();
  shape_.indexer_per_model_layer = false;
  shape_.num_heads = model_.num_heads();
  shape_.head_dim = model_.head_dim();
}

absl::StatusOr<std::optional<int32_t>> PatternAttentionModel::Extend(
    uint64_t sequence_id, int64_t first_slot, int64_t end_slot, std::span<const int32_t> tokens,
    const SamplingParams& sampling) {
  if (!tokens.empty()) {
    return absl::InvalidArgumentError(
        "the synthetic pattern model takes no token ids (it serves context lengths only)");
  }
  DSA_RETURN_IF_ERROR(backend_->ResizeSequence(sequence_id, end_slot));
  return std::optional<int32_t>();
}

absl::Status PatternAttentionModel::IndexKeys(uint64_t sequence_id,
                                              std::span<const uint64_t> prefix_block_ids,
                                              int full_rank, int64_t first_slot, int64_t num_slots,
                                              std::span<float> out) const {
  return SequenceIndexKeys(model_, prefix_block_ids, full_rank, first_slot, num_slots, out);
}

absl::Status PatternAttentionModel::Truncate(uint64_t sequence_id, int64_t num_slots) {
  return backend_->ResizeSequence(sequence_id, num_slots);
}

absl::StatusOr<std::unique_ptr<ModelStep>> PatternAttentionModel::BeginStep(
    std::span<const ModelRow> rows) {
  // Each sequence's KV rows up to its last row, every model layer, first.
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].token != -1) {
      return absl::InvalidArgumentError("the synthetic pattern model takes no token ids");
    }
    if (i + 1 == rows.size() || rows[i + 1].sequence_id != rows[i].sequence_id) {
      DSA_RETURN_IF_ERROR(backend_->ResizeSequence(rows[i].sequence_id, rows[i].position + 1));
    }
  }
  return std::unique_ptr<ModelStep>(
      new PatternModelStep(model_, *backend_, std::vector<ModelRow>(rows.begin(), rows.end())));
}

}  // namespace dsa
