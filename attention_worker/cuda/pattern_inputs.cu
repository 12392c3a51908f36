// The pattern model's indexer inputs on the GPU (see pattern_inputs.h). Every expression mirrors
// attention_worker/pattern_model.cc operation for operation (the same fp32 / fp64 operations in
// the same order); this file is compiled with -fmad=false so nvcc fuses none of them.
#include <cstring>
#include <vector>

#include "attention_worker/cuda/pattern_inputs.h"
#include "attention_worker/cuda/rotation_cos_sin.h"
#include "contracts/layout.h"

namespace dsa::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 4;
constexpr int kNoiseTerms = 8;  // pool rows summed per noise vector (two Philox blocks)
constexpr uint32_t kSharedHead = 0xFFFF;

__device__ uint32_t Lo32(uint64_t x) { return static_cast<uint32_t>(x); }
__device__ uint32_t Hi32(uint64_t x) { return static_cast<uint32_t>(x >> 32); }

// The eight pool rows and signs of one noise vector (PoolNoise): two Philox blocks at `counter`
// and at `counter` with word 1 incremented.
struct PoolTerms {
  uint32_t row[kNoiseTerms];
  float sign[kNoiseTerms];
};
__device__ PoolTerms PoolTermsOf(PhiloxKey key, PhiloxCounter counter, float gain) {
  PoolTerms terms;
  for (int block = 0; block < kNoiseTerms / 4; ++block) {
    PhiloxCounter c = counter;
    c.c[1] += static_cast<uint32_t>(block);
    const PhiloxCounter r = Philox4x32(c, key);
    for (int k = 0; k < 4; ++k) {
      terms.row[4 * block + k] = r.c[k] >> (32 - kPatternNoisePoolBits);
      terms.sign[4 * block + k] = (r.c[k] & 1u) ? -gain : gain;
    }
  }
  return terms;
}
// Element d of the noise vector: sum in order of sign * pool[row][d], from 0.
__device__ float PoolValue(const PoolTerms& terms, const float* pool, int dim, int d) {
  float out = 0.0f;
  for (int t = 0; t < kNoiseTerms; ++t) {
    out =
        __fadd_rn(out, __fmul_rn(terms.sign[t], pool[static_cast<size_t>(terms.row[t]) * dim + d]));
  }
  return out;
}

// Normals4's first value: radius(word 0) * cos(angle(word 1)), from the tables.
__device__ float FirstNormal(const PatternDeviceTables& t, PhiloxKey key, PhiloxCounter counter) {
  const PhiloxCounter r = Philox4x32(counter, key);
  return __fmul_rn(t.box_muller_radius[r.c[0] >> 8], t.box_muller_cosine[r.c[1] >> 8]);
}

// LayerNormals(stream, layer, c0, c2, c3, 4)[0].
__device__ float LayerNormal0(const PatternDeviceTables& t, PhiloxKey lattice_key,
                              PhiloxKey own_key, int layer, uint32_t c0, uint32_t c2, uint32_t c3) {
  const PatternScalars& s = t.scalars;
  double value = 0.0;
  if (s.layer_own_gain > 0.0) {
    const float own =
        FirstNormal(t, own_key, PhiloxCounter{{c0, static_cast<uint32_t>(layer), c2, c3}});
    value = __dadd_rn(value, __dmul_rn(s.layer_own_gain, static_cast<double>(own)));
  }
  if (s.layer_smooth_gain > 0.0) {
    const uint32_t lattice = t.layer_lattice[layer];
    const double smooth = t.layer_smoothstep[layer];
    const float a = FirstNormal(t, lattice_key, PhiloxCounter{{c0, lattice, c2, c3}});
    float b = 0.0f;
    if (smooth > 0.0) b = FirstNormal(t, lattice_key, PhiloxCounter{{c0, lattice + 1, c2, c3}});
    const double mix = __dadd_rn(__dmul_rn(__dsub_rn(1.0, smooth), static_cast<double>(a)),
                                 __dmul_rn(smooth, static_cast<double>(b)));
    value = __dadd_rn(value,
                      __dmul_rn(__dmul_rn(s.layer_smooth_gain, t.layer_lattice_norm[layer]), mix));
  }
  return static_cast<float>(value);
}

