// The real model's GQA attention on the GPU (see gqa_attention.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "attention_worker/cuda/gqa_attention.h"

namespace dsa::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kDecodeWarps = kGqaDecodeSlotsPerBlock / 32;

__device__ __forceinline__ float WarpMax(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    value = fmaxf(value, __shfl_xor_sync(kFullMask, value, offset));
  }
  return value;
}

__device__ __forceinline__ float WarpSum(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    value += __shfl_xor_sync(kFullMask, value, offset);
  }
  return value;
}

// Values of one block's partial result: m [G], l [G], acc [G][HD].
template <int HD, int G>
__host__ __device__ constexpr int PartialValues() {
  return G * (HD + 2);
}

// A softmax over a set of slots, for one query head and one value dim: m the largest score
// (-inf where the set holds no slot), l = sum exp(s - m), acc = sum exp(s - m) v (the attention
// output is acc / l).
struct SoftmaxPartial {
  float m;
  float l;
  float acc;
};

// Merges the partials part(0), ..., part(n - 1) of disjoint slot sets into the one of their
// union: each rescaled by exp(m_i - m) to the common max m; a part with m_i -inf adds nothing.
// Serves the decode kernel's merge of its warps and GqaMergeKernel's merge of the chunks. (The
// decode's constant n unrolls fully without a pragma; `#pragma unroll` here would pin the merge
// kernel's runtime loop to nounroll.)
template <typename Part>
__device__ __forceinline__ SoftmaxPartial MergeSoftmaxPartials(int n, Part part) {
  SoftmaxPartial merged{-INFINITY, 0.0f, 0.0f};
  for (int i = 0; i < n; ++i) merged.m = fmaxf(merged.m, part(i).m);
  for (int i = 0; i < n; ++i) {
    const SoftmaxPartial p = part(i);
    if (p.m == -INFINITY) continue;
    const float f = expf(p.m - merged.m);
    merged.l = fmaf(p.l, f, merged.l);
    merged.acc = fmaf(p.acc, f, merged.acc);
  }
  return merged;
}

// The decode kernel: block (entry, chunk, kv head), 4 warps; lane i of warp w scores slot entry
// chunk * 128 + w * 32 + i for the group's G heads (one key row read serves them all), then the
// warp accumulates P V with each lane owning HD / 32 value dims (one value row read a slot serves
// the G heads); the warps merge in shared memory; with one chunk the block writes the output,
// else its partial (m, l, acc) for GqaMergeKernel.
template <int HD, int G>
__global__ void __launch_bounds__(kGqaDecodeSlotsPerBlock)
    GqaDecodeKernel(GqaDecodeParams p, int num_chunks) {
  constexpr int kVec = HD / 4;  // float4s a key row
  constexpr int kDimsPerLane = HD >= 32 ? HD / 32 : 1;
  __shared__ __align__(16) float q_s[G][HD];
  __shared__ float m_s[kDecodeWarps][G];
  __shared__ float l_s[kDecodeWarps][G];
  __shared__ float acc_s[kDecodeWarps][G][HD];

  const int e = blockIdx.x, chunk = blockIdx.y, g = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = p.entry_rows[e];
  const LlamaRowCache cache = p.caches[r];
  const int begin = p.selection_offsets[e], end = p.selection_offsets[e + 1];
  const bool dense = begin == end;
  const int64_t length = dense ? cache.position + 1 : end - begin;
  const int kv_dim = p.num_kv_heads * HD;
  const float* keys = LlamaLayerKeys(cache.kv_base, cache.capacity, kv_dim, p.layer) + g * HD;
  const float* values = LlamaLayerValues(cache.kv_base, cache.capacity, kv_dim, p.layer) + g * HD;
  const float* query = p.queries + static_cast<int64_t>(r) * p.query_stride + g * G * HD;
  for (int i = threadIdx.x; i < G * HD; i += blockDim.x) (&q_s[0][0])[i] = query[i];
  __syncthreads();

  const int64_t index = static_cast<int64_t>(chunk) * kGqaDecodeSlotsPerBlock + warp * 32 + lane;
  int slot = -1;
  if (index < length) slot = dense ? static_cast<int>(index) : __ldg(p.selections + begin + index);
  float m[G], l[G], acc[G][kDimsPerLane];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.0f;
#pragma unroll
    for (int c = 0; c < kDimsPerLane; ++c) acc[h][c] = 0.0f;
  }
  if (__any_sync(kFullMask, slot >= 0)) {
    // Scores: this lane's slot (slot 0, always written, stands in for padding, then masked).
    const auto* key =
        reinterpret_cast<const float4*>(keys + static_cast<int64_t>(max(slot, 0)) * kv_dim);
    float s[G];
#pragma unroll
    for (int h = 0; h < G; ++h) s[h] = 0.0f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float4 k = __ldg(key + i);
#pragma unroll
      for (int h = 0; h < G; ++h) {
        const float4 q = reinterpret_cast<const float4*>(q_s[h])[i];
        s[h] = fmaf(q.x, k.x, s[h]);
        s[h] = fmaf(q.y, k.y, s[h]);
        s[h] = fmaf(q.z, k.z, s[h]);
        s[h] = fmaf(q.w, k.w, s[h]);
      }
    }
    float prob[G];
