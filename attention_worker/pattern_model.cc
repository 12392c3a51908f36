// The synthetic pattern model: counter-based (Philox4x32) generation of index keys, indexer
// queries and head weights with sinks, vertical lines, diagonals, recency and topic shifts.
#include "attention_worker/pattern_model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <numbers>

#include "absl/strings/str_cat.h"

namespace dsa {
namespace {

// Independent random streams; each has two Philox keys (smooth-over-layers lattice, per layer).
enum Stream : uint32_t {
  kKeyNoiseSlot = 0,
  kKeyNoisePrefix,
  kSalienceSlot,
  kSaliencePrefix,
  kSegmentTopicSlot,
  kSegmentTopicPrefix,
  kTopicDirection,
  kSinkDirection,
  kSalientDirection,
  kRopeBase,
  kCommonDirection,
  kKeyNoisePool,
  kQueryNoisePool,
  kQueryNoise,
  kHeadWeightNoise,
  kTopicSwitch,
  kEpochTopic,
  kDiagonalOffset,
  kNumStreams,
};

// The head index that stands for "shared by all heads" in the query-noise stream.
constexpr uint32_t kSharedHead = 0xFFFF;

// Noise vectors are sums of kNoiseTerms signed rows drawn from a per-layer pool of kNoisePoolRows
// N(0, 1) rows (about Gaussian and isotropic, 2 Philox blocks instead of D/4 Box-Mullers per
// vector). The pools are layer-correlated and the row choice depends only on the slot (or the
// head and time), so the noise is layer-correlated like every other quantity.
constexpr int kNoisePoolBits = 10;
constexpr int kNoisePoolRows = 1 << kNoisePoolBits;
constexpr int kNoiseTerms = 8;

uint32_t Lo32(uint64_t x) { return static_cast<uint32_t>(x); }
uint32_t Hi32(uint64_t x) { return static_cast<uint32_t>(x >> 32); }

// Box-Muller's radius sqrt(-2 ln u1) for the uniform u1 = ((word >> 8) + 1) / 2^24 in (0, 1] (so
// the log is finite), and its angle 2 pi u2 for u2 = UniformFloat(word) in [0, 1); fp32 math.
float BoxMullerRadius(uint32_t word) {
  const float u1 = static_cast<float>((word >> 8) + 1u) * (1.0f / 16777216.0f);
  return std::sqrt(-2.0f * std::log(u1));
}
float BoxMullerAngle(uint32_t word) {
  return 2.0f * std::numbers::pi_v<float> * UniformFloat(word);
}

// Four N(0, 1) values from one Philox block: Box-Muller on two pairs of words (fp32 math).
std::array<float, 4> Normals4(PhiloxKey key, PhiloxCounter counter) {
  const PhiloxCounter r = Philox4x32(counter, key);
  std::array<float, 4> out;
  for (int pair = 0; pair < 2; ++pair) {
    const float radius = BoxMullerRadius(r.c[2 * pair]);
    const float angle = BoxMullerAngle(r.c[2 * pair + 1]);
    out[2 * pair] = radius * std::cos(angle);
    out[2 * pair + 1] = radius * std::sin(angle);
  }
  return out;
}

// out[0, dim) = sum over kNoiseTerms signed pool rows / sqrt(kNoiseTerms); the rows and signs come
// from two Philox blocks at `counter` and `counter` with word 1 incremented.
void PoolNoise(const std::vector<float>& pool, int dim, PhiloxKey key, PhiloxCounter counter,
               float* out) {
  std::fill(out, out + dim, 0.0f);
  const float gain = 1.0f / std::sqrt(static_cast<float>(kNoiseTerms));
  for (int block = 0; block < kNoiseTerms / 4; ++block) {
    PhiloxCounter c = counter;
    c.c[1] += static_cast<uint32_t>(block);
    const PhiloxCounter r = Philox4x32(c, key);
    for (int k = 0; k < 4; ++k) {
      const uint32_t word = r.c[k];
      const float* row = pool.data() + static_cast<size_t>(word >> (32 - kNoisePoolBits)) * dim;
      const float sign = (word & 1u) ? -gain : gain;
      for (int d = 0; d < dim; ++d) out[d] += sign * row[d];
    }
  }
}

// Cubic smoothstep weight of value noise at fraction f in [0, 1).
double Smoothstep(double f) { return f * f * (3.0 - 2.0 * f); }

// x with P(N(0,1) > x) = tail, for tail in (0, 1), by bisection on erfc.
double NormalUpperQuantile(double tail) {
  double lo = -40.0, hi = 40.0;
  for (int it = 0; it < 200; ++it) {
    const double mid = 0.5 * (lo + hi);
    if (0.5 * std::erfc(mid / std::numbers::sqrt2) > tail) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return 0.5 * (lo + hi);
}

absl::Status Invalid(const char* field, const char* rule) {
  return absl::InvalidArgumentError(absl::StrCat("PatternModelConfig.", field, " ", rule));
}

int NumPositionalHeads(const PatternModelConfig& c) {
  return static_cast<int>(std::lround(c.positional_head_fraction * c.num_heads));
}

// A positional head's gain along the keys' common direction (IndexerQuery).
float PositionalThreshold(const PatternModelConfig& c, float strength) {
  return -c.positional_threshold / (1.0f - c.positional_threshold) * strength;
}

}  // namespace

void BoxMullerFirstNormalTables(std::vector<float>* radius, std::vector<float>* cosine) {
  radius->resize(kBoxMullerTableSize);
  cosine->resize(kBoxMullerTableSize);
  for (int64_t m = 0; m < kBoxMullerTableSize; ++m) {
    const uint32_t word = static_cast<uint32_t>(m) << 8;
    (*radius)[m] = BoxMullerRadius(word);
    (*cosine)[m] = std::cos(BoxMullerAngle(word));
  }
}

PatternModelConfig SpinFigurePatternConfig() {
  PatternModelConfig c;
  c.sink_strength = 4.0f;
  c.salient_strength = 2.0f;
  c.topic_strength = 1.0f;
  c.recency_strength = 2.0f;
  c.recency_window_slots = 128;
  c.key_noise = 1.0f;
  c.query_noise = 1.0f;
  c.layer_correlation = 0.6f;
  return c;
}

absl::Status ValidatePatternModelConfig(const PatternModelConfig& c) {
  if (c.num_layers < 1) return Invalid("num_layers", "must be >= 1");
  if (c.num_heads < 1 || c.num_heads > 65535) return Invalid("num_heads", "must be in [1, 65535]");
  if (c.head_dim < 8 || c.head_dim > 1024 || c.head_dim % 8 != 0) {
    return Invalid("head_dim", "must be a multiple of 8 in [8, 1024]");
  }
  if (c.num_sink_slots < 0) return Invalid("num_sink_slots", "must be >= 0");
  if (!(c.sink_strength >= 0.0f) || !std::isfinite(c.sink_strength)) {
    return Invalid("sink_strength", "must be finite and >= 0");
  }
  if (!(c.salient_fraction >= 0.0f && c.salient_fraction < 1.0f)) {
    return Invalid("salient_fraction", "must be in [0, 1)");
  }
  if (!(c.salient_strength >= 0.0f) || !std::isfinite(c.salient_strength)) {
    return Invalid("salient_strength", "must be finite and >= 0");
  }
  if (c.num_topics < 1) return Invalid("num_topics", "must be >= 1");
  if (!(c.topic_strength >= 0.0f) || !std::isfinite(c.topic_strength)) {
    return Invalid("topic_strength", "must be finite and >= 0");
  }
  if (!(c.topic_switch_rate == 0.0f ||
        (c.topic_switch_rate >= 1e-4f && c.topic_switch_rate <= 1.0f))) {
    return Invalid("topic_switch_rate", "must be 0 or in [1e-4, 1]");
  }
  if (!(c.positional_head_fraction >= 0.0f && c.positional_head_fraction <= 1.0f)) {
    return Invalid("positional_head_fraction", "must be in [0, 1]");
  }
  const int num_positional = NumPositionalHeads(c);
  if (c.num_diagonals < 1 || c.num_diagonals > 64 ||
      (num_positional > 0 && c.num_diagonals > num_positional)) {
    return Invalid("num_diagonals",
                   "must be in [1, 64] and at most the number of positional heads");
  }
  if (!(c.diagonal_strength >= 0.0f) || !std::isfinite(c.diagonal_strength)) {
    return Invalid("diagonal_strength", "must be finite and >= 0");
  }
  if (!(c.recency_strength >= 0.0f) || !std::isfinite(c.recency_strength)) {
    return Invalid("recency_strength", "must be finite and >= 0");
  }
  if (c.recency_window_slots < 1) return Invalid("recency_window_slots", "must be >= 1");
  if (c.diagonal_band_slots < 1) return Invalid("diagonal_band_slots", "must be >= 1");
  if (c.min_diagonal_offset < 1) return Invalid("min_diagonal_offset", "must be >= 1");
  if (c.max_diagonal_offset < c.min_diagonal_offset) {
    return Invalid("max_diagonal_offset", "must be >= min_diagonal_offset");
  }
  if (!(c.rope_base > 1.0f) || !std::isfinite(c.rope_base)) {
    return Invalid("rope_base", "must be finite and > 1");
  }
  if (!(c.positional_threshold >= 0.0f && c.positional_threshold < 1.0f)) {
    return Invalid("positional_threshold", "must be in [0, 1)");
  }
  if (!(c.key_noise >= 0.0f) || !std::isfinite(c.key_noise)) {
    return Invalid("key_noise", "must be finite and >= 0");
  }
  if (!(c.rope_key_noise >= 0.0f) || !std::isfinite(c.rope_key_noise)) {
    return Invalid("rope_key_noise", "must be finite and >= 0");
  }
  if (!(c.query_noise >= 0.0f) || !std::isfinite(c.query_noise)) {
    return Invalid("query_noise", "must be finite and >= 0");
  }
  if (c.query_noise_steps < 1) return Invalid("query_noise_steps", "must be >= 1");
  if (!(c.shared_query_noise_fraction >= 0.0f && c.shared_query_noise_fraction <= 1.0f)) {
    return Invalid("shared_query_noise_fraction", "must be in [0, 1]");
  }
  if (!(c.head_weight_noise >= 0.0f && c.head_weight_noise <= 4.0f)) {
    return Invalid("head_weight_noise", "must be in [0, 4]");
  }
  if (!(c.layer_correlation >= 0.0f && c.layer_correlation <= 1.0f)) {
    return Invalid("layer_correlation", "must be in [0, 1]");
  }
  if (c.layer_correlation_length < 1) return Invalid("layer_correlation_length", "must be >= 1");
  return absl::OkStatus();
}

absl::StatusOr<PatternModel> PatternModel::Create(const PatternModelConfig& config) {
  if (absl::Status status = ValidatePatternModelConfig(config); !status.ok()) return status;
  PatternModel model(config);
  model.Precompute();
  return model;
}

PhiloxKey PatternModel::StreamKey(uint32_t stream) const {
  const PhiloxCounter r = Philox4x32(PhiloxCounter{{stream, 0x5EEDu, 0u, 0u}},
                                     PhiloxKey{{Lo32(config_.seed), Hi32(config_.seed)}});
  return PhiloxKey{{r.c[0], r.c[1]}};
}

void PatternModel::Precompute() {
  const PatternModelConfig& c = config_;
  const int half = c.head_dim / 2;
  const int num_pairs = c.head_dim / 4;
  num_positional_heads_ = NumPositionalHeads(c);
  salience_threshold_ = c.salient_fraction > 0.0f
                            ? static_cast<float>(NormalUpperQuantile(c.salient_fraction))
                            : INFINITY;
  stream_keys_.resize(2 * kNumStreams);
  for (uint32_t s = 0; s < 2 * kNumStreams; ++s) stream_keys_[s] = StreamKey(s);

  // RoPE frequencies and the per-diagonal query spectra (gain per pair, kernel(0) = strength).
  rope_theta_.resize(num_pairs);
  for (int f = 0; f < num_pairs; ++f) {
    rope_theta_[f] =
        std::pow(static_cast<double>(c.rope_base), -static_cast<double>(f) / num_pairs);
  }
  diagonal_offsets_.assign(c.num_diagonals, 0);
  diagonal_spectra_.assign(static_cast<size_t>(c.num_diagonals) * num_pairs, 0.0f);
  for (int d = 0; d < c.num_diagonals; ++d) {
    std::vector<int> band;
    if (d == 0) {
      const double hi = 1.0 / c.recency_window_slots, lo = hi / 4.0;
      for (int f = 0; f < num_pairs; ++f) {
        if (rope_theta_[f] >= lo && rope_theta_[f] <= hi) band.push_back(f);
      }
      if (band.empty()) {  // few pairs: take the one nearest to 1 / window on a log scale
        int best = 0;
        for (int f = 1; f < num_pairs; ++f) {
          if (std::abs(std::log(rope_theta_[f] / hi)) <
              std::abs(std::log(rope_theta_[best] / hi))) {
            best = f;
          }
        }
        band.push_back(best);
      }
    } else {
      const PhiloxCounter r = Philox4x32(PhiloxCounter{{static_cast<uint32_t>(d), 0u, 0u, 0u}},
                                         stream_keys_[2 * kDiagonalOffset]);
      const double u = UniformFloat(r.c[0]);
      const double log_min = std::log(static_cast<double>(c.min_diagonal_offset));
      const double log_max = std::log(static_cast<double>(c.max_diagonal_offset));
      const double offset = std::exp(log_min + u * (log_max - log_min));
      diagonal_offsets_[d] = std::clamp(static_cast<int>(std::lround(offset)),
                                        c.min_diagonal_offset, c.max_diagonal_offset);
      for (int f = 0; f < num_pairs; ++f) {
        if (rope_theta_[f] * c.diagonal_band_slots >= 1.0) band.push_back(f);
      }
      if (band.empty()) band.push_back(0);
    }
    // Scaled so that the peak left after the threshold is the diagonal's strength.
    const float strength =
        (d == 0 ? c.recency_strength : c.diagonal_strength) / (1.0f - c.positional_threshold);
    for (int f : band) {
      diagonal_spectra_[static_cast<size_t>(d) * num_pairs + f] =
          strength * static_cast<float>(num_pairs) / static_cast<float>(band.size());
    }
  }

  // Head weights: content heads sum to 1, the heads of each diagonal sum to 1.
  head_weight_base_.assign(c.num_heads, 0.0f);
  std::vector<int> heads_per_diagonal(c.num_diagonals, 0);
  for (int h = 0; h < num_positional_heads_; ++h) ++heads_per_diagonal[h % c.num_diagonals];
  const int num_content = c.num_heads - num_positional_heads_;
  for (int h = 0; h < c.num_heads; ++h) {
    head_weight_base_[h] = h < num_positional_heads_
                               ? 1.0f / static_cast<float>(heads_per_diagonal[h % c.num_diagonals])
                               : 1.0f / static_cast<float>(num_content);
  }

  // Per-layer directions (layer-correlated) and the keys' RoPE-half mean (equal pair magnitudes).
  layers_.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    LayerTables& t = layers_[l];
    t.topic_directions.resize(static_cast<size_t>(c.num_topics) * half);
    for (int topic = 0; topic < c.num_topics; ++topic) {
      UnitDirection(kTopicDirection, l, static_cast<uint32_t>(topic), 0u, half,
                    t.topic_directions.data() + static_cast<size_t>(topic) * half);
    }
    t.sink_direction.resize(half);
    UnitDirection(kSinkDirection, l, 0u, 0u, half, t.sink_direction.data());
    t.salient_direction.resize(half);
    UnitDirection(kSalientDirection, l, 0u, 0u, half, t.salient_direction.data());
    t.common_direction.resize(half);
    UnitDirection(kCommonDirection, l, 0u, 0u, half, t.common_direction.data());
    t.key_noise_pool.resize(static_cast<size_t>(kNoisePoolRows) * c.head_dim);
    t.query_noise_pool.resize(static_cast<size_t>(kNoisePoolRows) * half);
    for (int row = 0; row < kNoisePoolRows; ++row) {
      LayerNormals(kKeyNoisePool, l, 0u, static_cast<uint32_t>(row), 0u, c.head_dim,
                   t.key_noise_pool.data() + static_cast<size_t>(row) * c.head_dim);
      LayerNormals(kQueryNoisePool, l, 0u, static_cast<uint32_t>(row), 0u, half,
                   t.query_noise_pool.data() + static_cast<size_t>(row) * half);
    }
    std::vector<float> raw(half);
    LayerNormals(kRopeBase, l, 0u, 0u, 0u, half, raw.data());
    t.rope_base.resize(half);
    const float pair_norm = 1.0f / std::sqrt(static_cast<float>(num_pairs));
    for (int f = 0; f < num_pairs; ++f) {
      const float x = raw[2 * f], y = raw[2 * f + 1];
      const float norm = std::max(std::hypot(x, y), 1e-12f);
      t.rope_base[2 * f] = pair_norm * x / norm;
      t.rope_base[2 * f + 1] = pair_norm * y / norm;
    }
  }
}

void PatternModel::LayerNormals(uint32_t stream, int layer, uint32_t c0, uint32_t c2, uint32_t c3,
                                int n, float* out) const {
  const double rho = config_.layer_correlation;
  const double smooth_gain = std::sqrt(rho), own_gain = std::sqrt(1.0 - rho);
  const int period = config_.layer_correlation_length;
  const uint32_t lattice = static_cast<uint32_t>(layer / period);
  const double s = Smoothstep(static_cast<double>(layer % period) / period);
  const double lattice_norm = 1.0 / std::sqrt((1.0 - s) * (1.0 - s) + s * s);
  const PhiloxKey lattice_key = stream_keys_[2 * stream];
  const PhiloxKey own_key = stream_keys_[2 * stream + 1];
  for (int g = 0; g < n / 4; ++g) {
    const uint32_t word0 = c0 + static_cast<uint32_t>(g);
    std::array<double, 4> value{};
    if (own_gain > 0.0) {
      const auto own =
          Normals4(own_key, PhiloxCounter{{word0, static_cast<uint32_t>(layer), c2, c3}});
      for (int k = 0; k < 4; ++k) value[k] += own_gain * own[k];
    }
    if (smooth_gain > 0.0) {
      const auto a = Normals4(lattice_key, PhiloxCounter{{word0, lattice, c2, c3}});
      std::array<float, 4> b{};
      if (s > 0.0) b = Normals4(lattice_key, PhiloxCounter{{word0, lattice + 1, c2, c3}});
      for (int k = 0; k < 4; ++k) {
        value[k] += smooth_gain * lattice_norm * ((1.0 - s) * a[k] + s * b[k]);
      }
    }
    for (int k = 0; k < 4; ++k) out[4 * g + k] = static_cast<float>(value[k]);
  }
}

void PatternModel::UnitDirection(uint32_t stream, int layer, uint32_t c2, uint32_t c3, int n,
                                 float* out) const {
  LayerNormals(stream, layer, 0u, c2, c3, n, out);
  double norm2 = 0.0;
  for (int d = 0; d < n; ++d) norm2 += static_cast<double>(out[d]) * out[d];
  const float inv = static_cast<float>(1.0 / std::sqrt(std::max(norm2, 1e-30)));
  for (int d = 0; d < n; ++d) out[d] *= inv;
}

void PatternModel::TimeNormals(uint32_t stream, int layer, uint32_t head, int64_t position, int n,
                               float* out) const {
  const int64_t period = config_.query_noise_steps;
  const uint64_t lattice = static_cast<uint64_t>(position / period);
  const double s = Smoothstep(static_cast<double>(position % period) / period);
  const double norm = 1.0 / std::sqrt((1.0 - s) * (1.0 - s) + s * s);
  LayerNormals(stream, layer, head << 16, Lo32(lattice), Hi32(lattice), n, out);
  if (s > 0.0) {
    std::vector<float> next(n);
    LayerNormals(stream, layer, head << 16, Lo32(lattice + 1), Hi32(lattice + 1), n, next.data());
    for (int d = 0; d < n; ++d) {
      out[d] = static_cast<float>(norm * ((1.0 - s) * out[d] + s * next[d]));
    }
  }
}

void PatternModel::QueryNoise(int layer, uint32_t head, int64_t position, float* out) const {
  const int half = config_.head_dim / 2;
  const std::vector<float>& pool = layers_[layer].query_noise_pool;
  const PhiloxKey key = stream_keys_[2 * kQueryNoise];
  const int64_t period = config_.query_noise_steps;
  const uint64_t lattice = static_cast<uint64_t>(position / period);
  const double s = Smoothstep(static_cast<double>(position % period) / period);
  PoolNoise(pool, half, key, PhiloxCounter{{head, 0u, Lo32(lattice), Hi32(lattice)}}, out);
  if (s > 0.0) {
    std::vector<float> next(half);
    PoolNoise(pool, half, key, PhiloxCounter{{head, 0u, Lo32(lattice + 1), Hi32(lattice + 1)}},
              next.data());
    const float norm = static_cast<float>(1.0 / std::sqrt((1.0 - s) * (1.0 - s) + s * s));
    const float a = norm * static_cast<float>(1.0 - s), b = norm * static_cast<float>(s);
    for (int d = 0; d < half; ++d) out[d] = a * out[d] + b * next[d];
  }
}

float PatternModel::SalienceValue(int layer, const ContentId& content) const {
  float value[4];
  if (content.from_prefix_block) {
    LayerNormals(kSaliencePrefix, layer, static_cast<uint32_t>(content.offset) << 16,
                 Lo32(content.id), Hi32(content.id), 4, value);
  } else {
    LayerNormals(kSalienceSlot, layer, 0u, Lo32(content.id), Hi32(content.id), 4, value);
  }
  return value[0];
}

int PatternModel::TopicOf(const ContentId& content) const {
  const uint64_t segment = content.from_prefix_block
                               ? content.id
                               : content.id / static_cast<uint64_t>(kPrefixBlockTokens);
  const Stream stream = content.from_prefix_block ? kSegmentTopicPrefix : kSegmentTopicSlot;
  const PhiloxCounter r =
      Philox4x32(PhiloxCounter{{Lo32(segment), Hi32(segment), 0u, 0u}}, stream_keys_[2 * stream]);
  return static_cast<int>(UniformBelow(r.c[0], static_cast<uint32_t>(config_.num_topics)));
}

bool PatternModel::IsSalientSlot(int layer, int64_t slot) const {
  return SalienceValue(layer, ContentId{false, static_cast<uint64_t>(slot), 0}) >
         salience_threshold_;
}

int PatternModel::SegmentTopic(int64_t slot) const {
  return TopicOf(ContentId{false, static_cast<uint64_t>(slot), 0});
}

int PatternModel::PrefixBlockTopic(uint64_t prefix_block_id) const {
  return TopicOf(ContentId{true, prefix_block_id, 0});
}

void PatternModel::KeyOf(int layer, const ContentId& content, int64_t slot, float* key) const {
  const PatternModelConfig& c = config_;
  const int half = c.head_dim / 2;
  const int num_pairs = c.head_dim / 4;
  const LayerTables& t = layers_[layer];
  // The random part of the whole key, norm ~key_noise in each half.
  // The pool rows are chosen by the content alone (not the layer): the pools carry the layer
  // correlation.
  if (content.from_prefix_block) {
    PoolNoise(t.key_noise_pool, c.head_dim, stream_keys_[2 * kKeyNoisePrefix],
              PhiloxCounter{
                  {static_cast<uint32_t>(content.offset), 0u, Lo32(content.id), Hi32(content.id)}},
              key);
  } else {
    PoolNoise(t.key_noise_pool, c.head_dim, stream_keys_[2 * kKeyNoiseSlot],
              PhiloxCounter{{0u, 0u, Lo32(content.id), Hi32(content.id)}}, key);
  }
  const float noise_gain = c.key_noise / std::sqrt(static_cast<float>(half));
  const float rope_noise_gain = c.rope_key_noise / std::sqrt(static_cast<float>(half));
  for (int d = 0; d < half; ++d) key[d] *= noise_gain;
  for (int d = half; d < c.head_dim; ++d) key[d] *= rope_noise_gain;

  // Content half: topic of the segment, sink and salience boosts.
  const float* topic = t.topic_directions.data() + static_cast<size_t>(TopicOf(content)) * half;
  const bool sink = slot < c.num_sink_slots;
  const bool salient = SalienceValue(layer, content) > salience_threshold_;
  for (int d = 0; d < half; ++d) {
    float v = key[d] + c.topic_strength * topic[d] + t.common_direction[d];
    if (sink) v += c.sink_strength * t.sink_direction[d];
    if (salient) v += c.salient_strength * t.salient_direction[d];
    key[d] = v;
  }
  // RoPE half: the mean vector plus noise, pair f rotated by theta_f * slot.
  float* rope = key + half;
  for (int f = 0; f < num_pairs; ++f) {
    const double angle = rope_theta_[f] * static_cast<double>(slot);
    const float cs = static_cast<float>(std::cos(angle)), sn = static_cast<float>(std::sin(angle));
    const float x = rope[2 * f] + t.rope_base[2 * f];
    const float y = rope[2 * f + 1] + t.rope_base[2 * f + 1];
    rope[2 * f] = x * cs - y * sn;
    rope[2 * f + 1] = x * sn + y * cs;
  }
}

absl::Status PatternModel::IndexKeys(int layer, int64_t first_slot, int64_t num_slots,
                                     std::span<float> out) const {
  if (layer < 0 || layer >= config_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("IndexKeys: layer ", layer, " not in [0, ", config_.num_layers, ")"));
  }
  if (first_slot < 0 || num_slots < 0) {
    return absl::InvalidArgumentError("IndexKeys: first_slot and num_slots must be >= 0");
  }
  if (static_cast<int64_t>(out.size()) != num_slots * config_.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("IndexKeys: out has ", out.size(),
                     " values, expected num_slots * head_dim = ", num_slots * config_.head_dim));
  }
  for (int64_t j = 0; j < num_slots; ++j) {
    const int64_t slot = first_slot + j;
    KeyOf(layer, ContentId{false, static_cast<uint64_t>(slot), 0}, slot,
          out.data() + j * config_.head_dim);
  }
  return absl::OkStatus();
}

