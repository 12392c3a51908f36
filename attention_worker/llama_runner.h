// Where the real model's forward pass runs (docs/model.md): one interface over the CPU pass
// (LlamaForward with LlamaKvCache, llama_model.h) and the GPU pass (cuda/llama_cuda_runner.h),
// so that LlamaAttentionModel keeps one copy of the sequence bookkeeping for both devices.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention_worker/llama_model.h"

namespace dsa {

class LlamaRunner;

/// One sequence's KV cache on a runner's device: slot t holds position t of every layer. Used by
/// one thread at a time and in at most one pass at a time (from LlamaRunner::Begin until the pass
/// has run its last layer or is destroyed). Must not outlive its runner.
class LlamaSequenceCache {
 public:
  virtual ~LlamaSequenceCache() = default;

  /// The runner that made it (a pass takes only its own runner's caches).
  virtual const LlamaRunner* runner() const = 0;
  /// Slots committed: a pass commits its rows when its last layer has run.
  virtual int64_t num_slots() const = 0;
  /// Drops slots [num_slots, num_slots()) (a rollback); the memory stays reserved.
  /// INVALID_ARGUMENT unless 0 <= num_slots <= num_slots(); FAILED_PRECONDITION in a pass.
  virtual absl::Status Truncate(int64_t num_slots) = 0;
  /// Makes this cache hold exactly `source`'s slots (a copy of its keys and values; prefix sharing,
  /// benchmarks). INVALID_ARGUMENT (another runner's cache, or itself); FAILED_PRECONDITION (either
  /// in a pass); RESOURCE_EXHAUSTED (device memory); INTERNAL (a device error). The source may be
  /// driven by another thread meanwhile (its passes begun, run, ended): the check and the copy are
  /// atomic with respect to Begin.
  virtual absl::Status CopyFrom(const LlamaSequenceCache& source) = 0;
  /// Bytes of key and value storage reserved (all layers).
  virtual int64_t bytes() const = 0;
};

/// One row of a pass: the token at `position` of the sequence whose cache is `cache`.
struct LlamaRunnerRow {
  LlamaSequenceCache* cache = nullptr;
  int64_t position = 0;
  int32_t token = 0;
};

/// One forward pass over a set of rows, layer by layer, as LlamaForward (llama_model.h) defines it:
/// for each layer optionally IndexerInputs and then RunLayer, then Logits. Rows of one cache see
/// each other causally. Not thread-safe: one thread at a time.
class LlamaPass {
 public:
  virtual ~LlamaPass() = default;

  virtual int num_rows() const = 0;
  /// The layer RunLayer runs next; the model's num_layers once the pass is done.
  virtual int next_layer() const = 0;
  virtual bool done() const = 0;

  /// The lightning indexer's inputs of next_layer() for every row, on the host (LlamaForward::
  /// IndexerInputs): queries fp32 [rows, H, D], head_weights fp32 [rows, H], index_keys fp32
  /// [rows, D]. FAILED_PRECONDITION (no indexer, the pass done), INVALID_ARGUMENT (sizes),
  /// INTERNAL (a device error).
  virtual absl::Status IndexerInputs(std::span<float> queries, std::span<float> head_weights,
                                     std::span<float> index_keys) = 0;

  /// Runs next_layer() (LlamaForward::RunLayer): `selections` empty (every row dense) or one per
  /// row (an empty span: dense; else int32 [K], -1 padding, exactly its non-negative slots
  /// attended). INVALID_ARGUMENT (checked before anything changes), FAILED_PRECONDITION (done),
  /// INTERNAL (a device error).
  virtual absl::Status RunLayer(std::span<const std::span<const int32_t>> selections = {}) = 0;

  /// Logits fp32 [row_indices.size(), vocab_size] of the given rows after the last layer, on the
  /// host. FAILED_PRECONDITION before the pass is done, INVALID_ARGUMENT (a row index, out's size),
  /// INTERNAL (a device error).
  virtual absl::Status Logits(std::span<const int32_t> row_indices, std::span<float> out) = 0;
};

/// A device that runs a LlamaModel's passes. Thread-safe: passes over different caches may be
/// driven from different threads at once (a device runner serializes its device work).
class LlamaRunner {
 public:
  virtual ~LlamaRunner() = default;

  /// The model (host weights, config) the runner runs.
  virtual const LlamaModel& model() const = 0;
  /// Where it runs: "cpu", or the GPU's description.
  virtual std::string Description() const = 0;
  /// An empty cache (no device memory until a pass needs it). RESOURCE_EXHAUSTED, INTERNAL.
  virtual absl::StatusOr<std::unique_ptr<LlamaSequenceCache>> NewCache() = 0;
  /// Starts a pass (LlamaForward::Begin's rules and errors; also INVALID_ARGUMENT for a cache of
  /// another runner, RESOURCE_EXHAUSTED for device memory). The caches must outlive the pass.
  virtual absl::StatusOr<std::unique_ptr<LlamaPass>> Begin(std::vector<LlamaRunnerRow> rows) = 0;
};

/// The CPU runner: LlamaForward over LlamaKvCache, with `options` for every pass.
std::shared_ptr<LlamaRunner> MakeCpuLlamaRunner(std::shared_ptr<const LlamaModel> model,
                                                const LlamaForwardOptions& options = {});

}  // namespace dsa