__device__ int TopicOfSegment(const PatternDeviceTables& t, PhiloxKey key, uint64_t segment) {
  const PhiloxCounter r = Philox4x32(PhiloxCounter{{Lo32(segment), Hi32(segment), 0u, 0u}}, key);
  return static_cast<int>(UniformBelow(r.c[0], static_cast<uint32_t>(t.scalars.num_topics)));
}

// One warp writes the key of `slot` whose content is (prefix block `id`, `offset`) when
// offset >= 0, else slot-indexed (id = slot). KeyOf in pattern_model.cc.
__device__ void WriteKey(const PatternDeviceTables& t, int layer, int64_t slot, uint64_t id,
                         int offset, float* key) {
  const PatternScalars& s = t.scalars;
  const int lane = threadIdx.x % kWarp;
  const int dim = s.head_dim, half = dim / 2, num_pairs = dim / 4;
  const bool prefix = offset >= 0;
  const PoolTerms terms =
      prefix
          ? PoolTermsOf(s.key_noise_prefix,
                        PhiloxCounter{{static_cast<uint32_t>(offset), 0u, Lo32(id), Hi32(id)}},
                        s.pool_gain)
          : PoolTermsOf(s.key_noise_slot, PhiloxCounter{{0u, 0u, Lo32(id), Hi32(id)}}, s.pool_gain);
  const float* pool = t.key_noise_pool + static_cast<size_t>(layer) * kPatternNoisePoolRows * dim;
  const uint64_t segment = prefix ? id : id / kPrefixBlockTokens;
  const int topic =
      TopicOfSegment(t, prefix ? s.segment_topic_prefix : s.segment_topic_slot, segment);
  const bool sink = slot < s.num_sink_slots;
  bool salient = false;
  if (!isinf(s.salience_threshold)) {  // an infinite threshold: no slot is salient
    const float value =
        prefix ? LayerNormal0(t, s.salience_prefix_lattice, s.salience_prefix_own, layer,
                              static_cast<uint32_t>(offset) << 16, Lo32(id), Hi32(id))
               : LayerNormal0(t, s.salience_slot_lattice, s.salience_slot_own, layer, 0u, Lo32(id),
                              Hi32(id));
    salient = value > s.salience_threshold;
  }
  const size_t layer_half = static_cast<size_t>(layer) * half;
  const float* topic_dir =
      t.topic_directions + (static_cast<size_t>(layer) * s.num_topics + topic) * half;
  for (int d = lane; d < half; d += kWarp) {
    const float noise = __fmul_rn(PoolValue(terms, pool, dim, d), s.key_noise_gain);
    float v = __fadd_rn(__fadd_rn(noise, __fmul_rn(s.topic_strength, topic_dir[d])),
                        t.common_direction[layer_half + d]);
    if (sink) v = __fadd_rn(v, __fmul_rn(s.sink_strength, t.sink_direction[layer_half + d]));
    if (salient) {
      v = __fadd_rn(v, __fmul_rn(s.salient_strength, t.salient_direction[layer_half + d]));
    }
    key[d] = v;
  }
  const float* rope_base = t.rope_base + layer_half;
  for (int f = lane; f < num_pairs; f += kWarp) {
    const double angle = __dmul_rn(t.rope_theta[f], static_cast<double>(slot));
    float cs, sn;
    rotation::RotationCosSin(angle, &cs, &sn);
    const float nx = __fmul_rn(PoolValue(terms, pool, dim, half + 2 * f), s.rope_key_noise_gain);
    const float ny =
        __fmul_rn(PoolValue(terms, pool, dim, half + 2 * f + 1), s.rope_key_noise_gain);
    const float x = __fadd_rn(nx, rope_base[2 * f]);
    const float y = __fadd_rn(ny, rope_base[2 * f + 1]);
    float2 out;
    out.x = __fsub_rn(__fmul_rn(x, cs), __fmul_rn(y, sn));
    out.y = __fadd_rn(__fmul_rn(x, sn), __fmul_rn(y, cs));
    *reinterpret_cast<float2*>(key + half + 2 * f) = out;
  }
}

