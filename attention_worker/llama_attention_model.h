// The real model behind the engine's model seam: SmolLM2-135M with its lightning indexers
// (llama_model.h, docs/model.md) on a LlamaRunner's device (llama_runner.h: the CPU, or the GPU
// with cuda/llama_cuda_runner.h). Prefill runs the context densely and keeps the full layers'
// index keys for the append; a decode step runs every row of the batch in one pass, each layer
// over the MLI schedule's selection, and samples each row's next token.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "attention_worker/attention_model.h"
#include "attention_worker/llama_model.h"
#include "attention_worker/llama_runner.h"

namespace dsa {

/// AttentionModel over a LlamaModel with its indexer. Thread-safety: AttentionModel's (a
/// sequence's state is used by one call at a time; the map of sequences is guarded).
class LlamaAttentionModel : public AttentionModel {
 public:
  /// `full_layers`: the schedule's full layers (model layer of each full-layer rank, increasing,
  /// each in [0, num_layers)). `name`: the model's name for GetInfo. INVALID_ARGUMENT (no model,
  /// no indexer, a full layer out of range).
  /// On the CPU (MakeCpuLlamaRunner).
  static absl::StatusOr<std::unique_ptr<LlamaAttentionModel>> Create(
      std::shared_ptr<const LlamaModel> model, std::vector<int> full_layers, std::string name);
  /// On `runner`'s device (its model must have an indexer). INVALID_ARGUMENT as above.
  static absl::StatusOr<std::unique_ptr<LlamaAttentionModel>> Create(
      std::shared_ptr<LlamaRunner> runner, std::vector<int> full_layers, std::string name);

  const LlamaModel& llama() const { return runner_->model(); }

  /// Receives a row's logits, fp32 [vocab_size], before its next token is sampled: the last
  /// context position of each Extend, and every row of each decode step (verifier rows
  /// included). For evaluations (a perplexity of given continuations: the caller feeds the true
  /// tokens and reads their log-probabilities here). Called on the thread of the call; may be
  /// called from several threads at once for different sequences.
  using LogitsObserver =
      std::function<void(uint64_t sequence_id, int64_t position, std::span<const float> logits)>;
  /// Sets the observer (empty: none). Set it before the model serves: not synchronized with
  /// calls in flight.
  void set_logits_observer(LogitsObserver observer);

  const ModelShape& shape() const override { return shape_; }
  std::string Description() const override { return runner_->Description(); }
  /// The observer gets no attention outputs from the real model (0 values a row).
  int64_t output_values_per_row() const override { return 0; }
  absl::StatusOr<std::optional<int32_t>> Extend(uint64_t sequence_id, int64_t first_slot,
                                                int64_t end_slot, std::span<const int32_t> tokens,
                                                const SamplingParams& sampling) override;
  absl::Status IndexKeys(uint64_t sequence_id, std::span<const uint64_t> prefix_block_ids,
                         int full_rank, int64_t first_slot, int64_t num_slots,
                         std::span<float> out) const override;
  void DropIndexKeys(uint64_t sequence_id) override;
  absl::Status Truncate(uint64_t sequence_id, int64_t num_slots) override;
  absl::StatusOr<std::unique_ptr<ModelStep>> BeginStep(std::span<const ModelRow> rows) override;

  /// One sequence's state (public for the step's implementation).
  struct Sequence {
    std::unique_ptr<LlamaSequenceCache> kv;
    // The index keys of the last Extend: slots [keys_first_slot, + n) of every full layer, fp32
    // [full layers][n, D].
    int64_t keys_first_slot = 0;
    std::vector<std::vector<float>> index_keys;
  };

 private:
  LlamaAttentionModel(std::shared_ptr<LlamaRunner> runner, std::vector<int> full_layers,
                      std::string name);
  std::shared_ptr<Sequence> Find(uint64_t sequence_id) const;

  const std::shared_ptr<LlamaRunner> runner_;
  const LlamaModel& model_;  // runner_->model()
  const std::vector<int> full_layers_;
  std::vector<int> full_rank_;  // per model layer: its full-layer rank, or -1
  ModelShape shape_;
  LogitsObserver logits_observer_;
  mutable std::mutex mutex_;  // guards sequences_
  absl::flat_hash_map<uint64_t, std::shared_ptr<Sequence>> sequences_;
};

}  // namespace dsa