#pragma unroll
    for (int h = 0; h < G; ++h) {
      s[h] = slot >= 0 ? s[h] * p.scale : -INFINITY;
      m[h] = WarpMax(s[h]);  // finite: some lane holds a slot
      prob[h] = slot >= 0 ? expf(s[h] - m[h]) : 0.0f;
      l[h] = WarpSum(prob[h]);
    }
    // P V: slot j's value row, read once for the G heads.
    const bool owns_dims = lane * kDimsPerLane < HD;
#pragma unroll 8
    for (int j = 0; j < 32; ++j) {
      const int slot_j = max(__shfl_sync(kFullMask, slot, j), 0);
      float prob_j[G];
#pragma unroll
      for (int h = 0; h < G; ++h) prob_j[h] = __shfl_sync(kFullMask, prob[h], j);
      if (owns_dims) {
        const float* value = values + static_cast<int64_t>(slot_j) * kv_dim + lane * kDimsPerLane;
        float v[kDimsPerLane];
        if constexpr (kDimsPerLane == 4) {
          const float4 x = __ldg(reinterpret_cast<const float4*>(value));
          v[0] = x.x;
          v[1] = x.y;
          v[2] = x.z;
          v[3] = x.w;
        } else if constexpr (kDimsPerLane == 2) {
          const float2 x = __ldg(reinterpret_cast<const float2*>(value));
          v[0] = x.x;
          v[1] = x.y;
        } else {
          v[0] = __ldg(value);
        }
#pragma unroll
        for (int h = 0; h < G; ++h) {
#pragma unroll
          for (int c = 0; c < kDimsPerLane; ++c) acc[h][c] = fmaf(prob_j[h], v[c], acc[h][c]);
        }
      }
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < G; ++h) {
      m_s[warp][h] = m[h];
      l_s[warp][h] = l[h];
    }
  }
  if (lane * kDimsPerLane < HD) {
#pragma unroll
    for (int h = 0; h < G; ++h) {
#pragma unroll
      for (int c = 0; c < kDimsPerLane; ++c) acc_s[warp][h][lane * kDimsPerLane + c] = acc[h][c];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
    const int h = i / HD, d = i % HD;
    const SoftmaxPartial merged = MergeSoftmaxPartials(kDecodeWarps, [&](int w) {
      return SoftmaxPartial{m_s[w][h], l_s[w][h], acc_s[w][h][d]};
    });
    if (num_chunks == 1) {
      // One chunk holds every slot of the entry: merged.l > 0.
      p.out[static_cast<int64_t>(r) * p.out_stride + (g * G + h) * HD + d] = merged.acc / merged.l;
    } else {
      float* part = static_cast<float*>(p.scratch) +
                    ((static_cast<int64_t>(e) * p.num_kv_heads + g) * num_chunks + chunk) *
                        PartialValues<HD, G>();
      part[2 * G + h * HD + d] = merged.acc;
      if (d == 0) {
        part[h] = merged.m;
        part[G + h] = merged.l;
      }
    }
  }
}