__global__ void PatternIndexKeysKernel(PatternIndexKeysParams p) {
  const int64_t key_index = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (key_index >= p.num_keys) return;
  int64_t slot;
  uint64_t id;
  int offset;
  if (p.slots != nullptr) {
    slot = p.slots[key_index];
    offset = p.key_prefix_offsets[key_index];
    id = offset >= 0 ? p.key_prefix_block_ids[key_index] : static_cast<uint64_t>(slot);
  } else {
    slot = p.first_slot + key_index;
    if (slot < kPrefixBlockTokens * p.num_prefix_ids) {
      id = p.prefix_block_ids[slot / kPrefixBlockTokens];
      offset = static_cast<int>(slot % kPrefixBlockTokens);
    } else {
      id = static_cast<uint64_t>(slot);
      offset = -1;
    }
  }
  WriteKey(p.tables, p.layer, slot, id, offset, p.keys + key_index * p.tables.scalars.head_dim);
}

// The latest topic switch at or before `position` (TopicEpochStart), searched by the whole warp
// 32 steps at a time; every lane returns it.
__device__ int64_t TopicEpochStart(const PatternScalars& s, int64_t position) {
  if (s.topic_switch_rate <= 0.0) return 0;
  const int lane = threadIdx.x % kWarp;
  for (int64_t base = position; base >= 1; base -= kWarp) {
    const int64_t step = base - lane;
    bool hit = false;
    if (step >= 1) {
      const auto group = static_cast<uint64_t>(step / 4);
      const PhiloxCounter words =
          Philox4x32(PhiloxCounter{{Lo32(group), Hi32(group), 0u, 0u}}, s.topic_switch);
      hit = static_cast<double>(UniformFloat(words.c[step % 4])) < s.topic_switch_rate;
    }
    const unsigned hits = __ballot_sync(0xffffffffu, hit);
    if (hits != 0) return base - (__ffs(hits) - 1);  // the lowest lane has the latest step
  }
  return 0;
}

// Smoothstep(position % period / period) and the value-noise weights of QueryNoise.
struct TimeWeights {
  bool next;  // s > 0: the next lattice point contributes
  float a, b;
};
__device__ TimeWeights QueryTimeWeights(int64_t position, int64_t period) {
  const double f = __ddiv_rn(static_cast<double>(position % period), static_cast<double>(period));
  const double s = __dmul_rn(__dmul_rn(f, f), __dsub_rn(3.0, __dmul_rn(2.0, f)));
  TimeWeights w{s > 0.0, 0.0f, 0.0f};
  if (w.next) {
    const double one_minus = __dsub_rn(1.0, s);
    const float norm = static_cast<float>(
        __ddiv_rn(1.0, __dsqrt_rn(__dadd_rn(__dmul_rn(one_minus, one_minus), __dmul_rn(s, s)))));
    w.a = __fmul_rn(norm, static_cast<float>(one_minus));
    w.b = __fmul_rn(norm, static_cast<float>(s));
  }
  return w;
}

// QueryNoise(layer, head, position) at dim d, given the lattice point's pool terms.
__device__ float QueryNoiseValue(const PoolTerms& now, const PoolTerms& next, const TimeWeights& w,
                                 const float* pool, int half, int d) {
  const float value = PoolValue(now, pool, half, d);
  if (!w.next) return value;
  return __fadd_rn(__fmul_rn(w.a, value), __fmul_rn(w.b, PoolValue(next, pool, half, d)));
}

