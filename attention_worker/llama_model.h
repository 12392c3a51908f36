// The real model of the attention worker on the CPU (docs/model.md): SmolLM2-135M, a LLaMA
// backbone, with a lightning indexer per layer; its weights, one sequence's KV cache, and the
// forward pass layer by layer (dense causal or over a selection per row), BLAS GEMMs and OpenMP.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention_worker/llama_pass_rules.h"

namespace dsa {

/// `dsa.format` of the backbone's safetensors file.
inline constexpr char kLlamaModelFormat[] = "dsa-llama/1";
/// `dsa.format` of the lightning indexer's safetensors file.
inline constexpr char kLightningIndexerFormat[] = "dsa-indexer/1";
/// `dsa.model` of SmolLM2-135M, whose shape fields must then be SmolLM2Config()'s.
inline constexpr char kSmolLM2ModelName[] = "smollm2-135m";

/// The backbone's shape (docs/model.md, "The backbone"), read from the model file's metadata
/// (decimal strings named as the fields). Every count is >= 1.
struct LlamaConfig {
  int num_layers = 0;      // decoder layers
  int d_model = 0;         // hidden width
  int num_heads = 0;       // query heads
  int num_kv_heads = 0;    // key/value heads (GQA: num_heads is a multiple of it)
  int head_dim = 0;        // dims per head, even (RoPE rotates adjacent pairs over all of them)
  int ffn_dim = 0;         // SwiGLU hidden width
  int vocab_size = 0;      // token ids are in [0, vocab_size); the embedding is tied to the head
  int context_length = 0;  // slots a sequence may hold: positions are in [0, context_length)
  double rope_base = 0;    // RoPE theta_j = rope_base^(-2j / head_dim), > 1
  float rms_eps = 0;       // RMSNorm epsilon, > 0
  int bos_token_id = 0;    // in [0, vocab_size)
  int eos_token_id = 0;    // in [0, vocab_size)

  /// num_heads * head_dim: the width of the attention's queries and output.
  int q_dim() const { return num_heads * head_dim; }
  /// num_kv_heads * head_dim: one slot's key (or value) width in the KV cache.
  int kv_dim() const { return num_kv_heads * head_dim; }

  /// Parses the metadata's shape fields. Errors (INVALID_ARGUMENT, naming `path` and the field):
  /// a field absent or not a decimal number, or values Validate refuses.
  static absl::StatusOr<LlamaConfig> FromMetadata(
      const std::map<std::string, std::string>& metadata, const std::string& path);
  /// INVALID_ARGUMENT (naming `path`) unless every field is in the range its comment gives.
  absl::Status Validate(const std::string& path) const;
};

/// SmolLM2-135M's values (docs/model.md's table; rms_eps the float nearest 1e-5, as the GGUF).
LlamaConfig SmolLM2Config();

/// The lightning indexer's shape (docs/model.md, "The lightning indexer"; DeepSeek-V3.2 section
/// 2.1), from the indexer file's metadata. The backbone width comes from the model.
struct LightningIndexerConfig {
  int num_layers = 0;        // one indexer per backbone layer
  int num_heads = 16;        // H
  int head_dim = 64;         // D (index key and query head width)
  int query_rank = 128;      // the low-rank query's width (Wqa's rows)
  int rope_dims = 32;        // RoPE over dims [0, rope_dims) of each head and of the key; even
  double rope_base = 1e5;    // theta_j = rope_base^(-2j / rope_dims)
  float k_norm_eps = 1e-6f;  // the key LayerNorm's epsilon (fixed by the format)

