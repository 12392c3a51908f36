// The attention engine's model seam: what runs a sequence's layers, holds its KV cache and makes
// its indexer inputs. Two implementations: the synthetic pattern model over an AttentionBackend
// (pattern_attention_model.h) and the real model, SmolLM2-135M with its lightning indexer
// (llama_attention_model.h, docs/model.md).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention_worker/attention_backend.h"
#include "attention_worker/sampler.h"

namespace dsa {

/// What the engine needs to know of a model.
struct ModelShape {
  /// "pattern" or the real model's name ("smollm2-135m").
  std::string name;
  /// Indexer layers the model makes inputs for, in full-layer rank order: the pattern model's
  /// layers (equal to the schedule's full layers), or the real model's layers (each has an indexer;
  /// equal to the schedule's model layers, of which the schedule's full layers use theirs).
  int num_indexer_layers = 0;
  /// Whether indexer inputs are indexed by full-layer rank (pattern model) or by model layer.
  bool indexer_per_model_layer = false;
  int num_heads = 0;  // indexer H
  int head_dim = 0;   // indexer D
  /// Token vocabulary of a real model; 0 for the synthetic model (no tokens in or out).
  int vocab_size = 0;
  int eos_token_id = -1;    // the real model's end-of-sequence id; -1 for none
  int64_t max_context = 0;  // slots a sequence may hold (0 = no model limit)
  /// With indexer_per_model_layer: the model layers whose index keys the model makes for the
  /// full-layer ranks (must be the schedule's full layers).
  std::vector<int> full_layers;
};

/// One row of a decode step: a sequence at a query position, with its input token (a real model;
/// -1 for the synthetic one).
struct ModelRow {
  uint64_t sequence_id = 0;
  int64_t position = 0;
  int32_t token = -1;
  SamplingParams sampling;  // a real model's draw for position + 1 (the sequence's)
};

/// One decode step's pass over the model's layers for a batch of rows (ModelRow order), driven by
/// the engine layer by layer: for each model layer l in order, IndexerInputs (if l is full) and
/// then AttendLayer(l), then Finish. Used by one thread at a time, except IndexerInputs, which may
/// run on several threads for disjoint rows after PrepareIndexerInputs.
class ModelStep {
 public:
  virtual ~ModelStep() = default;

  /// Readies the indexer inputs of model layer `model_layer` (full-layer rank `full_rank`): a real
  /// model computes them for every row from the layer's input (so every earlier layer must have
  /// been attended). INVALID_ARGUMENT (layer out of order), INTERNAL.
  virtual absl::Status PrepareIndexerInputs(int model_layer, int full_rank) = 0;

  /// The indexer inputs of rows [first_row, first_row + num_rows) of full-layer rank `full_rank`:
  /// queries fp32 [num_rows, H, D] (left alone when empty), head weights fp32 [num_rows, H], the
  /// rows' own index keys fp32 [num_rows, D]. `prefix_block_ids`: the rows' sequence's (the pattern
  /// model's shared-prefix content). Thread-safe for disjoint rows. INVALID_ARGUMENT (sizes).
  virtual absl::Status IndexerInputs(int full_rank, int first_row, int num_rows,
                                     std::span<const uint64_t> prefix_block_ids,
                                     std::span<float> queries, std::span<float> head_weights,
                                     std::span<float> index_keys) const = 0;

  /// Runs model layer `model_layer` for every row over its selection (`rows`, one AttentionRowRef
  /// per ModelRow, in order), writing the rows' KV first. With `outputs` non-empty (fp32
  /// [rows, output_values_per_row()]) the attention outputs are copied there (the observer).
  /// INVALID_ARGUMENT (a selected slot beyond the row's position, layer out of order), INTERNAL.
  virtual absl::Status AttendLayer(int model_layer, std::span<const AttentionRowRef> rows,
                                   std::span<float> outputs) = 0;