// Merges an entry's chunks: block (entry, kv head), one thread a (head, dim).
template <int HD, int G>
__global__ void GqaMergeKernel(GqaDecodeParams p, int num_chunks) {
  const int e = blockIdx.x, g = blockIdx.y;
  const int r = p.entry_rows[e];
  constexpr int kStride = PartialValues<HD, G>();
  const float* parts = static_cast<const float*>(p.scratch) +
                       (static_cast<int64_t>(e) * p.num_kv_heads + g) * num_chunks * kStride;
  for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
    const int h = i / HD, d = i % HD;
    const SoftmaxPartial merged = MergeSoftmaxPartials(num_chunks, [&](int c) {
      const int part = c * kStride;
      return SoftmaxPartial{parts[part + h], parts[part + G + h], parts[part + 2 * G + h * HD + d]};
    });
    p.out[static_cast<int64_t>(r) * p.out_stride + (g * G + h) * HD + d] = merged.acc / merged.l;
  }
}

template <int HD, int G>
cudaError_t LaunchDecode(const GqaDecodeParams& p, cudaStream_t stream) {
  const int num_chunks =
      (p.max_entry_slots + kGqaDecodeSlotsPerBlock - 1) / kGqaDecodeSlotsPerBlock;
  const dim3 grid(static_cast<unsigned>(p.num_entries), static_cast<unsigned>(num_chunks),
                  static_cast<unsigned>(p.num_kv_heads));
  GqaDecodeKernel<HD, G><<<grid, kGqaDecodeSlotsPerBlock, 0, stream>>>(p, num_chunks);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess || num_chunks == 1) return error;
  const int threads = std::min(256, (G * HD + 31) / 32 * 32);
  GqaMergeKernel<HD, G>
      <<<dim3(static_cast<unsigned>(p.num_entries), static_cast<unsigned>(p.num_kv_heads)), threads,
         0, stream>>>(p, num_chunks);
  return cudaGetLastError();
}