absl::Status PatternModel::PrefixBlockIndexKeys(int layer, uint64_t prefix_block_id,
                                                int first_offset, int64_t first_slot, int num_slots,
                                                std::span<float> out) const {
  if (layer < 0 || layer >= config_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("PrefixBlockIndexKeys: layer ", layer,
                                                   " not in [0, ", config_.num_layers, ")"));
  }
  if (first_slot < 0 || first_offset < 0 || num_slots < 0 ||
      first_offset + num_slots > kPrefixBlockTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PrefixBlockIndexKeys: need first_slot >= 0, first_offset >= 0, num_slots >= 0 and "
        "first_offset + num_slots <= ",
        kPrefixBlockTokens));
  }
  if (static_cast<int64_t>(out.size()) != static_cast<int64_t>(num_slots) * config_.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("PrefixBlockIndexKeys: out has ", out.size(),
                                                   " values, expected num_slots * head_dim"));
  }
  for (int j = 0; j < num_slots; ++j) {
    KeyOf(layer, ContentId{true, prefix_block_id, first_offset + j}, first_slot + j,
          out.data() + static_cast<int64_t>(j) * config_.head_dim);
  }
  return absl::OkStatus();
}

int64_t PatternModel::TopicEpochStart(int64_t position) const {
  const double rate = config_.topic_switch_rate;
  if (rate <= 0.0) return 0;
  const PhiloxKey key = stream_keys_[2 * kTopicSwitch];
  // A switch happens at step s >= 1 with probability `rate`, independently per step; four steps
  // share one Philox block.
  int64_t cached_group = -1;
  PhiloxCounter words{};
  for (int64_t s = position; s >= 1; --s) {
    const int64_t group = s / 4;
    if (group != cached_group) {
      words = Philox4x32(PhiloxCounter{{Lo32(static_cast<uint64_t>(group)),
                                        Hi32(static_cast<uint64_t>(group)), 0u, 0u}},
                         key);
      cached_group = group;
    }
    if (UniformFloat(words.c[s % 4]) < rate) return s;
  }
  return 0;
}

