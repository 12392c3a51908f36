// The synthetic pattern model of the attention worker: seeded index keys, indexer queries and head
// weights whose index scores show the patterns SPIN section 2 reports on real DSA models.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention_worker/pattern_tables.h"
#include "common/philox.h"
#include "contracts/layout.h"

namespace dsa {

/// Parameters of the pattern model. Every "strength" is in index-score units: the score a slot gets
/// from that pattern alone at the pattern's peak (head weights of each head group sum to 1).
///
/// The defaults of the sink, salient-strength, topic-strength, recency, noise and layer-correlation
/// fields are fitted to the index-score statistics of SmolLM2-135M's trained indexer on held-out
/// text (4 windows of 4,096 tokens, K = 512; at H = 64, D = 128, 4 layers, seed 0; the salient
/// fraction and topic switch rate held), as `dsa fit-pattern` printed them: docs/eval.md "The
/// pattern model, fitted to the real model" has the command. The fit is not unique (several sets
/// give the same statistics); it moves the noise from the keys to the queries.
///
/// Head roles (per layer, fixed by head index): heads [0, num_positional_heads) are positional
/// (RoPE) heads, assigned round-robin to `num_diagonals` diagonals; diagonal 0 is the recency
/// diagonal (offset 0, a broad hump over the newest `recency_window_slots`), diagonals 1.. are
/// narrow bands at seeded offsets in [min_diagonal_offset, max_diagonal_offset]. The other heads
/// are content heads (sinks, salient slots, topics, noise).
/// num_positional_heads = round(positional_head_fraction * H).
struct PatternModelConfig {
  /// L >= 1: full (indexer) layers the model generates.
  int num_layers = 4;
  /// H in [1, 65535]: indexer query heads.
  int num_heads = 64;
  /// D in [8, 1024], a multiple of 8: index-key and query head dimension. Dims [0, D/2) are the
  /// content half; dims [D/2, D) are the RoPE half (D/4 rotation pairs).
  int head_dim = 128;
  /// Seed of every random quantity (Philox4x32 key).
  uint64_t seed = 0;

  // Attention sinks (SPIN section 2: vertical lines at the first slots).
  /// Slots [0, num_sink_slots) are sinks; >= 0.
  int num_sink_slots = 4;
  /// Score of a sink slot from the content heads; >= 0.
  float sink_strength = 3.7078857f;

  // Persistent vertical lines (salient slots).
  /// Fraction of slots that are salient at a layer, in [0, 1). Salience is layer-correlated.
  float salient_fraction = 0.01f;
  /// Score of a salient slot from the content heads; >= 0.
  float salient_strength = 1.0625f;

  // Topics and sudden shifts: every prefix block (512 slots) has one of `num_topics` topics; the
  // query's topic is piecewise constant in the position t and switches at seeded random steps.
  /// >= 1.
  int num_topics = 8;
  /// Score of a slot whose segment has the query's topic; >= 0.
  float topic_strength = 0.75f;
  /// Probability per decode position that the query's topic switches: 0 or in [1e-4, 1].
  float topic_switch_rate = 1.0f / 32.0f;

  // Diagonal bands and recency from a RoPE-like rotation of the second half of the dims.
  /// Fraction of heads that are positional, in [0, 1].
  float positional_head_fraction = 0.25f;
  /// Distinct diagonals (diagonal 0 = recency), in [1, 64]; at most the positional heads.
  int num_diagonals = 4;
  /// Peak score of a narrow diagonal band (diagonals 1..), after the threshold; >= 0.
  float diagonal_strength = 2.0f;
  /// Peak score of the recency hump (diagonal 0), after the threshold; >= 0.
  float recency_strength = 10.387692f;
  /// Width of the recency hump in slots; >= 1.
  int recency_window_slots = 160;
  /// Narrow diagonals use the rotation frequencies theta_f >= 1 / diagonal_band_slots; >= 1.
  int diagonal_band_slots = 32;
  /// Smallest offset t - i of a narrow diagonal; >= 1. Offsets are log-uniform in
  /// [min_diagonal_offset, max_diagonal_offset].
  int min_diagonal_offset = 32;
  /// Largest offset t - i of a narrow diagonal; >= min_diagonal_offset.
  int max_diagonal_offset = 2048;
  /// RoPE base: theta_f = rope_base^(-f / (D/4)) for pair f; > 1.
  float rope_base = 10000.0f;
  /// Positional heads subtract this fraction of their diagonal's peak before the ReLU (through a
  /// key direction common to all slots), so only the band itself, not the kernel's oscillating
  /// tail, scores; in [0, 1).
  float positional_threshold = 0.5f;