template <int HD>
cudaError_t LaunchDecodeForGroup(const GqaDecodeParams& p, int group, cudaStream_t stream) {
  switch (group) {
    case 1:
      return LaunchDecode<HD, 1>(p, stream);
    case 2:
      return LaunchDecode<HD, 2>(p, stream);
    case 3:
      return LaunchDecode<HD, 3>(p, stream);
    case 4:
      return LaunchDecode<HD, 4>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// ---- the dense causal prefill ----

constexpr int kPrefillHeadDim = 64;
constexpr int kPrefillThreads = 256;
constexpr int kTile = kGqaPrefillTileRows;
constexpr int kLd = kTile + 4;  // padded row of the transposed tiles (float4-aligned)
constexpr size_t kPrefillSharedBytes =
    sizeof(float) * (2 * kPrefillHeadDim * kLd + kTile * kPrefillHeadDim) + sizeof(int64_t) * kTile;

// Block (tile, query head), 256 threads as 16 x 16; thread (ty, tx) holds rows ty*4..+3 of the
// tile and, in the scores, slots tx*4..+3 of the key tile; in the output, dims tx*4..+3.
__global__ void __launch_bounds__(kPrefillThreads) GqaPrefillKernel(GqaPrefillParams p) {
  extern __shared__ __align__(16) unsigned char shared[];
  float* q_s = reinterpret_cast<float*>(shared);  // [HD][kLd]: Q^T, pre-scaled
  float* k_s = q_s + kPrefillHeadDim * kLd;       // [HD][kLd]: K^T; then P^T [slots][kLd]
  float* v_s = k_s + kPrefillHeadDim * kLd;       // [slots][HD]
  auto* pos_s = reinterpret_cast<int64_t*>(v_s + kTile * kPrefillHeadDim);  // [kTile]

  constexpr int HD = kPrefillHeadDim;
  const GqaPrefillTile tile = p.tiles[blockIdx.x];
  const int head = blockIdx.y, g = head / (p.num_heads / p.num_kv_heads);
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const int kv_dim = p.num_kv_heads * HD;
  const LlamaRowCache cache = p.caches[p.tile_rows[tile.first]];
  const float* keys = LlamaLayerKeys(cache.kv_base, cache.capacity, kv_dim, p.layer) + g * HD;
  const float* values = LlamaLayerValues(cache.kv_base, cache.capacity, kv_dim, p.layer) + g * HD;
  if (tid < kTile) {
    pos_s[tid] = tid < tile.count ? p.caches[p.tile_rows[tile.first + tid]].position : -1;
  }
  for (int idx = tid; idx < kTile * HD; idx += kPrefillThreads) {
    const int i = idx / HD, d = idx % HD;
    float q = 0.0f;
    if (i < tile.count) {
      q = p.queries[static_cast<int64_t>(p.tile_rows[tile.first + i]) * p.query_stride + head * HD +
                    d] *
          p.scale;
    }
    q_s[d * kLd + i] = q;
  }
  __syncthreads();
  const int64_t kv_end = pos_s[tile.count - 1] + 1;  // rows in increasing position order

  float m[4], l[4], acc[4][4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[r][c] = 0.0f;
  }
  for (int64_t kv0 = 0; kv0 < kv_end; kv0 += kTile) {
    __syncthreads();  // the previous tile's P and V are read
    for (int idx = tid; idx < kTile * (HD / 4); idx += kPrefillThreads) {
      const int j = idx / (HD / 4), d4 = idx % (HD / 4);
      const int64_t slot = kv0 + j;
      float4 k = make_float4(0.0f, 0.0f, 0.0f, 0.0f), v = k;
      if (slot < kv_end) {
        k = __ldg(reinterpret_cast<const float4*>(keys + slot * kv_dim) + d4);
        v = __ldg(reinterpret_cast<const float4*>(values + slot * kv_dim) + d4);
      }
      k_s[(4 * d4 + 0) * kLd + j] = k.x;
      k_s[(4 * d4 + 1) * kLd + j] = k.y;
      k_s[(4 * d4 + 2) * kLd + j] = k.z;
      k_s[(4 * d4 + 3) * kLd + j] = k.w;
      reinterpret_cast<float4*>(v_s + j * HD)[d4] = v;
    }
    __syncthreads();
    float s[4][4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
#pragma unroll
      for (int c = 0; c < 4; ++c) s[r][c] = 0.0f;
    }
#pragma unroll 16
    for (int d = 0; d < HD; ++d) {
      const float4 a = *reinterpret_cast<const float4*>(q_s + d * kLd + ty * 4);
      const float4 b = *reinterpret_cast<const float4*>(k_s + d * kLd + tx * 4);
      const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int c = 0; c < 4; ++c) s[r][c] = fmaf(av[r], bv[c], s[r][c]);
      }
    }
    // The causal mask and the online softmax (a row's 64 slots are over the 16 tx lanes).
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int64_t position = pos_s[ty * 4 + r];
      float tile_max = -INFINITY;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (kv0 + tx * 4 + c > position) s[r][c] = -INFINITY;
        tile_max = fmaxf(tile_max, s[r][c]);
      }
      for (int offset = 1; offset < 16; offset <<= 1) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, offset));
      }
      const float peak = fmaxf(m[r], tile_max);
      float alpha = 1.0f, sum = 0.0f;
      if (peak == -INFINITY) {
#pragma unroll
        for (int c = 0; c < 4; ++c) s[r][c] = 0.0f;
      } else {
        alpha = m[r] == -INFINITY ? 0.0f : expf(m[r] - peak);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          s[r][c] = s[r][c] == -INFINITY ? 0.0f : expf(s[r][c] - peak);
          sum += s[r][c];
        }
      }
      for (int offset = 1; offset < 16; offset <<= 1) {
        sum += __shfl_xor_sync(kFullMask, sum, offset);
      }
      l[r] = fmaf(l[r], alpha, sum);
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[r][c] *= alpha;
      m[r] = peak;
    }
    __syncthreads();  // K^T is read: P^T takes its place
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      *reinterpret_cast<float4*>(k_s + (tx * 4 + c) * kLd + ty * 4) =
          make_float4(s[0][c], s[1][c], s[2][c], s[3][c]);
    }
    __syncthreads();
#pragma unroll 16
    for (int j = 0; j < kTile; ++j) {
      const float4 a = *reinterpret_cast<const float4*>(k_s + j * kLd + ty * 4);
      const float4 b = *reinterpret_cast<const float4*>(v_s + j * HD + tx * 4);
      const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[r][c] = fmaf(av[r], bv[c], acc[r][c]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int i = ty * 4 + r;
    if (i >= tile.count) continue;
    float* out = p.out + static_cast<int64_t>(p.tile_rows[tile.first + i]) * p.out_stride +
                 head * HD + tx * 4;
    const float inv = 1.0f / l[r];
    *reinterpret_cast<float4*>(out) =
        make_float4(acc[r][0] * inv, acc[r][1] * inv, acc[r][2] * inv, acc[r][3] * inv);
  }
}

bool Refuse(const char** why, const char* reason) {
  if (why != nullptr) *why = reason;
  return false;
}