int PatternModel::QueryTopic(int64_t position) const {
  const uint64_t epoch = static_cast<uint64_t>(TopicEpochStart(position));
  const PhiloxCounter r =
      Philox4x32(PhiloxCounter{{Lo32(epoch), Hi32(epoch), 0u, 0u}}, stream_keys_[2 * kEpochTopic]);
  return static_cast<int>(UniformBelow(r.c[0], static_cast<uint32_t>(config_.num_topics)));
}

absl::Status PatternModel::IndexerQuery(int layer, int64_t position, std::span<float> query_out,
                                        std::span<float> head_weights_out) const {
  const PatternModelConfig& c = config_;
  if (layer < 0 || layer >= c.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("IndexerQuery: layer ", layer, " not in [0, ", c.num_layers, ")"));
  }
  if (position < 0) return absl::InvalidArgumentError("IndexerQuery: position must be >= 0");
  if (query_out.size() != static_cast<size_t>(c.num_heads) * c.head_dim ||
      head_weights_out.size() != static_cast<size_t>(c.num_heads)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "IndexerQuery: query_out must have num_heads * head_dim = ", c.num_heads * c.head_dim,
        " values and head_weights_out num_heads = ", c.num_heads));
  }
  const int half = c.head_dim / 2;
  const int num_pairs = c.head_dim / 4;
  const LayerTables& t = layers_[layer];
  const float* topic = t.topic_directions.data() + static_cast<size_t>(QueryTopic(position)) * half;
  const float noise_gain = c.query_noise / std::sqrt(static_cast<float>(half));
  const float shared_gain = std::sqrt(c.shared_query_noise_fraction);
  const float own_gain = std::sqrt(1.0f - c.shared_query_noise_fraction);

  std::vector<float> shared(half, 0.0f), own(half, 0.0f);
  if (shared_gain > 0.0f) QueryNoise(layer, kSharedHead, position, shared.data());
  for (int h = 0; h < c.num_heads; ++h) {
    float* q = query_out.data() + static_cast<size_t>(h) * c.head_dim;
    if (own_gain > 0.0f) {
      QueryNoise(layer, static_cast<uint32_t>(h), position, own.data());
    }
    const bool positional = h < num_positional_heads_;
    // A positional head's threshold: -threshold * peak along the keys' common direction.
    const float threshold =
        positional ? PositionalThreshold(
                         c, h % c.num_diagonals == 0 ? c.recency_strength : c.diagonal_strength)
                   : 0.0f;
    for (int d = 0; d < half; ++d) {
      float v = noise_gain * (shared_gain * shared[d] + own_gain * own[d]);
      if (positional) {
        v += threshold * t.common_direction[d];
      } else {
        v += topic[d] + t.sink_direction[d] + t.salient_direction[d];
      }
      q[d] = v;
    }
    float* rope = q + half;
    if (positional) {
      // The mean RoPE vector shaped by the diagonal's spectrum, rotated to t - offset so that
      // q . k_i peaks (value = the diagonal's strength) at slot i = t - offset.
      const int diagonal = h % c.num_diagonals;
      const float* spectrum = diagonal_spectra_.data() + static_cast<size_t>(diagonal) * num_pairs;
      const double rel = static_cast<double>(position - diagonal_offsets_[diagonal]);
      for (int f = 0; f < num_pairs; ++f) {
        const double angle = rope_theta_[f] * rel;
        const float cs = static_cast<float>(std::cos(angle)),
                    sn = static_cast<float>(std::sin(angle));
        const float x = spectrum[f] * t.rope_base[2 * f];
        const float y = spectrum[f] * t.rope_base[2 * f + 1];
        rope[2 * f] = x * cs - y * sn;
        rope[2 * f + 1] = x * sn + y * cs;
      }
    } else {
      std::fill(rope, rope + half, 0.0f);
    }
    head_weights_out[h] = HeadWeight(layer, h, position);
  }
  return absl::OkStatus();
}