  // Noise.
  /// Norm of the per-slot random part of an index key's content half; >= 0.
  float key_noise = 0.00074185082f;
  /// Norm of the per-slot random part of an index key's RoPE half; >= 0.
  float rope_key_noise = 0.25f;
  /// Norm of the per-step random part of a content head's query; >= 0.
  float query_noise = 6.5917969f;
  /// Correlation length in decode steps of the query noise and head weights (smooth value noise);
  /// >= 1.
  int query_noise_steps = 8;
  /// Fraction of the query noise variance shared by all heads of a row, in [0, 1].
  float shared_query_noise_fraction = 0.5f;
  /// Log-normal sigma of the per-step head-weight modulation; >= 0.
  float head_weight_noise = 0.3f;

  // Layers.
  /// Fraction of every random quantity's variance that is smooth over layers, in [0, 1]; the rest
  /// is drawn independently per layer. 0: layers independent.
  float layer_correlation = 0.725f;
  /// Period in layers of the smooth part (value noise over the layer index); >= 1.
  int layer_correlation_length = 4;
};

/// The pattern model with hand-set strengths at which every pattern of SPIN section 2 shows plainly
/// (the defaults before they were fitted to a real model; the paper gives no strengths): sinks 4,
/// salient slots 2, topics 1, recency 2 over 128 slots, key and query noise 1, layer correlation
/// 0.6. For tests and studies of the patterns themselves (SPIN Figure 1, Table 1); the defaults are
/// what real text looks like.
PatternModelConfig SpinFigurePatternConfig();

/// Checks every field of `config`. INVALID_ARGUMENT naming the first bad field otherwise.
absl::Status ValidatePatternModelConfig(const PatternModelConfig& config);

/// The synthetic pattern model (DESIGN.md 3, attention_worker/): generates real index keys,
/// indexer queries and head weights (not scores) for L layers, such that the index scores
/// z_t[i] = s_i * sum_h w_t,h * ReLU(q_t,h . k_i) show SPIN section 2's patterns: persistent
/// vertical lines (sinks and salient slots), diagonal bands from a RoPE rotation of half the dims,
/// recency, and sudden shifts when the query's topic changes. Adjacent layers are correlated, so
/// the prev-layer predictor beats random but loses to prev-iter (SPIN Table 1).
///
/// The generative model, per layer l (U_* are layer-correlated unit directions in the content
/// half C = dims [0, D/2); R is a unit vector in the RoPE half with equal pair magnitudes; Rot(x)
/// rotates pair f by theta_f * x, theta_f = rope_base^(-f / (D/4))):
///   key k_i     C: key_noise * n_i + topic_strength * U_topic(segment of i) + U_common
///                  + sink_strength * U_sink [i < num_sink_slots]
///                  + salient_strength * U_salient [i salient]
///               R: Rot(i) (R + rope_key_noise * n'_i)
///   content head   C: U_topic(query topic at t) + U_sink + U_salient + query_noise * m_h(t)
///   positional     C: query_noise * m_h(t) - threshold * U_common
///   head (diag d)  R: Rot(t - offset_d) (spectrum_d * R), so q . k_i peaks at i = t - offset_d.
/// m_h(t) is smooth value noise over t (period query_noise_steps), part shared by all heads;
/// head weights are log-normal value noise over t around 1 / (heads in the head's group). Random
/// normals come from Philox4x32 through Box-Muller; the per-slot and per-step noise vectors are
/// sums of 8 signed rows of a per-layer pool of 1024 such normal vectors (chosen by Philox), which
/// keeps a key at about 1 us instead of D/4 Box-Mullers per layer.
///
/// Everything is a pure function of its coordinates (counter-based Philox4x32, no sequential
/// state): keys of slot i at layer l of (seed, l, i) (or of a prefix block id and offset),
/// queries and weights at position t of (seed, l, t). Memory: about 0.8 MB per layer at D = 128
/// (the noise pools). Thread-safe: all methods are const.
/// Box-Muller's first normal radius * cos(angle) (pattern_model.cc Normals4, fp32, glibc's logf
/// and cosf) tabulated over its two 24-bit uniforms: radius[m] for the word m << 8 of u1, cosine[m]
/// for the word m << 8 of u2, each [kBoxMullerTableSize] (64 MiB). Normals4's first value of a
/// Philox block r is radius[r.c[0] >> 8] * cosine[r.c[1] >> 8] exactly. Seed-independent; about
/// 0.3 s of CPU. The GPU generator reads them instead of evaluating logf / cosf.
void BoxMullerFirstNormalTables(std::vector<float>* radius, std::vector<float>* cosine);

class PatternModel {
 public:
  /// Validates `config` (see ValidatePatternModelConfig) and precomputes the per-layer
  /// directions. Errors: INVALID_ARGUMENT naming the bad field.
  static absl::StatusOr<PatternModel> Create(const PatternModelConfig& config);