// One warp per (row, head): IndexerQuery's query_out[h].
__global__ void PatternIndexerQueriesKernel(PatternIndexerQueriesParams p) {
  const PatternDeviceTables& t = p.tables;
  const PatternScalars& s = t.scalars;
  const int row = blockIdx.y;
  const int head = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp;
  if (head >= s.num_heads) return;  // whole warps leave together
  const int lane = threadIdx.x % kWarp;
  const int layer = p.layers[row];
  const int64_t position = p.positions[row];
  const int dim = s.head_dim, half = dim / 2, num_pairs = dim / 4;
  float* q = p.queries + (static_cast<size_t>(row) * s.num_heads + head) * dim;

  const int64_t epoch = TopicEpochStart(s, position);
  const PhiloxCounter topic_words =
      Philox4x32(PhiloxCounter{{Lo32(static_cast<uint64_t>(epoch)),
                                Hi32(static_cast<uint64_t>(epoch)), 0u, 0u}},
                 s.epoch_topic);
  const int topic =
      static_cast<int>(UniformBelow(topic_words.c[0], static_cast<uint32_t>(s.num_topics)));

  const int64_t period = s.query_noise_steps;
  const auto lattice = static_cast<uint64_t>(position / period);
  const TimeWeights w = QueryTimeWeights(position, period);
  const float* pool =
      t.query_noise_pool + static_cast<size_t>(layer) * kPatternNoisePoolRows * half;
  auto terms_at = [&](uint32_t which, uint64_t point) {
    return PoolTermsOf(s.query_noise, PhiloxCounter{{which, 0u, Lo32(point), Hi32(point)}},
                       s.pool_gain);
  };
  const bool use_shared = s.shared_noise_gain > 0.0f, use_own = s.own_noise_gain > 0.0f;
  PoolTerms shared_now{}, shared_next{}, own_now{}, own_next{};
  if (use_shared) {
    shared_now = terms_at(kSharedHead, lattice);
    if (w.next) shared_next = terms_at(kSharedHead, lattice + 1);
  }
  if (use_own) {
    own_now = terms_at(static_cast<uint32_t>(head), lattice);
    if (w.next) own_next = terms_at(static_cast<uint32_t>(head), lattice + 1);
  }
  const bool positional = head < s.num_positional_heads;
  const int diagonal = head % s.num_diagonals;
  const float threshold =
      positional ? (diagonal == 0 ? s.recency_threshold : s.diagonal_threshold) : 0.0f;
  const size_t layer_half = static_cast<size_t>(layer) * half;
  const float* topic_dir =
      t.topic_directions + (static_cast<size_t>(layer) * s.num_topics + topic) * half;
  for (int d = lane; d < half; d += kWarp) {
    const float shared =
        use_shared ? QueryNoiseValue(shared_now, shared_next, w, pool, half, d) : 0.0f;
    const float own = use_own ? QueryNoiseValue(own_now, own_next, w, pool, half, d) : 0.0f;
    float v = __fmul_rn(s.query_noise_gain, __fadd_rn(__fmul_rn(s.shared_noise_gain, shared),
                                                      __fmul_rn(s.own_noise_gain, own)));
    if (positional) {
      v = __fadd_rn(v, __fmul_rn(threshold, t.common_direction[layer_half + d]));
    } else {
      v = __fadd_rn(v, __fadd_rn(__fadd_rn(topic_dir[d], t.sink_direction[layer_half + d]),
                                 t.salient_direction[layer_half + d]));
    }
    q[d] = v;
  }
  float* rope = q + half;
  if (positional) {
    const float* spectrum = t.diagonal_spectra + static_cast<size_t>(diagonal) * num_pairs;
    const float* rope_base = t.rope_base + layer_half;
    const double rel = static_cast<double>(position - t.diagonal_offsets[diagonal]);
    for (int f = lane; f < num_pairs; f += kWarp) {
      float cs, sn;
      rotation::RotationCosSin(__dmul_rn(t.rope_theta[f], rel), &cs, &sn);
      const float x = __fmul_rn(spectrum[f], rope_base[2 * f]);
      const float y = __fmul_rn(spectrum[f], rope_base[2 * f + 1]);
      float2 out;
      out.x = __fsub_rn(__fmul_rn(x, cs), __fmul_rn(y, sn));
      out.y = __fadd_rn(__fmul_rn(x, sn), __fmul_rn(y, cs));
      *reinterpret_cast<float2*>(rope + 2 * f) = out;
    }
  } else {
    for (int d = lane; d < half; d += kWarp) rope[d] = 0.0f;
  }
}