// The shape rule both kernels share: the query heads split evenly over the KV heads.
bool CanGroupHeads(int num_heads, int num_kv_heads, const char** why) {
  if (num_kv_heads < 1 || num_heads < num_kv_heads || num_heads % num_kv_heads != 0) {
    return Refuse(why, "num_heads must be a positive multiple of num_kv_heads");
  }
  return true;
}

// The checks of the fields GqaDecodeParams and GqaPrefillParams share (the shape aside).
template <typename Params>
bool SharedParamsValid(const Params& p) {
  return p.queries != nullptr && p.caches != nullptr && p.out != nullptr && p.layer >= 0 &&
         p.query_stride >= p.num_heads * p.head_dim && p.out_stride >= p.num_heads * p.head_dim;
}

}  // namespace

bool CanImplementGqaDecode(int num_heads, int num_kv_heads, int head_dim, const char** why) {
  if (!CanGroupHeads(num_heads, num_kv_heads, why)) return false;
  const int group = num_heads / num_kv_heads;
  if (group > 4) return Refuse(why, "more than 4 query heads a KV head are not built");
  if (head_dim != 8 && head_dim != 16 && head_dim != 32 && head_dim != 64 && head_dim != 128) {
    return Refuse(why, "head_dim must be 8, 16, 32, 64 or 128");
  }
  return true;
}

size_t GqaDecodeScratchBytes(int num_entries, int max_entry_slots, int num_heads, int num_kv_heads,
                             int head_dim) {
  const int64_t chunks = (static_cast<int64_t>(max_entry_slots) + kGqaDecodeSlotsPerBlock - 1) /
                         kGqaDecodeSlotsPerBlock;
  if (chunks <= 1 || num_kv_heads < 1) return 0;
  const int64_t group = num_heads / num_kv_heads;
  return sizeof(float) * static_cast<size_t>(num_entries) * num_kv_heads * chunks * group *
         (head_dim + 2);
}

cudaError_t LaunchGqaDecode(const GqaDecodeParams& p, cudaStream_t stream) {
  if (!CanImplementGqaDecode(p.num_heads, p.num_kv_heads, p.head_dim, nullptr) ||
      !SharedParamsValid(p) || p.entry_rows == nullptr || p.selection_offsets == nullptr ||
      p.num_entries < 1 || p.max_entry_slots < 1 ||
      (p.max_entry_slots + kGqaDecodeSlotsPerBlock - 1) / kGqaDecodeSlotsPerBlock > 65535 ||
      (p.max_entry_slots > kGqaDecodeSlotsPerBlock && p.scratch == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const int group = p.num_heads / p.num_kv_heads;
  switch (p.head_dim) {
    case 8:
      return LaunchDecodeForGroup<8>(p, group, stream);
    case 16:
      return LaunchDecodeForGroup<16>(p, group, stream);
    case 32:
      return LaunchDecodeForGroup<32>(p, group, stream);
    case 64:
      return LaunchDecodeForGroup<64>(p, group, stream);
    case 128:
      return LaunchDecodeForGroup<128>(p, group, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

bool CanImplementGqaPrefill(int num_heads, int num_kv_heads, int head_dim, const char** why) {
  if (!CanGroupHeads(num_heads, num_kv_heads, why)) return false;
  if (head_dim != kPrefillHeadDim)
    return Refuse(why, "the prefill kernel is built for head_dim 64");
  return true;
}

cudaError_t LaunchGqaPrefill(const GqaPrefillParams& p, cudaStream_t stream) {
  if (!CanImplementGqaPrefill(p.num_heads, p.num_kv_heads, p.head_dim, nullptr) ||
      !SharedParamsValid(p) || p.tile_rows == nullptr || p.tiles == nullptr || p.num_tiles < 1 ||
      p.num_heads > 65535 || p.query_stride % 4 != 0 || p.out_stride % 4 != 0) {
    return cudaErrorInvalidValue;
  }
  cudaError_t error =
      cudaFuncSetAttribute(GqaPrefillKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(kPrefillSharedBytes));
  if (error != cudaSuccess) return error;
  GqaPrefillKernel<<<dim3(static_cast<unsigned>(p.num_tiles), static_cast<unsigned>(p.num_heads)),
                     kPrefillThreads, kPrefillSharedBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dsa::cuda