  /// Parses the metadata (num_layers, num_heads, head_dim, query_rank, rope_dims, rope_base).
  /// Errors: INVALID_ARGUMENT naming `path` and the field (absent, not decimal, out of range:
  /// counts >= 1, rope_dims even and <= head_dim, rope_base > 1).
  static absl::StatusOr<LightningIndexerConfig> FromMetadata(
      const std::map<std::string, std::string>& metadata, const std::string& path);
  /// The factor folded into the head weights: num_heads^-1/2 * head_dim^-1/2.
  float head_weight_scale() const;
};

/// The model's weights, fp32, immutable after Load and shared across threads (thread-safe).
class LlamaModel {
 public:
  /// Loads the backbone from `model_path` (fp32 safetensors, docs/model.md's names and shapes)
  /// and, unless `indexer_path` is empty, the lightning indexers from `indexer_path` (fp16,
  /// converted to fp32 here).
  ///
  /// Checks: `dsa.format` is kLlamaModelFormat (kLightningIndexerFormat for the indexer); the
  /// shape fields parse and validate (LlamaConfig::FromMetadata), and equal SmolLM2Config() when
  /// `dsa.model` is kSmolLM2ModelName; every tensor the config implies is present with dtype F32
  /// (F16 for the indexer) and its exact shape, and no other tensor is; the indexer has one layer
  /// per backbone layer, its Wqa's width equals d_model, and its `base_model_sha256` (when both
  /// files carry one) equals the model's `source_sha256`.
  /// Errors, each naming the file and what was expected: NOT_FOUND (no such file), DATA_LOSS (a
  /// truncated file), INVALID_ARGUMENT (a malformed file, a wrong format string, a metadata
  /// field, a missing, extra or mis-shaped tensor, a wrong dtype, an indexer made for another
  /// model), or the errno's code when a file cannot be read.
  ///
  /// Side effect: with the pthread build of OpenBLAS, sets its thread count to 1 (the model runs
  /// its own OpenMP threads around single-threaded GEMMs, so the two pools never oversubscribe).
  static absl::StatusOr<std::shared_ptr<const LlamaModel>> Load(const std::string& model_path,
                                                                const std::string& indexer_path);

  /// The weights of one layer of the backbone, fp32 row-major ([out, in]: y = W x).
  struct Layer {
    std::vector<float> attn_norm;  // [d_model]
    std::vector<float> wqkv;       // [q_dim + 2 kv_dim, d_model]: Wq, Wk, Wv stacked
    std::vector<float> wo;         // [d_model, q_dim]
    std::vector<float> ffn_norm;   // [d_model]
    std::vector<float> wgate_up;   // [2 ffn_dim, d_model]: Wgate, Wup stacked
    std::vector<float> wdown;      // [d_model, ffn_dim]
  };
  /// The lightning indexer of one layer, fp32 row-major.
  struct IndexerLayer {
    std::vector<float> wproj;          // [query_rank + head_dim + num_heads, d_model]: Wqa, Wk, Ww
    std::vector<float> wqb;            // [num_heads * head_dim, query_rank]
    std::vector<float> k_norm_weight;  // [head_dim] (LayerNorm gamma)
    std::vector<float> k_norm_bias;    // [head_dim] (LayerNorm beta)
  };

  /// Builds a model from weights in memory (tests; Load uses it). Errors: INVALID_ARGUMENT when
  /// the config does not validate or a tensor's size disagrees with it (`indexer_layers` empty
  /// means no indexer).
  static absl::StatusOr<std::shared_ptr<const LlamaModel>> FromWeights(
      const LlamaConfig& config, std::vector<float> token_embd, std::vector<float> output_norm,
      std::vector<Layer> layers, const LightningIndexerConfig& indexer_config,
      std::vector<IndexerLayer> indexer_layers);

  const LlamaConfig& config() const { return config_; }
  /// Whether the lightning indexers were loaded (LlamaForward::IndexerInputs needs them).
  bool has_indexer() const { return !indexer_layers_.empty(); }
  /// The indexer's shape (meaningful when has_indexer()).
  const LightningIndexerConfig& indexer_config() const { return indexer_config_; }
  /// token_embd: fp32 [vocab_size, d_model] (also the output head, tied).
  std::span<const float> token_embd() const { return token_embd_; }
  /// output_norm: fp32 [d_model].
  std::span<const float> output_norm() const { return output_norm_; }
  /// Layer `l`'s weights (a device runner uploads them); requires 0 <= l < num_layers.
  const Layer& layer(int l) const { return layers_[l]; }
  /// Layer `l`'s indexer weights; requires has_indexer() and 0 <= l < num_layers.
  const IndexerLayer& indexer_layer(int l) const { return indexer_layers_[l]; }
  /// Bytes of fp32 weights held.
  int64_t weight_bytes() const;