bool Fail(const char** why, const char* reason) {
  if (why != nullptr) *why = reason;
  return false;
}

bool TablesReady(const PatternDeviceTables& t, const char** why) {
  if (t.allocation == nullptr || t.box_muller_radius == nullptr) {
    return Fail(why, "tables not uploaded (UploadPatternTables)");
  }
  return true;
}

template <typename T>
size_t Align256(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

}  // namespace

cudaError_t UploadPatternTables(const PatternTables& tables, const float* box_muller_radius,
                                const float* box_muller_cosine, PatternDeviceTables* out) {
  const PatternScalars& s = tables.scalars;
  const size_t layers = static_cast<size_t>(s.num_layers);
  const size_t dim = static_cast<size_t>(s.head_dim), half = dim / 2, pairs = dim / 4;
  if (out == nullptr || box_muller_radius == nullptr || box_muller_cosine == nullptr ||
      s.num_layers < 1 || s.head_dim < 8 || s.head_dim % 8 != 0 ||
      tables.rope_theta.size() != pairs ||
      tables.diagonal_offsets.size() != static_cast<size_t>(s.num_diagonals) ||
      tables.diagonal_spectra.size() != static_cast<size_t>(s.num_diagonals) * pairs ||
      tables.topic_directions.size() != layers * s.num_topics * half ||
      tables.sink_direction.size() != layers * half ||
      tables.salient_direction.size() != layers * half ||
      tables.common_direction.size() != layers * half || tables.rope_base.size() != layers * half ||
      tables.key_noise_pool.size() != layers * kPatternNoisePoolRows * dim ||
      tables.query_noise_pool.size() != layers * kPatternNoisePoolRows * half ||
      tables.layer_lattice.size() != layers || tables.layer_smoothstep.size() != layers ||
      tables.layer_lattice_norm.size() != layers) {
    return cudaErrorInvalidValue;
  }
  struct Piece {
    const void* host;
    size_t bytes;
    size_t offset;
  };
  std::vector<Piece> pieces;
  size_t total = 0;
  auto add = [&](const void* host, size_t bytes) {
    pieces.push_back({host, bytes, total});
    total += Align256<char>(bytes);
    return pieces.size() - 1;
  };
  auto add_vector = [&](const auto& v) { return add(v.data(), v.size() * sizeof(v[0])); };
  const size_t i_theta = add_vector(tables.rope_theta);
  const size_t i_offsets = add_vector(tables.diagonal_offsets);
  const size_t i_spectra = add_vector(tables.diagonal_spectra);
  const size_t i_topic = add_vector(tables.topic_directions);
  const size_t i_sink = add_vector(tables.sink_direction);
  const size_t i_salient = add_vector(tables.salient_direction);
  const size_t i_common = add_vector(tables.common_direction);
  const size_t i_rope = add_vector(tables.rope_base);
  const size_t i_key_pool = add_vector(tables.key_noise_pool);
  const size_t i_query_pool = add_vector(tables.query_noise_pool);
  const size_t i_lattice = add_vector(tables.layer_lattice);
  const size_t i_smooth = add_vector(tables.layer_smoothstep);
  const size_t i_norm = add_vector(tables.layer_lattice_norm);
  const size_t i_radius = add(box_muller_radius, kBoxMullerTableSize * sizeof(float));
  const size_t i_cosine = add(box_muller_cosine, kBoxMullerTableSize * sizeof(float));
  char* base = nullptr;
  cudaError_t err = cudaMalloc(&base, total);
  if (err != cudaSuccess) return err;
  for (const Piece& piece : pieces) {
    if (piece.bytes == 0) continue;
    err = cudaMemcpy(base + piece.offset, piece.host, piece.bytes, cudaMemcpyHostToDevice);
    if (err != cudaSuccess) {
      cudaFree(base);
      return err;
    }
  }
  auto at = [&](size_t i) { return static_cast<const void*>(base + pieces[i].offset); };
  PatternDeviceTables t;
  t.scalars = s;
  t.rope_theta = static_cast<const double*>(at(i_theta));
  t.diagonal_offsets = static_cast<const int32_t*>(at(i_offsets));
  t.diagonal_spectra = static_cast<const float*>(at(i_spectra));
  t.topic_directions = static_cast<const float*>(at(i_topic));
  t.sink_direction = static_cast<const float*>(at(i_sink));
  t.salient_direction = static_cast<const float*>(at(i_salient));
  t.common_direction = static_cast<const float*>(at(i_common));
  t.rope_base = static_cast<const float*>(at(i_rope));
  t.key_noise_pool = static_cast<const float*>(at(i_key_pool));
  t.query_noise_pool = static_cast<const float*>(at(i_query_pool));
  t.layer_lattice = static_cast<const uint32_t*>(at(i_lattice));
  t.layer_smoothstep = static_cast<const double*>(at(i_smooth));
  t.layer_lattice_norm = static_cast<const double*>(at(i_norm));
  t.box_muller_radius = static_cast<const float*>(at(i_radius));
  t.box_muller_cosine = static_cast<const float*>(at(i_cosine));
  t.allocation = base;
  t.allocation_bytes = total;
  *out = t;
  return cudaSuccess;
}

