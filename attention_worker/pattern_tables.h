// The pattern model's precomputed tables and scalars, flattened for a copy on the GPU
// (attention_worker/cuda/pattern_inputs.h), which generates the same index keys and indexer queries
// bit for bit. Plain C++ (no Abseil, no CUDA): included by pattern_model.h and by the CUDA layer.
#pragma once

#include <cstdint>
#include <vector>

#include "common/philox.h"

namespace dsa {

/// Rows of a per-layer noise pool (pattern_model.cc kNoisePoolRows) and the bits that pick one.
inline constexpr int kPatternNoisePoolBits = 10;
inline constexpr int kPatternNoisePoolRows = 1 << kPatternNoisePoolBits;
/// Entries of each Box-Muller table: one per 24-bit uniform (Philox word >> 8).
inline constexpr int64_t kBoxMullerTableSize = int64_t{1} << 24;

/// Every scalar the generators read; all derived on the host from PatternModelConfig exactly as the
/// CPU generator derives them (so no transcendental function runs on the device for them).
struct PatternScalars {
  int num_layers = 0;             // L
  int num_heads = 0;              // H
  int head_dim = 0;               // D (a multiple of 8); half = D/2, pairs = D/4
  int num_topics = 0;             // >= 1
  int num_diagonals = 0;          // >= 1
  int num_sink_slots = 0;         // slots [0, num_sink_slots) are sinks
  int num_positional_heads = 0;   // heads [0, num_positional_heads) are positional
  int64_t query_noise_steps = 1;  // period (decode steps) of the query's value noise
  float salience_threshold = 0;   // a slot is salient when its salience value > this (may be +inf)
  float topic_strength = 0;
  float sink_strength = 0;
  float salient_strength = 0;
  float key_noise_gain = 0;       // key_noise / sqrt(D/2) (fp32, as the CPU computes it)
  float rope_key_noise_gain = 0;  // rope_key_noise / sqrt(D/2)
  float pool_gain = 0;           // 1 / sqrt(8): weight of each of the 8 pool rows of a noise vector
  float query_noise_gain = 0;    // query_noise / sqrt(D/2)
  float shared_noise_gain = 0;   // sqrt(shared_query_noise_fraction)
  float own_noise_gain = 0;      // sqrt(1 - shared_query_noise_fraction)
  float recency_threshold = 0;   // a recency head's common-direction gain (negative)
  float diagonal_threshold = 0;  // a narrow-diagonal head's common-direction gain (negative)
  double topic_switch_rate = 0;  // probability per step that the query's topic switches
  double layer_smooth_gain = 0;  // sqrt(layer_correlation)
  double layer_own_gain = 0;     // sqrt(1 - layer_correlation)
  // Philox keys of the streams the per-call generators draw from (pattern_model.cc Stream).
  PhiloxKey key_noise_slot{};           // pool rows of a slot-indexed key
  PhiloxKey key_noise_prefix{};         // pool rows of a prefix-block key
  PhiloxKey salience_slot_lattice{};    // salience, smooth-over-layers part (slot content)
  PhiloxKey salience_slot_own{};        // salience, per-layer part (slot content)
  PhiloxKey salience_prefix_lattice{};  // salience, smooth part (prefix content)
  PhiloxKey salience_prefix_own{};      // salience, per-layer part (prefix content)
  PhiloxKey segment_topic_slot{};       // topic of a slot-indexed segment
  PhiloxKey segment_topic_prefix{};     // topic of a prefix block
  PhiloxKey query_noise{};              // pool rows of a query's noise
  PhiloxKey topic_switch{};             // the query topic's switch steps
  PhiloxKey epoch_topic{};              // the query's topic of an epoch
};

/// The tables of one PatternModel (PatternModel::Tables()). Per-layer tables are concatenated
/// over the L layers, layer-major.
struct PatternTables {
  PatternScalars scalars;
  std::vector<double> rope_theta;         // [D/4] rotation frequency of pair f, radians per slot
  std::vector<int32_t> diagonal_offsets;  // [num_diagonals] offset t - i of each diagonal
  std::vector<float> diagonal_spectra;    // [num_diagonals, D/4] query gain per pair
  std::vector<float> topic_directions;    // [L, num_topics, D/2]
  std::vector<float> sink_direction;      // [L, D/2]
  std::vector<float> salient_direction;   // [L, D/2]
  std::vector<float> common_direction;    // [L, D/2]
  std::vector<float> rope_base;           // [L, D/2]
  std::vector<float> key_noise_pool;      // [L, 1024, D]
  std::vector<float> query_noise_pool;    // [L, 1024, D/2]
  // LayerNormals' smoothing over layers (pattern_model.cc), per layer.
  std::vector<uint32_t> layer_lattice;     // [L] layer / layer_correlation_length
  std::vector<double> layer_smoothstep;    // [L] s = smoothstep(layer % length / length)
  std::vector<double> layer_lattice_norm;  // [L] 1 / sqrt((1 - s)^2 + s^2)
};

}  // namespace dsa