  const PatternModelConfig& config() const { return config_; }
  int num_layers() const { return config_.num_layers; }
  int num_heads() const { return config_.num_heads; }
  int head_dim() const { return config_.head_dim; }
  int num_positional_heads() const { return num_positional_heads_; }

  /// Index keys of slots [first_slot, first_slot + num_slots) at `layer`: fp32
  /// [num_slots, head_dim], row-major, into `out`. Slot i's key is a pure function of
  /// (seed, layer, i): its content (all dims before the rotation) derives from the slot index and
  /// its topic segment is floor(i / kPrefixBlockTokens).
  /// Errors: INVALID_ARGUMENT (layer out of [0, L), first_slot < 0, num_slots < 0,
  /// out.size() != num_slots * head_dim).
  absl::Status IndexKeys(int layer, int64_t first_slot, int64_t num_slots,
                         std::span<float> out) const;

  /// Index keys of slots [first_slot, first_slot + num_slots) whose content comes from a shared
  /// prefix block: slot first_slot + j holds offset first_offset + j of block `prefix_block_id`.
  /// The content (all dims before the rotation, the salience and the topic) is a pure function of
  /// (seed, layer, prefix_block_id, offset); the RoPE rotation of the second half and the sink
  /// boost follow the absolute slot. So two requests whose prefix blocks share ids at the same
  /// positions get bit-identical keys. Layout as IndexKeys.
  /// Errors: INVALID_ARGUMENT (layer, first_slot < 0, first_offset < 0, num_slots < 0,
  /// first_offset + num_slots > kPrefixBlockTokens, out.size()).
  absl::Status PrefixBlockIndexKeys(int layer, uint64_t prefix_block_id, int first_offset,
                                    int64_t first_slot, int num_slots, std::span<float> out) const;

  /// The indexer query and head weights of the decode row at query position `position` (t) and
  /// `layer`: query_out fp32 [num_heads, head_dim] row-major, head_weights_out fp32 [num_heads]
  /// (positive). A pure function of (seed, layer, t), so verifier rows t..t+d can be generated in
  /// any order. Errors: INVALID_ARGUMENT (layer, position < 0, span sizes).
  absl::Status IndexerQuery(int layer, int64_t position, std::span<float> query_out,
                            std::span<float> head_weights_out) const;

  /// The head weights alone of the decode row at (`layer`, `position`): fp32 [num_heads], the
  /// same values IndexerQuery writes (one shared code path). The GPU generator takes them from
  /// here: they use glibc's expf, which the device cannot reproduce bit for bit
  /// (docs/attention_gpu_inputs.md). Errors: INVALID_ARGUMENT (layer, position < 0, span size).
  absl::Status HeadWeights(int layer, int64_t position, std::span<float> head_weights_out) const;

  /// The precomputed tables and scalars the GPU generator (attention_worker/cuda/pattern_inputs.h)
  /// needs to produce IndexKeys, PrefixBlockIndexKeys and IndexerQuery's queries bit for bit.
  /// About 0.8 MB per layer at D = 128.
  PatternTables Tables() const;