cudaError_t FreePatternTables(PatternDeviceTables* tables) {
  if (tables == nullptr || tables->allocation == nullptr) return cudaSuccess;
  const cudaError_t err = cudaFree(tables->allocation);
  *tables = PatternDeviceTables{};
  return err;
}

bool CanImplementPatternIndexKeys(const PatternIndexKeysParams& params, const char** why) {
  if (!TablesReady(params.tables, why)) return false;
  if (params.layer < 0 || params.layer >= params.tables.scalars.num_layers) {
    return Fail(why, "layer out of [0, num_layers)");
  }
  if (params.num_keys < 0 || params.num_keys > (int64_t{1} << 32)) {
    return Fail(why, "num_keys must be in [0, 2^32]");
  }
  if (params.num_keys > 0 && params.keys == nullptr) return Fail(why, "keys is required");
  if (params.slots != nullptr) {
    if (params.key_prefix_offsets == nullptr || params.key_prefix_block_ids == nullptr) {
      return Fail(why, "gather mode needs key_prefix_offsets and key_prefix_block_ids");
    }
  } else {
    if (params.first_slot < 0) return Fail(why, "first_slot must be >= 0");
    if (params.num_prefix_ids < 0 || (params.num_prefix_ids > 0 && !params.prefix_block_ids)) {
      return Fail(why, "num_prefix_ids must be >= 0, with prefix_block_ids when > 0");
    }
  }
  return true;
}

bool CanImplementPatternIndexerQueries(const PatternIndexerQueriesParams& params,
                                       const char** why) {
  if (!TablesReady(params.tables, why)) return false;
  if (params.num_rows < 0 || params.num_rows > 65535) {
    return Fail(why, "num_rows must be in [0, 65535]");
  }
  if (params.num_rows > 0 &&
      (params.layers == nullptr || params.positions == nullptr || params.queries == nullptr)) {
    return Fail(why, "layers, positions and queries are required");
  }
  return true;
}

cudaError_t LaunchPatternIndexKeys(const PatternIndexKeysParams& params, cudaStream_t stream) {
  if (!CanImplementPatternIndexKeys(params)) return cudaErrorInvalidValue;
  if (params.num_keys == 0) return cudaSuccess;
  const auto blocks =
      static_cast<unsigned>((params.num_keys + kWarpsPerBlock - 1) / kWarpsPerBlock);
  PatternIndexKeysKernel<<<blocks, kWarpsPerBlock * kWarp, 0, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t LaunchPatternIndexerQueries(const PatternIndexerQueriesParams& params,
                                        cudaStream_t stream) {
  if (!CanImplementPatternIndexerQueries(params)) return cudaErrorInvalidValue;
  if (params.num_rows == 0) return cudaSuccess;
  const dim3 grid((params.tables.scalars.num_heads + kWarpsPerBlock - 1) / kWarpsPerBlock,
                  params.num_rows);
  PatternIndexerQueriesKernel<<<grid, kWarpsPerBlock * kWarp, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace dsa::cuda