 private:
  friend class LlamaForward;
  LlamaModel() = default;
  LlamaConfig config_;
  LightningIndexerConfig indexer_config_;
  std::vector<float> token_embd_;   // [vocab_size, d_model]
  std::vector<float> output_norm_;  // [d_model]
  std::vector<Layer> layers_;
  std::vector<IndexerLayer> indexer_layers_;
};

/// One sequence's KV cache: per layer, keys and values fp32 [slots, kv_dim] (post-RoPE keys),
/// slot t holding position t: 2 x num_layers x kv_dim x 4 bytes a slot (46,080 for SmolLM2-135M).
/// Grows as passes write rows (capacity doubles, up to the context length). A cache is used by one
/// thread at a time, and is in at most one LlamaForward pass at a time (from Begin until the pass's
/// last layer has run or the pass is destroyed). Not copyable: CopyFrom copies the slots.
class LlamaKvCache {
 public:
  /// An empty cache for `model`'s shape.
  explicit LlamaKvCache(const LlamaModel& model);
  LlamaKvCache(const LlamaKvCache&) = delete;
  LlamaKvCache& operator=(const LlamaKvCache&) = delete;

  /// Slots committed: a pass commits its rows when its last layer has run.
  int64_t num_slots() const { return num_slots_; }
  /// Whether a pass holds the cache (from LlamaForward::Begin until the pass's last layer has run
  /// or the pass is destroyed). Safe to read from another thread while that pass ends: a runner
  /// that marks caches under its lock (the CPU LlamaRunner) checks it under the same lock, and
  /// reading false there also sees everything the ended pass wrote (its slots, num_slots()).
  bool in_pass() const { return in_pass_.load(std::memory_order_acquire); }
  /// Drops slots [num_slots, num_slots()) (a rollback: rejected speculative rows, a turn reset);
  /// the memory stays reserved. Errors: INVALID_ARGUMENT unless 0 <= num_slots <= num_slots();
  /// FAILED_PRECONDITION while the cache is in a pass.
  absl::Status Truncate(int64_t num_slots);
  /// Makes this cache hold exactly `source`'s slots (a copy of their keys and values; the memory
  /// grows as a pass's would). Errors, nothing changed: INVALID_ARGUMENT (`source` is this cache or
  /// was made for another model shape); FAILED_PRECONDITION (either cache in a pass).
  /// RESOURCE_EXHAUSTED (host memory) leaves this cache's slots as they were.
  absl::Status CopyFrom(const LlamaKvCache& source);
  /// Bytes of K and V storage allocated (capacity, all layers).
  int64_t bytes() const;
  /// Layer `layer`'s keys, fp32 [num_slots(), kv_dim] (for checks). Requires a valid layer.
  std::span<const float> keys(int layer) const;
  /// Layer `layer`'s values, fp32 [num_slots(), kv_dim] (for checks). Requires a valid layer.
  std::span<const float> values(int layer) const;