  // Introspection of the ground truth (for tests and studies).

  /// Whether slot `slot` (slot-indexed content) is salient (a vertical line) at `layer`.
  /// Requires 0 <= layer < L and slot >= 0.
  bool IsSalientSlot(int layer, int64_t slot) const;
  /// Topic of slot-indexed segment floor(slot / kPrefixBlockTokens); in [0, num_topics).
  int SegmentTopic(int64_t slot) const;
  /// Topic of prefix block `prefix_block_id`; in [0, num_topics).
  int PrefixBlockTopic(uint64_t prefix_block_id) const;
  /// The query's topic at position t (piecewise constant; switches at seeded steps). t >= 0.
  int QueryTopic(int64_t position) const;
  /// The latest topic switch at or before t (0 if none since position 0). t >= 0.
  int64_t TopicEpochStart(int64_t position) const;
  /// Offset t - i of diagonal `diagonal` (0 for the recency diagonal); 0 <= diagonal < the
  /// number of diagonals.
  int DiagonalOffset(int diagonal) const { return diagonal_offsets_[diagonal]; }

 private:
  struct LayerTables {
    std::vector<float> topic_directions;   // [num_topics, D/2], unit rows
    std::vector<float> sink_direction;     // [D/2], unit
    std::vector<float> salient_direction;  // [D/2], unit
    std::vector<float> common_direction;   // [D/2], unit, in every key (positional threshold)
    std::vector<float> rope_base;          // [D/2], the keys' RoPE-half mean before rotation, unit
    std::vector<float> key_noise_pool;     // [kNoisePoolRows, D], N(0, 1) entries
    std::vector<float> query_noise_pool;   // [kNoisePoolRows, D/2], N(0, 1) entries
  };
  /// Where a key's content comes from: a slot index or a (prefix block id, offset).
  struct ContentId {
    bool from_prefix_block = false;
    uint64_t id = 0;  // slot index or prefix block id
    int offset = 0;   // offset in the prefix block (prefix mode only)
  };

  explicit PatternModel(const PatternModelConfig& config) : config_(config) {}
  void Precompute();
  PhiloxKey StreamKey(uint32_t stream) const;
  // n (a multiple of 4) normals, pure in (stream, layer, c0, c2, c3) (c0's low 16 bits count the
  // groups of four), smooth over layers per config_.layer_correlation.
  void LayerNormals(uint32_t stream, int layer, uint32_t c0, uint32_t c2, uint32_t c3, int n,
                    float* out) const;
  void UnitDirection(uint32_t stream, int layer, uint32_t c2, uint32_t c3, int n, float* out) const;
  float SalienceValue(int layer, const ContentId& content) const;
  int TopicOf(const ContentId& content) const;
  void KeyOf(int layer, const ContentId& content, int64_t slot, float* key) const;
  // Smooth value noise over the decode position (period query_noise_steps) and layers.
  void TimeNormals(uint32_t stream, int layer, uint32_t head, int64_t position, int n,
                   float* out) const;
  // A query-noise vector [D/2] of `head` at `layer`, smooth in the position (period
  // query_noise_steps): value noise over pool noise at the lattice points.
  void QueryNoise(int layer, uint32_t head, int64_t position, float* out) const;
  // The head weight of `head` at (layer, position) (IndexerQuery, HeadWeights).
  float HeadWeight(int layer, int head, int64_t position) const;

  PatternModelConfig config_;
  int num_positional_heads_ = 0;
  float salience_threshold_ = 0.0f;  // N(0,1) quantile for salient_fraction
  std::vector<PhiloxKey> stream_keys_;
  std::vector<double> rope_theta_;       // [D/4] rotation frequency of pair f, radians per slot
  std::vector<int> diagonal_offsets_;    // [num_diagonals]
  std::vector<float> diagonal_spectra_;  // [num_diagonals, D/4] query gain per pair
  std::vector<float> head_weight_base_;  // [H] base weight (each head group sums to 1)
  std::vector<LayerTables> layers_;
};

}  // namespace dsa