float PatternModel::HeadWeight(int layer, int head, int64_t position) const {
  float weight_noise[4];
  TimeNormals(kHeadWeightNoise, layer, static_cast<uint32_t>(head), position, 4, weight_noise);
  const float sigma = config_.head_weight_noise;
  return head_weight_base_[head] * std::exp(sigma * weight_noise[0] - 0.5f * sigma * sigma);
}

absl::Status PatternModel::HeadWeights(int layer, int64_t position,
                                       std::span<float> head_weights_out) const {
  if (layer < 0 || layer >= config_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("HeadWeights: layer ", layer, " not in [0, ", config_.num_layers, ")"));
  }
  if (position < 0) return absl::InvalidArgumentError("HeadWeights: position must be >= 0");
  if (head_weights_out.size() != static_cast<size_t>(config_.num_heads)) {
    return absl::InvalidArgumentError(
        absl::StrCat("HeadWeights: head_weights_out must have num_heads = ", config_.num_heads,
                     " values, got ", head_weights_out.size()));
  }
  for (int h = 0; h < config_.num_heads; ++h) head_weights_out[h] = HeadWeight(layer, h, position);
  return absl::OkStatus();
}

PatternTables PatternModel::Tables() const {
  const PatternModelConfig& c = config_;
  const int half = c.head_dim / 2;
  PatternTables out;
  PatternScalars& s = out.scalars;
  s.num_layers = c.num_layers;
  s.num_heads = c.num_heads;
  s.head_dim = c.head_dim;
  s.num_topics = c.num_topics;
  s.num_diagonals = c.num_diagonals;
  s.num_sink_slots = c.num_sink_slots;
  s.num_positional_heads = num_positional_heads_;
  s.query_noise_steps = c.query_noise_steps;
  s.salience_threshold = salience_threshold_;
  s.topic_strength = c.topic_strength;
  s.sink_strength = c.sink_strength;
  s.salient_strength = c.salient_strength;
  // The same expressions as KeyOf, PoolNoise and IndexerQuery.
  s.key_noise_gain = c.key_noise / std::sqrt(static_cast<float>(half));
  s.rope_key_noise_gain = c.rope_key_noise / std::sqrt(static_cast<float>(half));
  s.pool_gain = 1.0f / std::sqrt(static_cast<float>(kNoiseTerms));
  s.query_noise_gain = c.query_noise / std::sqrt(static_cast<float>(half));
  s.shared_noise_gain = std::sqrt(c.shared_query_noise_fraction);
  s.own_noise_gain = std::sqrt(1.0f - c.shared_query_noise_fraction);
  s.recency_threshold = PositionalThreshold(c, c.recency_strength);
  s.diagonal_threshold = PositionalThreshold(c, c.diagonal_strength);
  s.topic_switch_rate = c.topic_switch_rate;
  s.layer_smooth_gain = std::sqrt(static_cast<double>(c.layer_correlation));
  s.layer_own_gain = std::sqrt(1.0 - static_cast<double>(c.layer_correlation));
  s.key_noise_slot = stream_keys_[2 * kKeyNoiseSlot];
  s.key_noise_prefix = stream_keys_[2 * kKeyNoisePrefix];
  s.salience_slot_lattice = stream_keys_[2 * kSalienceSlot];
  s.salience_slot_own = stream_keys_[2 * kSalienceSlot + 1];
  s.salience_prefix_lattice = stream_keys_[2 * kSaliencePrefix];
  s.salience_prefix_own = stream_keys_[2 * kSaliencePrefix + 1];
  s.segment_topic_slot = stream_keys_[2 * kSegmentTopicSlot];
  s.segment_topic_prefix = stream_keys_[2 * kSegmentTopicPrefix];
  s.query_noise = stream_keys_[2 * kQueryNoise];
  s.topic_switch = stream_keys_[2 * kTopicSwitch];
  s.epoch_topic = stream_keys_[2 * kEpochTopic];

  out.rope_theta = rope_theta_;
  out.diagonal_offsets.assign(diagonal_offsets_.begin(), diagonal_offsets_.end());
  out.diagonal_spectra = diagonal_spectra_;
  const int period = c.layer_correlation_length;
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerTables& t = layers_[l];
    auto append = [](std::vector<float>& to, const std::vector<float>& from) {
      to.insert(to.end(), from.begin(), from.end());
    };
    append(out.topic_directions, t.topic_directions);
    append(out.sink_direction, t.sink_direction);
    append(out.salient_direction, t.salient_direction);
    append(out.common_direction, t.common_direction);
    append(out.rope_base, t.rope_base);
    append(out.key_noise_pool, t.key_noise_pool);
    append(out.query_noise_pool, t.query_noise_pool);
    // The same expressions as LayerNormals.
    const double smooth = Smoothstep(static_cast<double>(l % period) / period);
    out.layer_lattice.push_back(static_cast<uint32_t>(l / period));
    out.layer_smoothstep.push_back(smooth);
    out.layer_lattice_norm.push_back(1.0 /
                                     std::sqrt((1.0 - smooth) * (1.0 - smooth) + smooth * smooth));
  }
  return out;
}

}  // namespace dsa