 private:
  friend class LlamaForward;
  // Grows every layer to hold `slots` slots. RESOURCE_EXHAUSTED when memory runs out.
  absl::Status Reserve(int64_t slots);
  int num_layers_ = 0;
  int kv_dim_ = 0;
  int64_t context_length_ = 0;
  int64_t num_slots_ = 0;
  int64_t capacity_ = 0;
  // Set by LlamaForward::Begin, cleared when the pass ends (possibly while another thread reads
  // in_pass()): the clear is a release after the pass's last writes to the cache.
  std::atomic<bool> in_pass_{false};
  std::vector<std::vector<float>> keys_;    // [num_layers][capacity_ * kv_dim_]
  std::vector<std::vector<float>> values_;  // [num_layers][capacity_ * kv_dim_]
};

/// One row of a pass: the token at `position` of the sequence whose cache is `kv`.
struct LlamaRow {
  LlamaKvCache* kv = nullptr;
  int64_t position = 0;
  int32_t token = 0;
};

/// Tuning of a LlamaForward pass.
struct LlamaForwardOptions {
  /// A GEMM, or a layer's attention, forks OpenMP threads only from this many multiply-adds on
  /// (smaller ones run on the calling thread). The default, 2^22, keeps a one-row decode step
  /// serial but for its logits, while a prefill or a batched step of a few rows forks every GEMM:
  /// on cores shared with other busy processes each fork-join can wait a whole time slice (a
  /// one-row step of SmolLM2-135M at 1K context measured 86 ms at 2^22 but 0.2-1.2 s at
  /// 2^18-2^20 on 2 busy cores). On idle dedicated cores 2^18 parallelizes the step's GEMVs too
  /// (27 ms against 45 ms at 2^22 on 2 cores). >= 1.
  int64_t parallel_min_work = int64_t{1} << 22;
  /// For evaluations (dsa eval --model smollm2): when set, every sparse row's attention also
  /// scores all its visible slots 0..position densely and reports, per KV head, the dense softmax
  /// probability mass that falls on the row's selected slots, averaged over that KV head's query
  /// heads (the selection's attention-mass recall, in [0, 1]). Arguments: the row's cache, the
  /// model layer, the row's position, the KV head, the mass. Called from the pass's OpenMP
  /// threads, so it must be thread-safe; costs a dense attention per sparse row.
  std::function<void(const LlamaKvCache* cache, int layer, int64_t position, int kv_head,
                     double mass)>
      selection_mass_probe;
};

/// One forward pass over a set of rows, layer by layer (prefill, a batched decode step and
/// speculative verifier rows share it): Begin, then for each layer optionally IndexerInputs and
/// then RunLayer, then Logits / FinalHidden. Rows of one cache see each other causally (row at
/// position t attends slots <= t, this pass's included). Projections are BLAS GEMMs over all the
/// pass's rows; attention runs on all cores (OpenMP). Not thread-safe: one thread at a time.
class LlamaForward {
 public:
  /// Starts a pass. Per cache, the rows' positions must be exactly num_slots() ..
  /// num_slots() + count - 1 (any order in `rows`). Errors, nothing changed: INVALID_ARGUMENT (no
  /// rows, a null cache, a cache made for another shape, positions not contiguous from
  /// num_slots(), a token outside [0, vocab_size)); RESOURCE_EXHAUSTED (a position >=
  /// context_length, or host memory for a cache's growth); FAILED_PRECONDITION (a cache already in
  /// another pass). The caches must outlive the pass.
  static absl::StatusOr<std::unique_ptr<LlamaForward>> Begin(
      std::shared_ptr<const LlamaModel> model, std::vector<LlamaRow> rows,
      const LlamaForwardOptions& options = {});

  /// Releases the caches; an unfinished pass commits nothing (its caches keep num_slots()).
  ~LlamaForward();
  LlamaForward(const LlamaForward&) = delete;
  LlamaForward& operator=(const LlamaForward&) = delete;

  int num_rows() const { return static_cast<int>(rows_.size()); }
  const std::vector<LlamaRow>& rows() const { return rows_; }
  /// The layer RunLayer runs next; config().num_layers once the pass is done.
  int next_layer() const { return layer_; }
  bool done() const { return layer_ == model_->config().num_layers; }

  /// The lightning indexer's inputs of next_layer() for every row (docs/model.md), from the same
  /// x = RMSNorm(h) * attn_norm the layer's attention reads:
  /// - queries (out): fp32 [rows, H, D], RoPE at the row's position on dims [0, rope_dims);
  /// - head_weights (out): fp32 [rows, H], (Ww x) * H^-1/2 * D^-1/2;
  /// - index_keys (out): fp32 [rows, D], RoPE(LayerNorm(Wk x)).
  /// Optional; may be called again for the same layer. Errors: FAILED_PRECONDITION (the model has
  /// no indexer, or the pass is done); INVALID_ARGUMENT (a span of the wrong size).
  absl::Status IndexerInputs(std::span<float> queries, std::span<float> head_weights,
                             std::span<float> index_keys);