  /// After the last layer: the token sampled for position + 1 of every row (a real model, with
  /// its sequence's SamplingParams), or nothing (the synthetic model). FAILED_PRECONDITION (a
  /// layer not attended yet), INTERNAL (a device error).
  virtual absl::StatusOr<std::vector<int32_t>> Finish() = 0;
};

/// The model seam. Thread-safety: calls for different sequences may run concurrently; the caller
/// serializes calls that touch the same sequence (the engine's sequence locks).
class AttentionModel {
 public:
  virtual ~AttentionModel() = default;

  virtual const ModelShape& shape() const = 0;

  /// Where it runs ("cpu", or the device's description).
  virtual std::string Description() const = 0;

  /// Values of one attended row's output (the observer's): attention heads x value dims.
  virtual int64_t output_values_per_row() const = 0;

  /// The unit KV slots are held in (AttentionBackend::slot_granularity).
  virtual int64_t slot_granularity() const { return 1; }

  /// Extends a sequence (created on first use with `first_slot` = 0) from its `first_slot` slots to
  /// `end_slot`: the synthetic model generates the KV rows; a real model runs `tokens` (the ids of
  /// slots [first_slot, end_slot), required, each in [0, vocab)) through every layer densely,
  /// keeps their index keys for IndexKeys, and returns the token sampled for position end_slot
  /// under `sampling` (the engine keeps it: each step's ModelRow carries it).
  /// INVALID_ARGUMENT (tokens' count or ids, first_slot not the sequence's length),
  /// RESOURCE_EXHAUSTED (memory, the model's context); nothing changes on an error.
  virtual absl::StatusOr<std::optional<int32_t>> Extend(uint64_t sequence_id, int64_t first_slot,
                                                        int64_t end_slot,
                                                        std::span<const int32_t> tokens,
                                                        const SamplingParams& sampling) = 0;

  /// Index keys fp32 [num_slots, D] of slots [first_slot, first_slot + num_slots) at full-layer
  /// rank `full_rank`: the synthetic model's pure function of (seed, layer, slot or prefix block),
  /// or the keys the last Extend of that sequence computed (its range only). Thread-safe.
  /// INVALID_ARGUMENT (layer, range, size).
  virtual absl::Status IndexKeys(uint64_t sequence_id, std::span<const uint64_t> prefix_block_ids,
                                 int full_rank, int64_t first_slot, int64_t num_slots,
                                 std::span<float> out) const = 0;

  /// Frees what Extend kept for IndexKeys (after the append). Never fails.
  virtual void DropIndexKeys(uint64_t sequence_id) = 0;

  /// Shrinks a sequence's KV to `num_slots` (a rollback, rejected drafts); 0 forgets it. The engine
  /// never passes more than the sequence's slots (a real model then changes nothing).
  virtual absl::Status Truncate(uint64_t sequence_id, int64_t num_slots) = 0;

  /// A decode step over `rows` (ModelRow order; a sequence's rows contiguous at positions from its
  /// length). Real model: INVALID_ARGUMENT (missing token, id out of the vocabulary, positions),
  /// RESOURCE_EXHAUSTED (the model's context; host or device memory for the rows' KV),
  /// NOT_FOUND (a sequence never extended); nothing changes on an error.
  virtual absl::StatusOr<std::unique_ptr<ModelStep>> BeginStep(std::span<const ModelRow> rows) = 0;

  /// Waits for queued device work (AttentionBackend::Synchronize).
  virtual absl::Status Synchronize() { return absl::OkStatus(); }

  // ---- The device-resident path (AttentionBackend's; the synthetic model on the CUDA backend)
  // ----
  virtual int device_ordinal() const { return -1; }
  virtual absl::Status EnableDeviceSelects() {
    return absl::UnimplementedError("this model has no device-resident path");
  }
  virtual absl::StatusOr<std::unique_ptr<DeviceStep>> BeginDeviceStep() {
    return absl::UnimplementedError("this model has no device-resident path");
  }
};

}  // namespace dsa