  /// Runs next_layer(): writes each row's K and V at its position, then attention, Wo, the
  /// residual and the feed-forward block; after the last layer, commits the rows to their caches.
  /// `selections` is empty (every row dense) or has one entry per row: an empty span for a dense
  /// row (slots 0..position), else the row's selection, int32 [K] for any K >= 1, -1 padding, any
  /// order: exactly its non-negative slots are attended.
  /// Errors (INVALID_ARGUMENT, checked before anything changes, the pass still usable):
  /// selections.size() not 0 or rows; a selection with a slot < -1 or > the row's position, a
  /// repeated slot, or no slot at all. FAILED_PRECONDITION when the pass is done.
  absl::Status RunLayer(std::span<const std::span<const int32_t>> selections = {});

  /// Logits of the given rows after the last layer: out fp32 [row_indices.size(), vocab_size] =
  /// token_embd @ (RMSNorm(h) * output_norm). Errors: FAILED_PRECONDITION before the pass is done;
  /// INVALID_ARGUMENT (a row index outside [0, num_rows()), a wrong out size).
  absl::Status Logits(std::span<const int32_t> row_indices, std::span<float> out) const;

  /// The final normed hidden state RMSNorm(h) * output_norm of the given rows, fp32
  /// [row_indices.size(), d_model]. Errors as Logits.
  absl::Status FinalHidden(std::span<const int32_t> row_indices, std::span<float> out) const;

 private:
  LlamaForward(std::shared_ptr<const LlamaModel> model, std::vector<LlamaRow> rows,
               const LlamaForwardOptions& options);
  void ComputeLayerInput();  // x_ for layer_, once per layer
  void Attention(std::span<const std::span<const int32_t>> selections);

  std::shared_ptr<const LlamaModel> model_;
  LlamaForwardOptions options_;
  std::vector<LlamaRow> rows_;
  std::vector<LlamaCacheRows<LlamaKvCache>> groups_;  // the rows of each cache
  int layer_ = 0;
  int x_layer_ = -1;         // the layer x_ was computed for
  std::vector<float> h_;     // [rows, d_model] the residual stream
  std::vector<float> x_;     // [rows, d_model] RMSNorm(h) * attn_norm of layer x_layer_
  std::vector<float> qkv_;   // [rows, q_dim + 2 kv_dim]
  std::vector<float> attn_;  // [rows, q_dim]
  std::vector<float> rope_cos_, rope_sin_;              // [rows, head_dim / 2]
  std::vector<float> index_rope_cos_, index_rope_sin_;  // [rows, rope_dims / 2]
  // Scratch kept across layers (no allocation and page faults per layer).
  struct AttentionScratch {
    std::vector<float> query, scores, out, gathered_keys, gathered_values;
    std::vector<int32_t> slots;
  };
  std::vector<AttentionScratch> scratch_;  // one per OpenMP thread
  std::vector<float> ffn_input_;           // [chunk rows, d_model]
  std::vector<float> ffn_gate_up_;         // [chunk rows, 2 ffn_dim]
  std::vector<float> index_proj_;          // [rows, query_rank + head_dim + num_heads]
  std::vector<uint8_t> selection_seen_;    // CheckLlamaSelections' scratch
};

/// The index scores of one row over fp32 keys (docs/model.md's z; DESIGN.md 2 without the fp8
/// scale): out[i] = sum_h w[h] * ReLU(q[h] . keys[i]), fp32 accumulation.
/// - query: fp32 [num_heads, head_dim]; head_weights: fp32 [num_heads];
/// - keys: fp32 [n, head_dim]; out: fp32 [n].
/// Errors: INVALID_ARGUMENT on sizes that disagree. Thread-safe. Take the top-K of the result with
/// SelectTopK (indexer_service/topk.h: DESIGN.md 4.1's rules, ties to the lower slot).
absl::Status IndexScores(int num_heads, int head_dim, std::span<const float> query,
                         std::span<const float> head_weights, std::span<const float> keys,
                         std::span<float> out);

}  // namespace dsa
